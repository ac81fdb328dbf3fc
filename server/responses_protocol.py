"""The request of POST /v1/responses (server/responses.py): strict pydantic models of OpenAI's
Responses API input, and parse_responses_request, which names the field a bad body got wrong (the
shared parser would name the wrong member of the input union)."""
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from server.openai_protocol import OpenAIError


# -- the request -------------------------------------------------------------------------------------
class _Strict(BaseModel):
    """Parsed as the other requests are (server/openai_protocol.py): strict JSON, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    def check_supported(self) -> None:
        """Raise OpenAIError for a combination of values the fields' types cannot refuse."""


class ResponsesInputText(_Strict):
    type: Literal["input_text"]
    text: str


class ResponsesOutputTextIn(_Strict):
    """An earlier answer's text, sent back as it came (its annotations and logprobs are ignored)."""

    type: Literal["output_text"]
    text: str


class ResponsesRefusalIn(_Strict):
    type: Literal["refusal"]
    refusal: str


ResponsesContentPart = Annotated[Union[ResponsesInputText, ResponsesOutputTextIn, ResponsesRefusalIn],
                                 Field(discriminator="type")]


class ResponsesMessageItem(_Strict):
    """A message of the conversation (`type` may be left out, as OpenAI's easy input messages do)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponsesContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, ResponsesRefusalIn) else p.text for p in self.content)


class ResponsesFunctionCallItem(_Strict):
    """A function call of an earlier answer: it becomes the assistant's tool call."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in a string")
    id: str | None = None
    status: str | None = None


class ResponsesFunctionCallOutputItem(_Strict):
    """The result of a function call (matched by call_id): it becomes the tool message."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponsesInputText]
    id: str | None = None
    status: str | None = None


class ResponsesReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ResponsesReasoningItemIn(_Strict):
    """An earlier answer's reasoning, sent back: accepted, and left out of the prompt."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ResponsesReasoningText] = Field(default_factory=list)
    content: list[ResponsesReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


ResponsesInputItem = Annotated[Union[Annotated[ResponsesMessageItem, Tag("message")],
                                     Annotated[ResponsesFunctionCallItem, Tag("function_call")],
                                     Annotated[ResponsesFunctionCallOutputItem, Tag("function_call_output")],
                                     Annotated[ResponsesReasoningItemIn, Tag("reasoning")]],
                               Discriminator(_item_kind)]
_ITEM_TAGS = {"message", "function_call", "function_call_output", "reasoning"}


class ResponsesFunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(_Strict):
    """text.format: plain text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesTextConfig(_Strict):
    format: ResponsesTextFormat | None = None


class ResponsesReasoningConfig(_Strict):
    effort: Literal["low", "medium", "high"] | None = Field(
        None, description="passed to the chat template as reasoning_effort (gpt-oss)")
    summary: str | None = None


class ResponsesRequest(_Strict):
    """OpenAI's POST /v1/responses body (the fields served here), and vLLM's extra sampling fields."""

    model: str | None = None
    input: str | list[ResponsesInputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = Field(None, description="keep the conversation for previous_response_id (default true)")
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    # vLLM's extras
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None

    def check_supported(self) -> None:
        if isinstance(self.input, list) and not self.input:
            raise OpenAIError("input must not be empty", param="input")
        if self.background:
            raise OpenAIError("background responses are not supported", param="background")

    @property
    def streaming(self) -> bool:
        return bool(self.stream)


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """The request from a raw JSON body; OpenAIError (400) naming the bad field, as `parse` does
    for the other routes (the deepest error of a union is the one reported)."""
    try:
        req = ResponsesRequest.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            raise OpenAIError(f"the body is not valid JSON: {errors[0]['msg']}") from None
        if errors[0]["type"] == "model_type" and not errors[0]["loc"]:
            raise OpenAIError("the body must be a JSON object") from None
        err = max(errors, key=lambda x: len(_loc(x["loc"])))
        loc = ".".join(_loc(err["loc"]))
        if err["type"] == "union_tag_invalid":
            raise OpenAIError(f"{loc}: type {err['ctx']['tag']!r} is not supported here (expected one of "
                              f"{err['ctx']['expected_tags']})", param=loc or None) from None
        got = repr(err.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."
        raise OpenAIError(f"{loc or 'body'}: {err['msg']} (got {got})", param=loc or None) from None
    req.check_supported()
    return req


def _loc(loc: tuple) -> list[str]:
    """An error's location without the union members pydantic names in it."""
    return [str(x) for x in loc if not (str(x) in ("str", "int", "float", "bool", "dict", "list") or "[" in str(x)
                                        or str(x).startswith("function-") or str(x) in _ITEM_TAGS)]
