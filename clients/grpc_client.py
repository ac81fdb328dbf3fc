"""Client of Shuttle's gRPC service shuttle.v1.Generation: `GrpcClient` (blocking) and
`AsyncGrpcClient` (asyncio), with the same methods. Results are plain dataclasses, not protobufs.

    with GrpcClient("127.0.0.1:50051", timeout=60) as client:
        result = client.generate("The for statement", max_tokens=32, temperature=0)
        print(result.completions[0].text, result.usage.completion_tokens)
        for chunk in client.generate_stream([5, 17, 33], max_tokens=32):   # text or token ids
            print(chunk.text, end="")                                      # usage on the last chunk
        for index, result in client.batch_generate(["a", "b", "c"], max_tokens=8):
            ...                            # in completion order; a bad prompt: a GrpcClientError

    async with AsyncGrpcClient("127.0.0.1:50051") as client:
        async for chunk in client.generate_stream("Hi", max_tokens=8, ignore_eos=True):
            ...

Keyword parameters are SamplingParams' (OpenAI / vLLM names, see SAMPLING_PARAMS); one left out,
or None, takes the server's default (temperature 1.0, max_tokens 16). An RPC that fails raises
GrpcClientError (a grpc.RpcError) whose message starts with the status code name.

A stream that is left before its end cancels its RPC (and the server frees the request's KV cache)
when it is closed: at once for the blocking client; for the asyncio one, close the async generator
(`await stream.aclose()`, or `async with contextlib.aclosing(...)`), else it happens when the
generator is garbage-collected.

Imports only grpc and the wire format (clients.proto), never the server.
"""
import json
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import grpc

from clients.proto import MAX_MESSAGE_BYTES
from clients.proto import shuttle_pb2 as pb
from clients.proto import shuttle_pb2_grpc as pb_grpc

__all__ = ["GrpcClient", "AsyncGrpcClient", "GrpcClientError", "GenerateResult", "Completion", "Usage",
           "StreamChunk", "TokenLogprob", "TopLogprob", "SAMPLING_PARAMS"]

SAMPLING_PARAMS = tuple(pb.SamplingParams.DESCRIPTOR.fields_by_name)  # the keyword parameters accepted
_REPEATED_PARAMS = ("stop", "stop_token_ids")
_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}

Prompt = str | list[int]


@dataclass
class TopLogprob:
    token_id: int
    logprob: float  # natural log
    decoded_token: str


@dataclass
class TokenLogprob:
    """The chosen token at one position, its rank (1 = most likely) and the most likely tokens
    (as many as the `logprobs` parameter asked for, most likely first)."""

    token_id: int
    logprob: float
    decoded_token: str
    rank: int | None
    top: list[TopLogprob]


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int  # over all completions
    total_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache served


@dataclass
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: str | None  # the stop string, or the stop token id in decimal
    logprobs: list[TokenLogprob] | None  # one per token when `logprobs` was given


@dataclass
class GenerateResult:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    usage: Usage


@dataclass
class StreamChunk:
    """What one step added to completion `index`: text and token ids are deltas. finish_reason is
    set on the chunk that finishes the completion; usage only on the last chunk of the request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    stop_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


BatchItem = tuple[int, GenerateResult | Exception]  # (index of the prompt, its result or its GrpcClientError)


class GrpcClientError(grpc.RpcError):
    """A failed RPC, or a failed prompt of a batch. code() and details() as grpc's own errors."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


# -- requests ----------------------------------------------------------------------------------
def sampling_params(params: dict[str, object]) -> pb.SamplingParams:
    """The wire SamplingParams of keyword parameters. TypeError for an unknown name; TypeError or
    ValueError, naming the parameter, for a value the wire cannot carry (the server checks ranges)."""
    unknown = sorted(set(params) - set(SAMPLING_PARAMS))
    if unknown:
        raise TypeError(f"unknown sampling parameter(s) {', '.join(unknown)}; known: {', '.join(SAMPLING_PARAMS)}")
    msg = pb.SamplingParams()
    for name, value in params.items():
        if value is None:
            continue
        try:
            if name in _REPEATED_PARAMS:
                getattr(msg, name).extend([value] if isinstance(value, str) else value)
            elif name == "logit_bias":
                msg.logit_bias.update({int(k): float(v) for k, v in value.items()})  # type: ignore[union-attr]
            elif name == "structured_outputs":
                msg.structured_outputs.CopyFrom(structured_outputs(value))  # type: ignore[arg-type]
            else:
                setattr(msg, name, value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"sampling parameter {name}={value!r}: {e}") from None
    return msg


