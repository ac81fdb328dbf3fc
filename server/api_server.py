"""The OpenAI-compatible HTTP server (FastAPI on uvicorn and uvloop), and gRPC beside it.

    shuttle serve [--model DIR] [--port 8000] [--api-key KEY] [--grpc-port 50051] [pool flags]

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both stream as server-sent
events with stream=true), GET /health, GET /metrics (Prometheus), GET /version, and POST
/v1/responses (OpenAI's Responses API, over the chat machinery: server/responses.py) with GET and
DELETE /v1/responses/{id} for stored responses. Every error is
OpenAI's {"error": {"message", "type", "param", "code"}} with its status: 400 bad values, 401 bad
key, 404 unknown model or route, 413 oversized body, 503 (with Retry-After) when more than
max_waiting requests wait for their first token, 500 when the engine failed. /health is 200 only
when a generation step can run (503 engine_not_ready with Retry-After while failed workers restart,
503 engine_dead once the engine is gone). A client that
disconnects aborts its request, streaming or not, which frees its KV blocks.

SIGTERM or SIGINT: the server stops taking connections, running requests may finish for DRAIN_S,
then the engine stops and what still runs ends with its error (a stream: an error event, then
[DONE]); the caller then shuts the pools down. The process exits within EXIT_S of the signal
however far that got, and every process of the deployment is gone within STOP_S (the workers end
with their front: pools/launchers.py).
"""
import asyncio
import errno
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from models.loader import freeze_loaded_heap
from pools.launchers import kill_descendants
from pools.stragglers import THRESHOLD, WINDOW_S
from server.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, OpenAIError,
                                    TokenizeChatRequest, TokenizeCompletionRequest, TokenizeRequest, parse)
from server.openai_schemas import (AUTH_ERRORS, ERRORS_400, ChatCompletionResponse, ChatCompletionStreamResponse,
                                   CompletionResponse, CompletionStreamResponse, ErrorResponse, Health, ModelList,
                                   TokenizeResponse, DetokenizeResponse, Version, generation_responses, install_openapi, request_body)
from server.openai_schemas import (RESPONSE_LOOKUP_ERRORS, ResponseDeleted, ResponseObject, ResponseStreamEvent,
                                   WorkerTimings, responses_api_responses)
from server.responses import ResponsesServing
from server.responses_protocol import ResponsesRequest, parse_responses_request
from server.openai_serving import OpenAIServing, as_openai_error

