"""DeepSeek's and Kimi K2's parsers (server/parsers/deepseek.py, kimi_k2.py): fixed texts in each
family's format, parsed whole and streamed split at every character boundary (tests/parser_cases);
and the families' published chat templates (tests/fixtures/chat_templates) render a conversation
with tools and tool calls, whose calls parse back."""
import json
from pathlib import Path

import pytest

from server.parsers import deepseek as ds
from server.parsers import kimi_k2 as kimi
from server.parsers.base import Block
from tests.parser_cases import check

V3, V31, R1 = ds.DeepSeekV3ToolParser(), ds.DeepSeekV31ToolParser(), ds.DeepSeekR1ReasoningParser()
K2, K2_THINK = kimi.KimiK2ToolParser(), kimi.KimiK2ReasoningParser()
EOS = ds.END_OF_SENTENCE
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

WEATHER = '{"city": "Paris"}'
NESTED = '{\n  "query": {"all": [{"term": "a"}, {"range": {"n": [1, 2.5]}}], "flag": true},\n  "limit": null\n}'
NESTED_VALUE = {"query": {"all": [{"term": "a"}, {"range": {"n": [1, 2.5]}}], "flag": True}, "limit": None}
UNICODE = '{"city": "Zürich", "note": "東京 🌧 \\u00e9"}'
UNICODE_VALUE = {"city": "Zürich", "note": "東京 🌧 é"}


def v3_call(name: str, args: str, kind: str = "function") -> str:
    return f"{ds.CALL_BEGIN}{kind}{ds.SEP}{name}\n```json\n{args}\n```{ds.CALL_END}"


def v3(*calls: str) -> str:
    return ds.CALLS_BEGIN + "\n".join(calls) + ds.CALLS_END


def v31_call(name: str, args: str) -> str:
    return f"{ds.CALL_BEGIN}{name}{ds.SEP}{args}{ds.CALL_END}"


def v31(*calls: str) -> str:
    return ds.CALLS_BEGIN + "".join(calls) + ds.CALLS_END


def k2_call(call_id: str, args: str) -> str:
    return f"{kimi.CALL_BEGIN}{call_id}{kimi.ARGUMENT_BEGIN}{args}{kimi.CALL_END}"


def k2(*calls: str, singular: bool = False) -> str:
    i = 1 if singular else 0
    return kimi.SECTION_BEGINS[i] + "".join(calls) + kimi.SECTION_ENDS[i]


def test_markers_are_the_families_tokens():
    assert ds.CALLS_BEGIN == "<\uff5ctool\u2581calls\u2581begin\uff5c>" == "<｜tool▁calls▁begin｜>"
    assert (ds.CALL_BEGIN, ds.SEP, ds.CALL_END) == ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")
    assert (ds.CALLS_END, EOS) == ("<｜tool▁calls▁end｜>", "<｜end▁of▁sentence｜>")
    assert (V3.name, V31.name, R1.name, K2.name, K2_THINK.name) == (
        "deepseek_v3", "deepseek_v31", "deepseek_r1", "kimi_k2", "kimi_k2")
    assert V3.markers == V31.markers == (ds.CALLS_BEGIN, EOS)
    assert K2.markers == ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>", "<|im_end|>")
    # DeepSeek's markers are plain tokens; Kimi's tokenizer drops its markers and </think> with
    # skip_special_tokens (vLLM sets it false for kimi_k2)
    assert (V3.needs_special_tokens, V31.needs_special_tokens, R1.needs_special_tokens) == (False, False, False)
    assert K2.needs_special_tokens and K2_THINK.needs_special_tokens


