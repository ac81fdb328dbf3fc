"""gpt-oss's harmony format (server/parsers/harmony.py): the openai_gptoss reasoning parser and the
openai tool parser, whole and streamed at every character boundary (tests/parser_cases.check), and
the published gpt-oss chat template (tests/fixtures/chat_templates/gpt_oss.jinja)."""
import json
from pathlib import Path

import pytest

from server.parsers.harmony import GptOssReasoningParser, HarmonyToolParser
from tests.parser_cases import check, streamed, whole

TOOLS, REASONING = HarmonyToolParser(), GptOssReasoningParser()
TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "gpt_oss.jinja"

THINK = "<|channel|>analysis<|message|>User wants the weather. Call the tool.<|end|>"
CALL_HEAD = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
PARIS = '{"city": "Paris", "unit": "celsius"}'
PARIS_ARGS = {"city": "Paris", "unit": "celsius"}
WHY = "User wants the weather. Call the tool."


def call(name: str, args: str, head: str = "<|start|>assistant<|channel|>commentary to=functions.{} "
         "<|constrain|>json<|message|>", end: str = "<|call|>") -> str:
    return head.format(name) + args + end


@pytest.mark.parametrize("text,expected", [
    # analysis, then the answer
    ("<|channel|>analysis<|message|>The user greets. Reply.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Hello! How can I help?<|return|>", ("The user greets. Reply.", "Hello! How can I help?", [])),
    # analysis, then a function call (the text ends with <|call|>)
    (THINK + CALL_HEAD + PARIS + "<|call|>", (WHY, "", [("get_weather", PARIS_ARGS)])),
    # the recipient in the role part of the header, the content type without <|constrain|>
    (THINK + "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" + PARIS + "<|call|>",
     (WHY, "", [("get_weather", PARIS_ARGS)])),
    # the call as the first message (no analysis), either header order
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + PARIS + "<|call|>",
     ("", "", [("get_weather", PARIS_ARGS)])),
    (" to=functions.get_weather<|channel|>commentary json<|message|>" + PARIS + "<|call|>",
     ("", "", [("get_weather", PARIS_ARGS)])),
    # two calls (ended by <|end|>, then <|call|>)
    (THINK + call("a", '{"x": 1}', end="<|end|>") + call("b", '{"y": [2, 3]}'),
     (WHY, "", [("a", {"x": 1}), ("b", {"y": [2, 3]})])),
    # a preamble (commentary without a recipient: shown to the user), then a call
    (THINK + "<|start|>assistant<|channel|>commentary<|message|>I'll look up Paris first.<|end|>"
     + CALL_HEAD + PARIS + "<|call|>", (WHY, "I'll look up Paris first.", [("get_weather", PARIS_ARGS)])),
    # a preamble and the final answer: one per line
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>",
     ("", "Checking.\nDone.", [])),
    # final only
    ("<|channel|>final<|message|>Just this.<|return|>", ("", "Just this.", [])),
    # nested JSON and unicode arguments (kept as they are, not \u-escaped)
    (THINK + call("search", '{"q": {"nested": [1, {"k": "ü"}], "text": "日本 ✓"}, "n": null}'),
     (WHY, "", [("search", {"q": {"nested": [1, {"k": "ü"}], "text": "日本 ✓"}, "n": None})])),
    # a malformed call (not JSON): the message stays in the content as the model wrote it
    (THINK + call("get_weather", '{"city": Paris}'),
     (WHY, call("get_weather", '{"city": Paris}'), [])),
    # arguments that are JSON but not an object, and a recipient naming no function: malformed
    (call("f", "[1, 2]"), ("", call("f", "[1, 2]"), [])),
    (call("", "{}"), ("", call("", "{}"), [])),
    # two analysis messages: one per line
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Three.<|return|>", ("One.\nTwo.", "Three.", [])),
    # a built-in tool's call (browser, python) is the model's own: reasoning, not a function call
    ("<|channel|>analysis to=browser.search <|constrain|>json<|message|>{\"query\": \"x\"}<|call|>",
     ('{"query": "x"}', "", [])),
    # not harmony at all: the text is the answer
    ("Plain answer, no channels.", ("", "Plain answer, no channels.", [])),
])
def test_whole_and_streamed(text, expected):
    check(text, expected, tools=TOOLS, reasoning=REASONING)


@pytest.mark.parametrize("text,expected", [
    # the stop token cut off the end (the serving layer does): the last message is over
    (THINK + CALL_HEAD + PARIS, (WHY, "", [("get_weather", PARIS_ARGS)])),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>The answer",
     ("a", "The answer", [])),
    # cut short (max_tokens) inside the arguments: an open call message, content as written
    (THINK + CALL_HEAD + '{"city": "Par', (WHY, CALL_HEAD + '{"city": "Par', [])),
    # inside the analysis, inside a header, inside the first header
    ("<|channel|>analysis<|message|>Still thinking", ("Still thinking", "", [])),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", ("a", "", [])),
    ("<|channel|>analys", ("", "", [])),
    # a partial special token at the very end is text once the output is over
    ("<|channel|>final<|message|>x <|e", ("", "x <|e", [])),
    ("<|cha", ("", "<|cha", [])),
    # a message that starts without the previous one's terminator ends it
    ("<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b<|return|>", ("a", "b", [])),
    (CALL_HEAD + PARIS + "<|start|>assistant<|channel|>final<|message|>ok<|return|>",
     ("", "ok", [("get_weather", PARIS_ARGS)])),
])
def test_unclosed_and_cut_off(text, expected):
    check(text, expected, tools=TOOLS, reasoning=REASONING)


