"""The reference MoE (sort by expert, one matmul pair per active expert) against the naive
gather-and-einsum formulation, at decode and prefill shapes, on the CPU.

    python bench/moe_cpu.py [--dtype bfloat16]

Shapes: OLMoE-1B-7B-like layer scaled to the CPU (hidden 2048, 64 experts of 1024, top-8) and a
Mixtral-like one (hidden 1024, 8 experts of 2048, top-2). Prints a table and writes
bench/results/moe_cpu.json with the speed-up of the reference over the naive version.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import best_of, print_table, save  # noqa: E402
from kernels.moe import fused_moe, moe_gather_einsum  # noqa: E402
from kernels.routing import topk_route  # noqa: E402

SHAPES = {"olmoe-like": (2048, 1024, 64, 8), "mixtral-like": (1024, 2048, 8, 2)}  # D, I, E, K


def run(args: argparse.Namespace) -> None:
    dtype = getattr(torch, args.dtype)
    rows = []
    for name, (D, I, E, K) in SHAPES.items():
        torch.manual_seed(0)
        w13 = (torch.randn(E, 2 * I, D) / D ** 0.5).to(dtype)
        w2 = (torch.randn(E, D, I) / I ** 0.5).to(dtype)
        for T in args.tokens:
            x = torch.randn(T, D).to(dtype)
            weights, ids = topk_route(torch.randn(T, E), K, "softmax", True)
            ref = fused_moe(x, w13, w2, weights, ids)
            naive_ok = T * K * 3 * I * D * x.element_size() < args.naive_limit_gb * 1e9  # it copies weights per token
            row = {"shape": name, "tokens": T, "reference_ms": 1e3 * best_of(lambda: fused_moe(x, w13, w2, weights, ids), 3)}
            if naive_ok:
                naive = moe_gather_einsum(x, w13, w2, weights, ids)
                assert (naive.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max() + 1e-3
                row["naive_ms"] = 1e3 * best_of(lambda: moe_gather_einsum(x, w13, w2, weights, ids), 2)
                row["speedup"] = row["naive_ms"] / row["reference_ms"]
            active = int(ids.unique().numel())
            weight_gb = active * 3 * I * D * x.element_size() / 1e9
            row["active_experts"] = active
            row["weight_GB_per_s"] = weight_gb / (row["reference_ms"] / 1e3)
            rows.append(row)
            print(row, flush=True)
    print(f"\nMoE layer on the CPU, {args.dtype}, {torch.get_num_threads()} threads")
    print_table(rows, ["shape", "tokens", "active_experts", "reference_ms", "naive_ms", "speedup", "weight_GB_per_s"])
    print(f"wrote {save('moe_cpu', {'benchmark': 'moe_cpu', 'dtype': args.dtype, 'rows': rows, 'date': time.strftime('%Y-%m-%d %H:%M:%S')})}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512])
    p.add_argument("--naive-limit-gb", type=float, default=4.0, help="skip the naive version above this copy size")
    run(p.parse_args())
