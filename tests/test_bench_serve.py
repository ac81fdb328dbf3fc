"""`shuttle bench serve` (clients/bench_serve.py, bench_stream.py, bench_metrics.py, bench_datasets.py).

Unit tests: calculate_metrics on hand-built records, the table and JSON keys, the SSE decoder, the
event handling (what counts as the first token), the datasets, the arrival process, the flags.
End-to-end: the benchmark against a small but real streaming OpenAI-compatible server (FastAPI +
uvicorn in a thread, SSE with usage / include_usage as OpenAI sends them), both HTTP backends.
`bench_and_check(base_url, tmp_path, backend)` takes any base URL, so it also serves a test
against `shuttle serve`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from clients.bench_datasets import BenchError, BenchRequest, load_jsonl, random_requests
from clients.bench_metrics import (RequestRecord, calculate_metrics, concurrency_steps, format_table, metrics_dict,
                                   parse_goodput)
from clients.bench_serve import (HttpBackend, SSEDecoder, StreamRecorder, add_parser, arrival_times, bench_serve,
                                 build_parser, main, run_bench)
from clients.live_server import free_port

# ---------------------------------------------------------------- calculate_metrics


def _records() -> list[RequestRecord]:
    a = RequestRecord(success=True, start_time=10.0, ttft=0.1, itl=[0.02, 0.04], latency=0.2, prompt_tokens=10,
                      output_tokens=3, usage_reported=True)
    b = RequestRecord(success=True, start_time=10.05, ttft=0.3, itl=[0.1], latency=0.5, prompt_tokens=20,
                      output_tokens=2, usage_reported=True)
    one = RequestRecord(success=True, start_time=10.6, ttft=0.05, itl=[], latency=0.05, prompt_tokens=4,
                        output_tokens=1, usage_reported=False)
    failed = RequestRecord(success=False, error="HTTP 500: boom", start_time=10.0, prompt_tokens=7)
    return [a, b, one, failed]


def test_calculate_metrics_counts_and_throughputs():
    m = calculate_metrics(_records(), duration=2.0, percentiles=[50, 90, 99], num_gpus=2)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 34, 6)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.output_throughput_per_gpu == pytest.approx(1.5)
    assert m.total_token_throughput == pytest.approx(20.0)
    assert m.request_goodput is None
    assert m.max_concurrent_requests == 2  # a and b overlap; `one` starts after both ended
    assert m.max_output_tokens_per_s == pytest.approx(6.0)  # every token within the first second
    assert m.requests_without_usage == 1


def test_calculate_metrics_latencies_exact():
    m = calculate_metrics(_records(), duration=2.0, percentiles=[50, 90, 99])
    ttft = m.latencies["ttft"]  # [100, 300, 50] ms
    assert ttft.mean_ms == pytest.approx(150.0)
    assert ttft.median_ms == pytest.approx(100.0)
    assert ttft.std_ms == pytest.approx(np.std([100, 300, 50]))
    assert ttft.percentiles_ms == [(50.0, pytest.approx(100.0)), (90.0, pytest.approx(260.0)),
                                   (99.0, pytest.approx(296.0))]
    tpot = m.latencies["tpot"]  # only requests with > 1 token: (0.2-0.1)/2 = 50 ms, (0.5-0.3)/1 = 200 ms
    assert (tpot.mean_ms, tpot.median_ms, tpot.std_ms) == (pytest.approx(125.0), pytest.approx(125.0),
                                                            pytest.approx(75.0))
    itl = m.latencies["itl"]  # pooled gaps: [20, 40, 100] ms
    assert itl.mean_ms == pytest.approx(160 / 3)
    assert itl.median_ms == pytest.approx(40.0)
    assert dict(itl.percentiles_ms)[90.0] == pytest.approx(88.0)
    e2el = m.latencies["e2el"]  # [200, 500, 50] ms
    assert e2el.mean_ms == pytest.approx(250.0)
    assert dict(e2el.percentiles_ms)[99.0] == pytest.approx(200 + 0.98 * 300)


@pytest.mark.parametrize("slos, good", [({"ttft": 250}, 2), ({"tpot": 100}, 2), ({"tpot": 100, "e2el": 300}, 2),
                                        ({"e2el": 600}, 3), ({"ttft": 99, "tpot": 1000}, 1), ({"ttft": 10}, 0)])
def test_goodput(slos: dict[str, float], good: int):
    # a: ttft 100, tpot 50, e2el 200; b: 300, 200, 500; one: 50, 0 (single token), 50 ms
    m = calculate_metrics(_records(), duration=4.0, goodput_slos_ms=slos)
    assert m.request_goodput == pytest.approx(good / 4.0)


def test_metrics_of_no_success_are_zero():
    m = calculate_metrics([RequestRecord(error="x")], duration=1.0)
    assert (m.completed, m.failed, m.max_concurrent_requests, m.max_output_tokens_per_s) == (0, 1, 0, 0.0)
    assert m.latencies["ttft"].mean_ms == 0.0
    with pytest.raises(ValueError, match="duration"):
        calculate_metrics([], duration=0.0)


def test_concurrency_is_half_open():
    a = RequestRecord(success=True, start_time=0.0, latency=1.0)
    b = RequestRecord(success=True, start_time=1.0, latency=1.0)
    c = RequestRecord(success=True, start_time=0.5, latency=1.0)
    assert concurrency_steps([a, b])[1].max() == 1
    assert concurrency_steps([a, b, c])[1].max() == 2


def test_table_layout_and_json_keys():
    m = calculate_metrics(_records(), duration=2.0, percentiles=[50, 90, 99.9], goodput_slos_ms={"ttft": 250})
    lines = format_table(m, max_concurrency=4, request_rate=8.0).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert lines[1] == "{:<40} {:<10}".format("Successful requests:", 3)
    assert "{:<40} {:<10}".format("Maximum request concurrency:", 4) in lines
    assert "{:<40} {:<10.2f}".format("Request rate configured (RPS):", 8.0) in lines
    assert "{:<40} {:<10.2f}".format("Request goodput (req/s):", 1.0) in lines
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "{:<40} {:<10.2f}".format("P90 TTFT (ms):", 260.0) in lines
    assert "{:<40} {:<10.2f}".format("P99.9 E2EL (ms):", np.percentile([200, 500, 50], 99.9)) in lines
    d = metrics_dict(m, ["ttft", "itl"])
    assert d["p99.9_ttft_ms"] == pytest.approx(np.percentile([100, 300, 50], 99.9))
    assert {"mean_itl_ms", "median_itl_ms", "std_itl_ms", "p50_itl_ms"} <= d.keys()
    assert "mean_tpot_ms" not in d
    assert json.loads(json.dumps(d))["completed"] == 3


def test_parse_goodput():
    assert parse_goodput("ttft:200,tpot:50,e2el:3000") == {"ttft": 200.0, "tpot": 50.0, "e2el": 3000.0}
    assert parse_goodput("e2el:1.5") == {"e2el": 1.5}
    for bad in ["itl:3", "ttft", "ttft:fast", "ttft:-1", ""]:
        with pytest.raises(argparse.ArgumentTypeError, match="goodput"):
            parse_goodput(bad)


# ---------------------------------------------------------------- SSE and stream events

STREAM = (b": keep-alive\n\n"
          b"data: {\"a\": 1}\n\n"
          b"event: message\nid: 7\ndata: {\"b\": \"\xc3\xa9t\xc3\xa9\"}\n\n"
          b":ping\n\n"
          b"data: line1\ndata: line2\n\n"
          b"data:{\"c\": 3}\r\n\r\n"
          b"data: [DONE]\n\n")
EVENTS = ['{"a": 1}', '{"b": "été"}', "line1\nline2", '{"c": 3}', "[DONE]"]


def test_sse_whole_stream():
    d = SSEDecoder()
    assert d.feed(STREAM) + d.close() == EVENTS


@pytest.mark.parametrize("size", [1, 2, 3, 7, 13])
def test_sse_split_anywhere(size: int):
    d = SSEDecoder()
    events = []
    for i in range(0, len(STREAM), size):  # splits lines, CRLF pairs and UTF-8 sequences
        events += d.feed(STREAM[i:i + size])
    assert events + d.close() == EVENTS


def test_sse_cr_only_and_unterminated_tail():
    d = SSEDecoder()
    assert d.feed(b"data: x\r\rdata: y\r") == ["x"]
    assert d.feed(b"\r") == []  # a CR ending a read may be the first half of a CRLF
    assert d.feed(b"data: z\n\n") == ["y", "z"]
    assert d.feed(b"data: [DONE]") == []
    assert d.close() == ["[DONE]"]


def _chunk(**kw) -> str:
    return json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m", "usage": None, **kw})


def test_events_first_token_is_first_text():
    backend = HttpBackend("http://127.0.0.1:1", chat=True, endpoint=None, api_key=None, ignore_eos=False,
                          temperature=0.0, timeout_s=None)
    rec = StreamRecorder(BenchRequest("p", None, 4, 3))
    t0 = rec.rec.start_time
    role = _chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    assert backend.handle_event(role, t0 + 0.5, rec) is False
    for k, at in enumerate([1.0, 1.25, 1.75]):
        backend.handle_event(_chunk(choices=[{"index": 0, "delta": {"content": f"w{k}"}}]), t0 + at, rec)
    backend.handle_event(_chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "length"}]), t0 + 1.8, rec)
    usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    backend.handle_event(_chunk(choices=[], usage=usage), t0 + 1.9, rec)
    assert backend.handle_event(" [DONE]", t0 + 2.0, rec) is True
    out = rec.finish()
    assert out.success and out.generated_text == "w0w1w2"
    assert out.ttft == pytest.approx(1.0) and out.itl == pytest.approx([0.25, 0.5])
    assert (out.prompt_tokens, out.output_tokens, out.usage_reported) == (9, 3, True)


def test_events_error_object_and_no_text():
    backend = HttpBackend("http://127.0.0.1:1", chat=False, endpoint=None, api_key="k", ignore_eos=True,
                          temperature=0.0, timeout_s=None)
    assert backend.headers == {"Authorization": "Bearer k"} and backend.url.endswith("/v1/completions")
    assert backend.payload(BenchRequest("hi", None, 3, 1))["ignore_eos"] is True
    rec = StreamRecorder(BenchRequest("p", None, 4, 3))
    with pytest.raises(Exception, match="out of memory"):
        backend.handle_event(json.dumps({"error": {"message": "out of memory", "code": 500}}), 0.0, rec)
    empty = StreamRecorder(BenchRequest("p", None, 4, 3)).finish()
    assert not empty.success and "no generated text" in empty.error


def test_a_stream_of_tokens_without_text_succeeds_as_in_vllm():
    """Tokens that decode to nothing (special tokens; seen with random weights: 16 tokens, text "")
    still stream one chunk each with empty text: the request succeeds, timed from its first chunk,
    its tokens from the usage (vllm bench serve counts any chunk with a choice). A stream that also
    carried text keeps its text-based TTFT."""
    backend = HttpBackend("http://127.0.0.1:1", chat=False, endpoint=None, api_key=None, ignore_eos=True,
                          temperature=0.0, timeout_s=None)
    rec = StreamRecorder(BenchRequest("p", None, 4, 3))
    t0 = rec.rec.start_time
    for at in (0.5, 0.75, 1.25):
        backend.handle_event(_chunk(choices=[{"index": 0, "text": "", "finish_reason": None}]), t0 + at, rec)
    backend.handle_event(_chunk(choices=[], usage={"prompt_tokens": 4, "completion_tokens": 3}), t0 + 1.3, rec)
    assert backend.handle_event("[DONE]", t0 + 1.4, rec) is True
    out = rec.finish()
    assert out.success and out.generated_text == "" and out.output_tokens == 3
    assert out.ttft == pytest.approx(0.5) and out.itl == pytest.approx([0.25, 0.5])
    mixed = StreamRecorder(BenchRequest("p", None, 4, 3))
    t0 = mixed.rec.start_time
    backend.handle_event(_chunk(choices=[{"index": 0, "text": "", "finish_reason": None}]), t0 + 0.5, mixed)
    backend.handle_event(_chunk(choices=[{"index": 0, "text": "a", "finish_reason": None}]), t0 + 0.9, mixed)
    assert mixed.finish().ttft == pytest.approx(0.9)


# ---------------------------------------------------------------- datasets and arrivals


def test_random_dataset_word_prompts():
    reqs = random_requests(20, input_len=32, output_len=7, seed=3)
    assert all(len(r.prompt.split()) == 32 and r.est_input_len == 32 and r.output_len == 7 for r in reqs)
    assert len({r.prompt for r in reqs}) == 20
    assert random_requests(20, 32, 7, seed=3) == reqs
    ranged = random_requests(200, input_len=100, output_len=10, range_ratio=0.25, seed=0)
    ins = [r.est_input_len for r in ranged]
    assert min(ins) >= 75 and max(ins) <= 125 and len(set(ins)) > 20
    assert all(len(r.prompt.split()) == r.est_input_len for r in ranged)
    assert all(8 <= r.output_len <= 13 for r in ranged)


def test_random_dataset_exact_token_lengths(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    reqs = random_requests(10, input_len=40, output_len=4, range_ratio=0.5, seed=1, tokenizer_dir=str(tokenizer_dir))
    for r in reqs:
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.est_input_len
    with pytest.raises(BenchError, match="--tokenizer"):
        random_requests(1, 4, 4, tokenizer_dir=str(tokenizer_dir / "missing"))


def test_jsonl_dataset(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a b c", "output_len": 5}\n\n{"prompt": "d e", "max_tokens": 2}\n'
                    '{"messages": [{"role": "user", "content": "hi there"}]}\n')
    reqs = load_jsonl(path, num_prompts=5, default_output_len=9, chat=True)
    assert [(r.prompt, r.output_len, r.est_input_len) for r in reqs[:3]] == [("a b c", 5, 3), ("d e", 2, 2), ("", 9, 2)]
    assert reqs[2].messages == [{"role": "user", "content": "hi there"}]
    assert reqs[3:] == reqs[:2]  # cycled to num_prompts
    with pytest.raises(BenchError, match=rf"{path}:4: .*needs --backend openai-chat"):
        load_jsonl(path, 5, 9, chat=False)


@pytest.mark.parametrize("line, message", [('{"prompt": "ok"}\n{"prompt": "x"\n', "not valid JSON"),
                                           ('{"prompt": "ok"}\n[1, 2]\n', "expected a JSON object"),
                                           ('{"prompt": "ok"}\n{"text": "x"}\n', "exactly one of"),
                                           ('{"prompt": "ok"}\n{"prompt": "x", "output_len": 0}\n', "positive"),
                                           ('{"prompt": "ok"}\n{"messages": [{"role": "user"}]}\n', "messages")])
def test_jsonl_errors_name_file_and_line(tmp_path: Path, line: str, message: str):
    path = tmp_path / "bad.jsonl"
    path.write_text(line)
    with pytest.raises(BenchError, match=rf"{path}:2: .*{message}"):
        load_jsonl(path, 3, 4, chat=True)


def test_jsonl_missing_or_empty(tmp_path: Path):
    with pytest.raises(BenchError, match="nope.jsonl: no such file"):
        load_jsonl(tmp_path / "nope.jsonl", 3, 4, chat=False)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(BenchError, match="no requests"):
        load_jsonl(tmp_path / "empty.jsonl", 3, 4, chat=False)


def test_poisson_arrivals():
    t = arrival_times(4000, request_rate=20.0, seed=0)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 20, rel=0.08)  # exponential: std == mean
    assert np.array_equal(arrival_times(4000, 20.0, seed=0), t)
    bursty = np.diff(arrival_times(4000, request_rate=20.0, burstiness=0.25, seed=0))
    assert bursty.mean() == pytest.approx(1 / 20, rel=0.1) and bursty.std() > 1.5 * bursty.mean()
    assert not arrival_times(5, float("inf")).any()
    with pytest.raises(ValueError):
        arrival_times(5, 0.0)


# ---------------------------------------------------------------- flags


def test_add_parser_wires_func_and_validates():
    root = argparse.ArgumentParser(prog="shuttle")
    bench = root.add_subparsers(dest="command").add_parser("bench").add_subparsers(dest="bench_command")
    add_parser(bench)
    args = root.parse_args(["bench", "serve", "--base-url", "http://h:1", "--goodput", "ttft:100",
                            "--metric-percentiles", "50,99.9", "--percentile-metrics", "ttft,e2el"])
    assert args.func is bench_serve
    assert (args.goodput, args.metric_percentiles, args.percentile_metrics) == ({"ttft": 100.0}, [50.0, 99.9],
                                                                               ["ttft", "e2el"])
    assert (args.num_prompts, args.input_len, args.output_len, args.request_rate) == (100, 128, 128, float("inf"))
    for bad in (["--goodput", "itl:1"], ["--range-ratio", "1.5"], ["--num-prompts", "0"],
                ["--percentile-metrics", "ttft,foo"], ["--metric-percentiles", "0"], ["--metric-percentiles", "101"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--base-url", "http://h:1", *bad])


# ---------------------------------------------------------------- a real streaming OpenAI-compatible server


def make_fake_openai_app(token_delay_s: float = 0.003):
    """FastAPI app streaming deterministic tokens " t0", " t1", ... as OpenAI does (SSE, usage chunk only
    when stream_options.include_usage). Prompt tokens = words of the prompt (chat: + 4 per message).
    Triggers: a prompt containing HTTP400 -> 400 error body; STREAMERROR -> an error object mid-stream;
    model "no-usage" -> never a usage chunk. app.state.reported: (prompt, completion) tokens per usage sent;
    app.state.loading: GET /v1/models answers 503 that many more times (a server still starting)."""
    app = FastAPI()
    app.state.reported, app.state.loading = [], 0

    @app.get("/v1/models", response_model=None)
    async def models() -> dict | JSONResponse:
        if app.state.loading > 0:
            app.state.loading -= 1
            return JSONResponse({"error": {"message": "loading", "type": "server_error", "code": 503}}, 503)
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "t"}]}

    async def complete(request: Request, chat: bool):
        body = await request.json()
        if chat:
            text = " ".join(m["content"] for m in body["messages"])
            n_prompt = len(text.split()) + 4 * len(body["messages"])
        else:
            text = body["prompt"]
            n_prompt = len(text.split())
        if "HTTP400" in text or not body.get("stream"):
            return JSONResponse({"error": {"message": "bad prompt", "type": "BadRequestError", "code": 400}}, 400)
        usage = (body.get("stream_options") or {}).get("include_usage") and body["model"] != "no-usage"
        events = _fake_events(body, chat, n_prompt, usage, "STREAMERROR" in text, app.state.reported)
        return StreamingResponse(_paced(events, token_delay_s), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


def _fake_events(body: dict, chat: bool, n_prompt: int, usage: bool, fail: bool, reported: list) -> Iterator[str]:
    base = {"id": "x1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
            "model": body["model"]}
    if usage:
        base["usage"] = None

    def choice(text: str | None, finish: str | None) -> dict:
        if chat:
            return {"index": 0, "delta": {} if text is None else {"content": text}, "logprobs": None,
                    "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    yield ": keep-alive"
    if chat:
        yield json.dumps({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
    n = body["max_tokens"]
    for i in range(n):
        if fail and i == 1:
            yield json.dumps({"error": {"object": "error", "message": "engine died", "type": "InternalError",
                                        "code": 500}})
            return
        last = i == n - 1 and not chat
        yield json.dumps({**base, "choices": [choice(f" t{i}", "length" if last else None)]})
    if chat:
        yield json.dumps({**base, "choices": [choice(None, "length")]})
    if usage:
        reported.append((n_prompt, n))
        yield json.dumps({**base, "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n,
                                                           "total_tokens": n_prompt + n}})
    yield "[DONE]"


async def _paced(events: Iterator[str], delay_s: float) -> AsyncIterator[str]:
    for e in events:
        await asyncio.sleep(delay_s)
        yield f"{e}\n\n" if e.startswith(":") else f"data: {e}\n\n"


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Run `app` with uvicorn on a free 127.0.0.1 port in a daemon thread; yield its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def fake_server():
    app = make_fake_openai_app()
    with serve_in_thread(app) as url:
        yield url, app


RESULT_FIELDS = ["completed", "failed", "duration", "num_prompts", "total_input_tokens", "total_output_tokens",
                 "request_throughput", "output_throughput", "total_token_throughput", "output_throughput_per_gpu",
                 "max_concurrent_requests", "request_rate", "max_concurrency", "num_gpus", "backend", "model",
                 "date", "input_lens", "output_lens", "ttfts", "itls", "errors"] + [
    f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p50", "p90",
                                                                            "p99")]


def bench_and_check(base_url: str, tmp_path: Path, backend: str, num_prompts: int = 8, output_len: int = 5,
                    *extra: str) -> dict:
    """Run the benchmark against base_url with --save-result and --plot; check what holds for any server."""
    out_json, out_png = tmp_path / f"{backend}.json", tmp_path / f"{backend}.png"
    result = run_bench(["--base-url", base_url, "--backend", backend, "--num-prompts", str(num_prompts),
                        "--input-len", "16", "--output-len", str(output_len), "--ignore-eos", "--disable-tqdm",
                        "--save-result", str(out_json), "--plot", str(out_png), *extra])
    saved = json.loads(out_json.read_text())
    assert set(RESULT_FIELDS) <= saved.keys(), set(RESULT_FIELDS) - saved.keys()
    assert (saved["completed"], saved["failed"], saved["num_prompts"]) == (num_prompts, 0, num_prompts)
    assert saved["total_output_tokens"] == sum(saved["output_lens"]) > 0
    assert saved["errors"] == [""] * num_prompts and len(saved["itls"]) == num_prompts
    assert 0 < saved["mean_ttft_ms"] <= saved["mean_e2el_ms"]
    assert out_png.stat().st_size > 10_000 and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return result


@pytest.mark.parametrize("backend, extra", [
    ("openai", ["--max-concurrency", "3", "--request-rate", "200", "--goodput", "ttft:5000,e2el:10000"]),
    ("openai-chat", []),
])
def test_end_to_end_fake_server(fake_server, tmp_path: Path, capsys, backend: str, extra: list[str]):
    url, app = fake_server
    app.state.reported.clear()
    result = bench_and_check(url, tmp_path, backend, 8, 5, *extra)
    reported = app.state.reported[1:]  # [0] is the one-token test request
    assert len(reported) == 8 and result["model"] == "fake-model" and result["backend"] == backend
    assert result["total_output_tokens"] == sum(c for _, c in reported) == 40
    assert result["total_input_tokens"] == sum(p for p, _ in reported)
    assert 0 <= result["client_cpu_s"] <= result["duration"] * (os.cpu_count() or 1)  # the load's own CPU
    assert sorted(result["input_lens"]) == sorted(p for p, _ in reported)
    assert all(len(itl) == 4 for itl in result["itls"])  # 5 text chunks each; a role-only chunk is no token
    assert result["requests_without_usage"] == 0
    if backend == "openai":
        assert result["max_concurrent_requests"] <= 3 and result["goodput"] == result["request_goodput"] > 0
    else:
        assert "goodput" not in result and result["max_concurrent_requests"] >= 2
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out and "Failed requests:" in out


def test_end_to_end_failures_are_counted(fake_server, tmp_path: Path, capsys):
    url, _ = fake_server
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "output_len": 3})
                              for p in ["hello there", "HTTP400 please", "a STREAMERROR b", "fine"]))
    assert main(["--base-url", url, "--dataset", str(data), "--num-prompts", "4", "--disable-tqdm",
                 "--save-result", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (2, 2, 6)
    assert r["errors"][1] == "HTTP 400: bad prompt"
    assert r["errors"][2] == "server error in stream: engine died"
    assert "Failed: 1 x HTTP 400: bad prompt" in capsys.readouterr().out


def test_end_to_end_without_usage(fake_server, tmp_path: Path, capsys):
    url, _ = fake_server
    r = run_bench(["--base-url", url + "/v1/", "--model", "no-usage", "--num-prompts", "3", "--input-len", "6",
                   "--output-len", "4", "--disable-tqdm"])
    assert (r["completed"], r["total_output_tokens"], r["total_input_tokens"]) == (3, 12, 18)
    assert r["requests_without_usage"] == 3 and r["model"] == "no-usage"
    assert "came back without `usage`" in capsys.readouterr().out


def test_ready_check_waits_for_a_starting_server(fake_server, monkeypatch, capsys):
    url, app = fake_server
    monkeypatch.setattr("clients.bench_serve.READY_RETRY_S", 0.05)
    args = ["--base-url", url, "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--disable-tqdm"]
    app.state.loading = 3
    assert main([*args, "--ready-check-timeout-sec", "30"]) == 0
    out = capsys.readouterr().out
    assert "Waiting for" in out and "HTTP 503" in out and "Successful requests:" in out and app.state.loading == 0
    app.state.loading = 1000  # never ready: the last error, and how long it waited
    assert main([*args, "--ready-check-timeout-sec", "0.2"]) == 1
    err = capsys.readouterr().err.strip()
    assert "HTTP 503" in err and "still failing after --ready-check-timeout-sec 0.2" in err
    app.state.loading = 1  # the default (0) fails at once, as before
    assert main(args) == 1 and "HTTP 503" in capsys.readouterr().err
    app.state.loading = 0


def test_unreachable_server_is_one_line(capsys):
    port = free_port()  # nothing listens there
    assert main(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2", "--disable-tqdm"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("shuttle bench serve: error: cannot reach the server at") and "\n" not in err
    assert main(["--base-url", "127.0.0.1:1", "--disable-tqdm"]) == 1
    assert "must start with http://" in capsys.readouterr().err
    assert main(["--base-url", "http://127.0.0.1:1", "--dataset", "/nonexistent/x.jsonl"]) == 1
    assert "x.jsonl: no such file" in capsys.readouterr().err


# ---------------------------------------------------------------- the grpc backend, with a stand-in client


@dataclass
class _Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0


@dataclass
class _Chunk:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: _Usage | None


class _FakeGrpcClient:
    targets: list[str] = []

    def __init__(self, target: str) -> None:
        self.targets.append(target)

    async def generate_stream(self, prompt: str, max_tokens: int, ignore_eos: bool = False,
                              temperature: float = 0.0) -> AsyncIterator[_Chunk]:
        n_prompt = len(prompt.split())
        for i in range(0, max_tokens, 2):  # two tokens per chunk
            await asyncio.sleep(0.002)
            ids = list(range(i, min(i + 2, max_tokens)))
            last = ids[-1] == max_tokens - 1
            yield _Chunk(0, "".join(f" t{k}" for k in ids), ids, "length" if last else None,
                         _Usage(n_prompt, max_tokens, n_prompt + max_tokens) if last else None)

    async def close(self) -> None:
        pass


def test_grpc_backend_with_stand_in_client(monkeypatch, tmp_path: Path):
    fake = types.ModuleType("clients.grpc_client")
    fake.AsyncGrpcClient = _FakeGrpcClient
    monkeypatch.setitem(sys.modules, "clients.grpc_client", fake)
    r = run_bench(["--backend", "grpc", "--base-url", "grpc://127.0.0.1:50051", "--num-prompts", "4",
                   "--input-len", "8", "--output-len", "5", "--disable-tqdm", "--plot", str(tmp_path / "g.png")])
    assert _FakeGrpcClient.targets[-1] == "127.0.0.1:50051"
    assert (r["completed"], r["total_output_tokens"], r["total_input_tokens"]) == (4, 20, 32)
    assert all(len(itl) == 2 for itl in r["itls"])  # three chunks of 2, 2, 1 tokens
    assert r["mean_tpot_ms"] > 0 and (tmp_path / "g.png").stat().st_size > 0
