"""Ping-pong: does splitting each step into micro-batches keep both pools busy?

    python bench/pingpong.py [--quick] [--trace pingpong.trace.json]

On this machine's 2 cores: 1 attention worker and 1 expert worker (1 torch thread each, shm
transport) decode with m = 1, 2, 3 micro-batches, against the colocated engine (experts in the
attention process, 2 torch threads) on the same checkpoint and requests. The model (float32, hidden
512, 8 layers, 8 heads, 2 kv heads, 4 experts of 640, top-2, vocabulary 4096) and the batch (128
sequences, 32-token prompts, 32 new tokens, EOS ignored) are chosen so that one micro-batch's
attention and expert times are of the same order (the busy fractions below show it), with enough
tokens per expert that splitting the batch does not multiply the expert weights' memory traffic.
Decode throughput counts the tokens generated after every sequence has its first token, over that
window. Busy fractions: the share of the window each worker spent computing (attention: between its
M2N calls; expert: between recv and reply), from the workers' traces.
--trace FILE writes a Chrome trace (chrome://tracing or ui.perfetto.dev) of a few steps of the m=2
run: each worker's attention, expert, transfer and wait intervals.
Writes bench/results/pingpong.json.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_nodes.config import CacheConfig, EngineConfig, ParallelConfig  # noqa: E402
from attention_nodes.engine import LLMEngine  # noqa: E402
from attention_nodes.sampling_params import SamplingParams  # noqa: E402
from bench.common import print_table, save  # noqa: E402
from m2n_comm.trace import busy_fraction  # noqa: E402
from models.builtin import make_random_checkpoint  # noqa: E402
from server.pools import PoolEngine  # noqa: E402


def checkpoint(out: Path, args: argparse.Namespace) -> Path:
    from transformers import MixtralConfig

    cfg = MixtralConfig(vocab_size=4096, hidden_size=512, intermediate_size=args.inter, num_hidden_layers=args.layers,
                        num_attention_heads=8, num_key_value_heads=args.kv_heads, num_local_experts=args.experts, num_experts_per_tok=2,
                        max_position_embeddings=1024, bos_token_id=0, eos_token_id=0)
    return make_random_checkpoint(out, cfg, seed=0, dtype="float32", tokenizer_dir=None)


def decode_throughput(engine, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Submit `batch` requests at once; tokens per second after all have their first token."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), torch.randint(1, 4096, (prompt_len,), generator=g).tolist(), params)
    started: set[str] = set()
    t0 = None
    tokens = 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            if t0 is not None:
                tokens += len(d.new_token_ids)
            started.add(d.request_id)
        if t0 is None and len(started) == batch:
            t0 = time.monotonic_ns()
    t1 = time.monotonic_ns()
    return {"tokens": tokens, "seconds": (t1 - t0) / 1e9, "tok_s": tokens / ((t1 - t0) / 1e9), "window_ns": (t0, t1)}


def run_pools(ckpt: Path, m: int, args, trace_dir: Path) -> dict:
    par = ParallelConfig(False, 1, 1, m, args.transport, torch_threads=1, trace_dir=str(trace_dir))
    engine = PoolEngine(EngineConfig(str(ckpt), cache=CacheConfig(num_blocks=1024), parallel=par), {0})
    try:
        decode_throughput(engine, 8, args.prompt_len, 4)  # warm-up
        r = decode_throughput(engine, args.batch, args.prompt_len, args.new_tokens)
    finally:
        engine.shutdown()
    t0, t1 = (t / 1e3 for t in r["window_ns"])
    a = json.loads((trace_dir / "a0.trace.json").read_text())
    e = json.loads((trace_dir / "e0.trace.json").read_text())
    r["attention_busy"] = busy_fraction(a, {"attention"}, t0, t1)
    r["expert_busy"] = busy_fraction(e, {"expert"}, t0, t1)
    r["events"] = [ev for ev in a + e if t1 - args.trace_ms * 1e3 <= ev["ts"] <= t1]
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smaller batch, for a smoke run")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--trace", default=None, help="Chrome trace file of the m=2 run's last steps")
    ap.add_argument("--trace-ms", type=float, default=150.0, help="how much of the end of the run to trace")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--inter", type=int, default=640)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.new_tokens = 32, 16
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = checkpoint(Path(tmp) / "ckpt", args)
        torch.set_num_threads(2)
        colocated = LLMEngine(EngineConfig(str(ckpt), cache=CacheConfig(num_blocks=1024)), {0})
        decode_throughput(colocated, 8, args.prompt_len, 4)
        base = decode_throughput(colocated, args.batch, args.prompt_len, args.new_tokens)
        del colocated
        torch.set_num_threads(1)
        rows = [{"run": "colocated, 2 threads", "tok/s": base["tok_s"], "vs colocated": 1.0}]
        runs = {}
        for m in (1, 2, 3):
            d = Path(tmp) / f"trace-m{m}"
            d.mkdir()
            runs[m] = run_pools(ckpt, m, args, d)
            rows.append({"run": f"1 attn + 1 expert, m={m}", "tok/s": runs[m]["tok_s"],
                         "vs colocated": runs[m]["tok_s"] / base["tok_s"], "vs m=1": runs[m]["tok_s"] / runs[1]["tok_s"],
                         "attn busy": runs[m]["attention_busy"], "expert busy": runs[m]["expert_busy"]})
    print(f"decode, batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.transport}")
    print_table(rows, ["run", "tok/s", "vs colocated", "vs m=1", "attn busy", "expert busy"])
    if args.trace:
        Path(args.trace).write_text(json.dumps({"traceEvents": runs[2]["events"], "displayTimeUnit": "ms"}))
        print(f"trace of the m=2 run's last {args.trace_ms:.0f} ms: {args.trace}")
    payload = {"config": vars(args), "rows": rows,
               "runs": {m: {k: v for k, v in r.items() if k != "events"} for m, r in runs.items()},
               "colocated": base}
    if not args.quick:
        print(f"wrote {save('pingpong', payload)}")


if __name__ == "__main__":
    main()
