"""The XML-style tool-call parsers (server/parsers/glm45.py, qwen3_coder.py, minimax_m2.py) and the
<think> reasoning parsers (server/parsers/reasoning.py): fixed texts in each family's format, parsed
whole and streamed split at every character boundary (tests/parser_cases); values typed by the tools'
schemas; and the families' published chat templates (tests/fixtures/chat_templates), which render a
conversation with tools and tool calls whose calls parse back, and open the reasoning as the parsers
expect."""
import json
from pathlib import Path

import pytest

from server.parsers.base import Block
from server.parsers.glm45 import Glm45ToolParser
from server.parsers.minimax_m2 import MinimaxM2ToolParser
from server.parsers.qwen3_coder import Qwen3CoderToolParser
from server.parsers.reasoning import Glm45ReasoningParser, MiniMaxM2ReasoningParser, Qwen3ReasoningParser
from tests.parser_cases import check, whole

GLM, QC, MM = Glm45ToolParser(), Qwen3CoderToolParser(), MinimaxM2ToolParser()
QWEN3, GLM_THINK, MM_THINK = Qwen3ReasoningParser(), Glm45ReasoningParser(), MiniMaxM2ReasoningParser()
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


def glm(name: str, *args: tuple[str, str]) -> str:
    return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                            for k, v in args) + "</tool_call>"


def qc(name: str, *args: tuple[str, str]) -> str:
    return f"<tool_call>\n<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n"
                                                         for k, v in args) + "</function>\n</tool_call>"


def invoke(name: str, *args: tuple[str, str]) -> str:
    return f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n'
                                                 for k, v in args) + "</invoke>\n"


def mm(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


def mm1(name: str, *args: tuple[str, str]) -> str:
    return mm(invoke(name, *args))


NESTED = '{"filter": {"tags": ["a", "ü"], "range": [1, 2.5]}, "flag": true, "none": null}'
NESTED_VALUE = {"filter": {"tags": ["a", "ü"], "range": [1, 2.5]}, "flag": True, "none": None}
LINES = "line 1\n    line 2 <b>bold</b>\n\nline 4"


def cases(call, parallel):
    """The same situations in one family's markup: `call(name, *args)` writes one call in its own
    block, `parallel(*calls)` several calls as the family writes them."""
    weather = call("get_weather", ("city", "Paris"), ("days", "3"))
    return [
        ("Let me check.\n" + weather, (None, "Let me check.", [("get_weather", {"city": "Paris", "days": 3})])),
        (weather, (None, "", [("get_weather", {"city": "Paris", "days": 3})])),
        (parallel(("get_weather", ("city", "Paris")), ("get_time", ("tz", "Europe/Paris"), ("utc", "false"))),
         (None, "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris", "utc": False})])),
        ("Before " + call("ping") + " after.", (None, "Before\nafter.", [("ping", {})])),
        ("a\n" + call("f", ("q", NESTED), ("ids", "[1, 2, [3]]")) + "\nb\n\n" + call("g", ("n", "-1.5e3")) + "\nc",
         (None, "a\nb\nc", [("f", {"q": NESTED_VALUE, "ids": [1, 2, [3]]}), ("g", {"n": -1500.0})])),
        ("Wetter: " + call("wetter", ("stadt", "Zürich"), ("notiz", "東京 🌧 é")),
         (None, "Wetter:", [("wetter", {"stadt": "Zürich", "notiz": "東京 🌧 é"})])),
        (call("write", ("path", "/tmp/a.txt"), ("text", LINES)),
         (None, "", [("write", {"path": "/tmp/a.txt", "text": LINES})])),
        # not JSON: stays the text (a quoted string is JSON: its value)
        (call("say", ("a", "{not json"), ("b", '"quoted"'), ("c", "NaN"), ("d", "null")),
         (None, "", [("say", {"a": "{not json", "b": "quoted", "c": "NaN", "d": None})])),
        as_content("No tools needed.\n"),
        as_content("1 < 2 and x <b>"),
    ]


