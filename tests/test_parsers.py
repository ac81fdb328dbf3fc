"""The shared splitting and streaming (server/parsers/base.py, output.py) and the hermes parser."""
import pytest

from server.parsers import TOOL_PARSERS
from server.parsers.base import ReasoningParser
from tests.parser_cases import check

HERMES = TOOL_PARSERS["hermes"]()


class Think(ReasoningParser):
    name = "test-think"


@pytest.mark.parametrize("text,expected", [
    ("Hello there.\n", (None, "Hello there.\n", [])),  # no call: the text as it is
    ("Let me check.\n<tool_call>\n{\"name\": \"get\", \"arguments\": {\"q\": \"x\"}}\n</tool_call>",
     (None, "Let me check.", [("get", {"q": "x"})])),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"n": [1, {"k": "ü"}]}}</tool_call>', (None, "", [("a", {}), ("b", {"n": [1, {"k": "ü"}]})])),
    ('Before <tool_call>{"name": "a", "arguments": {}}</tool_call> after.',
     (None, "Before\nafter.", [("a", {})])),
    ("x <tool_call>not json</tool_call> y", (None, "x <tool_call>not json</tool_call> y", [])),
    ('<tool_call>{"name": "a", "arguments": {}}', (None, '<tool_call>{"name": "a", "arguments": {}}', [])),
    ("a < b <tool", (None, "a < b <tool", [])),
])
def test_hermes_whole_and_streamed(text, expected):
    check(text, expected, tools=HERMES)


@pytest.mark.parametrize("text,opened,expected", [
    ("<think>\nweigh it\n</think>\n\nThe answer.", False, ("weigh it", "The answer.", [])),
    ("weigh it</think>The answer.", True, ("weigh it", "The answer.", [])),
    ("Just an answer.", False, ("", "Just an answer.", [])),
    ("<think>never closed", False, ("never closed", "", [])),
    ("<thin", False, ("", "<thin", [])),
])
def test_reasoning_whole_and_streamed(text, opened, expected):
    check(text, expected, reasoning=Think(), starts_in_reasoning=opened)


def test_reasoning_then_tool_calls_in_the_answer_only():
    text = '<think>call <tool_call>{"name": "no", "arguments": {}}</tool_call>?</think>Sure.' \
           '<tool_call>{"name": "yes", "arguments": {"a": 1}}</tool_call>'
    check(text, ('call <tool_call>{"name": "no", "arguments": {}}</tool_call>?', "Sure.", [("yes", {"a": 1})]),
          tools=HERMES, reasoning=Think())


def test_prompt_opened_reasoning():
    p = Think()
    assert p.starts_in_reasoning("<|user|>hi<|assistant|><think>\n")
    assert not p.starts_in_reasoning("<|assistant|><think></think>")
    assert not p.starts_in_reasoning("<|user|>hi<|assistant|>")


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>\n{"name": "get", "arguments": {"q": "a long value", "n": [1, 2]}}\n</tool_call>'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get\n```json\n"
                    '{"q": "a long value", "n": [1, 2]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get<｜tool▁sep｜>"
                     '{"q": "a long value", "n": [1, 2]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get:0<|tool_call_argument_begin|>"
                '{"q": "a long value", "n": [1, 2]}<|tool_call_end|><|tool_calls_section_end|>'),
    ("openai", '<|channel|>commentary to=functions.get <|constrain|>json<|message|>{"q": "a long value", "n": [1, 2]}'
               "<|call|>"),
])
def test_json_arguments_stream_as_they_arrive(parser, text):
    """The call is sent once its name is written, and its arguments piece by piece before its block
    closes; the pieces add up to the arguments as written, which the whole answer also has."""
    from server.parsers.output import ChatOutput

    out, deltas, closed_at = ChatOutput(None, TOOL_PARSERS[parser]()), [], text.index('"n"')
    for i in range(1, len(text) + 1):
        for d in out.feed(text[:i], final=i == len(text)):
            deltas.extend((i, c) for c in d.get("tool_calls", []))
    first, args = deltas[0][1], "".join(c["function"]["arguments"] for _, c in deltas)
    assert first["function"]["name"] == "get" and first["index"] == 0 and all(c["index"] == 0 for _, c in deltas)
    assert sum(1 for i, _ in deltas if i < closed_at) >= 5  # streamed before the block closed
    assert args == '{"q": "a long value", "n": [1, 2]}'
    assert ChatOutput(None, TOOL_PARSERS[parser]()).message(text)["tool_calls"][0]["function"]["arguments"] == args
