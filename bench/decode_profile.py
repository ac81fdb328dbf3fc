"""Where a colocated CPU decode step goes: exclusive time per op category, per batch size, on the
Mixtral-shaped ~425M checkpoint of bench/engine.py (stored bf16, served as `--dtype` says).

    python bench/decode_profile.py [--quick] [--dtype auto|float32|bfloat16] [--threads N] [--wall] [--model DIR]

Each category's call sites are wrapped with a timer (nested calls are charged to the innermost
category, so the categories add up to the step): dense GEMMs (fused q/k/v and o projections), the
LM head, the router's GEMM, routing top-k, expert GEMMs (the oneDNN calls inside the MoE block), the
rest of the MoE block (sort, gather, SiLU-mul, weighted scatter; where the whole block is one native
call, kernels/native.fused_moe_bf16, it is one category with its GEMMs), attention over the paged cache
(with the cache write), norms (+ residual add), q/k/v heads + rotary, the sampler, the runner's
input preparation, and what is left of LLMEngine.step (scheduler, bookkeeping: Python). The GEMM
rows also give the achieved GB/s (weight bytes read) and GFLOP/s. Default: 1 thread and CPU time
(time.process_time), the steadiest measure on a shared machine; --wall times wall clock at
--threads. The timers cost about 1 us a call (~100 calls a step), under 1% at batch 1.
--quick: batches 1/16/64, fewer steps (about 2 minutes on 2 quiet cores).
Writes bench/results/decode_profile.json (--quick: decode_profile_quick.json).
"""
import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attention_nodes.engine as engine_mod  # noqa: E402
import attention_nodes.model_runner as runner_mod  # noqa: E402
import kernels.cpu_linear as cpu_linear  # noqa: E402
import models.cpu_inference as cpu_inference  # noqa: E402
import models.kv_cache as kv_cache  # noqa: E402
import models.moe_decoder as moe_decoder  # noqa: E402
import models.norm as norm  # noqa: E402
import models.stages as stages  # noqa: E402
from bench.common import print_table, save  # noqa: E402
from bench.engine import mixtral  # noqa: E402
from server import LLM, SamplingParams  # noqa: E402

MOE = "MoE sort/gather/act/scatter"
MOE_NATIVE = "MoE block (native kernel, GEMMs included)"


class Timers:
    """Exclusive time per category: a call's time less that of the timed calls inside it."""

    def __init__(self, clock: Callable[[], float]):
        self.clock, self.on = clock, False
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list] = []  # [category, time of timed children]

    def wrap(self, fn: Callable, category: str | Callable[[tuple], str | None]) -> Callable:
        def timed(*args, **kwargs):
            cat = category(args) if callable(category) else category
            if not self.on or cat is None:
                return fn(*args, **kwargs)
            self.stack.append([cat, 0.0])
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = self.clock() - t0
                _, children = self.stack.pop()
                self.total[cat] += dt - children
                self.calls[cat] += 1
                if self.stack:
                    self.stack[-1][1] += dt
        return timed

    def install(self, vocab: int) -> None:
        """Wrap the call sites (process-wide; this benchmark's process only)."""
        def patch(owner: object, name: str, category) -> None:
            setattr(owner, name, self.wrap(getattr(owner, name), category))

        patch(engine_mod.LLMEngine, "step", "engine step (scheduler, Python)")
        patch(runner_mod.ModelRunner, "_prepare", "prepare inputs")
        patch(engine_mod.Sampler, "__call__", "sampler")
        patch(cpu_linear.PackedLinear, "forward",
              lambda a: "lm_head GEMM" if a[0].out_features == vocab else "dense GEMMs (qkv, o)")
        patch(moe_decoder.Router, "forward", "router GEMM")
        patch(norm.RMSNorm, "add_and_norm", "norms (+residual)")
        patch(norm.RMSNorm, "forward", "norms (+residual)")
        patch(kv_cache.PagedKVCache, "attend", "attention (+cache write)")
        patch(cpu_inference.PackedExperts, "forward",  # one native call (bf16, AVX-512 BF16) or torch ops + GEMMs
              lambda a: MOE_NATIVE if a[0].native is not None else MOE)
        # fused_moe_packed imports packed_linear at call time; PackedLinear's calls stay dense
        patch(cpu_linear, "packed_linear", lambda a: "expert GEMMs" if self.stack and self.stack[-1][0] == MOE else None)

    def stages(self) -> stages.DecodeStages:
        return stages.DecodeStages(add_rms_norm=self.wrap(stages.add_rms_norm, "norms (+residual)"),
                                   q_k_v_heads=self.wrap(stages.q_k_v_heads, "q/k/v heads + rotary"),
                                   route=self.wrap(stages.route, "routing top-k"))


