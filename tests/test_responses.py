"""POST /v1/responses through the official openai client against the server's app in process: text
answers whole and streamed (every event one of the client's typed classes, in OpenAI's order), the
conversation the chat template renders (instructions, function calls and their outputs, a stored
previous response), max_output_tokens, reasoning items, and OpenAI-shaped errors."""
import asyncio
import contextlib
import json
import typing

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import ResponseStreamEvent

from server.api_server import ServerConfig, build_app
from server.async_llm import AsyncLLM
from server.metrics import ServerMetrics
from server.openai_protocol import ChatMessage
from server.parsers import REASONING_PARSERS, ReasoningParser
from server.responses import ResponseStore

TIMEOUT = 60.0
GREEDY = {"temperature": 0}
# the arguments can only be {"city": "Paris"} or {"city": "Rome"}: a short call even from a random model
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}
# the client's class of each event type: every event must parse into its own class
EVENT_CLASSES = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
                 for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


@pytest.fixture(scope="module")
def llm(make_checkpoint):
    llm = AsyncLLM(make_checkpoint("mixtral"))
    yield llm
    llm.shutdown()


@pytest.fixture
def rendered(llm, monkeypatch) -> list[str]:
    """The prompt texts the chat template rendered, in order."""
    texts: list[str] = []
    real = llm.render_chat

    def spy(*args, **kwargs):
        text, ids = real(*args, **kwargs)
        texts.append(text)
        return text, ids

    monkeypatch.setattr(llm, "render_chat", spy)
    return texts


def run(llm, test, cfg: ServerConfig | None = None):
    """asyncio.run(test(client, http)) under TIMEOUT, with the official client and a raw one on the app."""
    async def main():
        app = build_app(llm, cfg or ServerConfig(), ServerMetrics("tiny"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shuttle") as http:
            client = openai.AsyncOpenAI(base_url="http://shuttle/v1", api_key="none", http_client=http, max_retries=0)
            return await test(client, http)

    return asyncio.run(asyncio.wait_for(main(), TIMEOUT))


async def events_of(client: openai.AsyncOpenAI, **kw) -> list:
    stream = await client.responses.create(stream=True, **kw)
    events = [e async for e in stream]
    for i, e in enumerate(events):
        assert type(e) is EVENT_CLASSES[e.type], (e.type, type(e))  # parsed into its class, not a fallback
        assert e.sequence_number == i
    return events


def check_order(events: list) -> None:
    """OpenAI's order: created, in_progress, then each item added, its parts and deltas, done; last
    completed (or incomplete)."""
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    body = kinds[2:-1]
    for index, item in enumerate(final.output):
        start = body.index("response.output_item.added")
        end = body.index("response.output_item.done")
        added, done = events[2 + start], events[2 + end]
        assert added.output_index == done.output_index == index and done.item == item
        body = body[end + 1:]
        events = events[:2] + events[2 + end + 1:]
    assert body == []


def text_of(response) -> str:
    return "".join(p.text for item in response.output if item.type == "message" for p in item.content)


def test_text_answer_whole_and_streamed(llm, rendered):
    """The same greedy answer whole and streamed (its deltas add up), and the same as chat
    completions gives for the same conversation; max_output_tokens cuts it: incomplete."""
    ask = dict(model="shuttle", input="The for statement", max_output_tokens=6, extra_body={"ignore_eos": True},
               **GREEDY)

    async def test(client, http):
        whole = await client.responses.create(**ask)
        events = await events_of(client, **ask)
        chat = await client.chat.completions.create(model="shuttle", max_tokens=6, extra_body={"ignore_eos": True},
                                                    messages=[{"role": "user", "content": "The for statement"}],
                                                    **GREEDY)
        return whole, events, chat

    whole, events, chat = run(llm, test)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == "shuttle"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].type == "output_text" and message.content[0].text == chat.choices[0].message.content
    assert whole.output_text == chat.choices[0].message.content != ""  # the client's convenience property
    assert whole.usage.input_tokens == chat.usage.prompt_tokens and whole.usage.output_tokens == 6
    assert whole.usage.total_tokens == whole.usage.input_tokens + 6
    assert whole.usage.output_tokens_details.reasoning_tokens == 0
    assert rendered[0] == "<|user|>\nThe for statement<|end|>\n<|assistant|>\n" == rendered[1] == rendered[2]

    check_order(events)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert "".join(deltas) == done.text == text_of(final) == text_of(whole) and len(deltas) > 1
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == "incomplete" and final.id != whole.id
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, 6)