log = logging.getLogger("shuttle")
VERSION = "0.1.0"
DRAIN_S = 5.0   # after SIGTERM/SIGINT: how long running requests may go on before the engine stops
EXIT_S = 10.0   # after SIGTERM/SIGINT: the front's process has exited by then, its shutdown done or not
STOP_S = 15.0   # after SIGTERM/SIGINT (or the front's death): no process of the deployment is left
# answered without the API key: load balancers' probes, and the API's description
OPEN_PATHS = ("/health", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect")


@dataclass(frozen=True)
class ServerConfig:
    """host/port: where HTTP listens. api_key: required as `Authorization: Bearer KEY` on every
    route but OPEN_PATHS (None: no key). grpc_port: also serve gRPC there (None: no gRPC; 0: any
    free port). max_body_bytes: larger requests get 413. tool_call_parser: reads tool calls from the
    text under tool_choice auto (server/parsers; None: auto is refused). reasoning_parser: tells a
    chat answer's reasoning (reasoning_content) from its content (None: all is content)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str = "shuttle"
    grpc_port: int | None = None
    max_body_bytes: int = 32 * 2 ** 20
    log_requests: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


class _BodyTooLarge(Exception):
    pass


class _Guard:
    """ASGI middleware in front of every route: API key, body size, and the request counter."""

    def __init__(self, app, cfg: ServerConfig, metrics: ServerMetrics):
        self.app, self.cfg, self.metrics = app, cfg, metrics
        self._key = None if cfg.api_key is None else f"Bearer {cfg.api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self._key is not None and scope["path"] not in OPEN_PATHS and \
                not secrets.compare_digest(headers.get(b"authorization", b""), self._key):
            return await self._error(send, scope, OpenAIError("Incorrect API key provided: pass it as "
                                                              "'Authorization: Bearer KEY'.", status=401,
                                                              headers={"WWW-Authenticate": "Bearer"}))
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.cfg.max_body_bytes:
            return await self._error(send, scope, self._too_large())
        status, received = [0], [0]

        async def counted_receive():
            msg = await receive()
            received[0] += len(msg.get("body", b""))
            if received[0] > self.cfg.max_body_bytes:  # a chunked body without Content-Length
                raise _BodyTooLarge()
            return msg

        async def recorded_send(msg) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, counted_receive, recorded_send)
        except _BodyTooLarge:
            if not status[0]:
                await self._error(send, scope, self._too_large())
        finally:
            if status[0]:
                self.metrics.http_requests.labels(_route(scope["path"]), str(status[0])).inc()

    def _too_large(self) -> OpenAIError:
        return OpenAIError(f"the request body is larger than {self.cfg.max_body_bytes} bytes", status=413)

    async def _error(self, send, scope, e: OpenAIError) -> None:
        body = json.dumps(e.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self.metrics.http_requests.labels(_route(scope["path"]), str(e.status)).inc()


def _route(path: str) -> str:
    """The path as a metric label; unknown paths are one label, so scanners cannot grow the series."""
    known = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/version", "/workers",
             "/tokenize", "/detokenize", "/v1/responses")
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{response_id}"
    return path if path in known else "other"


class _SSEResponse(StreamingResponse):
    """A stream that is cancelled as soon as the client disconnects, even while no chunk is due
    (a request still waiting for its first token), so its request is aborted at once. `on_close`
    runs however the stream ended, in the event loop's thread (a quick, non-blocking call: a
    starlette BackgroundTask of a plain function took a worker-thread round trip per request,
    ~10% of the front's interpreter time in a served batch-16 run)."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.create_task(self.stream_response(send))
        gone = asyncio.create_task(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stream, gone):
                t.cancel()
            try:
                await asyncio.gather(stream, gone, return_exceptions=True)
            finally:  # also when this task is cancelled again while it waits for them
                self.on_close()
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()


async def _unless_disconnected(request: Request, work) -> dict | None:
    """Await `work`; cancel it (its requests abort) if the client disconnects first."""
    task = asyncio.create_task(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


def build_app(llm: AsyncLLM, cfg: ServerConfig, metrics: ServerMetrics) -> FastAPI:
    """The FastAPI application over a running AsyncLLM (which `shuttle serve` made with `metrics`
    as its observer). With cfg.grpc_port set, the gRPC server runs in the same event loop."""
    serving = OpenAIServing(llm, cfg.served_model_name, cfg.tool_call_parser, cfg.reasoning_parser)
    responses_serving = ResponsesServing(serving)  # holds the stored conversations of previous_response_id
    metrics.bind(llm.stats)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        grpc_server = None
        if cfg.grpc_port is not None:
            from server.grpc_server import start_grpc_server
            grpc_server, port = await start_grpc_server(llm, cfg.host, cfg.grpc_port)
            app.state.grpc_port = port
            log.info("gRPC on %s:%d (reflection on)", cfg.host, port)
        yield
        if grpc_server is not None:
            await grpc_server.stop(grace=1.0)

    app = FastAPI(title="Shuttle", version=VERSION, lifespan=lifespan, redoc_url=None,
                  description="OpenAI-compatible API of the Shuttle MoE serving engine (vLLM's extras included).")
    app.add_middleware(_Guard, cfg=cfg, metrics=metrics)
    _add_error_handlers(app)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, CompletionStreamResponse,
                          ChatCompletionStreamResponse, TokenizeRequest, DetokenizeRequest, ResponsesRequest,
                          ResponseStreamEvent])

    @app.get("/health", response_model=None, responses={
        200: {"model": Health, "description": "a generation step can run"},
        503: {"model": ErrorResponse, "description": "engine dead, or workers restarting (with Retry-After)"}})
    async def health() -> Response:
        try:
            llm.check_alive()
        except EngineDeadError as e:
            raise OpenAIError(str(e), status=503, code="engine_dead") from None
        if not llm.ready:  # workers are being restarted: requests wait meanwhile
            raise OpenAIError("workers are restarting; requests wait until they are back", status=503,
                              code="engine_not_ready", headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    @app.get("/version", response_model=Version)
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/workers", response_model=WorkerTimings, responses=AUTH_ERRORS)
    async def workers() -> dict:
        s = await asyncio.get_running_loop().run_in_executor(None, llm.stats)  # reads the store
        return {"window_s": WINDOW_S, "threshold": THRESHOLD, "workers": s.get("timings", [])}

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text exposition format",
              "content": {"text/plain": {"schema": {"type": "string"}}}}, **AUTH_ERRORS})
    async def prometheus() -> Response:
        body = await asyncio.get_running_loop().run_in_executor(None, metrics.render)  # reads the store
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **AUTH_ERRORS})
    async def models() -> JSONResponse:
        return JSONResponse(serving.models())

    @app.post("/v1/completions", response_model=None, openapi_extra=request_body(CompletionRequest),
              responses=generation_responses(CompletionResponse, CompletionStreamResponse))
    async def completions(request: Request) -> Response:
        req = parse(CompletionRequest, await request.body())
        job = serving.completion_job(req)
        return await _respond(request, serving, llm, job, req.stream, req)

    @app.post("/v1/chat/completions", response_model=None, openapi_extra=request_body(ChatCompletionRequest),
              responses=generation_responses(ChatCompletionResponse, ChatCompletionStreamResponse))
    async def chat_completions(request: Request) -> Response:
        req = parse(ChatCompletionRequest, await request.body())
        job = serving.chat_job(req)
        return await _respond(request, serving, llm, job, req.stream, req)

    @app.post("/v1/responses", response_model=None, openapi_extra=request_body(ResponsesRequest),
              responses=responses_api_responses())
    async def responses(request: Request) -> Response:
        req = parse_responses_request(await request.body())
        job = responses_serving.job(req)
        return await _respond_responses(request, responses_serving, llm, job)

    @app.get("/v1/responses/{response_id}", response_model=None,
             responses={200: {"model": ResponseObject}, **RESPONSE_LOOKUP_ERRORS})
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses_serving.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}", response_model=None,
                responses={200: {"model": ResponseDeleted}, **RESPONSE_LOOKUP_ERRORS})
    async def delete_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses_serving.delete(response_id))

    @app.post("/tokenize", response_model=None, openapi_extra=request_body(TokenizeRequest),
              responses={200: {"model": TokenizeResponse}, **ERRORS_400})
    async def tokenize(request: Request) -> JSONResponse:
        body = await request.body()
        chat = _has_key(body, "messages")
        return JSONResponse(serving.tokenize(parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)))

    @app.post("/detokenize", response_model=None, openapi_extra=request_body(DetokenizeRequest),
              responses={200: {"model": DetokenizeResponse}, **ERRORS_400})
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(serving.detokenize(parse(DetokenizeRequest, await request.body())))

    return app


