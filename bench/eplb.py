"""EPLB: does re-placing the experts from their measured load balance a skewed router, and pay?

    python bench/eplb.py [--quick]

A checkpoint whose router sends most tokens to two experts per layer is built here: a random
Mixtral-shaped model (float32, hidden 256, 4 layers, 8 experts of 2048, top-2, vocabulary 2048: the
experts' work dominates a step)
whose embeddings get a constant +BIAS in dimension 0 (so every token's normalised hidden state has a
large positive component there) and whose router rows of the hot experts get +GATE in that column.
The hot pair is experts {0, 1} in even layers and {2, 3} in odd ones: all on expert worker e0 in the
default contiguous placement (e0: experts 0-3, e1: 4-7), the worst case a static placement meets.

Two deployments run side by side, both up at once (1 attention worker, 2 expert workers, shm,
1 torch thread each): the baseline with the static placement, and --eplb (interval 16 steps, 2
redundant experts per layer). Each decodes warm-up rounds (the EPLB one until its re-placement is in
use), then timed rounds alternate between the two (so drifting load from other jobs hits both
alike): BATCH requests of PROMPT random tokens, NEW tokens each (defaults 64, 16, 32), EOS ignored.
One micro-batch by default (--micro-batches): on a 2-core host the expert workers can then run in
parallel while the attention worker waits, which is where balancing pays; with m=2 the three
workers contend for two cores. Reported per deployment: the expert workers' (token, expert) pairs
over the timed rounds and their max/mean (1.0 = balanced), the median output tokens per second of
the rounds, the seconds each expert worker spent computing experts in them (against the rounds'
wall time), and the placement version in use. Writes bench/results/eplb.json.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_nodes.config import CacheConfig, EngineConfig, ParallelConfig  # noqa: E402
from attention_nodes.sampling_params import SamplingParams  # noqa: E402
from bench.common import print_table, save  # noqa: E402
from pools.eplb import imbalance  # noqa: E402
from models.builtin import make_random_checkpoint  # noqa: E402
from pools.engine import PoolEngine  # noqa: E402

VOCAB, LAYERS, EXPERTS = 2048, 4, 8


def skewed_checkpoint(out: Path, bias: float, gate: float) -> Path:
    """A random Mixtral-shaped checkpoint whose router prefers two experts per layer (see above)."""
    from safetensors.torch import load_file, save_file
    from transformers import MixtralConfig

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=2048, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2,
                        max_position_embeddings=512, bos_token_id=0, eos_token_id=0)
    make_random_checkpoint(out, cfg, seed=0, dtype="float32", tokenizer_dir=None)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name == "model.embed_tokens.weight":
                t[:, 0] += bias
            elif name.endswith("block_sparse_moe.gate.weight"):
                layer = int(name.split(".")[2])
                hot = [2 * (layer % 2), 2 * (layer % 2) + 1]
                t[hot, 0] += gate
        save_file(tensors, f, metadata={"format": "pt"})
    return out


def decode(engine: PoolEngine, batch: int, prompt: int, new: int, seed: int) -> tuple[int, float]:
    """Submit `batch` requests at once and run them to the end: (output tokens, seconds)."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{seed}-{i}", torch.randint(1, VOCAB, (prompt,), generator=g).tolist(), params)
    tokens, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(d.new_token_ids) for d in engine.step())
    return tokens, time.perf_counter() - t0


def worker_pairs(engine: PoolEngine) -> list[int]:
    """(token, expert) pairs per expert worker so far, once the workers' published counts settle
    (they publish after an idle step, or once a second)."""
    last, deadline = None, time.monotonic() + 3.0
    while time.monotonic() < deadline:
        now = list(engine.stats()["expert_worker_tokens"].values())
        if now == last:
            return now
        last = now
        time.sleep(0.3)
    return last


def expert_busy_s(engine: PoolEngine) -> list[float]:
    """Seconds each expert worker has spent computing experts so far (as published)."""
    return [w["busy_ns"] / 1e9 for w in engine.stats()["busy"] if w["pool"] == "expert"]


def start(ckpt: Path, eplb: bool, args: argparse.Namespace) -> PoolEngine:
    par = ParallelConfig(False, 1, 2, args.micro_batches, "shm", torch_threads=1, eplb=eplb,
                         eplb_interval=args.interval, num_redundant_experts=args.redundant if eplb else 0)
    return PoolEngine(EngineConfig(str(ckpt), cache=CacheConfig(num_blocks=2048), parallel=par), {0})


