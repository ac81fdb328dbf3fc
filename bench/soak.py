"""Soak: `shuttle serve` under Poisson load above its capacity, with clients that disconnect and
clients that send bad input, for a fixed time; then the verdict on leaks and on every response.

    python bench/soak.py [--duration-s 1800] [--rate 40] [--max-waiting 32] [--dtype float32]
                         [--summary bench/results/soak_rss.json --label NAME] [--server-arg=--colocated ...]

The server is a real `shuttle serve` (the built-in model unless --model; 1 attention + 1 expert
worker by default) on a free port. Requests arrive as a Poisson process at --rate per second, each
one of: a streamed or non-streamed completion or chat of random length (a --disconnect-frac share
of them hang up after a random delay, mid-stream or while waiting), or a malformed request
(--bad-frac) that must get a 400 in OpenAI's error shape. Every response is classified:
  ok          200 with a complete body (a stream ends in [DONE] with no error event)
  bad_input   400 for a malformed request (expected)
  queue_full  503 with Retry-After and code queue_full (expected: the load is above capacity)
  hung_up     the client disconnected on purpose
  unexpected  anything else: any other status, a 400 for a good request, an error event, a timeout
              (--request-timeout-s for the whole answer) or a stall (a stream that sent tokens and
              then none for --stall-s); either says how far the request got: no response yet, a
              response but no token, or tokens that then stopped, with the times
Latencies of the completed requests (percentiles of arrival to last byte, and to the first token of
streams) and the server's queue (/metrics: running, waiting for a first token) sampled with the
RSS tell a timeout that is the tail of an overloaded queue from a request the server lost.
The RSS of every process of the deployment (front and workers, from /proc) is sampled every
--sample-s; growth is reported over the last two thirds of the run (the first third warms up
allocator pools and caches). At the end, once the load stopped, /metrics must show no running
request and every KV block free. Writes bench/results/soak.json (or --out); --summary adds the run's
RSS per process (start, one third, end, growth) and verdict to a file of runs under --label,
replacing a run of that label (baseline and candidate side by side). Exits 1 when the verdict fails
(an unexpected response, blocks still in use, or RSS growth over --max-rss-growth).
"""
import argparse
import asyncio
import json
import random
import re
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import RESULTS, print_table, save  # noqa: E402
from clients.live_server import LiveServer  # noqa: E402

WORDS = ("the for while statement list dict module function class return value object import string "
         "number loop file error exception method attribute name type call argument default").split()
