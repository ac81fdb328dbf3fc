"""The gRPC front end: service shuttle.v1.Generation (clients/proto/shuttle.proto) over an AsyncLLM.

    llm = AsyncLLM(model_dir)
    server, port = await start_grpc_server(llm, "0.0.0.0", 50051)   # in any running event loop
    ...
    await server.stop(grace=5)                                      # then llm.shutdown()

Generate runs a request to the end; GenerateStream sends one message per engine step that changed
the output (deltas only); BatchGenerate submits every prompt at once and streams each result as its
prompt finishes. Errors: a bad request (SamplingParams, prompt, request id) is INVALID_ARGUMENT with
the ValueError's message, a full waiting queue (AsyncLLM's max_waiting) RESOURCE_EXHAUSTED, a stopped
engine or failed worker (AsyncLLM reports both as EngineDeadError) UNAVAILABLE, anything else INTERNAL.
A cancelled RPC (client gone, deadline passed) cancels its handler, which stops iterating
AsyncLLM.generate, which aborts the request and frees its KV blocks.

The server runs in whatever event loop calls start_grpc_server (asyncio or uvloop), so the HTTP
server can start it inside its own loop and share one AsyncLLM. Server reflection is on.
"""
import asyncio
import functools
import logging
from contextlib import aclosing
from typing import Awaitable, Callable

import grpc
from grpc_reflection.v1alpha import reflection

from attention_nodes.sampling_params import SamplingParams
from clients.proto import MAX_MESSAGE_BYTES
from clients.proto import shuttle_pb2 as pb
from clients.proto import shuttle_pb2_grpc as pb_grpc
from server.async_llm import Admission, AsyncLLM, EngineDeadError, QueueFullError
from server.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["GenerationServicer", "start_grpc_server", "sampling_params", "MAX_BATCH", "SERVICE_NAME"]
log = logging.getLogger("shuttle")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "shuttle.v1.Generation"
MAX_BATCH = 4096  # prompts in one BatchGenerate call
# The proto3 `optional` scalars of pb.SamplingParams, named as SamplingParams' fields: set or default.
_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "n",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "min_tokens",
                    "include_stop_str_in_output", "skip_special_tokens")

Handler = Callable[..., Awaitable[object]]  # (servicer, request, context) -> response, or None when streaming


def _status_errors(handler: Handler) -> Handler:
    """Turn the handler's exceptions into gRPC statuses (cancellation passes through untouched)."""

    @functools.wraps(handler)
    async def wrapped(self: "GenerationServicer", request: object, context: grpc.aio.ServicerContext) -> object:
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Exception as e:
            log.exception("gRPC %s failed", handler.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {e!r}")

    return wrapped


class GenerationServicer(pb_grpc.GenerationServicer):
    """shuttle.v1.Generation over one AsyncLLM (shared with other front ends)."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm

    @_status_errors
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        params = sampling_params(request.sampling_params)
        final = await self._run(_prompt(request), params, request.request_id or None)
        return response(final, params)

    @_status_errors
    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        params = sampling_params(request.sampling_params)
        deltas = StreamDeltas(params)
        # aclosing: however this handler ends (a cancelled write included), generate is closed now,
        # and it aborts its request if it has not finished.
        async with aclosing(self.llm.generate(_prompt(request), params, request.request_id or None)) as outs:
            async for out in outs:
                message = deltas.message(out)
                if message is not None:
                    await context.write(message)

    @_status_errors
    async def BatchGenerate(self, request: pb.BatchGenerateRequest, context: grpc.aio.ServicerContext) -> None:
        n = len(request.prompts)
        if n > MAX_BATCH:
            raise ValueError(f"a batch holds at most {MAX_BATCH} prompts, got {n}")
        params = sampling_params(request.sampling_params)
        admission = self.llm.reserve(n)  # all of the batch waits at once: refuse it whole, not half-run
        prefix = request.request_id
        tasks = [asyncio.create_task(self._batch_item(i, p, params, f"{prefix}-{i}" if prefix else None, admission))
                 for i, p in enumerate(request.prompts)]
        try:
            for next_done in asyncio.as_completed(tasks):
                await context.write(await next_done)
        finally:  # the call failed or was cancelled: abort the prompts still running
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            admission.release()

    async def _batch_item(self, index: int, prompt: pb.Prompt, params: SamplingParams, request_id: str | None,
                          admission: Admission) -> pb.BatchGenerateResponse:
        """One prompt of a batch, run to the end (in its place reserved for the batch); a bad prompt
        becomes an error for its index."""
        try:
            final = await self._run(_prompt(prompt), params, request_id, admission)
        except (ValueError, QueueFullError) as e:
            code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, ValueError) else grpc.StatusCode.RESOURCE_EXHAUSTED
            error = pb.Error(code=code.value[0], message=str(e))
            return pb.BatchGenerateResponse(index=index, error=error)
        return pb.BatchGenerateResponse(index=index, response=response(final, params))

    async def _run(self, prompt: str | list[int], params: SamplingParams, request_id: str | None,
                   admission: Admission | None = None) -> RequestOutput:
        """The request's final output (ValueError for a bad request, EngineDeadError if the engine is gone)."""
        final = None
        async with aclosing(self.llm.generate(prompt, params, request_id, admission)) as outs:
            async for final in outs:
                pass
        assert final is not None and final.finished, "AsyncLLM.generate ended without a finished output"
        return final


async def start_grpc_server(llm: AsyncLLM, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.aio.Server, int]:
    """Serve shuttle.v1.Generation (and server reflection) on host:port in the running event loop.
    port 0 picks a free port. Returns the started server and the bound port; stop it with
    `await server.stop(grace_seconds)`. Raises ValueError for a port outside [0, 65535] and
    OSError when the address cannot be bound."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.so_reuseport", 0)]  # a port in use is an error, not silently shared with another server
    server = grpc.aio.server(options=options)
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(llm), server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc's "Failed to bind"
        raise OSError(f"gRPC server cannot listen on {address}: {e}") from None
    if bound == 0:  # older grpc reports a failed bind this way
        raise OSError(f"gRPC server cannot listen on {address}")
    await server.start()
    log.info("gRPC server (%s) listening on %s", SERVICE_NAME, f"{host}:{bound}")
    return server, bound


# -- proto <-> engine types ------------------------------------------------------------------------
def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    """SamplingParams from the wire: unset fields take SamplingParams' defaults. ValueError names a
    bad field."""
    kwargs: dict[str, object] = {name: getattr(msg, name) for name in _OPTIONAL_PARAMS if msg.HasField(name)}
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    return SamplingParams(**kwargs)


def _prompt(msg: pb.GenerateRequest | pb.Prompt) -> str | list[int]:
    """The text or token ids of the message's `prompt` oneof; ValueError when neither is set."""
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise ValueError("the prompt is missing: set text or token_ids")
    return msg.text if kind == "text" else list(msg.token_ids.ids)


def response(out: RequestOutput, params: SamplingParams) -> pb.GenerateResponse:
    """The wire form of a finished request's output."""
    completions = [completion(o, 0, params.logprobs) for o in out.outputs]
    return pb.GenerateResponse(request_id=out.request_id, prompt_token_ids=out.prompt_token_ids,
                               completions=completions, usage=usage(out))


def usage(out: RequestOutput) -> pb.Usage:
    prompt, generated = len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
    return pb.Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated,
                    cached_tokens=out.num_cached_tokens)