def warm_up(engine: PoolEngine, eplb: bool, args: argparse.Namespace) -> list[int]:
    """Warm-up rounds (EPLB: until a re-placement is in use); the pairs per worker they computed."""
    for r in range(args.warmup_rounds):
        decode(engine, args.batch, args.prompt, args.new, seed=100 + r)
        if not eplb or engine.placements.applied:
            break
    return worker_pairs(engine)


def measure(ckpt: Path, args: argparse.Namespace) -> list[dict]:
    """Both deployments up at once; timed rounds alternate between them (the same requests), so
    drifting load from other jobs on the host hits both alike. Median tok/s per deployment."""
    engines = {False: start(ckpt, False, args), True: start(ckpt, True, args)}
    try:
        warm = {eplb: warm_up(e, eplb, args) for eplb, e in engines.items()}
        busy0 = {eplb: expert_busy_s(e) for eplb, e in engines.items()}
        rates: dict[bool, list[float]] = {False: [], True: []}
        tokens = {}
        for r in range(args.rounds):
            for eplb, e in engines.items():
                tokens[eplb], seconds = decode(e, args.batch, args.prompt, args.new, seed=1 + r)
                rates[eplb].append(tokens[eplb] / seconds)
        out = []
        for eplb, e in engines.items():
            pairs = [a - b for a, b in zip(worker_pairs(e), warm[eplb])]
            busy = [a - b for a, b in zip(expert_busy_s(e), busy0[eplb])]
            out.append({"eplb": eplb, "tokens_per_round": tokens[eplb], "tok_s_rounds": rates[eplb],
                        "tok_s": statistics.median(rates[eplb]), "warmup_pairs": warm[eplb], "pairs": pairs,
                        "imbalance": imbalance(pairs), "warmup_imbalance": imbalance(warm[eplb]),
                        "expert_busy_s": busy, "rounds_s": sum(tokens[eplb] / r for r in rates[eplb]),
                        "placement_version": e.placements.current.version,
                        "placement": [[list(ws) for ws in p.copies] for p in e.placements.current.layers]})
        return out
    finally:
        for e in engines.values():
            e.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smaller batch, for a smoke run (no JSON)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--interval", type=int, default=16, help="--eplb-interval (steps)")
    ap.add_argument("--redundant", type=int, default=2, help="--num-redundant-experts")
    ap.add_argument("--warmup-rounds", type=int, default=4, help="most warm-up rounds waiting for a re-placement")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per deployment (alternating)")
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--bias", type=float, default=0.3, help="added to every embedding's dimension 0")
    ap.add_argument("--gate", type=float, default=0.5, help="added to the hot experts' router weight there")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.new, args.rounds = 16, 16, 1
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = skewed_checkpoint(Path(tmp) / "ckpt", args.bias, args.gate)
        runs = measure(ckpt, args)
    base = runs[0]["tok_s"]
    rows = [{"run": "static placement" if not r["eplb"] else f"--eplb, R={args.redundant}",
             "placement v": r["placement_version"], "e0 pairs": r["pairs"][0], "e1 pairs": r["pairs"][1],
             "max/mean": r["imbalance"], "warm-up max/mean": r["warmup_imbalance"],
             "e0 busy s": r["expert_busy_s"][0], "e1 busy s": r["expert_busy_s"][1],
             "timed s": r["rounds_s"], "tok/s": r["tok_s"],
             "vs static": r["tok_s"] / base} for r in runs]
    print(f"decode, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens; 1 attention + 2 expert workers, "
          f"m={args.micro_batches}; tok/s: median of {args.rounds} alternating rounds")
    print_table(rows, ["run", "placement v", "e0 pairs", "e1 pairs", "max/mean", "warm-up max/mean", "e0 busy s",
                       "e1 busy s", "timed s", "tok/s", "vs static"])
    if not args.quick:
        load = os.getloadavg()[0]
        print(f"load average {load:.1f} at the end (other jobs on this machine share its cores)")
        print(f"wrote {save('eplb', {'config': vars(args), 'rows': rows, 'runs': runs, 'load_average': load})}")


if __name__ == "__main__":
    main()