@pytest.mark.parametrize("text,expected", [
    (v3(v3_call("get_weather", WEATHER)), (None, "", [("get_weather", {"city": "Paris"})])),
    # parallel calls (the template joins them with a newline), then the end of sentence kept with
    # special tokens: never content
    (v3(v3_call("get_weather", WEATHER), v3_call("add", '{"a": 1, "b": 2}')) + EOS,
     (None, "", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})])),
    ("Let me check.\n" + v3(v3_call("get_weather", WEATHER)) + "\nDone.",
     (None, "Let me check.\nDone.", [("get_weather", {"city": "Paris"})])),
    (v3(v3_call("search", NESTED)), (None, "", [("search", NESTED_VALUE)])),
    ("Voilà: " + v3(v3_call("météo", UNICODE)) + EOS, (None, "Voilà:", [("météo", UNICODE_VALUE)])),
    # whitespace the model may put around the fence and between the calls
    (ds.CALLS_BEGIN + "\n" + f"{ds.CALL_BEGIN}function{ds.SEP} get \n```json\n\n{WEATHER}\n\n```\n{ds.CALL_END}\n\n"
     + ds.CALLS_END, (None, "", [("get", {"city": "Paris"})])),
    # malformed: bad JSON, arguments that are not an object, no name, a bad call among good ones,
    # junk between calls, an empty section: the whole section is content
    *[(text, (None, text, [])) for text in [
        "x " + v3(v3_call("get_weather", '{"city": Paris}')) + " y",
        v3(v3_call("get_weather", "[1, 2]")),
        v3(v3_call("", WEATHER)),
        v3(v3_call("get_weather", WEATHER), v3_call("add", "{oops")),
        v3(v3_call("a", "{}") + " and " + v3_call("b", "{}")),
        ds.CALLS_BEGIN + ds.CALLS_END,
        # an end of sentence with no call stays (the server cuts the one ending the text)
        "Hello." + EOS,
    ]],
    # a malformed section is content, a valid one after it still gives its call
    ("a " + v3(v3_call("x", "{")) + " b " + v3(v3_call("y", "{}")),
     (None, "a " + v3(v3_call("x", "{")) + " b", [("y", {})])),
    # unclosed section: content, no call
    ("Sure. " + ds.CALLS_BEGIN + v3_call("get_weather", WEATHER),
     (None, "Sure. " + ds.CALLS_BEGIN + v3_call("get_weather", WEATHER), [])),
    ("Hello there.\n", (None, "Hello there.\n", [])),
    ("a < b <｜tool", (None, "a < b <｜tool", [])),
])
def test_deepseek_v3(text, expected):
    check(text, expected, tools=V3)


@pytest.mark.parametrize("text,expected", [
    (v31(v31_call("get_weather", WEATHER)), (None, "", [("get_weather", {"city": "Paris"})])),
    (v31(v31_call("get_weather", WEATHER), v31_call("add", '{"a": 1, "b": 2}')) + EOS,
     (None, "", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})])),
    ("I'll look.\n\n" + v31(v31_call("get_weather", WEATHER)) + " Then more.",
     (None, "I'll look.\nThen more.", [("get_weather", {"city": "Paris"})])),
    (v31(v31_call("search", NESTED)), (None, "", [("search", NESTED_VALUE)])),
    ("Voilà " + v31(v31_call("météo", UNICODE)), (None, "Voilà", [("météo", UNICODE_VALUE)])),
    *[(text, (None, text, [])) for text in [
        v31(v31_call("get_weather", '{"city": ')),
        v31(f"{ds.CALL_BEGIN}get_weather{WEATHER}{ds.CALL_END}"),  # no separator
        v31(v31_call("two words", WEATHER)),
        v31(v31_call("a", "{}"), v31_call("b", "nope")),
    ]],
    (ds.CALLS_BEGIN + v31_call("get_weather", WEATHER), (None, ds.CALLS_BEGIN + v31_call("get_weather", WEATHER), [])),
    ("Plain answer.", (None, "Plain answer.", [])),
])
def test_deepseek_v31(text, expected):
    check(text, expected, tools=V31)