def as_content(text: str) -> tuple:
    """A text that parses to itself as the content (no reasoning parser, no calls)."""
    return text, (None, text, [])


def unclosed(text: str) -> list:
    """A call never closed is content, as it is (and so is everything after its start)."""
    return [as_content(text), as_content("Hm. " + text)]


GLM_CASES = cases(glm, lambda *calls: "\n".join(glm(*c) for c in calls)) + unclosed(glm("f", ("a", "1"))[:-5]) + [
    # GLM-4.7 writes the pairs without newlines; a call without arguments
    ("<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>x</arg_value>"
     "</tool_call>", (None, "", [("f", {"a": 1, "b": "x"})])),
    ("<tool_call>now</tool_call>", (None, "", [("now", {})])),
    # values: JSON, else a Python literal, else the text (stripped)
    (glm("f", ("a", " True "), ("b", "None"), ("c", "{'k': (1, 2)}"), ("d", "{1, 2}"), ("e", "  x  ")),
     (None, "", [("f", {"a": True, "b": None, "c": {"k": [1, 2]}, "d": "{1, 2}", "e": "x"})])),
    # malformed: a value without its <arg_value>, text between the pairs, no name: content
    as_content("x <tool_call>f\n<arg_key>a</arg_key>\n1\n</tool_call> y"),
    as_content("<tool_call>f\nsome words\n</tool_call>"),
    as_content('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
    ("<tool_call>bare</tool_call> then " + glm("good", ("a", "1")), (None, "then", [("bare", {}), ("good", {"a": 1})])),
    ("<tool_call>f\n<arg_key>a</arg_key>\n</tool_call> then " + glm("good", ("a", "1")),
     (None, "<tool_call>f\n<arg_key>a</arg_key>\n</tool_call> then", [("good", {"a": 1})])),
    as_content("2 <tool_ca"),
]

QC_CASES = cases(qc, lambda *calls: "\n".join(qc(*c) for c in calls)) + unclosed(qc("f", ("a", "1"))[:-12]) + [
    # several <function=...> in one <tool_call>
    ("<tool_call>\n<function=a>\n</function>\n<function=b>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
     (None, "", [("a", {}), ("b", {"x": 1})])),
    # a value holding the markup itself (code that writes tool calls) ends only at the real </parameter>
    (qc("write", ("code", 'print("<tool_call>")\nend = "</tool_call></parameter>"\n</parameter>x')),
     (None, "", [("write", {"code": 'print("<tool_call>")\nend = "</tool_call></parameter>"\n</parameter>x'})])),
    # one newline on each side belongs to the markup, the rest is the value's
    ("<tool_call>\n<function=f>\n<parameter=s>\n\n  two  \n\n</parameter>\n<parameter=t>x</parameter></function>"
     "</tool_call>", (None, "", [("f", {"s": "\n  two  \n", "t": "x"})])),
    # </function> left out: </tool_call> ends the call (as vLLM forgives)
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call> ok",
     (None, "ok", [("f", {"a": 1})])),
    # malformed: JSON inside, a name with a space, text between parameters: content up to </tool_call>
    as_content('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
    as_content("x <tool_call>\n<function=get weather>\n</function>\n</tool_call> y"),
    ("<tool_call>\n<function=f>\nhello\n</function>\n</tool_call>" + qc("g", ("a", "[1]")),
     (None, "<tool_call>\n<function=f>\nhello\n</function>\n</tool_call>", [("g", {"a": [1]})])),
    # a value never closed: the block stays open, so everything from it is content
    as_content("<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call> more"),
    as_content("2 <tool_ca"),
]

MM_CASES = cases(mm1, lambda *calls: mm(*(invoke(*c) for c in calls))) + unclosed(mm1("f", ("a", "1"))[:-10]) + [
    # two wrappers; a name in single quotes; values are stripped
    (mm1("a") + "\n" + mm(invoke("b", ("x", "  1  "))).replace('"b"', "'b'"), (None, "", [("a", {}), ("b", {"x": 1})])),
    # malformed: no name, text between parameters, no invoke at all: content
    as_content("<minimax:tool_call>\n<invoke>\n</invoke>\n</minimax:tool_call>"),
    as_content("x " + mm1("f", ("a", "1")).replace("</parameter>\n", "</parameter>\nwords\n") + " y"),
    ("<minimax:tool_call>\n</minimax:tool_call> then " + mm1("g"),
     (None, "<minimax:tool_call>\n</minimax:tool_call> then", [("g", {})])),
    as_content("2 <minimax:tool"),
]


@pytest.mark.parametrize("text,expected", GLM_CASES)
def test_glm45(text, expected):
    check(text, expected, tools=GLM)


@pytest.mark.parametrize("text,expected", QC_CASES)
def test_qwen3_coder(text, expected):
    check(text, expected, tools=QC)


@pytest.mark.parametrize("text,expected", MM_CASES)
def test_minimax_m2(text, expected):
    check(text, expected, tools=MM)


def test_names_markers_and_special_tokens():
    assert (GLM.name, QC.name, MM.name) == ("glm45", "qwen3_coder", "minimax_m2")
    assert GLM.markers == QC.markers == ("<tool_call>",) and MM.markers == ("<minimax:tool_call>",)
    assert (QWEN3.name, GLM_THINK.name, MM_THINK.name) == ("qwen3", "glm45", "minimax_m2")
    # GLM's tokenizer has <tool_call>, <arg_key>, <think>, ... as special tokens; Qwen's and
    # MiniMax's markers are ordinary (added) tokens
    assert GLM.needs_special_tokens and GLM_THINK.needs_special_tokens
    assert not (QC.needs_special_tokens or MM.needs_special_tokens or QWEN3.needs_special_tokens
                or MM_THINK.needs_special_tokens)


@pytest.mark.parametrize("parser,text", [(Glm45ToolParser(), GLM_CASES[4][0]), (Qwen3CoderToolParser(), QC_CASES[4][0]),
                                         (MinimaxM2ToolParser(), MM_CASES[4][0])])
def test_closed_blocks_stay_put_as_the_text_grows(parser, text):
    final = parser.blocks(text)
    assert [b.calls is not None for b in final] == [True, True]
    for i in range(len(text) + 1):
        for b in parser.blocks(text[:i]):
            assert b.end is None or b in final
    # the same parser on another text (its memo of closed blocks must not leak)
    assert parser.blocks("x" + text) == [Block(b.start + 1, b.end + 1, b.calls) for b in final]


FRAGMENTS = {  # pieces of each family's markup, well-formed calls among them
    Glm45ToolParser: ["<tool_call>", "</tool_call>", "f", "\n", "<arg_key>", "</arg_key>", "<arg_value>",
                      "</arg_value>", "a", "1", " ", "x y", "<", glm("f", ("a", "[1]")), glm("g")],
    Qwen3CoderToolParser: ["<tool_call>", "</tool_call>", "<function=", "f>", "</function>", "<parameter=", "a>",
                           "</parameter>", "\n", "1", " ", "x", "<", "<function", qc("f", ("a", "[1]")), qc("g")],
    MinimaxM2ToolParser: ["<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=", '"f">', "</invoke>",
                          "<parameter name=", '"a">', "</parameter>", "\n", "1", " ", "x", "<", mm1("f", ("a", "[1]"))],
}
REASONING = {Glm45ToolParser: Glm45ReasoningParser, Qwen3CoderToolParser: Qwen3ReasoningParser,
             MinimaxM2ToolParser: MiniMaxM2ReasoningParser}


@pytest.mark.parametrize("family", list(FRAGMENTS), ids=lambda c: c.name)
def test_random_markup_streams_as_it_parses_whole(family):
    """Random mixes of a family's markup (and <think> markers): streamed in one piece, one character
    at a time and cut at random places, the deltas add up to the whole text's message."""
    import random

    from tests.parser_cases import streamed

    rng = random.Random(7)
    pieces = FRAGMENTS[family] + ["<think>", "</think>"]
    for _ in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 20)))
        schema = {"f": {"properties": {"a": {"type": rng.choice(["string", "integer", "array"])}}}}
        kw = dict(tools=family(schema if rng.random() < 0.3 else None),
                  reasoning=REASONING[family]() if rng.random() < 0.5 else None)
        kw["starts_in_reasoning"] = kw["reasoning"] is not None and rng.random() < 0.4
        expected = whole(text, **kw)
        cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1)))
        for split in ([text], list(text), [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]):
            assert streamed(split, **kw) == expected, (text, split)