def test_completed_answer_with_a_json_format(llm):
    """text.format json_schema constrains the answer; the grammar ends it: completed."""
    fmt = {"type": "json_schema", "name": "answer", "schema": {"enum": ["yes", "no"]}, "strict": True}

    async def test(client, http):
        whole = await client.responses.create(model="shuttle", input="Is it?", text={"format": fmt},
                                              max_output_tokens=16, **GREEDY)
        events = await events_of(client, model="shuttle", input="Is it?", text={"format": fmt}, max_output_tokens=16,
                                  **GREEDY)
        return whole, events

    whole, events = run(llm, test)
    assert whole.status == "completed" and whole.incomplete_details is None
    assert json.loads(whole.output_text) in ("yes", "no") and whole.output[0].status == "completed"
    check_order(events)
    assert events[-1].type == "response.completed" and text_of(events[-1].response) == whole.output_text
    assert whole.text.format.type == "json_schema"


def test_instructions_and_message_items_reach_the_template(llm, rendered):
    async def test(client, http):
        return await client.responses.create(
            model="shuttle", instructions="Be brief.", max_output_tokens=2, input=[
                {"role": "developer", "content": "Answer in English."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is "},
                                                                 {"type": "input_text", "text": "a list?"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "A sequence.", "annotations": []}]},
                {"role": "user", "content": "And a dict?"}])

    r = run(llm, test)
    assert rendered == ["<|system|>\nBe brief.<|end|>\n<|developer|>\nAnswer in English.<|end|>\n"
                        "<|user|>\nWhat is a list?<|end|>\n<|assistant|>\nA sequence.<|end|>\n"
                        "<|user|>\nAnd a dict?<|end|>\n<|assistant|>\n"]
    assert r.instructions == "Be brief." and r.usage.output_tokens == 2


