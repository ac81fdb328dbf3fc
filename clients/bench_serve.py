"""`shuttle bench serve`: load-test any OpenAI-compatible server (vLLM, SGLang, Shuttle) like `vllm bench serve`.

    shuttle bench serve --base-url http://127.0.0.1:8000 [--backend openai|openai-chat|grpc]
                        [--dataset random|FILE.jsonl] [--num-prompts 100] [--input-len 128] [--output-len 128]
                        [--request-rate inf] [--max-concurrency N] [--save-result R.json] [--plot R.png]
    python -m clients.bench_serve ...   (the same flags)

Requests stream (`stream: true`, `stream_options.include_usage: true`) so the client times every
text chunk: TTFT, inter-token gaps and end-to-end latency per request. Token counts come from the
server's final `usage` chunk; a server that sends none gets its chunks counted, and the table says so.
Arrivals are Poisson at --request-rate (gamma with --burstiness); --max-concurrency caps requests in
flight. The numbers (bench_metrics.calculate_metrics) and their table and JSON keys are vLLM's.
Datasets live in clients/bench_datasets.py, a stream's decoding and timing in clients/bench_stream.py.
Only wire formats and client libraries are imported here.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import os
import resource
import sys
import time
from datetime import datetime
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp
import numpy as np
from tqdm import tqdm

from clients.bench_datasets import BenchError, BenchRequest, load_jsonl, random_requests
from clients.bench_metrics import (METRICS, RequestRecord, calculate_metrics, error_summary, format_spec_table,
                                   format_table, metrics_dict, parse_goodput, per_request_dict, plot_results,
                                   spec_counters, spec_decode_stats)
from clients.bench_stream import SSEDecoder, StreamRecorder

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
READY_RETRY_S = 5.0  # --ready-check-timeout-sec: seconds between test requests (vLLM's interval)


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times (seconds from the start) of n requests: the first at 0, then gaps drawn from a
    gamma distribution of mean 1/request_rate and shape `burstiness` (1 = exponential gaps, a Poisson
    process; below 1 burstier, above 1 more regular). An infinite rate sends everything at 0."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be positive, got {request_rate} and {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


class _ServerError(Exception):
    """An `error` object the server put in the stream."""


def _oneline(text: object, limit: int = 300) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _error_message(body: Any) -> str:
    """The human part of an OpenAI-style error body ({"error": {"message": ...}}, {"message": ...}, {"detail": ...})."""
    if isinstance(body, dict):
        for key in ("error", "message", "detail"):
            if key in body:
                return _error_message(body[key]) if isinstance(body[key], dict) else _oneline(body[key])
        return _oneline(json.dumps(body))
    return _oneline(body) or "(empty body)"


class Backend(Protocol):
    """One way of sending a BenchRequest; `send` never raises, a failure is a record with `error`."""

    async def start(self, model: str | None) -> str: ...

    async def send(self, req: BenchRequest) -> RequestRecord: ...

    async def spec_counters(self) -> dict[str, Any] | None:
        """Speculative decoding's counters now (bench_metrics.spec_counters), None where unknown."""
        ...

    async def close(self) -> None: ...