def _has_key(body: bytes, key: str) -> bool:
    """Whether the body is a JSON object with `key` (which of a route's request shapes it is)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return False  # parse() reports it
    return isinstance(obj, dict) and key in obj


async def _respond(request: Request, serving: OpenAIServing, llm: AsyncLLM, job, stream: bool, req) -> Response:
    # The places in the waiting queue are taken now: a stream answers 200 before its requests
    # start, and a check here followed by a refusal there would turn a 503 into an error event.
    try:
        job.admission = llm.reserve(len(job.prompts))
    except QueueFullError as e:
        raise as_openai_error(e) from None
    except EngineDeadError as e:
        raise OpenAIError(str(e), status=503, code="engine_dead") from None
    if stream:
        return _SSEResponse(serving.stream(job, req.include_usage,
                                           req.stream_options is not None and req.stream_options.continuous_usage_stats),
                            on_close=job.admission.release, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
    try:
        body = await _unless_disconnected(request, serving.full_response(job))
    finally:
        job.admission.release()
    if body is None:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    return JSONResponse(body)


async def _respond_responses(request: Request, api: ResponsesServing, llm: AsyncLLM, job) -> Response:
    """/v1/responses as _respond answers the chat routes: the queue place reserved first, then the
    stream (aborted when the client goes) or the whole response (499 if the client went)."""
    try:
        job.admission = llm.reserve(1)
    except QueueFullError as e:
        raise as_openai_error(e) from None
    except EngineDeadError as e:
        raise OpenAIError(str(e), status=503, code="engine_dead") from None
    if job.req.streaming:
        return _SSEResponse(api.stream(job), on_close=job.admission.release, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
    try:
        body = await _unless_disconnected(request, api.full_response(job))
    finally:
        job.admission.release()
    if body is None:
        return Response(status_code=499)
    return JSONResponse(body)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        err = OpenAIError(f"{request.method} {request.url.path}: {e.detail}", status=e.status_code,
                          code="not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        err = OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500, code="internal_error")
        return JSONResponse(err.body(), status_code=500)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, bound before the model loads so a busy port fails at
    once; OSError whose message names the address and says why."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is free
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        reason = "already in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise OSError(f"cannot listen on {host}:{port}: {reason} (pick another --port or stop what holds it)") from None
    return sock


def serve(llm: AsyncLLM, cfg: ServerConfig, metrics: ServerMetrics, sock: socket.socket | None = None) -> None:
    """Run the HTTP (and gRPC) server until SIGINT/SIGTERM (see the module docstring); the caller
    shuts the engine down. sock: the socket from bind() to serve on (None: bind cfg.host:cfg.port now)."""
    app = build_app(llm, cfg, metrics)
    # uvicorn waits for open connections until DRAIN_S, when the engine stops and ends every request,
    # and cancels what is left (a connection then closes) a second later
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, loop="uvloop", http="httptools",
                            log_level="info", access_log=cfg.log_requests, timeout_graceful_shutdown=DRAIN_S + 1)
    freeze_loaded_heap()  # the engine, the tokenizer and the app are built: serving allocates the rest
    # uvicorn stops on SIGTERM, then raises the signal again: with its default action the process
    # would end there, before the caller shuts the engine down (pools, traces). Leave through the
    # caller's `finally` instead, as SIGINT does with KeyboardInterrupt.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    server = _Server(config, llm)
    try:
        server.run(sockets=[sock if sock is not None else bind(cfg.host, cfg.port)])
    finally:  # the signal comes back as SystemExit or KeyboardInterrupt
        if server.stopper is not None:
            server.stopper.join()
        signal.signal(signal.SIGTERM, previous)


class _Server(uvicorn.Server):
    """uvicorn's server, which on the first SIGTERM/SIGINT also starts the exit timer (_exit_later)
    and, DRAIN_S into its shutdown, stops the engine in the `stopper` thread: the requests still
    running fail as the engine's do when it dies, each in its route's way."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM):
        super().__init__(config)
        self.llm, self.stopper = llm, None
        self._deadline: threading.Thread | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._deadline is None:
            self._deadline = threading.Thread(target=_exit_later, args=(sig,), daemon=True, name="shuttle-exit")
            self._deadline.start()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drained = asyncio.get_running_loop().call_later(DRAIN_S, self._stop_engine)
        try:
            await super().shutdown(sockets)
        finally:
            drained.cancel()

    def _stop_engine(self) -> None:
        self.stopper = threading.Thread(target=self.llm.shutdown, daemon=True, name="shuttle-stop")
        self.stopper.start()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _exit_later(signum: int) -> None:
    """End the process, and every process below it, EXIT_S from now however far its shutdown got
    (a daemon thread's body)."""
    time.sleep(EXIT_S)
    log.error("still shutting down %.0f s after signal %d: killing the workers and exiting", EXIT_S, signum)
    kill_descendants()
    sys.stderr.flush()
    os._exit(128 + signum)