def decode(llm: LLM, timers: Timers, B: int, steps: int, skip: int = 2) -> tuple[float, int]:
    """Run B 32-token prompts; time (clock) the decode steps after the first `skip`. Returns (s, steps)."""
    engine, rng = llm.engine, random.Random(B)
    params = SamplingParams(max_tokens=steps + skip + 2, temperature=0, ignore_eos=True)
    for b in range(B):
        engine.add_request(f"p{B}-{b}-{rng.random()}", [rng.randrange(10, 4000) for _ in range(32)], params)
    spent, n, seen = 0.0, 0, 0
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        decoding = (len(running) == B and not engine.scheduler.waiting
                    and all(s.num_computed_tokens >= s.num_prompt_tokens for s in running))
        timers.on = decoding and seen >= skip
        seen += decoding
        t0 = timers.clock()
        engine.step()
        if timers.on:
            spent, n = spent + timers.clock() - t0, n + 1
        timers.on = False
    return spent, n


def gemm_rates(cfg, B: int, elem: int, ms: dict[str, float]) -> dict[str, str]:
    """Achieved GB/s (weights read) and GFLOP/s of the GEMM categories."""
    D, L, E, K, I_ = cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size
    active = E * (1 - (1 - K / E) ** B)  # expected distinct experts hit per layer
    qkvo = (cfg.q_size + 2 * cfg.kv_size) * D + cfg.q_size * D
    sizes = {"dense GEMMs (qkv, o)": (L * qkvo, L * qkvo),
             "lm_head GEMM": (cfg.vocab_size * D, cfg.vocab_size * D),
             "expert GEMMs": (L * active * 3 * I_ * D, L * K * 3 * I_ * D),  # (weights read, MACs per token)
             MOE_NATIVE: (L * active * 3 * I_ * D, L * K * 3 * I_ * D)}
    out = {}
    for cat, (weights, macs) in sizes.items():
        if ms.get(cat):
            s = ms[cat] / 1e3
            out[cat] = f"{weights * elem / s / 1e9:.1f} GB/s, {2 * B * macs / s / 1e9:.1f} GFLOP/s"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 16 64 256 (quick: 1 16 64)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of the process's CPU time")
    ap.add_argument("--model", default=None, help="another checkpoint directory (default: the ~425M Mixtral shape)")
    args = ap.parse_args()
    batches = args.batches or ([1, 16, 64] if args.quick else [1, 16, 64, 256])
    torch.set_num_threads(args.threads)
    timers = Timers(time.perf_counter if args.wall else time.process_time)
    rows, rates = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.model or mixtral(Path(tmp) / "big", "bfloat16", 1024, 2048, 8, 16, 4)
        llm = LLM(ckpt, dtype=args.dtype, max_num_seqs=max(batches), max_num_batched_tokens=32 * max(batches),
                  native_decode=False)
        timers.install(llm.cfg.vocab_size)
        st = timers.stages()
        for m in llm.engine.runner.model.modules():
            if hasattr(m, "stages"):
                m.stages = st
        elem = llm.engine.runner.dtype.itemsize
        for B in batches:
            decode(llm, timers, B, 2)  # warm-up
            timers.total.clear()
            timers.calls.clear()
            spent, n = decode(llm, timers, B, (8 if B <= 16 else 4) if args.quick else (24 if B <= 16 else 10))
            ms = {c: 1e3 * v / n for c, v in timers.total.items()}
            rates[B] = gemm_rates(llm.cfg, B, elem, ms)
            for c, v in sorted(ms.items(), key=lambda kv: -kv[1]):
                rows.append({"batch": B, "category": c, "ms_per_step": v, "share": v / (1e3 * spent / n),
                             "calls_per_step": timers.calls[c] / n, "rate": rates[B].get(c, "")})
            print(f"batch {B}: {1e3 * spent / n:.1f} ms per step ({n} steps)", flush=True)
        dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
        llm.shutdown()
    print(f"\ndecode step by category, {dtype}, {args.threads} thread(s), "
          f"{'wall' if args.wall else 'CPU'} time")
    print_table(rows, ["batch", "category", "ms_per_step", "share", "calls_per_step", "rate"])
    path = save("decode_profile_quick" if args.quick else "decode_profile", {
        "dtype_arg": args.dtype, "dtype": dtype, "threads": args.threads, "clock": "wall" if args.wall else "cpu",
        "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
