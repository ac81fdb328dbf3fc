"""Each family's chat format end to end, through the official `openai` client against the HTTP app:
a tiny checkpoint carrying the family's published chat template (tests/fixtures/chat_templates/),
its output forced into the family's markup by structured outputs (a regex of the exact text), and
the server's --tool-call-parser / --reasoning-parser turning it into tool_calls and
reasoning_content, whole and streamed alike."""
import asyncio
import json
import re
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from server.api_server import ServerConfig, build_app
from server.async_llm import AsyncLLM
from server.metrics import ServerMetrics

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a term up.", "parameters": {
    "type": "object", "properties": {"term": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["term"]}}}]
MESSAGES = [{"role": "user", "content": "What is a list?"}]

# family -> (template fixture, --tool-call-parser, --reasoning-parser, the output text, expected
# (reasoning or None, content, [(name, arguments)]))
ARGS = '{"term": "list", "limit": 2}'
CALL = [("lookup", {"term": "list", "limit": 2})]
CASES = {
    "hermes": ("qwen3.jinja", "hermes", None,
               f'Let me check.\n<tool_call>\n{{"name": "lookup", "arguments": {ARGS}}}\n</tool_call>',
               (None, "Let me check.", CALL)),
    "qwen3 reasoning": ("qwen3.jinja", "hermes", "qwen3",
                        f'<think>\nLook it up.\n</think>\n\n<tool_call>\n{{"name": "lookup", "arguments": {ARGS}}}'
                        '\n</tool_call>', ("Look it up.", "", CALL)),
    "deepseek_v3": ("deepseek_v3.jinja", "deepseek_v3", "deepseek_r1",
                    "<think>Look it up.</think>Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                    f"lookup\n```json\n{ARGS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", ("Look it up.", "Sure.", CALL)),
    "deepseek_v31": ("deepseek_v31.jinja", "deepseek_v31", None,
                     "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>lookup<｜tool▁sep｜>"
                     f"{ARGS}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", (None, "Sure.", CALL)),
    "kimi_k2": ("kimi_k2.jinja", "kimi_k2", "kimi_k2",
                "<think>Look it up.</think>Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0"
                f"<|tool_call_argument_begin|>{ARGS}<|tool_call_end|><|tool_calls_section_end|>",
                ("Look it up.", "Sure.", CALL)),
    "glm45": ("glm45.jinja", "glm45", "glm45",
              "<think>Look it up.</think>\nSure.\n<tool_call>lookup\n<arg_key>term</arg_key>\n<arg_value>list"
              "</arg_value>\n<arg_key>limit</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
              ("Look it up.", "Sure.", CALL)),
    "qwen3_coder": ("qwen3_coder.jinja", "qwen3_coder", None,
                    "Sure.\n<tool_call>\n<function=lookup>\n<parameter=term>\nlist\n</parameter>\n"
                    "<parameter=limit>\n2\n</parameter>\n</function>\n</tool_call>", (None, "Sure.", CALL)),
    "minimax_m2": ("minimax_m2.jinja", "minimax_m2", "minimax_m2",
                   'Look it up.</think>\nSure.\n<minimax:tool_call>\n<invoke name="lookup">\n'
                   '<parameter name="term">list</parameter>\n<parameter name="limit">2</parameter>\n</invoke>\n'
                   "</minimax:tool_call>", ("Look it up.", "Sure.", CALL)),
    "openai": ("gpt_oss.jinja", "openai", "openai",
               "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary "
               f"to=functions.lookup <|constrain|>json<|message|>{ARGS}<|call|>", ("Look it up.", "", CALL)),
    "stop string": ("qwen3.jinja", None, "qwen3", "<think>東京 🌧 ok</think>Zürich, ENDE then more.",
                    ("東京 🌧 ok", "Zürich, ", [])),
    "openai answer": ("gpt_oss.jinja", None, "openai",
                      "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
                      "An ordered sequence.<|return|>", ("Easy.", "An ordered sequence.", [])),
}


@pytest.fixture(scope="module")
def llm(make_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("formats") / "mixtral"
    shutil.copytree(make_checkpoint("mixtral", max_position_embeddings=4096), d)  # templates with tools are long
    engine = AsyncLLM(d)
    yield engine
    engine.shutdown()


def _ask(llm, case: str, stream: bool, stop: list[str] | None = None):
    template, tool_parser, reasoning_parser, text, _ = CASES[case]
    llm.tokenizer.chat_template = (TEMPLATES / template).read_text()
    cfg = ServerConfig(tool_call_parser=tool_parser, reasoning_parser=reasoning_parser)
    extra = {"structured_outputs": {"regex": re.escape(text)}, "chat_template_kwargs": {}}
    if stop:
        extra["stop"] = stop

    async def run():
        app = build_app(llm, cfg, ServerMetrics("tiny"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as http:
            client = openai.AsyncOpenAI(base_url="http://shuttle/v1", api_key="none", http_client=http)
            kw = dict(model="shuttle", messages=MESSAGES, max_tokens=4 * len(text) + 8, temperature=0, extra_body=extra,
                      **({"tools": TOOLS, "tool_choice": "auto"} if tool_parser else {}))
            if not stream:
                return await client.chat.completions.create(**kw)
            chunks = [c async for c in await client.chat.completions.create(stream=True, **kw)]
            return chunks

    return asyncio.run(run())


def _message(r) -> tuple:
    m = r.choices[0].message
    extra = m.model_extra or {}
    reasoning = (extra["reasoning_content"] or "") if "reasoning_content" in extra else None
    assert extra.get("reasoning") == extra.get("reasoning_content")  # vLLM's alias
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
    return reasoning, m.content or "", calls


def _streamed(chunks) -> tuple:
    reasoning, content, calls, saw_reasoning = "", "", [], False
    for c in chunks:
        for ch in c.choices:
            extra = ch.delta.model_extra or {}
            if "reasoning_content" in extra:
                saw_reasoning = True
                reasoning += extra["reasoning_content"] or ""
            content += ch.delta.content or ""
            for call in ch.delta.tool_calls or []:  # the first delta of a call names it, later ones add arguments
                if call.id:
                    assert call.index == len(calls)
                    calls.append([call.function.name, ""])
                calls[call.index][1] += call.function.arguments or ""
    return (reasoning if saw_reasoning else None), content, [(name, json.loads(args)) for name, args in calls]


@pytest.mark.parametrize("case", sorted(set(CASES) - {"stop string"}))
def test_family_format_through_the_openai_client(llm, case):
    *_, expected = CASES[case]
    whole = _ask(llm, case, stream=False)
    assert whole.choices[0].finish_reason == ("tool_calls" if expected[2] else "stop")
    assert _message(whole) == expected
    assert _streamed(_ask(llm, case, stream=True)) == expected


def test_stop_string_and_multibyte_characters_stream_as_whole(llm):
    """A stop string that may arrive over several tokens and characters of several bytes: the
    parsers see only what the detokenizer released, so the stream still adds up to the whole."""
    *_, expected = CASES["stop string"]
    assert _message(_ask(llm, "stop string", stream=False, stop=["END"])) == expected
    assert _streamed(_ask(llm, "stop string", stream=True, stop=["END"])) == expected


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {
    "type": "integer", "minimum": 0, "maximum": 9}}, "required": ["city"], "additionalProperties": False}
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}},
                {"type": "function", "function": {"name": "lookup", "description": "Look up.", "parameters": {
                    "type": "object", "properties": {"term": {"enum": ["list", "map"]}}, "required": ["term"]}}}]
FAMILIES = {"hermes": "qwen3.jinja", "deepseek_v3": "deepseek_v3.jinja", "deepseek_v31": "deepseek_v31.jinja",
            "kimi_k2": "kimi_k2.jinja", "glm45": "glm45.jinja", "qwen3_coder": "qwen3_coder.jinja",
            "minimax_m2": "minimax_m2.jinja", "openai": "gpt_oss.jinja"}


@pytest.mark.parametrize("parser", sorted(FAMILIES))
def test_required_and_named_calls_in_the_family_markup(llm, parser):
    """tool_choice required and named hold the model to the family's own markup (not JSON), which
    the family's parser turns into tool_calls: whole and streamed the same, arguments valid."""
    llm.tokenizer.chat_template = (TEMPLATES / FAMILIES[parser]).read_text()
    cfg = ServerConfig(tool_call_parser=parser)

    async def run(choice, stream: bool):
        app = build_app(llm, cfg, ServerMetrics("tiny"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as http:
            client = openai.AsyncOpenAI(base_url="http://shuttle/v1", api_key="none", http_client=http)
            kw = dict(model="shuttle", messages=MESSAGES, max_tokens=160, temperature=0, tools=FORCED_TOOLS,
                      tool_choice=choice, parallel_tool_calls=False)
            if not stream:
                r = await client.chat.completions.create(**kw)
                return _message(r), r.choices[0].finish_reason
            chunks = [c async for c in await client.chat.completions.create(stream=True, **kw)]
            return _streamed(chunks), [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    for choice, finish in (("required", "tool_calls"), ({"type": "function", "function": {"name": "lookup"}}, "stop")):
        whole = asyncio.run(run(choice, False))
        assert whole == asyncio.run(run(choice, True)), parser
        (_, content, calls), got = whole
        assert got == finish and content == "" and len(calls) == 1, (parser, whole)
        name, arguments = calls[0]
        assert choice == "required" or name == "lookup"
        schema = next(t["function"]["parameters"] for t in FORCED_TOOLS if t["function"]["name"] == name)
        jsonschema.validate(arguments, schema)
