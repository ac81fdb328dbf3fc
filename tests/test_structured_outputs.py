"""Structured outputs end to end: the official `openai` client against a live `shuttle serve` on the
built-in model (disaggregated: sampling and grammar masks run on the attention worker). 50 JSON
schemas of varied shape each give output that parses and validates with `jsonschema`, greedy and
sampled, streamed and not; regex, choice, grammar, json_object and vLLM's older guided_* names;
invalid constraints are a 400 naming the field."""
import asyncio
import json
import re

import grpc
import httpx
import jsonschema
import openai
import pytest

from bench.json_schemas import schemas
from clients.grpc_client import GrpcClient
from clients.live_server import LiveServer

pytestmark = pytest.mark.slow
MAX_TOKENS = 192  # the largest of the 50 schemas' outputs takes about 120 tokens of the built-in model
PROMPT = 'A JSON object such as {"name": "spam"}:'  # a prompt under which greedy free-form JSON closes


@pytest.fixture(scope="module")
def server():
    with LiveServer(["--grpc-port", "0", "--tool-call-parser", "hermes"]) as srv:
        yield srv


def _chat_kwargs(schema: dict, i: int) -> dict:
    """Schema i's request: the variants cycle over greedy/sampled x streamed/not."""
    return dict(model="shuttle-builtin", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "An object:"}],
                temperature=0.0 if i % 2 == 0 else 1.0, seed=i, stream=i % 4 >= 2,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})


async def _run(client: openai.AsyncOpenAI, kwargs: dict) -> tuple[str, str | None]:
    if not kwargs["stream"]:
        r = await client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await client.chat.completions.create(**kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_fifty_json_schemas_validate(server):
    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600) as client:
            return await asyncio.gather(*(_run(client, _chat_kwargs(s, i)) for i, s in enumerate(schemas(50))))

    results = asyncio.run(main())
    for i, (schema, (text, finish)) in enumerate(zip(schemas(50), results)):
        assert finish == "stop", f"schema {i} did not finish in {MAX_TOKENS} tokens: {text!r}"
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}}, lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
    ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["alpha", "beta gamma"]}}, lambda t: t in ("alpha", "beta gamma")),
    ({"guided_choice": ["x", "y"]}, lambda t: t in ("x", "y")),
    ({"structured_outputs": {"grammar": 'root ::= "v" [0-9] [0-9]? "."'}}, lambda t: re.fullmatch(r"v\d\d?\.", t)),
    ({"guided_grammar": 'root ::= ("ab" | "cd") ("ab" | "cd")? "!"'}, lambda t: re.fullmatch(r"(ab|cd){1,2}!", t)),
    # free-form JSON: a sampled key of the small model may never close within max_tokens, so greedy only
    ({"structured_outputs": {"json_object": True}, "temperature": 0}, lambda t: isinstance(json.loads(t), dict)),
    ({"response_format": {"type": "json_object"}, "temperature": 0}, lambda t: isinstance(json.loads(t), dict)),
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
     lambda t: isinstance(json.loads(t)["n"], int)),
])
def test_other_constraints_on_completions(server, extra, check):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    temperatures = [extra.pop("temperature")] if "temperature" in extra else [0.0, 1.0]
    for temperature in temperatures:
        r = client.completions.create(model="shuttle-builtin", prompt=PROMPT, max_tokens=64, seed=7,
                                      temperature=temperature, extra_body=extra)
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop" and check(text), (extra, text)


@pytest.mark.parametrize("body,param,says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minLength": "a"}}}},
     "response_format", "minLength"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs", "undefined_rule"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_json": "{not json", "guided_regex": "a"}, "guided_regex", "only one"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "text"),
])
def test_invalid_constraints_are_400(server, body, param, says):
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


def test_over_grpc(server):
    """The same constraints through the gRPC service: a schema, a choice, logit_bias, and a bad regex."""
    schema = schemas(50)[3]
    with GrpcClient(f"127.0.0.1:{server.grpc_port}") as c:
        r = c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.8, seed=2, structured_outputs={"json": schema})
        jsonschema.validate(json.loads(r.completions[0].text), schema)
        r = c.generate(PROMPT, max_tokens=8, structured_outputs={"choice": ["spam", "eggs"]}, logit_bias={0: -100})
        assert r.completions[0].text in ("spam", "eggs")
        chunks = "".join(ch.text for ch in c.generate_stream(PROMPT, max_tokens=16, temperature=0,
                                                             structured_outputs={"regex": "[0-9]{4}"}))
        assert re.fullmatch("[0-9]{4}", chunks)
        with pytest.raises(grpc.RpcError) as err:
            c.generate(PROMPT, max_tokens=4, structured_outputs={"regex": "(unclosed"})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parenthesis" in err.value.details()


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city"],
           "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def _tool_calls(client: openai.OpenAI, stream: bool, **kw) -> tuple[list[tuple[str, str]], str | None, str | None]:
    """(name, arguments) of each call, the content and the finish reason, streamed or not."""
    kw = dict(model="shuttle-builtin", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
              tools=TOOLS, max_tokens=96, **kw)
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        return [(c.function.name, c.function.arguments) for c in m.tool_calls or []], m.content, r.choices[0].finish_reason
    calls: dict[int, list] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        content += d.content or ""
        for c in d.tool_calls or []:
            entry = calls.setdefault(c.index, ["", ""])
            entry[0] += (c.function.name or "") if c.function else ""
            entry[1] += (c.function.arguments or "") if c.function else ""
            assert c.id is None or c.id.startswith("call_")
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], content or None, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_tool_calls_validate(server, stream, temperature):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    # a small model may add calls until max_tokens (finish "length", the calls closed so far returned);
    # parallel_tool_calls=False caps them at one
    parallel = temperature == 0
    calls, _, finish = _tool_calls(client, stream, tool_choice="required", temperature=temperature, seed=5,
                                   parallel_tool_calls=parallel)
    assert calls and finish in (("tool_calls", "length") if parallel else ("tool_calls",))
    for name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])
    calls, content, finish = _tool_calls(client, stream, temperature=temperature, seed=5,
                                         tool_choice={"type": "function", "function": {"name": "add"}})
    assert [name for name, _ in calls] == ["add"] and finish == "stop" and not content
    jsonschema.validate(json.loads(calls[0][1]), ADD)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_call_is_parsed(server, stream):
    """tool_choice auto: the text the model writes (held to a tool call by a regex here, since the
    small model was never taught to call tools) is parsed by --tool-call-parser hermes."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    regex = r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'
    calls, content, finish = _tool_calls(client, stream, extra_body={"structured_outputs": {"regex": regex}})
    assert content.strip() == "Checking." and finish == "tool_calls"
    assert calls[0][0] == "get_weather" and json.loads(calls[0][1])["city"] in ("Paris", "Rome")
    plain, content, finish = _tool_calls(client, stream, tool_choice="none", temperature=0)
    assert plain == [] and finish in ("stop", "length")


def test_tool_results_are_accepted_back(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="shuttle-builtin", max_tokens=8, tools=TOOLS, tool_choice="none", messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 40
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