@pytest.mark.parametrize("text,expected", [
    (k2(k2_call("functions.get_weather:0", WEATHER)), (None, "", [("get_weather", {"city": "Paris"})])),
    # parallel calls, the end of turn kept with special tokens
    (k2(k2_call("functions.get_weather:0", WEATHER), k2_call("functions.add:1", '{"a": 1, "b": 2}')) + kimi.IM_END,
     (None, "", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})])),
    ("Checking. " + k2(k2_call("functions.get_weather:3", WEATHER)) + " Back soon.",
     (None, "Checking.\nBack soon.", [("get_weather", {"city": "Paris"})])),
    (k2(k2_call("functions.search:0", NESTED)), (None, "", [("search", NESTED_VALUE)])),
    ("Voilà " + k2(k2_call("functions.météo:0", UNICODE)) + kimi.IM_END,
     (None, "Voilà", [("météo", UNICODE_VALUE)])),
    # an id without the functions. prefix, whitespace around the id and the arguments, the singular
    # section markers
    (k2("\n" + k2_call(" get_weather:0 ", f" {WEATHER}\n") + "\n" + k2_call("\nadd:1", "{}"), singular=True),
     (None, "", [("get_weather", {"city": "Paris"}), ("add", {})])),
    *[(text, (None, text, [])) for text in [
        k2(k2_call("functions.get_weather:0", "{'city': 'Paris'}")),
        k2(k2_call("functions.get_weather", WEATHER)),  # no index
        k2(k2_call(":0", WEATHER)),
        k2(f"{kimi.CALL_BEGIN}functions.get_weather:0{WEATHER}{kimi.CALL_END}"),  # no argument marker
        k2(k2_call("functions.a:0", "{}"), k2_call("functions.b:1", "[]")),
        "Done." + kimi.IM_END,
    ]],
    ("Sure " + kimi.SECTION_BEGINS[0] + k2_call("functions.get_weather:0", WEATHER),
     (None, "Sure " + kimi.SECTION_BEGINS[0] + k2_call("functions.get_weather:0", WEATHER), [])),
    ("Just text, <| not a marker.", (None, "Just text, <| not a marker.", [])),
])
def test_kimi_k2(text, expected):
    check(text, expected, tools=K2)


@pytest.mark.parametrize("text,opened,expected", [
    ("<think>\nweigh it\n</think>\n\nThe answer.", False, ("weigh it", "The answer.", [])),
    ("weigh it\n</think>\n\nThe answer.", True, ("weigh it", "The answer.", [])),  # the template wrote <think>\n
    ("still weighing", True, ("still weighing", "", [])),
    ("<think>\nweigh it</think>ok", True, ("weigh it", "ok", [])),  # <think> written again: dropped
    ("<b>bold</b> thought</think>ok", True, ("<b>bold</b> thought", "ok", [])),
    ("<think>never closed", False, ("never closed", "", [])),
    ("Just an answer.", False, ("", "Just an answer.", [])),
])
def test_deepseek_r1_reasoning(text, opened, expected):
    check(text, expected, reasoning=R1, starts_in_reasoning=opened)


def test_deepseek_r1_reasoning_then_v3_calls():
    text = "Need the weather.\n</think>\n\nOne moment." + v3(v3_call("get_weather", WEATHER)) + EOS
    check(text, ("Need the weather.", "One moment.", [("get_weather", {"city": "Paris"})]),
          tools=V3, reasoning=R1, starts_in_reasoning=True)
    assert R1.starts_in_reasoning("<｜User｜>hi<｜Assistant｜><think>\n")
    assert not R1.starts_in_reasoning("<｜User｜>hi<｜Assistant｜></think>")


@pytest.mark.parametrize("text,opened,expected", [
    ("<think>plan it</think>The answer.", False, ("plan it", "The answer.", [])),
    ("plan it</think>The answer.", True, ("plan it", "The answer.", [])),
    ("<think>plan it</think>The answer.", True, ("plan it", "The answer.", [])),
    ("<think>never closed", False, ("never closed", "", [])),
    ("The answer.", False, ("", "The answer.", [])),
    # a tool-call section closes the reasoning; the section is the answer's
    ("<think>need weather " + k2(k2_call("functions.get_weather:0", WEATHER)) + kimi.IM_END, False,
     ("need weather", "", [("get_weather", {"city": "Paris"})])),
    ("<think>plan</think>Calling. " + k2(k2_call("functions.get_weather:0", WEATHER)), False,
     ("plan", "Calling.", [("get_weather", {"city": "Paris"})])),
])
def test_kimi_k2_reasoning(text, opened, expected):
    check(text, expected, tools=K2, reasoning=K2_THINK, starts_in_reasoning=opened)


