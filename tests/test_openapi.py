"""The documented API is the API: schemathesis generates request bodies from `/openapi.json` for every
operation of a live `shuttle serve` and checks each response (no server error, status code, content
type and body all as documented). Bounded in examples and time so the module takes about a minute.
"""
import json

import httpx
import hypothesis
import jsonschema
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from clients.live_server import LiveServer

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 25  # per operation; with max_tokens bounded by a 64-token context each answer is fast
# Not positive_data_acceptance: a body can match the schema and still be refused with 400 (a prompt
# longer than the context, top_p above 1, an unknown token id); the 400 is documented.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(make_checkpoint):
    # A short context keeps every generated request small (max_tokens null means "the rest of it").
    ckpt = make_checkpoint("qwen3_moe", max_position_embeddings=64)
    with LiveServer(["--model", str(ckpt), "--served-model-name", "tiny", "--colocated",
                     "--max-body-bytes", "100000"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
              ("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
              ("GET", "/health"), ("GET", "/version"), ("GET", "/v1/responses/{response_id}"),
              ("DELETE", "/v1/responses/{response_id}"), ("GET", "/workers")]
def test_openapi_documents_every_route(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/metrics", "/health",
            "/tokenize", "/detokenize"} <= set(doc["paths"])
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert {"model", "max_tokens", "temperature", "stream", "logit_bias"} <= set(body["properties"])
        assert {"200", "400", "401", "404", "413", "503"} <= set(op["responses"])
        assert "text/event-stream" in op["responses"]["200"]["content"]
    op = doc["paths"]["/v1/responses"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"model", "input", "instructions", "max_output_tokens", "stream", "tools", "previous_response_id"} <= \
        set(body["properties"])
    assert {"200", "400", "401", "404", "413", "503"} <= set(op["responses"])
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert {"200", "404"} <= set(doc["paths"]["/v1/responses/{response_id}"]["get"]["responses"])
    assert {"200", "404"} <= set(doc["paths"]["/v1/responses/{response_id}"]["delete"]["responses"])
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert httpx.get(f"{server.url}/docs").status_code == 200


@pytest.mark.parametrize("method,path", OPERATIONS)
def test_every_operation_answers_as_documented(api_schema, method, path):
    """Bodies generated from the documented schema: no 5xx, and status, content type and body as documented."""
    operation = api_schema[path][method]

    @hypothesis.given(case=operation.as_strategy())
    @hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def check(case) -> None:
        case.call_and_validate(checks=CHECKS, timeout=30)

    check()


@pytest.mark.parametrize("path,body,name", [
    ("/v1/completions", {"prompt": "a", "n": 2, "logprobs": 2, "echo": True}, "CompletionStreamResponse"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "ChatCompletionStreamResponse")])
def test_stream_chunks_match_their_schema(server, path, body, name):
    """schemathesis sees each event's data as a string; the chunks inside are checked here."""
    doc = httpx.get(f"{server.url}/openapi.json").json()
    validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", **doc})
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True, "max_tokens": 4}) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 3
    for data in events[:-1]:
        validator.validate(json.loads(data))


def test_the_fuzz_reached_generation(server):
    """The generated bodies were not all refused: some completions and chats really ran."""
    text = httpx.get(f"{server.url}/metrics").text
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        ok = [line for line in text.splitlines() if line.startswith("shuttle_http_requests_total")
              and f'route="{route}"' in line and 'status="200"' in line]
        assert ok and float(ok[0].rsplit(" ", 1)[1]) > 0, f"no 200 from {route}:\n{text[:2000]}"
