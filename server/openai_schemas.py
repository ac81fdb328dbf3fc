"""The API's responses as pydantic models, and the OpenAPI document built from them and the requests.

These models document the wire format (`/openapi.json`, `/docs`) and are what schemathesis checks
every response against; server/openai_serving.py (and server/responses.py for /v1/responses) builds
the same shapes as plain dicts (cheaper per streamed chunk), so a field added there must be added here
too. Requests are parsed by hand from the raw body (server/openai_protocol.py: strict JSON,
OpenAI-shaped errors), so their schemas are attached to the routes with `request_body`, not through
FastAPI's parameter binding.
"""
from typing import Annotated, Any, Literal, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field, RootModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error: OpenAI's shape."""

    error: ErrorBody


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = None
    max_model_len: int = Field(description="the context length in tokens (prompt plus completion)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose prefill the prefix cache skipped")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Per token of the text (the prompt's first when echoed): its text, log-probability (null for
    the first prompt token, which has none), the top alternatives and the offset in the text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="vLLM's prompt_logprobs: per prompt token {token id: logprob}; null for the first")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(BaseModel):
    """One server-sent event of a streamed completion (`data: {...}`); the stream ends with `data: [DONE]`."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in a string")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="vLLM's prompt_logprobs of the rendered conversation, when asked for")


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a tool call: the first delta of a call has its id, type and name; later ones
    append to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One server-sent event of a streamed chat completion; the stream ends with `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- /v1/responses (OpenAI's Responses API; built in server/responses.py) --------------------------------
class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class ResponseReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseOutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class ResponseFunctionToolCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(description="what a function_call_output input item answers")
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in a string")
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseReasoningItem(BaseModel):
    """The reasoning the server's --reasoning-parser told from the answer."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ResponseReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


ResponseOutputItem = Annotated[Union[ResponseOutputMessage, ResponseFunctionToolCall, ResponseReasoningItem],
                               Field(discriminator="type")]


class ResponseInputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose prefill the prefix cache skipped")
    cache_write_tokens: int = 0


class ResponseOutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="the reasoning's length in tokens (its text encoded again)")


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponseIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseErrorDetails(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response of POST /v1/responses (OpenAI's Response object)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    background: bool | None = None
    error: ResponseErrorDetails | None = None
    incomplete_details: ResponseIncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[ResponseOutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = None
    usage: ResponseUsage | None = None
    user: str | None = None


class ResponseDeleted(BaseModel):
    """The answer of DELETE /v1/responses/{id}."""

    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class _ResponseEvent(BaseModel):
    sequence_number: int = Field(description="the event's place in the stream, from 0")


class ResponseCreatedEvent(_ResponseEvent):
    type: Literal["response.created"]
    response: ResponseObject


class ResponseInProgressEvent(_ResponseEvent):
    type: Literal["response.in_progress"]
    response: ResponseObject


class ResponseCompletedEvent(_ResponseEvent):
    type: Literal["response.completed"]
    response: ResponseObject


class ResponseIncompleteEvent(_ResponseEvent):
    """The last event when max_output_tokens cut the answer short."""

    type: Literal["response.incomplete"]
    response: ResponseObject


class ResponseFailedEvent(_ResponseEvent):
    type: Literal["response.failed"]
    response: ResponseObject


class ResponseErrorEvent(_ResponseEvent):
    """The engine failed mid-stream (response.failed follows)."""

    type: Literal["error"]
    code: str | None = None
    message: str
    param: str | None = None


class ResponseOutputItemAddedEvent(_ResponseEvent):
    type: Literal["response.output_item.added"]
    output_index: int
    item: ResponseOutputItem


class ResponseOutputItemDoneEvent(_ResponseEvent):
    type: Literal["response.output_item.done"]
    output_index: int
    item: ResponseOutputItem


class ResponseContentPartAddedEvent(_ResponseEvent):
    type: Literal["response.content_part.added"]
    item_id: str
    output_index: int
    content_index: int
    part: Annotated[Union[ResponseOutputText, ResponseReasoningText], Field(discriminator="type")]


class ResponseContentPartDoneEvent(_ResponseEvent):
    type: Literal["response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: Annotated[Union[ResponseOutputText, ResponseReasoningText], Field(discriminator="type")]


class ResponseTextDeltaEvent(_ResponseEvent):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ResponseTextDoneEvent(_ResponseEvent):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ResponseReasoningTextDeltaEvent(_ResponseEvent):
    type: Literal["response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ResponseReasoningTextDoneEvent(_ResponseEvent):
    type: Literal["response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str


class ResponseFunctionCallArgumentsDeltaEvent(_ResponseEvent):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ResponseFunctionCallArgumentsDoneEvent(_ResponseEvent):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str


RESPONSE_EVENTS = (ResponseCreatedEvent, ResponseInProgressEvent, ResponseOutputItemAddedEvent,
                   ResponseContentPartAddedEvent, ResponseTextDeltaEvent, ResponseTextDoneEvent,
                   ResponseReasoningTextDeltaEvent, ResponseReasoningTextDoneEvent,
                   ResponseFunctionCallArgumentsDeltaEvent, ResponseFunctionCallArgumentsDoneEvent,
                   ResponseContentPartDoneEvent, ResponseOutputItemDoneEvent, ResponseCompletedEvent,
                   ResponseIncompleteEvent, ResponseFailedEvent, ResponseErrorEvent)


class ResponseStreamEvent(RootModel[Annotated[Union[RESPONSE_EVENTS], Field(discriminator="type")]]):
    """One server-sent event of a streamed response: `event: <type>` and `data: <the event as JSON>`."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: Literal["ok"]


class Version(BaseModel):
    version: str


class WorkerTiming(BaseModel):
    """One worker over the straggler window (pools/stragglers.py)."""

    pool: Literal["attention", "expert"]
    worker: str
    window_s: float
    busy: float | None = Field(description="share of the window spent computing")
    waited_on: float | None = Field(description="share of the window the other pool's workers waited on it, summed")
    score: float = Field(description="waited_on over the median of its pool's other workers (1: like them)")
    speed: float = Field(1.0, description="the speed expert placement (EPLB) gives it: 1.0, lower while a straggler")


class WorkerTimings(BaseModel):
    """GET /workers: each pool worker's last window (none for a colocated engine)."""

    window_s: float
    threshold: float = Field(description="the score at which a worker is logged as a straggler")
    workers: list[WorkerTiming]


def _error(description: str) -> dict:
    return {"model": ErrorResponse, "description": description}


ERRORS = {400: _error("invalid request: the message and `param` name what is wrong"),
          401: _error("missing or wrong API key"), 404: _error("unknown model"),
          413: _error("request body too large"), 500: _error("the engine failed"),
          503: _error("too many requests waiting (with Retry-After), or the engine is dead")}
AUTH_ERRORS = {k: ERRORS[k] for k in (401, 500)}
ERRORS_400 = {k: ERRORS[k] for k in (400, 401, 404, 413, 500)}
RESPONSE_LOOKUP_ERRORS = {401: ERRORS[401], 404: _error("no stored response with this id"), 500: ERRORS[500]}


def generation_responses(full: type[BaseModel], chunk: type[BaseModel]) -> dict:
    """The responses of a generation route: JSON, or server-sent events of `chunk` when stream is
    true. The event-stream schema describes one event (OpenAPI 3.1): its data is a chunk as JSON,
    an error body, or the closing [DONE]."""
    chunk_data = {"type": "string", "contentMediaType": "application/json",
                  "contentSchema": {"anyOf": [{"$ref": REF.format(model=chunk.__name__)},
                                              {"$ref": REF.format(model="ErrorResponse")}]}}
    event = {"type": "object", "required": ["data"], "description": f"`data: <{chunk.__name__} as JSON>` per "
             "event, an error body if the engine fails mid-stream, and `data: [DONE]` last",
             "properties": {"data": {"anyOf": [{"const": "[DONE]"}, chunk_data]}}}
    return {200: {"model": full, "content": {"text/event-stream": {"schema": event}}}, **ERRORS}


def responses_api_responses() -> dict:
    """The responses of POST /v1/responses: a ResponseObject, or (stream true) server-sent events
    `event: <type>` / `data: <ResponseStreamEvent as JSON>`, with no closing [DONE] (as OpenAI)."""
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"$ref": REF.format(model="ResponseStreamEvent")}}
    event = {"type": "object", "required": ["data"], "description": "`event: <type>` and `data: <ResponseStreamEvent "
             "as JSON>` per event, from response.created to response.completed (response.incomplete when "
             "max_output_tokens cut the answer short; error then response.failed if the engine fails)",
             "properties": {"event": {"type": "string", "enum": [m.model_fields["type"].annotation.__args__[0]
                                                                  for m in RESPONSE_EVENTS]},
                            "data": data}}
    return {200: {"model": ResponseObject, "content": {"text/event-stream": {"schema": event}}}, **ERRORS}


def request_body(model: type[BaseModel]) -> dict:
    """openapi_extra for a route that parses `model` from the raw body itself."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}


def install_openapi(app: FastAPI, extra_models: list[type[BaseModel]]) -> None:
    """app.openapi() also carries the schemas of `extra_models` (the request bodies and stream
    chunks, which no route parameter references) under components/schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in extra_models], ref_template=REF)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in defs.get("$defs", {}).items():
                schemas.setdefault(name, schema)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