def test_blocks_of_a_growing_text_stay_put():
    """A section is one block; its end of text, once the section gave calls, another (no calls)."""
    text = "Hi " + v3(v3_call("a", "{}"), v3_call("b", "{}")) + EOS
    blocks = V3.blocks(text)
    assert [b.calls is not None and len(b.calls) for b in blocks] == [2, 0]
    assert blocks[1] == Block(len(text) - len(EOS), len(text), ())
    for i in range(len(text)):
        for b in V3.blocks(text[:i]):
            assert b.end is None or b in blocks


# --- the published chat templates ---

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALLS = [("get_weather", {"city": "Zürich"}), ("add", {"a": 1, "b": 2})]


def _conversation() -> list[dict]:
    """A conversation as the server hands it to chat templates (ChatMessage.as_template_input)."""
    from server.openai_protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"tools": TOOLS, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich, and 1 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"functions.{name}:{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
            for i, (name, args) in enumerate(CALLS)]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "functions.add:1", "content": "3"}]})
    return [m.as_template_input() for m in req.messages]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from models.builtin import BUILTIN_DIR

    return AutoTokenizer.from_pretrained(str(BUILTIN_DIR))


def _render(tokenizer, name: str, messages: list[dict], **kwargs) -> str:
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kwargs)


@pytest.mark.parametrize("name,parser", [("deepseek_v3", V3), ("deepseek_v31", V31), ("kimi_k2", K2)])
def test_published_template_renders_tools_and_calls_that_parse_back(tokenizer, name, parser):
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8").split("\n", 1)[0]
    assert source.startswith("{# source: https://") and source.endswith(" #}")
    text = _render(tokenizer, name, _conversation(), add_generation_prompt=True)
    assert "get_weather" in text and "sunny" in text and "Be brief." in text
    # the assistant turn's calls, as the template wrote them, are what the parser reads back (the
    # DeepSeek templates also spell the markers out in their tool instructions: those sections are
    # not valid calls)
    calls = next(b.calls for b in parser.blocks(text) if b.calls)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS


def test_templates_open_the_reasoning_as_the_parsers_expect(tokenizer):
    messages = _conversation()[:2]
    thinking = _render(tokenizer, "deepseek_v31", messages, add_generation_prompt=True, thinking=True)
    assert thinking.endswith("<think>") and R1.starts_in_reasoning(thinking)
    plain = _render(tokenizer, "deepseek_v31", messages, add_generation_prompt=True)
    assert plain.endswith("</think>") and not R1.starts_in_reasoning(plain)
    # Kimi K2 Thinking writes <think></think> into earlier assistant turns, and leaves the
    # reasoning's opening to the model
    kimi_prompt = _render(tokenizer, "kimi_k2", _conversation(), add_generation_prompt=True)
    assert "<think></think>" in kimi_prompt and kimi_prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    assert not K2_THINK.starts_in_reasoning(kimi_prompt)


def test_kimi_keeps_the_models_call_ids():
    """Kimi's template writes each call's id back as `functions.NAME:IDX`: the id the model wrote is
    the tool call's id (whole and streamed); other families get fresh call_ ids."""
    from server.parsers.output import ChatOutput

    text = "Sure. " + k2(k2_call("functions.get_weather:3", WEATHER), k2_call("functions.add:4", "{}"))
    whole = ChatOutput(None, kimi.KimiK2ToolParser()).message(text)["tool_calls"]
    streamed = [c for d in ChatOutput(None, kimi.KimiK2ToolParser()).feed(text, True) for c in d.get("tool_calls", [])]
    assert [c["id"] for c in whole] == [c["id"] for c in streamed] == ["functions.get_weather:3", "functions.add:4"]
    v3 = ChatOutput(None, ds.DeepSeekV31ToolParser()).message("x" + v31(v31_call("f", "{}")))["tool_calls"]
    assert v3[0]["id"].startswith("call_")
