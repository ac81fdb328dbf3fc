"""Ping-pong: does splitting each step into micro-batches keep both pools busy, and where does a
disaggregated decode step lose time against the colocated engine?

    python bench/pingpong.py [--quick] [--rounds 3] [--dtype float32] [--batches 1 16 64 256] [--trace pingpong.trace.json]

Model: the Mixtral-shaped bf16 checkpoint of ~425M parameters that bench/engine.py builds (hidden
1024, 8 layers, 16 heads, 4 KV heads, 8 experts of 2048, top-2; `--small` swaps in a float32 model of
hidden 512 with 4 experts of 640 for a smoke run). `--dtype` is the dtype both deployments serve it in
(EngineConfig.dtype): `auto` by default, resolved as `shuttle serve --dtype auto` does
(models.loader.auto_dtype: float32 on a CPU whose bf16 GEMMs are emulated, like this AVX2-only EPYC
at ~100x slower per FLOP than float32; the checkpoint's bf16 where the CPU has native bf16);
`--dtype bfloat16` or `float32` forces one. Requests: batch B of 32-token prompts, --new-tokens
new tokens each (EOS ignored), submitted at once. On this machine's 2 cores: 1 attention worker and
1 expert worker (1 torch thread each, shm transport) with m = 1, 2, 3 micro-batches, against the
colocated engine (experts in the attention process) with 2 torch threads: the same total threads,
in one run, plus 'm=1 serve': m = 1 with shuttle serve's default threads on one host (the pools
take turns at m = 1, so each worker gets every core; attention_nodes.config.worker_threads), whose
spawned workers wait passively (pools/launchers.py). Each deployment serves every batch size in
turn (one start per deployment).

Decode step time: the window from the moment every sequence has its first token to the last token,
over the steps in it (new_tokens - 1). "vs colo" is the colocated step time over the pools' (higher
is better); the target for the best m is printed beside it.

Breakdown (ms per step, from the workers' traces over the same window):
  attention worker: attn = compute inside the forward between M2N calls (embedding, attention,
  router, LM head); send = dispatch (routing tables, packing, writing the slots); wait = combine
  (blocked on the experts' answers); engine = the rest of the engine step (scheduling, preparing
  inputs, sampling, updating sequences); control = applying the server's messages and sending the
  deltas and stats (the latter run inside the next step, right after its first dispatch: the trace's
  "deferred" spans); gap = none of these (the worker loop between steps).
  expert worker: expert = computing; reply = sending the answers; wait_in = waiting for a chunk
  inside a step; wait_between = waiting for the first chunk of the next step (the attention worker's
  engine work and control between steps).
--trace FILE writes a Chrome trace (chrome://tracing or ui.perfetto.dev) of the last --trace-ms of
the m=2 run at the largest batch. Writes bench/results/pingpong.json (--quick: pingpong_quick.json).
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_nodes.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from attention_nodes.engine import LLMEngine  # noqa: E402
from attention_nodes.sampling_params import SamplingParams  # noqa: E402
from bench.common import print_table, save  # noqa: E402
from bench.engine import mixtral  # noqa: E402  (the 425M checkpoint's builder, shared)
from pools.engine import PoolEngine  # noqa: E402

# "vs colo" of the best m (colocated's step time over the pools'), at least these
TARGETS = {1: 0.7, 16: 0.8, 64: 0.95, 256: 1.0}
PROMPT_LEN = 32
ATTN_CATS = ("attention", "transfer", "wait", "step", "control")


def build(out: Path, small: bool) -> Path:
    if small:
        return mixtral(out, "float32", 512, 640, 8, 8, 2)
    return mixtral(out, "bfloat16", 1024, 2048, 8, 16, 4)


def decode_window(engine, B: int, new_tokens: int, tag: str) -> tuple[int, int, int]:
    """Submit B requests at once, run them to the end; returns (t0 ns, t1 ns, decode steps): t0 when
    every sequence has its first token, t1 at the last token."""
    g = torch.Generator().manual_seed(B)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(B):
        engine.add_request(f"{tag}-{B}-{i}", torch.randint(1, 4000, (PROMPT_LEN,), generator=g).tolist(), params)
    started: set[str] = set()
    counts: dict[str, int] = {}
    t0 = None
    while engine.has_unfinished_requests():
        for d in engine.step():
            started.add(d.request_id)
            counts[d.request_id] = counts.get(d.request_id, 0) + len(d.new_token_ids)
        if t0 is None and len(started) == B:
            t0 = time.monotonic_ns()
            at_t0 = min(counts.values())
    return t0, time.monotonic_ns(), new_tokens - at_t0


def run_batches(engine, batches: list[int], new_tokens: int, tag: str) -> dict[int, dict]:
    decode_window(engine, 4, 4, f"{tag}-warm")
    out = {}
    for B in batches:
        t0, t1, steps = decode_window(engine, B, new_tokens, tag)
        out[B] = {"window_ns": (t0, t1), "steps": steps, "step_ms": (t1 - t0) / 1e6 / max(steps, 1)}
    return out


def covered(events: list[dict], t0: float, t1: float, pred) -> float:
    """Microseconds of [t0, t1] (us) covered by the events that satisfy pred."""
    return sum(max(0.0, min(e["ts"] + e["dur"], t1) - max(e["ts"], t0)) for e in events if pred(e))


def breakdown(a: list[dict], e: list[dict], window_ns: tuple[int, int], steps: int, first_recv: str) -> dict:
    """ms per decode step of each kind of work on both workers over the window (see the module doc)."""
    t0, t1 = (t / 1e3 for t in window_ns)
    per = 1e-3 / max(steps, 1)
    cat = {c: covered(a, t0, t1, lambda ev, c=c: ev["cat"] == c) for c in ATTN_CATS}
    forward = cat["attention"] + cat["transfer"] + cat["wait"]
    deferred = covered(a, t0, t1, lambda ev: ev["name"] == "deferred")  # control work inside the next step
    wait_between = covered(e, t0, t1, lambda ev: ev["cat"] == "wait" and ev["name"] == first_recv)
    r = {"attn": cat["attention"], "send": cat["transfer"], "wait": cat["wait"],
         "engine": cat["step"] - forward - deferred, "control": cat["control"],
         "gap": (t1 - t0) - cat["step"] - cat["control"] + deferred,
         "expert": covered(e, t0, t1, lambda ev: ev["cat"] == "expert"),
         "reply": covered(e, t0, t1, lambda ev: ev["cat"] == "transfer"),
         "wait_in": covered(e, t0, t1, lambda ev: ev["cat"] == "wait") - wait_between, "wait_between": wait_between}
    return {k: v * per for k, v in r.items()}


def run_pools(ckpt: Path, m: int, threads: int | None, args, trace_dir: Path, first_recv: str) -> tuple[dict, list[dict]]:
    par = ParallelConfig(False, 1, 1, m, "shm", torch_threads=threads, trace_dir=str(trace_dir))
    engine = PoolEngine(engine_cfg(ckpt, args, par), {0})
    try:
        res = run_batches(engine, args.batches, args.new_tokens, f"m{m}")
    finally:
        engine.shutdown()
    a = json.loads((trace_dir / "a0.trace.json").read_text())
    e = json.loads((trace_dir / "e0.trace.json").read_text())
    for r in res.values():
        r.update(breakdown(a, e, r["window_ns"], r["steps"], first_recv))
    return res, a + e


def engine_cfg(ckpt: Path, args, par: ParallelConfig) -> EngineConfig:
    B = max(args.batches)
    blocks = B * -(-(PROMPT_LEN + args.new_tokens) // 16) + 64
    return EngineConfig(str(ckpt), dtype=args.serving_dtype, cache=CacheConfig(num_blocks=blocks),
                        scheduler=SchedulerConfig(max_num_seqs=max(B, 4), max_num_batched_tokens=4096), parallel=par)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 new tokens per request (a few minutes); writes pingpong_quick.json")
    ap.add_argument("--small", action="store_true", help="a small float32 model instead of the 425M bf16 one")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="dtype to serve the checkpoint in (both deployments); auto: as shuttle serve resolves it "
                         "(float32 on a CPU with emulated bf16 GEMMs)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 3], help="micro-batch counts to run")
    ap.add_argument("--pool-threads", type=int, nargs="+", default=[1],
                    help="torch threads per pool worker to run each m with (1: the two workers share the 2 cores; "
                         "2: each may use both while the other waits; rows 'm=M tT')")
    ap.add_argument("--no-serve-default", action="store_true",
                    help="skip the 'm=1 serve' row: m=1 with shuttle serve's default threads (at m=1 the pools "
                         "take turns and each worker gets every core: attention_nodes.config.worker_threads)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1,
                    help="passes over every deployment (colocated first, then last, in turn); each row is the "
                         "median pass (use 3 on a host whose speed drifts)")
    ap.add_argument("--trace", default=None, help="Chrome trace file of the m=2 run's last steps")
    ap.add_argument("--trace-ms", type=float, default=300.0, help="how much of the end of the run to trace")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens = min(args.new_tokens, 8)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build(Path(tmp) / "ckpt", args.small)
        from models.config import ModelConfig
        from models.loader import auto_dtype
        if args.dtype == "auto":  # as shuttle serve resolves it for this checkpoint on this CPU
            args.serving_dtype, why = auto_dtype(ModelConfig.from_pretrained(str(ckpt)).dtype, ["cpu"])
            print(f"--dtype auto: {why or 'the checkpoint dtype'} -> {args.serving_dtype}")
        else:
            args.serving_dtype = getattr(torch, args.dtype)
        first_recv = f"recv L{ModelConfig.from_pretrained(str(ckpt)).moe_layers.index(True)} mb0"
        # --rounds: every deployment once per round, colocated first in even rounds and last in odd
        # ones; each (deployment, batch) keeps the round with the median step (its breakdown with it).
        # One pass per deployment compared deployments measured minutes apart, at the host's
        # different speeds (three passes of the same code put batch 256's best row at 0.67-0.93).
        def colocated_pass() -> dict:
            torch.set_num_threads(2)
            colocated = LLMEngine(engine_cfg(ckpt, args, ParallelConfig()), {0})
            base = run_batches(colocated, args.batches, args.new_tokens, "colo")
            del colocated
            torch.set_num_threads(1)
            return base

        bases, rounds, events = [], [], {}
        for r in range(args.rounds):
            if r % 2 == 0:
                bases.append(colocated_pass())
            runs = {}
            for threads in args.pool_threads:
                for m in args.ms:
                    key = f"m={m}" + (f" t{threads}" if threads != 1 else "")
                    d = Path(tmp) / f"trace-m{m}-t{threads}-r{r}"
                    d.mkdir()
                    runs[key], events[key] = run_pools(ckpt, m, threads, args, d, first_recv)
            if not args.no_serve_default:
                d = Path(tmp) / f"trace-m1-serve-r{r}"
                d.mkdir()
                runs["m=1 serve"], events["m=1 serve"] = run_pools(ckpt, 1, None, args, d, first_recv)
            if r % 2 == 1:
                bases.append(colocated_pass())
            rounds.append(runs)
    base = median_round(bases, args.batches)
    runs = {key: median_round([rr[key] for rr in rounds], args.batches) for key in rounds[0]}
    rows = table(base, runs, args.batches)
    model = "small float32" if args.small else f"Mixtral-shaped 425M bf16 checkpoint served in {args.serving_dtype}"
    print(f"decode on {model}, 32-token prompts, {args.new_tokens} new tokens; pools: 1 attention + 1 expert "
          f"worker, shm, torch threads each: {args.pool_threads} (rows 'tT': T threads; 'serve': shuttle serve's "
          f"default, every core each at m=1); colocated: 2 threads")
    print_table(rows, ["batch", "run", "step ms", "vs colo", "target", "attn", "send", "wait", "engine", "control",
                       "gap", "expert", "reply", "wait_in", "wait_between"])
    if args.trace and "m=2" in events:
        t1 = rounds[-1]["m=2"][max(args.batches)]["window_ns"][1] / 1e3  # the last round's events
        ev = [x for x in events["m=2"] if t1 - args.trace_ms * 1e3 <= x["ts"] <= t1]
        Path(args.trace).write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ms"}))
        print(f"trace of the m=2 run's last {args.trace_ms:.0f} ms at batch {max(args.batches)}: {args.trace}")
    name = "pingpong_quick" if args.quick else "pingpong"
    print(f"wrote {save(name, {'config': {**vars(args), 'serving_dtype': str(args.serving_dtype)}, 'rows': rows, 'date': time.strftime('%Y-%m-%d')})}")


def median_round(passes: list[dict], batches: list[int]) -> dict:
    """{batch: the pass with the median step_ms at that batch (lower middle for an even count), plus
    every pass's step_ms as "rounds_step_ms"} over passes of {batch: {"step_ms", ...}}."""
    out = {}
    for B in batches:
        ordered = sorted(passes, key=lambda p: p[B]["step_ms"])
        out[B] = {**ordered[(len(ordered) - 1) // 2][B], "rounds_step_ms": [round(p[B]["step_ms"], 2) for p in passes]}
    return out


def table(base: dict, runs: dict, batches: list[int]) -> list[dict]:
    """One row per (batch, deployment); the best m of each batch (per pool thread count) is marked with '*'."""
    rows = []
    for B in batches:
        rows.append({"batch": B, "run": "colocated", "step ms": base[B]["step_ms"], "vs colo": 1.0,
                     "rounds_step_ms": base[B].get("rounds_step_ms")})
        best = set()  # the best m of each thread count
        for group in {k.partition(" ")[2] for k in runs}:
            keys = [k for k in runs if k.partition(" ")[2] == group]
            best.add(min(keys, key=lambda k: runs[k][B]["step_ms"]))
        for m, res in runs.items():
            r = res[B]
            rows.append({"batch": B, "run": m + ("*" if m in best else ""), "step ms": r["step_ms"],
                         "vs colo": base[B]["step_ms"] / r["step_ms"], "rounds_step_ms": r.get("rounds_step_ms"),
                         "target": TARGETS.get(B) if m in best else None,
                         **{k: r[k] for k in ("attn", "send", "wait", "engine", "control", "gap", "expert", "reply",
                                              "wait_in", "wait_between")}})
    cols = {k for r in rows for k in r}
    return [{k: r.get(k, "") if r.get(k) is not None else "" for k in cols} for r in rows]


if __name__ == "__main__":
    main()