BAD_BODIES = [  # (body, why it is bad): each must give 400
    ({"prompt": "hi", "max_tokens": -1}, "negative max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, "string for a number"),
    ({"prompt": "hi", "temperature": -2}, "negative temperature"),
    ({"max_tokens": 4}, "no prompt"),
    ({"prompt": "hi", "n": 0}, "n = 0"),
    ({"prompt": "hi", "top_p": 7}, "top_p over 1"),
]


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def one_request(session: aiohttp.ClientSession, url: str, model: str, rng: random.Random,
                      args: argparse.Namespace, latencies: list | None = None) -> str:
    """One request of a random kind; returns its class (see the module docstring). latencies gets
    (sent at, stream, seconds to the last byte, seconds to the first token or None) of an ok one."""
    if rng.random() < args.bad_frac:
        body, _ = rng.choice(BAD_BODIES)
        async with session.post(f"{url}/v1/completions", json={"model": model, **body}) as r:
            err = (await r.json()).get("error", {})
            return "bad_input" if r.status == 400 and err.get("message") else f"unexpected:{r.status}"
    chat, stream = rng.random() < 0.5, rng.random() < 0.7
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 96)))
    body = {"model": model, "max_tokens": rng.randint(4, 64), "stream": stream,
            "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 1000)}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    hang_up = rng.random() < args.disconnect_frac
    trace = {"sent": time.monotonic(), "stream": stream, "chunks": 0}
    work = _post(session, f"{url}/v1/{'chat/completions' if chat else 'completions'}", body, stream, trace,
                 args.stall_s)
    if hang_up:
        try:
            await asyncio.wait_for(work, timeout=rng.uniform(0.01, 2.0))
        except asyncio.TimeoutError:  # cancelling the request closes its connection: a disconnect
            return "hung_up"
        return "hung_up"  # it finished first; the server saw an ordinary request
    try:
        kind = await asyncio.wait_for(work, timeout=args.request_timeout_s)
    except asyncio.TimeoutError:
        return "unexpected:timeout:" + _how_far(trace)
    except _Stalled:
        return "unexpected:stalled:" + _how_far(trace)
    if kind == "ok" and latencies is not None:
        latencies.append((trace["sent"], stream, time.monotonic() - trace["sent"],
                          trace["first"] - trace["sent"] if "first" in trace else None))
    return kind


def _how_far(trace: dict) -> str:
    """Where a timed-out request was: no response, a response but no token, or tokens that stopped."""
    now, sent = time.monotonic(), trace["sent"]
    kind = "stream" if trace["stream"] else "non-stream"
    if "headers" not in trace:
        return f"{kind}, no response in {now - sent:.0f} s"
    if not trace["chunks"]:
        return f"{kind}, response after {trace['headers'] - sent:.1f} s, no token in {now - sent:.0f} s"
    return (f"{kind}, {trace['chunks']} chunks, the first {trace['first'] - sent:.1f} s after sending, the last "
            f"{now - trace['last']:.1f} s ago")


class _Stalled(Exception):
    pass


async def _next_line(r: aiohttp.ClientResponse, trace: dict, stall_s: float) -> bytes:
    """The stream's next line; _Stalled when tokens had come and then none for stall_s seconds."""
    if not trace["chunks"]:
        return await r.content.readline()
    try:
        return await asyncio.wait_for(r.content.readline(), timeout=stall_s)
    except asyncio.TimeoutError:
        raise _Stalled() from None


async def _post(session: aiohttp.ClientSession, url: str, body: dict, stream: bool, trace: dict,
                stall_s: float) -> str:
    async with session.post(url, json=body) as r:
        trace["headers"] = time.monotonic()
        if r.status == 503:
            err = (await r.json()).get("error", {})
            ok = err.get("code") == "queue_full" and "Retry-After" in r.headers
            return "queue_full" if ok else f"unexpected:503:{err.get('code')}"
        if r.status != 200:
            return f"unexpected:{r.status}:{(await r.text())[:200]}"
        if not stream:
            out = await r.json()
            return "ok" if out.get("choices") else "unexpected:no choices"
        done = False
        while line := await _next_line(r, trace, stall_s):
            line = line.strip()
            if line.startswith(b"data: {"):
                trace["last"] = time.monotonic()
                trace.setdefault("first", trace["last"])
                trace["chunks"] += 1
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: ") and b'"error"' in line[:20]:
                return f"unexpected:error event {line[:200]!r}"
        return "ok" if done else "unexpected:stream without [DONE]"


async def load(url: str, model: str, args: argparse.Namespace, samples: list, pids: dict[str, int]) -> dict:
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    examples: list[str] = []
    tasks: set[asyncio.Task] = set()

    def done(t: asyncio.Task) -> None:
        tasks.discard(t)
        kind = t.result() if not t.exception() else f"unexpected:{type(t.exception()).__name__}: {t.exception()}"
        key = kind.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
        if key == "unexpected" and len(examples) < 10:
            examples.append(kind)

    connector = aiohttp.TCPConnector(limit=0)
    latencies: list[tuple] = []
    queue: list[dict] = []
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.monotonic()
        watcher = asyncio.create_task(watch_queue(session, url, start, args.sample_s, queue))
        next_sample = start
        t = start
        sent = 0
        while (now := time.monotonic()) - start < args.duration_s:
            if now >= next_sample:
                samples.append({"t": round(now - start, 2), **{n: rss_bytes(p) for n, p in pids.items()}})
                next_sample += args.sample_s
            t += rng.expovariate(args.rate)
            await asyncio.sleep(max(0.0, min(t, next_sample) - time.monotonic()))
            if time.monotonic() < t:
                continue
            task = asyncio.create_task(one_request(session, url, model, random.Random(rng.random()), args,
                                                   latencies))
            task.add_done_callback(done)
            tasks.add(task)
            sent += 1
        if tasks:
            await asyncio.wait(set(tasks), timeout=args.request_timeout_s + 10)
        left = len(tasks)
        samples.append({"t": round(time.monotonic() - start, 2), **{n: rss_bytes(p) for n, p in pids.items()}})
        watcher.cancel()
    return {"sent": sent, "counts": counts, "unfinished": left, "unexpected_examples": examples,
            "seconds": round(time.monotonic() - start, 1), "latency_s": latency_summary(latencies, start),
            "queue": queue}


async def watch_queue(session: aiohttp.ClientSession, url: str, start: float, every_s: float,
                      out: list[dict]) -> None:
    """Every every_s: the server's running requests and those waiting for a first token (/metrics)."""
    while True:
        try:
            async with session.get(f"{url}/metrics") as r:
                text = await r.text()
            out.append({"t": round(time.monotonic() - start, 1),
                        "running": metric(text, "shuttle_num_requests_running"),
                        "queued": metric(text, "shuttle_num_requests_queued")})
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(every_s)


def latency_summary(latencies: list[tuple], start: float) -> dict:
    """Percentiles (s) of the completed requests' time to the last byte (all) and to the first token
    (streams), and the slowest requests with when they were sent (s into the run)."""
    def pct(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {f"p{q}": round(xs[min(len(xs) - 1, int(len(xs) * q / 100))], 2) for q in (50, 90, 99)} | \
            {"max": round(xs[-1], 2), "n": len(xs)} if xs else {}
    slowest = sorted(latencies, key=lambda x: -x[2])[:5]
    return {"total": pct([x[2] for x in latencies]), "first_token": pct([x[3] for x in latencies if x[3] is not None]),
            "slowest": [{"sent_at_s": round(t - start, 1), "stream": st, "total_s": round(tot, 1)}
                        for t, st, tot, _ in slowest]}


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def rss_growth(samples: list[dict], names: list[str]) -> dict[str, dict]:
    """Per process: RSS (MiB) at the start, at one third of the run and at its end, and the growth
    from one third to the end."""
    third = samples[len(samples) // 3]
    out = {}
    for n in names:
        a, b = third.get(n), samples[-1].get(n)
        if a and b:
            out[n] = {"rss_start_mib": round((samples[0].get(n) or 0) / 2 ** 20, 1),
                      "rss_third_mib": round(a / 2 ** 20, 1), "rss_end_mib": round(b / 2 ** 20, 1),
                      "growth_pct": round(100 * (b - a) / a, 2)}
    return out


def add_summary(path: Path, label: str, args: argparse.Namespace, growth: dict, verdict: dict,
                samples: list[dict], every_s: float = 60.0) -> Path:
    """Add this run to the file of runs at `path` under `label` (replacing one of that label): its
    settings, RSS per process and verdict, and the RSS (MiB) every `every_s` seconds."""
    runs = json.loads(path.read_text()).get("runs", []) if path.exists() else []
    step = max(1, round(every_s / args.sample_s))
    run = {"label": label, "dtype": args.dtype or "auto", "duration_s": args.duration_s,
           "config": {k: v for k, v in vars(args).items() if k not in ("out", "summary", "label")},
           "rss": growth, "verdict": verdict, "rss_every_s": every_s,
           "rss_mib": [{k: v if k == "t" else round((v or 0) / 2 ** 20, 1) for k, v in s.items()}
                       for s in samples[::step] + samples[-1:]]}
    runs = [r for r in runs if r["label"] != label] + [run]
    payload = {"runs": runs}
    if path.parent.resolve() == RESULTS.resolve():
        return save(path.stem, payload)
    path.write_text(json.dumps(payload, indent=1))
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--rate", type=float, default=40.0, help="requests per second (Poisson)")
    p.add_argument("--max-waiting", type=int, default=32, help="the server's --max-waiting")
    p.add_argument("--max-num-seqs", type=int, default=32, help="the server's --max-num-seqs")
    p.add_argument("--dtype", default=None, help="the server's --dtype (default: its own, auto)")
    p.add_argument("--disconnect-frac", type=float, default=0.1)
    p.add_argument("--bad-frac", type=float, default=0.05)
    # A request may legitimately wait for --max-waiting requests ahead of it and then decode beside
    # --max-num-seqs others: 112 s at the worst on the 2-core host at load average 12 (the 30-minute
    # run's 13 timeouts at 120 s were that tail, not lost requests). So the total deadline is
    # generous, and a stream that stops is caught sooner by --stall-s.
    p.add_argument("--request-timeout-s", type=float, default=300.0,
                   help="a request with no complete answer by then is unexpected")
    p.add_argument("--stall-s", type=float, default=60.0,
                   help="a stream that sent tokens and then nothing for this long is unexpected")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--max-rss-growth", type=float, default=10.0, help="percent, over the last two thirds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="an extra `shuttle serve` flag (repeat)")
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    p.add_argument("--summary", default=None, help="a JSON file of runs to add this one's RSS and verdict to")
    p.add_argument("--label", default=None, help="this run's name in --summary (default: its dtype)")
    args = p.parse_args()
    flags = (["--model", args.model] if args.model else []) + ["--max-waiting", str(args.max_waiting),
                                                              "--max-num-seqs", str(args.max_num_seqs)] \
        + (["--dtype", args.dtype] if args.dtype else []) + args.server_arg
    samples: list[dict] = []
    with LiveServer(flags) as srv:
        model = json.loads(urllib.request.urlopen(f"{srv.url}/v1/models").read())["data"][0]["id"]
        pids = {"front": srv.proc.pid, **{t.removeprefix("shuttle-"): p for t, p in srv.children().items()}}
        result = asyncio.run(load(srv.url, model, args, samples, pids))
        time.sleep(2.0)  # aborts and the last Stats reach the front
        text = urllib.request.urlopen(f"{srv.url}/metrics").read().decode()
    blocks, free = metric(text, "shuttle_kv_cache_blocks"), metric(text, "shuttle_kv_cache_free_blocks")
    growth = rss_growth(samples, list(pids))
    verdict = {"unexpected": result["counts"].get("unexpected", 0) + result["unfinished"],
               "kv_blocks_in_use": blocks - free, "running": metric(text, "shuttle_num_requests_running"),
               "max_rss_growth_pct": max((g["growth_pct"] for g in growth.values()), default=0.0)}
    verdict["passed"] = (verdict["unexpected"] == 0 and verdict["kv_blocks_in_use"] == 0 and verdict["running"] == 0
                         and verdict["max_rss_growth_pct"] <= args.max_rss_growth)
    rows = [{"process": n, **g} for n, g in growth.items()]
    print_table(rows, ["process", "rss_start_mib", "rss_third_mib", "rss_end_mib", "growth_pct"])
    print(json.dumps({**{k: v for k, v in result.items() if k != "queue"}, **verdict}, indent=1))
    payload = {"config": {k: v for k, v in vars(args).items() if k != "out"}, **result, "verdict": verdict,
               "rss": growth, "samples": samples}
    out = Path(args.out)
    path = save(out.stem, payload) if out.parent.resolve() == RESULTS.resolve() else out
    if path is out:
        out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    if args.summary:
        label = args.label or args.dtype or "auto"
        print(f"wrote {add_summary(Path(args.summary), label, args, growth, verdict, samples)}")
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
