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