class HttpBackend:
    """POST /v1/completions or /v1/chat/completions with SSE streaming, through one aiohttp session."""

    def __init__(self, base_url: str, chat: bool, endpoint: str | None, api_key: str | None, ignore_eos: bool,
                 temperature: float, timeout_s: float | None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise BenchError(f"--base-url {base_url!r} must start with http:// or https://")
        self.base = base_url.rstrip("/").removesuffix("/v1")
        self.url = self.base + (endpoint or ENDPOINTS["openai-chat" if chat else "openai"])
        self.chat, self.ignore_eos, self.temperature = chat, ignore_eos, temperature
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.model = ""
        self._session: aiohttp.ClientSession | None = None

    async def start(self, model: str | None) -> str:
        """Open the session and check the server answers GET /v1/models; its first id unless `model`."""
        # limit=0: aiohttp's default pool of 100 connections would silently cap concurrency.
        if self._session is None:  # start() is retried while the server comes up
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        url = self.base + "/v1/models"
        try:
            async with self._session.get(url, headers=self.headers, timeout=aiohttp.ClientTimeout(total=30)) as r:
                body = await r.json(content_type=None) if r.status == 200 else await r.text()
                status = r.status
        except aiohttp.ClientConnectorError as e:
            raise BenchError(f"cannot reach the server at {self.base}: {_oneline(e)}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise BenchError(f"GET {url} failed: {_oneline(e) or type(e).__name__}") from None
        ids = [m.get("id") for m in body.get("data", [])] if status == 200 and isinstance(body, dict) else []
        if model is None and not ids:
            detail = f"HTTP {status}: {_error_message(body)}" if status != 200 else "no models listed"
            raise BenchError(f"GET {url}: {detail}; pass --model NAME")
        self.model = model or ids[0]
        return self.model

    async def spec_counters(self) -> dict[str, Any] | None:
        """From GET /metrics (a server without speculation, or without the page: None)."""
        try:
            async with self._session.get(self.base + "/metrics", headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=30)) as r:
                return spec_counters(await r.text()) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    def payload(self, req: BenchRequest) -> dict[str, Any]:
        """The JSON body of one request."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.output_len, "temperature": self.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True  # a vLLM / SGLang extension
        return body

    async def send(self, req: BenchRequest) -> RequestRecord:
        assert self._session is not None, "start() first"
        rec = StreamRecorder(req)
        try:
            async with self._session.post(self.url, json=self.payload(req), headers=self.headers,
                                          timeout=self.timeout) as resp:
                if resp.status != 200:
                    return rec.finish(f"HTTP {resp.status}: {_error_message(await _body(resp))}")
                return rec.finish(await self._read(resp, rec))
        except asyncio.TimeoutError:
            return rec.finish(f"timed out after {self.timeout.total} s")
        except _ServerError as e:
            return rec.finish(str(e))
        except (aiohttp.ClientError, ValueError) as e:
            return rec.finish(f"{type(e).__name__}: {_oneline(e)}")

    async def _read(self, resp: aiohttp.ClientResponse, rec: StreamRecorder) -> str:
        """Consume the SSE stream into `rec`; return an error text, empty when it ended with [DONE]."""
        decoder, done = SSEDecoder(), False
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            for payload in decoder.feed(data):
                done = done or self.handle_event(payload, now, rec)
        for payload in decoder.close():
            done = done or self.handle_event(payload, time.perf_counter(), rec)
        return "" if done else "the stream ended without data: [DONE]"

    def handle_event(self, payload: str, now: float, rec: StreamRecorder) -> bool:
        """Apply one SSE event; True for the closing [DONE]."""
        if payload.strip() == "[DONE]":
            return True
        obj = json.loads(payload)
        if not isinstance(obj, dict):
            raise ValueError(f"SSE data is not a JSON object: {_oneline(payload, 80)}")
        if obj.get("error"):
            raise _ServerError(f"server error in stream: {_error_message(obj)}")
        if obj.get("usage"):
            rec.usage(obj["usage"].get("prompt_tokens"), obj["usage"].get("completion_tokens"))
        choices = obj.get("choices") or []
        text = self._text(choices[0]) if choices else ""
        if text:
            rec.content(text, now)
        elif choices:
            rec.textless(now)
        return False

    def _text(self, choice: dict[str, Any]) -> str:
        if not self.chat:
            return choice.get("text") or ""
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _body(resp: aiohttp.ClientResponse) -> Any:
    text = await resp.text(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


class GrpcBackend:
    """Shuttle's gRPC front end through clients.grpc_client.AsyncGrpcClient (imported only here)."""

    def __init__(self, target: str, ignore_eos: bool, temperature: float, timeout_s: float | None) -> None:
        try:
            from clients.grpc_client import AsyncGrpcClient
        except ImportError as e:
            raise BenchError(f"--backend grpc needs clients.grpc_client: {e}") from None
        self.target = target.removeprefix("grpc://").rstrip("/")
        self.ignore_eos, self.temperature, self.timeout_s = ignore_eos, temperature, timeout_s
        try:
            self._client = AsyncGrpcClient(self.target)
        except (TypeError, ValueError) as e:
            raise BenchError(f"--base-url {target!r}: {e}") from None

    async def start(self, model: str | None) -> str:
        return model or "default"  # the gRPC Generate call serves the server's one model

    async def send(self, req: BenchRequest) -> RequestRecord:
        rec = StreamRecorder(req)
        try:
            async with asyncio.timeout(self.timeout_s):
                async for chunk in self._client.generate_stream(req.prompt, max_tokens=req.output_len,
                                                                ignore_eos=self.ignore_eos,
                                                                temperature=self.temperature):
                    now = time.perf_counter()
                    if chunk.text or chunk.token_ids:
                        rec.content(chunk.text, now, tokens=len(chunk.token_ids) or 1)
                    if chunk.usage is not None:
                        rec.usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        except TimeoutError:
            return rec.finish(f"timed out after {self.timeout_s} s")
        except Exception as e:  # grpc.aio.AioRpcError and the client's own errors: one request fails, not the run
            return rec.finish(_grpc_error(e))
        return rec.finish()

    async def spec_counters(self) -> dict[str, Any] | None:
        return None  # (the gRPC service has no /metrics; run against the HTTP port for them)

    async def close(self) -> None:
        await self._client.close()


def _grpc_error(e: Exception) -> str:
    code, details = getattr(e, "code", None), getattr(e, "details", None)
    if callable(code) and callable(details):
        return f"gRPC {getattr(code(), 'name', code())}: {_oneline(details())}"
    return f"{type(e).__name__}: {_oneline(e)}"


def make_backend(args: argparse.Namespace) -> Backend:
    """The backend named by --backend, configured from the flags."""
    if args.backend == "grpc":
        return GrpcBackend(args.base_url, args.ignore_eos, args.temperature, args.timeout)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    return HttpBackend(args.base_url, args.backend == "openai-chat", args.endpoint, api_key, args.ignore_eos,
                       args.temperature, args.timeout)


def make_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The requests of --dataset: random prompts, or a JSONL file's (cycled to --num-prompts)."""
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                               args.tokenizer)
    return load_jsonl(args.dataset, args.num_prompts, args.output_len, chat=args.backend == "openai-chat")


