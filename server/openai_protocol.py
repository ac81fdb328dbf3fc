"""The OpenAI API's requests, as parsed and checked by the HTTP server, and its error shape.

Requests are parsed from the raw JSON body in pydantic's strict JSON mode: a number must be a JSON
number (an integer field refuses 1.5, no field takes "5"), a flag a JSON boolean. Unknown fields
are ignored, as OpenAI and vLLM do. vLLM's extra sampling parameters (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, min_tokens, ...) are accepted beside OpenAI's, so
clients written for vLLM work unchanged. Ranges are checked by SamplingParams, whose errors name
the field; every problem becomes an OpenAIError (HTTP 400 unless said otherwise).
"""
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from attention_nodes.sampling_params import SamplingParams
from attention_nodes.structured import StructuredOutputs
from server.parsers import TOOL_PARSERS
from server.tool_calls import ToolMode


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers
        self.code = code or {400: "invalid_value", 401: "invalid_api_key", 404: "not_found",
                             413: "request_too_large", 503: "service_unavailable"}.get(status)
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    def check_supported(self) -> None:
        """Raise OpenAIError for a combination of values the fields' types cannot refuse."""


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text (no constraint), any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's structured_outputs: exactly one of the constraints."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Request):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        if self.logit_bias and not all(k.isdigit() and k.isascii() for k in self.logit_bias):
            raise OpenAIError("logit_bias keys must be token ids (strings of digits)", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options")

    def structured(self) -> tuple[StructuredOutputs, str] | None:
        """The output constraint the request asks for, and the field that asked; 400 if several do
        or the constraint is invalid (the message says what is wrong)."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append((StructuredOutputs("json_object"), "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise OpenAIError("response_format json_schema needs json_schema.schema", param="response_format")
            found.append((StructuredOutputs("json", json.dumps(rf.json_schema.schema_)), "response_format"))
        so = self.structured_outputs
        if so is not None:
            given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                         ("grammar", so.grammar), ("json_object", so.json_object or None))
                     if v is not None]
            if len(given) != 1:
                raise OpenAIError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                                  param="structured_outputs")
            found.append((_spec(*given[0]), "structured_outputs"))
        for kind, name in (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                           ("grammar", "guided_grammar")):
            if getattr(self, name) is not None:
                found.append((_spec(kind, getattr(self, name)), name))
        if len(found) > 1:
            raise OpenAIError(f"only one output constraint may be given, got {', '.join(f for _, f in found)}",
                              param=found[1][1])
        if not found:
            return None
        try:
            found[0][0].check()
        except ValueError as e:
            raise OpenAIError(str(e), param=found[0][1]) from None
        return found[0]

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        structured: StructuredOutputs | None = None) -> SamplingParams:
        """SamplingParams (defaults where a field is null); its ValueError names the bad field."""
        set_ = {k: v for k, v in dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                      min_p=self.min_p, presence_penalty=self.presence_penalty,
                                      frequency_penalty=self.frequency_penalty,
                                      repetition_penalty=self.repetition_penalty).items() if v is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, n=self.n, seed=self.seed, stop=self.stop,
                                  stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                                  logprobs=logprobs, min_tokens=self.min_tokens,
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  skip_special_tokens=self.skip_special_tokens,
                                  logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()} or None,
                                  prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                                  structured_outputs=structured, **set_)
        except ValueError as e:
            raise OpenAIError(str(e), param=str(e).split(" ", 1)[0].split("[")[0]) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError("best_of other than n is not supported", param="best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")

    def echo_logprobs(self) -> int | None:
        """With echo and logprobs, the prompt's tokens come with logprobs too (OpenAI's legacy API)."""
        return self.logprobs if self.echo and self.logprobs is not None else None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of the batch: text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # assistant turns: the reasoning a --reasoning-parser returned (vLLM's alias: reasoning)
    reasoning_content: str | None = None
    reasoning: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it (tool call arguments as objects, as HF templates
        expect; an assistant turn's reasoning as reasoning_content, which the Qwen3, GLM and
        DeepSeek templates read, and as thinking, which gpt-oss's reads)."""
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        msg: dict[str, Any] = {"role": self.role, "content": text or ""}
        if self.name:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                                 for c in self.tool_calls]
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None and self.role == "assistant":
            msg["reasoning_content"] = msg["thinking"] = reasoning
        return msg


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class FunctionDef(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # gpt-oss: its template's variable

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise OpenAIError("continue_final_message and add_generation_prompt cannot both be true",
                              param="continue_final_message")

    def tool_mode(self, parser: str | None) -> ToolMode | None:
        """How the tools are used (None: they are not); 400 for a choice the request cannot have."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice == "none":
            return None
        if not self.tools:
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        functions: dict[str, dict] = {}
        for i, t in enumerate(self.tools):
            params = t.function.parameters if t.function.parameters is not None else {"type": "object"}
            try:
                StructuredOutputs("json", json.dumps(params)).check()
            except ValueError as e:
                raise OpenAIError(f"tools[{i}].function.parameters: {e}", param="tools") from None
            functions[t.function.name] = params
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in functions:
                raise OpenAIError(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                  f"({', '.join(functions)})", param="tool_choice")
            return ToolMode("named", functions, choice.function.name, parser=TOOL_PARSERS.get(parser))
        if choice == "auto" and parser is None:
            raise OpenAIError('"auto" tool choice needs the server started with --tool-call-parser '
                              f"({', '.join(TOOL_PARSERS)}); use tool_choice \"required\" or a named function",
                              param="tool_choice")
        return ToolMode(choice, functions, parallel=self.parallel_tool_calls is not False,
                        parser=TOOL_PARSERS.get(parser))

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(_Request):
    """vLLM's /tokenize of a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """vLLM's /tokenize of a conversation, rendered by the chat template."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if not self.messages:
            raise OpenAIError("messages must not be empty", param="messages")


class TokenizeRequest(RootModel[TokenizeCompletionRequest | TokenizeChatRequest]):
    """A prompt or a conversation (vLLM's /tokenize takes either)."""

    def check_supported(self) -> None:
        if isinstance(self.root, TokenizeChatRequest):
            self.root.check_supported()


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def _spec(kind: str, value: Any) -> StructuredOutputs:
    """StructuredOutputs from a request field's value (schemas and choices travel as JSON text)."""
    if kind == "json_object":
        return StructuredOutputs("json_object")
    if kind == "choice" or (kind == "json" and not isinstance(value, str)):
        return StructuredOutputs(kind, json.dumps(value))
    return StructuredOutputs(kind, value)


def parse(cls: type[BaseModel], body: bytes) -> Any:
    """The request model from a raw JSON body; OpenAIError (400) naming the first bad field."""
    try:
        req = cls.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = ".".join(str(x) for x in err["loc"] if not _union_tag(str(x)))
        if err["type"] == "json_invalid":
            raise OpenAIError(f"the body is not valid JSON: {err['msg']}", param=None) from None
        if err["type"] == "model_type":
            raise OpenAIError("the body must be a JSON object", param=None) from None
        raise OpenAIError(f"{loc or 'body'}: {err['msg']} (got {_short(err.get('input'))})", param=loc or None) from None
    req.check_supported()
    return req


def _union_tag(part: str) -> bool:
    """pydantic names the member of a union it tried in the error's location ('str', 'list[int]')."""
    return part in ("str", "int", "float", "bool", "dict", "list") or "[" in part or part.startswith("function-")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