def completion(o: CompletionOutput, start: int, num_top: int | None, text: str | None = None) -> pb.Completion:
    """o's tokens (and logprobs) from position `start` on, with `text` (default: all of o.text).
    num_top: SamplingParams.logprobs (None: no logprobs were asked for)."""
    msg = pb.Completion(index=o.index, text=o.text if text is None else text, token_ids=o.token_ids[start:])
    if o.finish_reason is not None:
        msg.finish_reason = o.finish_reason
    if o.stop_reason is not None:
        msg.stop_reason = str(o.stop_reason)  # a stop token id travels as its decimal string
    if o.logprobs is not None and num_top is not None:
        msg.logprobs.extend(token_logprob(t, entry, num_top)
                            for t, entry in zip(o.token_ids[start:], o.logprobs[start:]))
    return msg


def token_logprob(token_id: int, entry: dict[int, Logprob], num_top: int) -> pb.TokenLogprob:
    """entry (server.outputs) holds the num_top most likely tokens in rank order, then the chosen
    token if it ranks lower; so its first num_top items are the alternatives."""
    chosen = entry[token_id]
    top = [pb.TopLogprob(token_id=t, logprob=lp.logprob, decoded_token=lp.decoded_token or "")
           for t, lp in list(entry.items())[:num_top]]
    msg = pb.TokenLogprob(token_id=token_id, logprob=chosen.logprob, decoded_token=chosen.decoded_token or "",
                          top=top)
    if chosen.rank is not None:
        msg.rank = chosen.rank
    return msg


class StreamDeltas:
    """Turns one request's cumulative outputs into GenerateStream messages.

    A completion is in a message when the step gave it tokens or finished it: changes are told by
    token counts and finish states, so a completion the step did not touch (finished, preempted,
    still prefilling) is left out whatever its delta fields hold. The text sent is delta_text,
    because the cumulative text may still lose a held-back tail (a stop string's first characters)."""

    def __init__(self, params: SamplingParams) -> None:
        self.num_top = params.logprobs
        self.sent_tokens = [0] * params.n  # per completion index
        self.sent_finish = [False] * params.n
        self.first = True

    def message(self, out: RequestOutput) -> pb.GenerateStreamResponse | None:
        """The message for this output, or None when nothing changed that a client could see."""
        completions = []
        for o in out.outputs:
            if len(o.token_ids) > self.sent_tokens[o.index] or (o.finished and not self.sent_finish[o.index]):
                completions.append(completion(o, self.sent_tokens[o.index], self.num_top, text=o.delta_text))
                self.sent_tokens[o.index], self.sent_finish[o.index] = len(o.token_ids), o.finished
        if not completions and not out.finished:
            return None
        msg = pb.GenerateStreamResponse(request_id=out.request_id, completions=completions)
        if self.first:
            msg.prompt_token_ids.extend(out.prompt_token_ids)
            self.first = False
        if out.finished:
            msg.usage.CopyFrom(usage(out))
        return msg