async def dispatch(backend: Backend, requests: list[BenchRequest], send_at: np.ndarray,
                   max_concurrency: int | None, progress: bool) -> tuple[list[RequestRecord], float]:
    """Send each request at its time (seconds from now), at most `max_concurrency` in flight.
    Returns the records in request order and the wall time until the last one finished (s)."""
    gate = asyncio.Semaphore(max_concurrency or len(requests))
    bar = tqdm(total=len(requests), disable=not progress, desc="requests")

    async def one(req: BenchRequest) -> RequestRecord:
        async with gate:
            rec = await backend.send(req)
        bar.update(1)
        return rec

    # The garbage collector's full passes over what this process already holds (a caller's torch and
    # tokenizer: 100-200 ms each) would land in the measured latencies: frozen for the load (not
    # collected first: that would be CPU the callers that time this client count), given back after.
    gc.freeze()
    try:
        start = time.perf_counter()
        tasks = []
        for req, at in zip(requests, send_at):
            if (delay := start + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    finally:
        gc.unfreeze()
    bar.close()
    return list(records), duration


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Check the server with one short request, run the load, print the table; the result dict."""
    requests = make_requests(args)
    backend = make_backend(args)
    try:
        model = await wait_until_ready(backend, args, requests[0])
        kind = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
        print(f"Model: {model}\nTraffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness} "
              f"({kind})\nMaximum request concurrency: {args.max_concurrency}", flush=True)
        send_at = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed + 1)
        spec_before = await backend.spec_counters()
        cpu0 = _process_cpu_s()
        records, duration = await dispatch(backend, requests, send_at, args.max_concurrency, not args.disable_tqdm)
        cpu_s = _process_cpu_s() - cpu0
        spec = spec_decode_stats(spec_before, await backend.spec_counters())
    finally:
        await backend.close()
    # This process's CPU seconds during the load alone (not loading the tokenizer, making the
    # requests, the readiness check or the report): what a planner charges per request and token.
    return {**report(args, model, records, duration, spec), "client_cpu_s": cpu_s}


def _process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def wait_until_ready(backend: Backend, args: argparse.Namespace, first: BenchRequest) -> str:
    """Find the model and send one 1-token test request; the model's name. With
    --ready-check-timeout-sec T > 0, a failure is retried every 5 s (or sooner, near the deadline)
    until T seconds have passed, as vLLM's ready check does for a server that is still loading;
    then the last error is raised, saying how long it waited."""
    deadline = time.monotonic() + args.ready_check_timeout_sec
    said = False
    while True:
        try:
            model = await backend.start(args.model)
            probe = await backend.send(dataclasses.replace(first, output_len=1))
            if probe.success:
                return model
            error = BenchError(f"the test request to {args.base_url} failed: {probe.error}")
        except BenchError as e:
            error = e
        left = deadline - time.monotonic()
        if left <= 0:
            if args.ready_check_timeout_sec > 0:
                raise BenchError(f"{error} (still failing after --ready-check-timeout-sec "
                                 f"{args.ready_check_timeout_sec:g})")
            raise error
        if not said:
            print(f"Waiting for {args.base_url} to answer (up to {args.ready_check_timeout_sec:g} s): {error}",
                  flush=True)
            said = True
        await asyncio.sleep(min(READY_RETRY_S, left))


def report(args: argparse.Namespace, model: str, records: list[RequestRecord], duration: float,
           spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Print the errors and the table (with speculative decoding's section where the server drafted:
    `spec`, bench_metrics.spec_decode_stats), write --save-result and --plot; return the result dict."""
    m = calculate_metrics(records, duration, args.metric_percentiles, args.goodput, args.num_gpus)
    for line in error_summary(records):
        print(f"Failed: {line}")
    print(format_table(m, args.percentile_metrics, args.max_concurrency, args.request_rate))
    if spec is not None:
        print(format_spec_table(spec))
    if m.requests_without_usage:
        print(f"Note: {m.requests_without_usage} of {m.completed} requests came back without `usage`: their output "
              "tokens are the streamed chunks counted, their input tokens the prompt's estimated length.")
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "model": model,
        "base_url": args.base_url, "dataset": args.dataset, "num_prompts": len(records),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "num_gpus": args.num_gpus,
        **metrics_dict(m, args.percentile_metrics), **per_request_dict(records)}
    if args.goodput:
        result.update(goodput=m.request_goodput, goodput_slos_ms=args.goodput)
    if spec is not None:  # (vLLM's keys)
        result.update({f"spec_decode_{k}": v for k, v in spec.items() if k != "per_position_acceptance_rates"},
                      spec_decode_per_position_acceptance_rates=spec["per_position_acceptance_rates"])
    if args.save_result:
        Path(args.save_result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save_result).write_text(json.dumps(result))
        print(f"Saved the result to {args.save_result}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_results(records, args.plot, f"{args.backend} {model}: {len(records)} requests at rate {args.request_rate}")
        print(f"Saved the plot to {args.plot}")
    return result


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse type: `kind(text)`, which must be > 0."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value
    return parse


def _non_negative(text: str) -> float:
    """An argparse type: a float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def _percentiles(text: str) -> list[float]:
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"{text!r}: each percentile must be in (0, 100]")
    return ps


def _metric_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in METRICS for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(METRICS)}")
    return names


def _range_ratio(text: str) -> float:
    r = float(text)
    if not 0 <= r < 1:
        raise argparse.ArgumentTypeError(f"--range-ratio {text} must be in [0, 1)")
    return r


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `shuttle bench serve` (vLLM's names where vLLM has the flag)."""
    p.add_argument("--base-url", required=True, help="http://HOST:PORT (HTTP backends) or [grpc://]HOST:PORT (grpc)")
    p.add_argument("--backend", choices=["openai", "openai-chat", "grpc"], default="openai",
                   help="openai: POST /v1/completions; openai-chat: POST /v1/chat/completions; grpc: Shuttle's gRPC")
    p.add_argument("--model", default=None, help="model name (default: the first id of GET /v1/models)")
    p.add_argument("--endpoint", default=None, help="override the request path, e.g. /v1/completions")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset", default="random", help="random, or a JSONL file of {prompt|messages, output_len?}")
    p.add_argument("--num-prompts", type=_positive(int), default=100)
    p.add_argument("--input-len", type=_positive(int), default=128, help="random: prompt tokens")
    p.add_argument("--output-len", type=_positive(int), default=128, help="max_tokens (JSONL lines may override)")
    p.add_argument("--range-ratio", type=_range_ratio, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--tokenizer", default=None, help="local HF tokenizer dir: random prompts of exact token length")
    p.add_argument("--request-rate", type=_positive(float), default=float("inf"), help="requests/s (default inf)")
    p.add_argument("--burstiness", type=_positive(float), default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=_positive(int), default=None, help="requests in flight at most")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM/SGLang extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-gpus", type=_positive(int), default=1, help="for output tokens/s per GPU")
    p.add_argument("--goodput", type=parse_goodput, default=None, metavar="ttft:MS,tpot:MS,e2el:MS",
                   help="SLOs in ms; goodput = requests/s meeting all of them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-check-timeout-sec", type=_non_negative, default=0.0, metavar="S",
                   help="retry the test request for up to S seconds while the server starts "
                        "(default 0: fail at once; vLLM's default is 600)")
    p.add_argument("--timeout", type=_positive(float), default=None, help="seconds per request (default: none)")
    p.add_argument("--percentile-metrics", type=_metric_names, default=list(METRICS), help="default ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", type=_percentiles, default=[50.0, 90.0, 99.0], help="default 50,90,99")
    p.add_argument("--save-result", default=None, metavar="FILE.json", help="write the result JSON here")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="latency histograms and throughput over time")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `serve` to the sub-commands of `shuttle bench`; its `func` runs it and returns the exit code."""
    p = subparsers.add_parser("serve", help="load-test an OpenAI-compatible (or Shuttle gRPC) server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    p.set_defaults(func=bench_serve)
    return p


def build_parser(prog: str = "shuttle bench serve") -> argparse.ArgumentParser:
    """A standalone parser with the same flags (for `python -m clients.bench_serve` and run_bench)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    return p


def run_bench(argv: list[str]) -> dict[str, Any]:
    """Run the benchmark of these command-line flags; the result dict. Raises BenchError on failure."""
    return asyncio.run(run_benchmark(build_parser().parse_args(argv)))


def bench_serve(args: argparse.Namespace) -> int:
    """Entry point of `shuttle bench serve`: 0 when some request succeeded, 1 otherwise (one-line error)."""
    try:
        result = asyncio.run(run_benchmark(args))
    except BenchError as e:
        print(f"shuttle bench serve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shuttle bench serve: interrupted", file=sys.stderr)
        return 130
    if result["completed"] == 0:
        print(f"shuttle bench serve: error: all {result['num_prompts']} requests failed", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m clients.bench_serve ...`."""
    return bench_serve(build_parser("python -m clients.bench_serve").parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