def test_function_call_round_trip(llm, rendered):
    """tool_choice required gives a function_call item (whole and streamed); its output sent back,
    after the call item or through previous_response_id, is rendered into the prompt as the
    conversation's tool result (the previous response's instructions are not carried over, as OpenAI)."""
    question = "What is the weather in Paris?"
    tools = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_output_tokens=64, **GREEDY)

    async def test(client, http):
        first = await client.responses.create(model="shuttle", input=question, instructions="Use the tools.", **tools)
        events = await events_of(client, model="shuttle", input=question, **tools)
        call = first.output[0]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
        chained = await client.responses.create(model="shuttle", previous_response_id=first.id, input=[result],
                                                tools=[WEATHER], tool_choice="none", max_output_tokens=2)
        sent_back = await client.responses.create(
            model="shuttle", input=[{"role": "user", "content": question}, call.model_dump(exclude_none=True), result],
            tools=[WEATHER], tool_choice="none", max_output_tokens=2, store=False)
        return first, events, chained, sent_back

    first, events, chained, sent_back = run(llm, test)
    assert first.status == "completed" and len(first.output) == 1, first.output
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    assert first.tool_choice == "required" and first.tools[0].name == "get_weather"

    check_order(events)
    kinds = [e.type for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    [streamed] = events[-1].response.output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    assert events[3].delta == events[4].arguments == call.arguments and events[2].item.arguments == ""

    assert chained.previous_response_id == first.id and chained.status == "incomplete"
    prompt = rendered[-2]
    assert prompt == rendered[-1]  # stored conversation and the items sent back render alike
    assert "Use the tools." in rendered[0] and "Use the tools." not in prompt  # instructions are not carried over
    assert f"<|user|>\n{question}<|end|>" in prompt
    assert f'<tool_call>{{"name": "get_weather", "arguments": {call.arguments}}}</tool_call>' in prompt
    assert prompt.endswith("<|tool|>\nsunny, 21 C<|end|>\n<|assistant|>\n")
    assert '"name": "get_weather"' in prompt.split("<|user|>")[0]  # the tools, shown by the template


def test_named_tool_choice_streams_the_arguments(llm):
    choice = {"type": "function", "name": "get_weather"}

    async def test(client, http):
        whole = await client.responses.create(model="shuttle", input="Weather?", tools=[WEATHER], tool_choice=choice,
                                              max_output_tokens=64, **GREEDY)
        events = await events_of(client, model="shuttle", input="Weather?", tools=[WEATHER], tool_choice=choice,
                                 max_output_tokens=64, **GREEDY)
        return whole, events

    whole, events = run(llm, test)
    [call] = whole.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    check_order(events)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments == events[-1].response.output[0].arguments


class _Think(ReasoningParser):
    name = "test_think"


def test_reasoning_items(llm, monkeypatch):
    """With a reasoning parser the reasoning is an item of its own, before the message (a prompt that
    opened <think> leaves the model in its reasoning; the format forces the end marker)."""
    monkeypatch.setitem(REASONING_PARSERS, "test_think", _Think)
    fmt = {"type": "json_schema", "name": "a", "schema": {"enum": ["</think>yes"]}}
    ask = dict(model="shuttle", input="<think>", text={"format": fmt}, max_output_tokens=24, **GREEDY)

    async def test(client, http):
        return await client.responses.create(**ask), await events_of(client, **ask)

    whole, events = run(llm, test, ServerConfig(reasoning_parser="test_think"))
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text == '"'
    assert message.type == "message" and whole.output_text == 'yes"'
    assert whole.usage.output_tokens_details.reasoning_tokens == 1
    check_order(events)
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == '"'
    assert events[-1].response.output[0].content == reasoning.content


def test_bodies_and_events_match_the_openapi_document(llm, monkeypatch):
    """Each response and each raw server-sent event (`event: <type>` beside its data) as /openapi.json
    documents them: a message, a function call, a reasoning item, and their events."""
    monkeypatch.setitem(REASONING_PARSERS, "test_think", _Think)
    fmt = {"type": "json_schema", "name": "a", "schema": {"enum": ["</think>yes"]}}
    bodies = [{"input": "hi", "max_output_tokens": 3, "metadata": {"k": "v"}},
              {"input": "Weather?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
               "max_output_tokens": 64, "instructions": "Be brief."},
              {"input": "<think>", "text": {"format": fmt}, "max_output_tokens": 24}]

    async def test(client, http):
        doc = (await http.get("/openapi.json")).json()
        out = []
        for body in bodies:
            whole = (await http.post("/v1/responses", json={**body, **GREEDY})).json()
            async with http.stream("POST", "/v1/responses", json={**body, **GREEDY, "stream": True}) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                text = "".join([chunk async for chunk in r.aiter_text()])
            out.append((whole, [block.split("\n") for block in text.strip().split("\n\n")]))
        return doc, out

    doc, out = run(llm, test, ServerConfig(reasoning_parser="test_think"))
    op = doc["paths"]["/v1/responses"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert "text/event-stream" in op["responses"]["200"]["content"] and {"400", "404", "503"} <= set(op["responses"])
    response = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/ResponseObject", **doc})
    event = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/ResponseStreamEvent", **doc})
    kinds = set()
    for whole, blocks in out:
        response.validate(whole)
        kinds |= {item["type"] for item in whole["output"]}
        for lines in blocks:
            assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), lines
            data = json.loads(lines[1][len("data: "):])
            assert data["type"] == lines[0][len("event: "):]
            event.validate(data)
    assert kinds == {"message", "function_call", "reasoning"}


def test_previous_response_id_unknown_or_not_stored(llm):
    async def test(client, http):
        r = await http.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="shuttle", input="hi", previous_response_id="resp_nope")
        unstored = await client.responses.create(model="shuttle", input="hi", max_output_tokens=1, store=False)
        later = await http.post("/v1/responses", json={"input": "hi", "previous_response_id": unstored.id})
        return r, e.value, later

    r, error, later = run(llm, test)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "Previous response with id 'resp_nope' not found.", "type": "invalid_request_error",
        "param": "previous_response_id", "code": "previous_response_not_found"}
    assert error.status_code == 400 and error.body["param"] == "previous_response_id"
    assert later.status_code == 400 and later.json()["error"]["code"] == "previous_response_not_found"