def structured_outputs(spec: dict[str, object]) -> pb.StructuredOutputs:
    """The wire form of vLLM's structured_outputs dict: exactly one of json (a schema: dict or JSON
    text), json_object (true), regex, choice (a list of strings), grammar (EBNF)."""
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    if len(given) != 1 or not set(given) <= {"json", "json_object", "regex", "choice", "grammar"}:
        raise ValueError(f"structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                         f"got {sorted(spec)}")
    (kind, value), = given.items()
    if kind == "json" and not isinstance(value, str):
        value = json.dumps(value)
    if kind == "choice":
        return pb.StructuredOutputs(choice=pb.Choices(choices=list(value)))  # type: ignore[call-overload]
    return pb.StructuredOutputs(**{kind: value})


def _prompt_fields(prompt: Prompt) -> dict[str, object]:
    """The `prompt` oneof's field for text or token ids; TypeError for anything else."""
    if isinstance(prompt, str):
        return {"text": prompt}
    if isinstance(prompt, (list, tuple)):
        try:
            return {"token_ids": pb.TokenIds(ids=prompt)}
        except (TypeError, ValueError) as e:
            raise type(e)(f"prompt token ids must be 32-bit integers: {e}") from None
    raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")


def generate_request(prompt: Prompt, params: dict[str, object]) -> pb.GenerateRequest:
    return pb.GenerateRequest(sampling_params=sampling_params(params), **_prompt_fields(prompt))


def batch_request(prompts: list[Prompt], params: dict[str, object]) -> pb.BatchGenerateRequest:
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    return pb.BatchGenerateRequest(prompts=[pb.Prompt(**_prompt_fields(p)) for p in prompts],
                                   sampling_params=sampling_params(params))


# -- replies -----------------------------------------------------------------------------------
def _usage(msg: pb.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.total_tokens, msg.cached_tokens)


def _optional(msg: pb.Completion, name: str) -> str | None:
    return getattr(msg, name) if msg.HasField(name) else None


def _logprobs(msg: pb.Completion, wanted: bool) -> list[TokenLogprob] | None:
    if not wanted:
        return None
    return [TokenLogprob(t.token_id, t.logprob, t.decoded_token, t.rank if t.HasField("rank") else None,
                         [TopLogprob(a.token_id, a.logprob, a.decoded_token) for a in t.top])
            for t in msg.logprobs]


def _completion(msg: pb.Completion, logprobs: bool) -> Completion:
    return Completion(msg.index, msg.text, list(msg.token_ids), _optional(msg, "finish_reason"),
                      _optional(msg, "stop_reason"), _logprobs(msg, logprobs))


def _result(msg: pb.GenerateResponse, logprobs: bool) -> GenerateResult:
    return GenerateResult(msg.request_id, list(msg.prompt_token_ids),
                          [_completion(c, logprobs) for c in msg.completions], _usage(msg.usage))


def _chunks(msg: pb.GenerateStreamResponse, logprobs: bool) -> list[StreamChunk]:
    """One chunk per completion in the message; the message's usage goes on its last chunk."""
    chunks = [StreamChunk(c.index, c.text, list(c.token_ids), _optional(c, "finish_reason"), None,
                          _optional(c, "stop_reason"), _logprobs(c, logprobs)) for c in msg.completions]
    if msg.HasField("usage"):
        if not chunks:
            chunks.append(StreamChunk(0, "", [], None, None))
        chunks[-1].usage = _usage(msg.usage)
    return chunks


def _batch_item(msg: pb.BatchGenerateResponse, logprobs: bool) -> BatchItem:
    if msg.WhichOneof("result") == "error":
        code = _STATUS_CODES.get(msg.error.code, grpc.StatusCode.UNKNOWN)
        return msg.index, GrpcClientError(code, msg.error.message)
    return msg.index, _result(msg.response, logprobs)


def _client_error(e: grpc.RpcError) -> GrpcClientError:
    """grpc's error (a grpc.Call, or grpc.aio.AioRpcError) as a GrpcClientError."""
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return GrpcClientError(code, details or "")


def _check_client_args(target: str, timeout: float | None) -> None:
    if not isinstance(target, str) or not target:
        raise ValueError(f"target must be HOST:PORT, got {target!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")


def _wants_logprobs(params: dict[str, object]) -> bool:
    return params.get("logprobs") is not None


# -- the clients -------------------------------------------------------------------------------
class GrpcClient:
    """Blocking client. target: "HOST:PORT"; timeout: seconds each call may take (None: no limit)."""

    def __init__(self, target: str, timeout: float | None = None) -> None:
        _check_client_args(target, timeout)
        self.target, self.timeout = target, timeout
        self._channel = grpc.insecure_channel(target, options=_OPTIONS)
        self._stub = pb_grpc.GenerationStub(self._channel)

    def generate(self, prompt: Prompt, **params: object) -> GenerateResult:
        """Run one prompt (text or token ids) to the end."""
        request = generate_request(prompt, params)
        try:
            reply = self._stub.Generate(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _client_error(e) from None
        return _result(reply, _wants_logprobs(params))

    def generate_stream(self, prompt: Prompt, **params: object) -> Iterator[StreamChunk]:
        """Chunks as the server produces them (the RPC starts at the first next())."""
        return self._stream(generate_request(prompt, params), _wants_logprobs(params))

    def batch_generate(self, prompts: list[Prompt], **params: object) -> Iterator[BatchItem]:
        """(index in prompts, result or GrpcClientError) for each prompt, as each finishes."""
        return self._batch(batch_request(prompts, params), _wants_logprobs(params))

    def _stream(self, request: pb.GenerateRequest, logprobs: bool) -> Iterator[StreamChunk]:
        call = self._stub.GenerateStream(request, timeout=self.timeout)
        try:
            for msg in call:
                yield from _chunks(msg, logprobs)
        except grpc.RpcError as e:
            raise _client_error(e) from None
        finally:
            call.cancel()  # left early: the server aborts the request (a no-op once it has ended)

    def _batch(self, request: pb.BatchGenerateRequest, logprobs: bool) -> Iterator[BatchItem]:
        call = self._stub.BatchGenerate(request, timeout=self.timeout)
        try:
            for msg in call:
                yield _batch_item(msg, logprobs)
        except grpc.RpcError as e:
            raise _client_error(e) from None
        finally:
            call.cancel()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "GrpcClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGrpcClient:
    """asyncio client, with GrpcClient's methods as coroutines and async iterators. The channel is
    opened at the first call, in the event loop that makes it; use the client in that loop only."""

    def __init__(self, target: str, timeout: float | None = None) -> None:
        _check_client_args(target, timeout)
        self.target, self.timeout = target, timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GenerationStub | None = None
        self._closed = False

    def _open(self) -> pb_grpc.GenerationStub:
        if self._closed:
            raise RuntimeError(f"the gRPC client of {self.target} is closed")
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.target, options=_OPTIONS)
            self._stub = pb_grpc.GenerationStub(self._channel)
        return self._stub

    async def generate(self, prompt: Prompt, **params: object) -> GenerateResult:
        """Run one prompt (text or token ids) to the end."""
        request = generate_request(prompt, params)
        try:
            reply = await self._open().Generate(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _client_error(e) from None
        return _result(reply, _wants_logprobs(params))

    def generate_stream(self, prompt: Prompt, **params: object) -> AsyncIterator[StreamChunk]:
        """Chunks as the server produces them (parameters are checked now, the RPC starts at the
        first iteration)."""
        return self._stream(generate_request(prompt, params), _wants_logprobs(params))

    def batch_generate(self, prompts: list[Prompt], **params: object) -> AsyncIterator[BatchItem]:
        """(index in prompts, result or GrpcClientError) for each prompt, as each finishes."""
        return self._batch(batch_request(prompts, params), _wants_logprobs(params))

    async def _stream(self, request: pb.GenerateRequest, logprobs: bool) -> AsyncIterator[StreamChunk]:
        call = self._open().GenerateStream(request, timeout=self.timeout)
        try:
            async for msg in call:
                for chunk in _chunks(msg, logprobs):
                    yield chunk
        except grpc.RpcError as e:
            raise _client_error(e) from None
        finally:
            call.cancel()

    async def _batch(self, request: pb.BatchGenerateRequest, logprobs: bool) -> AsyncIterator[BatchItem]:
        call = self._open().BatchGenerate(request, timeout=self.timeout)
        try:
            async for msg in call:
                yield _batch_item(msg, logprobs)
        except grpc.RpcError as e:
            raise _client_error(e) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        self._closed = True
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> "AsyncGrpcClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