def test_reasoning_parser_alone():
    check("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Answer.<|return|>",
          ("Think.", "Answer.", []), reasoning=REASONING)
    # without a tool parser a call message is the answer's text (kept whole, as the tool parser reads it)
    check(THINK + CALL_HEAD + PARIS, (WHY, CALL_HEAD + PARIS + "<|call|>", []), reasoning=REASONING)


def test_prompt_opened_the_analysis():
    assert not REASONING.starts_in_reasoning("<|start|>user<|message|>hi<|end|><|start|>assistant")
    opened = "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>analysis<|message|>"
    assert REASONING.starts_in_reasoning(opened)
    assert not REASONING.starts_in_reasoning(opened + "done<|end|>")
    assert not REASONING.starts_in_reasoning("<|start|>assistant<|channel|>final<|message|>")
    check("weigh it<|end|><|start|>assistant<|channel|>final<|message|>ok<|return|>", ("weigh it", "ok", []),
          tools=TOOLS, reasoning=REASONING, starts_in_reasoning=True)
    # the prompt opened the final channel: the text is the answer
    check("ok<|return|>", ("", "ok", []), tools=TOOLS, reasoning=REASONING)


def test_special_tokens_and_names():
    assert TOOLS.name == "openai" and REASONING.name == "openai_gptoss"  # vLLM's names
    assert TOOLS.needs_special_tokens and REASONING.needs_special_tokens


def test_tool_parser_alone_finds_the_calls():
    """Without a reasoning parser the blocks are still the call messages, whole and streamed (the
    stop token must then stay in the text: the blocks cannot know the text is over)."""
    text = THINK + call("a", '{"x": 1}', end="<|end|>") + call("b", '{"y": "ü"}')
    expected = [("a", {"x": 1}), ("b", {"y": "ü"})]
    assert whole(text, tools=TOOLS)[2] == expected
    for i in range(1, len(text)):
        assert streamed([text[:i], text[i:]], tools=TOOLS)[2] == expected
    assert streamed(list(text), tools=TOOLS)[2] == expected


def test_tool_parser_alone_keeps_analysis_out_of_content():
    check(THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>", (None, "It is sunny.", []),
          tools=TOOLS)


def test_template_renders_tools_calls_results_and_effort(tokenizer_dir):
    """The published template, on a conversation with tools, an assistant call and its result, with
    reasoning_effort (the request's field, passed as a template variable)."""
    from transformers import AutoTokenizer

    source = TEMPLATE.read_text().splitlines()[0]
    assert source.startswith("{# source: https://") and source.endswith("#}")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.chat_template = TEMPLATE.read_text()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
              "parameters": {"type": "object", "properties": {
                  "city": {"type": "string", "description": "The city."},
                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "thinking": "Need the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                   reasoning_effort="high")
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "\nReasoning: high\n" in text
    assert "Calls to these tools must go to the commentary channel: 'functions'." in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n" in text
    assert "type get_weather = (_: {\n// The city.\ncity: string,\nunit?: \"celsius\" | \"fahrenheit\",\n}) => any;" \
        in text
    assert "<|start|>user<|message|>Weather in Paris?<|end|>" in text
    assert "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>" in text  # kept: no final after
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' \
        in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" \
           + json.dumps('{"temp": 21}') + "<|end|>" in text
    assert text.endswith("<|start|>assistant")
    # the default effort is medium
    assert "\nReasoning: medium\n" in tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    # the call message the template writes is one the parsers read
    rendered = text[text.index("<|start|>assistant to="):text.index("<|call|>") + len("<|call|>")]
    check(rendered, ("", "", [("get_weather", {"city": "Paris"})]), tools=TOOLS, reasoning=REASONING)


def test_prefix_property_on_random_texts():
    """On random mixes of harmony's pieces (well formed or not): every value on a prefix is a prefix
    of the whole text's, the calls so far are the first of the whole's, and a closed block stays."""
    import random

    from server.parsers.base import split_tools

    pieces = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.f",
              " to=browser.open", "<|constrain|>", "json", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
              '{"a": 1}', '{"b": ["ü"]}', "{bad", " ", "\n", "hi", "to=", "<|", "<|sta"]
    firsts = ["<|channel|>analysis<|message|>think", "<|channel|>final<|message|>ans", "",
              '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}']
    rng = random.Random(0)
    for _ in range(300):
        text = rng.choice(firsts) + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        for opened in (False, True):
            r_all, a_all = REASONING.split(text, True, opened)
            c_all, calls_all = split_tools(TOOLS, a_all, True)
            blocks_all = TOOLS.blocks(a_all)
            for i in range(len(text)):
                r, a = REASONING.split(text[:i], False, opened)
                assert r_all.startswith(r) and a_all.startswith(a), (text, i)
                c, calls = split_tools(TOOLS, a, False)
                assert c_all.startswith(c) and calls_all[:len(calls)] == calls, (text, i)
                closed = [b for b in TOOLS.blocks(a) if b.end is not None]
                assert blocks_all[:len(closed)] == closed, (text, i)