# --- values typed by the tools' schemas ---

SCHEMAS = {"f": {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "ns": {"type": ["string", "null"]},
    "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "e": {"enum": [1, 2, 3]}}}}


def calls_of(parser, text):
    return whole(text, tools=parser)[2]


def test_glm45_values_by_schema():
    text = glm("f", ("s", " 123 "), ("i", "7"), ("o", '{"k": 1}'), ("x", "[1]"))
    assert calls_of(Glm45ToolParser(SCHEMAS), text) == [("f", {"s": " 123 ", "i": 7, "o": {"k": 1}, "x": [1]})]
    assert calls_of(GLM, text) == [("f", {"s": 123, "i": 7, "o": {"k": 1}, "x": [1]})]
    # a function the schemas do not know: read as without them
    assert calls_of(Glm45ToolParser(SCHEMAS), glm("g", ("s", "123"))) == [("g", {"s": 123})]


def test_qwen3_coder_values_by_schema():
    typed = Qwen3CoderToolParser(SCHEMAS)
    text = qc("f", ("x", "[1]"), ("s", "123"), ("i", "7"), ("n", "2.50"), ("b", "True"), ("o", "{'k': [1, 'x']}"),
              ("a", '["a", 1]'), ("ns", "null"), ("u", "12"))
    assert calls_of(typed, text) == [("f", {"x": "[1]", "s": "123", "i": 7, "n": 2.5, "b": True, "o": {"k": [1, "x"]},
                                            "a": ["a", 1], "ns": None, "u": 12})]
    text = qc("f", ("s", "null"), ("i", "seven"), ("n", "3.0"), ("b", "yes"), ("o", "{oops"), ("e", "2"))
    # (e: a schema without a type is a string's)
    assert calls_of(typed, text) == [("f", {"s": "null", "i": "seven", "n": 3, "b": False, "o": "{oops", "e": "2"})]
    # with a schema, only its parameter names end a value (as vLLM: a value may hold such markup), so
    # a parameter it does not name, after another, is read as part of that one's text
    assert calls_of(typed, qc("f", ("s", "a"), ("zz", "b"))) == [("f", {"s": "a\n</parameter>\n<parameter=zz>\nb"})]
    assert calls_of(typed, qc("g", ("s", "123"))) == [("g", {"s": "123"})]  # a function it does not know
    # without schemas: JSON, else the text
    assert calls_of(QC, qc("f", ("s", "123"), ("o", "{'k': 1}"))) == [("f", {"s": 123, "o": "{'k': 1}"})]


def test_minimax_m2_values_by_schema():
    typed = MinimaxM2ToolParser(SCHEMAS)
    text = mm1("f", ("s", "123"), ("i", "7"), ("n", "2.50"), ("b", "yes"), ("o", '{"k": 1}'), ("a", "[1]"),
               ("u", "abc"), ("e", "2"), ("x", "[1]"), ("nil", "nil"))
    assert calls_of(typed, text) == [("f", {"s": "123", "i": 7, "n": 2.5, "b": True, "o": {"k": 1}, "a": [1],
                                            "u": "abc", "e": 2, "x": "[1]", "nil": None})]
    assert calls_of(typed, mm1("f", ("i", "x1"), ("b", "maybe"))) == [("f", {"i": "x1", "b": "maybe"})]
    assert calls_of(MM, mm1("f", ("s", "123"), ("nil", "nil"))) == [("f", {"s": 123, "nil": "nil"})]


# --- reasoning ---

def reasoning_cases(tool_call: str, call: tuple):
    """(text, prompt opened the reasoning, expected) for every family; `tool_call` is one call in the
    family's markup and `call` what it parses to."""
    return [
        ("<think>\nweigh it\n</think>\n\nThe answer.", False, ("weigh it", "The answer.", [])),
        ("\n<think>a</think>b", False, ("a", "b", [])),
        ("weigh it</think>The answer.", True, ("weigh it", "The answer.", [])),
        ("<think>\nthe model opened it again\n</think>\nok", True, ("the model opened it again", "ok", [])),
        ("<think>never closed", False, ("never closed", "", [])),
        ("never closed", True, ("never closed", "", [])),
        ("Just an answer.", False, ("", "Just an answer.", [])),
        ("</think>", True, ("", "", [])),
        ("<thin", False, ("", "<thin", [])),
        ("<think>plan: call it</think>\n\nSure. " + tool_call, False, ("plan: call it", "Sure.", [call])),
    ]


@pytest.mark.parametrize("text,opened,expected", reasoning_cases(glm("f", ("a", "1")), ("f", {"a": 1})) + [
    # markup in the reasoning is reasoning
    ("plan " + glm("f", ("a", "1")) + "</think>" + glm("f", ("a", "1")), True,
     ("plan " + glm("f", ("a", "1")), "", [("f", {"a": 1})])),
])
def test_glm45_reasoning(text, opened, expected):
    check(text, expected, tools=GLM, reasoning=GLM_THINK, starts_in_reasoning=opened)


@pytest.mark.parametrize("text,opened,expected", reasoning_cases(mm1("f", ("a", "1")), ("f", {"a": 1})) + [
    ("plan " + mm1("f", ("a", "1")) + "</think>" + mm1("f", ("a", "1")), True,
     ("plan " + mm1("f", ("a", "1")), "", [("f", {"a": 1})])),
])
def test_minimax_m2_reasoning(text, opened, expected):
    check(text, expected, tools=MM, reasoning=MM_THINK, starts_in_reasoning=opened)


CALL = qc("f", ("a", "1"))


@pytest.mark.parametrize("text,opened,expected", reasoning_cases(CALL, ("f", {"a": 1})) + [
    # a tool call with <function=...> ends an unclosed reasoning (Qwen3.5); a <tool_call> that is not
    # followed by <function is reasoning text
    ("<think>\nI will call f. " + CALL, False, ("I will call f.", "", [("f", {"a": 1})])),
    ("I will call f.\n\n" + CALL + "\nDone.", True, ("I will call f.", "Done.", [("f", {"a": 1})])),
    ("the <tool_call> tag, then " + CALL, True, ("the <tool_call> tag, then", "", [("f", {"a": 1})])),
    ("<think>a <tool_call> b <tool_call>\n\n", False, ("a <tool_call> b <tool_call>", "", [])),
    ("a <tool_call>\n<functional> b</think>c", True, ("a <tool_call>\n<functional> b", "c", [])),
    # so a call in the reasoning ends it there, and the rest (its </think> too) is the answer
    ("plan " + CALL + "</think>" + CALL, True, ("plan", "</think>", [("f", {"a": 1}), ("f", {"a": 1})])),
])
def test_qwen3_reasoning(text, opened, expected):
    check(text, expected, tools=QC, reasoning=QWEN3, starts_in_reasoning=opened)


def test_qwen3_reasoning_with_hermes_calls():
    """Qwen3's own template writes hermes calls: those never end the reasoning."""
    from server.parsers.hermes import HermesToolParser

    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    check("<think>maybe " + call + "</think>\n\n" + call, ("maybe " + call, "", [("f", {"a": 1})]),
          tools=HermesToolParser(), reasoning=QWEN3)


def test_prompt_opened_reasoning():
    for parser in (QWEN3, GLM_THINK, MM_THINK):
        assert parser.starts_in_reasoning("<|user|>hi<|assistant|><think>\n")
        assert not parser.starts_in_reasoning("<|assistant|><think></think>\n")
    assert not QWEN3.starts_in_reasoning("<|im_start|>assistant\n")
    assert not GLM_THINK.starts_in_reasoning("<|assistant|>")
    # MiniMax-M2: the output is reasoning until </think> whatever the prompt (as vLLM's parser)
    assert MM_THINK.starts_in_reasoning("]~b]ai\n")


# --- the published chat templates ---

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"},
                                               "options": {"type": "object"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALLS = [("get_weather", {"city": "Zürich", "days": 3, "options": {"units": ["°C", "km/h"], "hourly": True}}),
         ("add", {"a": 1, "b": 2})]
FUNCTIONS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
FAMILIES = {  # template -> (tool parser, the assistant turn's header and what follows the turn)
    "glm45": (Glm45ToolParser, "<|assistant|>", "<|observation|>"),
    "qwen3_coder": (Qwen3CoderToolParser, "<|im_start|>assistant", "<|im_end|>"),
    "minimax_m2": (MinimaxM2ToolParser, "]~b]ai", "[e~["),
}


def _conversation(tool_results: bool = True) -> list[dict]:
    """A conversation as the server hands it to chat templates (ChatMessage.as_template_input)."""
    from server.openai_protocol import ChatCompletionRequest

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich, and 1 + 2?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
            for i, (name, args) in enumerate(CALLS)]}]
    if tool_results:
        messages += [{"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
                     {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    req = ChatCompletionRequest.model_validate({"tools": TOOLS, "messages": messages})
    return [m.as_template_input() for m in req.messages]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from models.builtin import BUILTIN_DIR

    return AutoTokenizer.from_pretrained(str(BUILTIN_DIR))


def _render(tokenizer, name: str, messages: list[dict], **kwargs) -> str:
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kwargs)


@pytest.mark.parametrize("name", ["glm45", "qwen3_coder", "qwen3", "minimax_m2"])
def test_template_fixture_names_its_source(name):
    first = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8").split("\n", 1)[0]
    assert first.startswith("{# source: https://") and first.endswith(" #}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_published_template_renders_tools_and_calls_that_parse_back(tokenizer, name):
    parser_cls, header, end = FAMILIES[name]
    text = _render(tokenizer, name, _conversation(), add_generation_prompt=True)
    assert "get_weather" in text and "sunny" in text and "Be brief." in text and "Zürich" in text
    # the assistant turn, as the template wrote it, is what the model writes: parsed back, its
    # content and calls are the conversation's (with the schemas, and without them)
    turn = text[text.rindex(header, 0, text.index("Checking.")) + len(header):]
    turn = turn[:turn.index(end)].rsplit("</think>", 1)[-1]
    for parser in (parser_cls(), parser_cls(FUNCTIONS)):
        reasoning, content, calls = whole(turn, tools=parser)
        assert content.strip() == "Checking." and calls == CALLS


def test_templates_open_the_reasoning_as_the_parsers_expect(tokenizer):
    messages = _conversation()
    # GLM-4.5/4.6: the model writes <think> itself; thinking off puts an empty block in the prompt
    prompt = _render(tokenizer, "glm45", messages, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>") and not GLM_THINK.starts_in_reasoning(prompt)
    prompt = _render(tokenizer, "glm45", messages, add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<think></think>") and not GLM_THINK.starts_in_reasoning(prompt)
    # Qwen3: likewise (its template renders hermes calls)
    prompt = _render(tokenizer, "qwen3", messages, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and not QWEN3.starts_in_reasoning(prompt)
    assert '<tool_call>\n{"name": "get_weather"' in prompt
    prompt = _render(tokenizer, "qwen3", messages, add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and not QWEN3.starts_in_reasoning(prompt)
    # MiniMax-M2: the template opens the reasoning in every generation prompt
    prompt = _render(tokenizer, "minimax_m2", messages, add_generation_prompt=True)
    assert prompt.endswith("]~b]ai\n<think>\n") and MM_THINK.starts_in_reasoning(prompt)
    check("Think.\n</think>\n\nIt is sunny. " + mm1("add", ("a", "1"), ("b", "2")),
          ("Think.", "It is sunny.", [("add", {"a": 1, "b": 2})]), tools=MM, reasoning=MM_THINK,
          starts_in_reasoning=MM_THINK.starts_in_reasoning(prompt))