def test_an_engine_failure_is_an_error(llm, monkeypatch):
    """Whole: a 500 with an OpenAI error. Streamed (200 was sent): an error event, then response.failed."""
    real = llm.generate

    async def failing(*args, **kwargs):
        async with contextlib.aclosing(real(*args, **kwargs)) as outputs:
            async for out in outputs:
                yield out
                raise RuntimeError("a worker died")

    monkeypatch.setattr(llm, "generate", failing)
    ask = dict(model="shuttle", input="hi", max_output_tokens=4)

    async def test(client, http):
        whole = await http.post("/v1/responses", json=ask)
        return whole, await events_of(client, **ask)

    whole, events = run(llm, test)
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "engine_error"
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "a worker died" in events[-2].message and events[-1].response.status == "failed"
    assert events[-1].response.error.code == "server_error"


def test_the_store_is_bounded():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(f"resp_{i}", [ChatMessage(role="user", content=str(i))], {"id": f"resp_{i}"})
    assert len(store) == 2 and store.get("resp_0") is None and store.get("resp_2")[0].content == "2"
    assert store.body("resp_0") is None and store.body("resp_1") == {"id": "resp_1"}


def test_stored_responses_are_retrieved_and_deleted(llm):
    """GET /v1/responses/{id} answers the stored response object (whole or streamed, the same body),
    DELETE forgets it; an unknown, unstored or deleted id is a 404 OpenAI error."""
    async def test(client, http):
        made = await client.responses.create(model="shuttle", input="hi", max_output_tokens=3, **GREEDY)
        streamed = (await events_of(client, model="shuttle", input="hi", max_output_tokens=3, **GREEDY))[-1].response
        got = [await client.responses.retrieve(r.id) for r in (made, streamed)]
        unstored = await client.responses.create(model="shuttle", input="hi", max_output_tokens=1, store=False)
        missing = [await http.get(f"/v1/responses/{i}") for i in (unstored.id, "resp_nope")]
        deleted = await http.delete(f"/v1/responses/{made.id}")
        await client.responses.delete(streamed.id)
        after = [await http.get(f"/v1/responses/{made.id}"), await http.delete(f"/v1/responses/{made.id}")]
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(streamed.id)
        later = await http.post("/v1/responses", json={"input": "hi", "previous_response_id": made.id})
        return made, streamed, got, missing, deleted, after, later

    made, streamed, got, missing, deleted, after, later = run(llm, test)
    assert got[0].model_dump() == made.model_dump() and got[1].model_dump() == streamed.model_dump()
    assert got[0].output_text == made.output_text and got[1].status == streamed.status
    assert deleted.status_code == 200 and deleted.json() == {"id": made.id, "object": "response", "deleted": True}
    for r in missing + after:
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.json()
    assert later.status_code == 400 and later.json()["error"]["code"] == "previous_response_not_found"


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0.output"),
    ({"input": "hi", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": [WEATHER]}, "tool_choice"),  # auto needs --tool-call-parser
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "hi", "background": True}, "background"),
])
def test_bad_requests_are_400_with_an_openai_error(llm, body, param):
    async def test(client, http):
        return await http.post("/v1/responses", json=body)

    r = run(llm, test)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error
    assert "max_tokens" not in error["message"], error  # named as this API names it


def test_unknown_model_and_bad_json(llm):
    async def test(client, http):
        return (await http.post("/v1/responses", json={"model": "gpt-5", "input": "hi"}),
                await http.post("/v1/responses", content=b"{not json"))

    model, bad_json = run(llm, test)
    assert model.status_code == 404 and model.json()["error"]["code"] == "model_not_found"
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
