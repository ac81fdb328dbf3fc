"""The decode stages (models/stages.py) eager against compiled, one call each, on the shapes of the
Mixtral-shaped ~425M checkpoint of bench/engine.py (hidden 1024, 16 heads, 4 KV heads of 64, 8
experts top-2): median microseconds per call at T = 1 / 16 / 64 / 256 rows.

    python bench/stages.py [--dtype float32|bfloat16] [--quick]

The compiled stages replace 5-15 eager dispatches with one dynamo-guarded call of one fused
kernel; this shows at which row counts that pays. Writes bench/results/stages.json.
"""
import argparse
from dataclasses import replace
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from kernels.ops import torch_ops  # noqa: E402
from models.stages import EAGER, BUCKETS, HeadSpec, RouteSpec, compiled_stages, route  # noqa: E402


def median_us(fn, n: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[n // 2]


def stage_args(T: int, dtype: torch.dtype) -> dict[str, tuple]:
    ops = torch_ops()
    x, r, w = torch.randn(T, 1024, dtype=dtype), torch.randn(T, 1024, dtype=dtype), torch.ones(1024, dtype=dtype)
    q, k, v = torch.randn(T, 1024, dtype=dtype), torch.randn(T, 256, dtype=dtype), torch.randn(T, 256, dtype=dtype)
    cos_sin = torch.randn(T, 64, dtype=dtype)
    return {"add_rms_norm": (x, r, w, 1e-5, ops),
            "q_k_v_heads": (q, k, v, cos_sin, cos_sin, None, None, HeadSpec(16, 4, 64, 64, "none", 1e-5, None), ops),
            "route": (torch.randn(T, 8), None, RouteSpec(2, "softmax", False, 1, 1, "max", 1.0, None), ops)}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    args = ap.parse_args()
    dtype, n = getattr(torch, args.dtype), 50 if args.quick else 300
    # routing is compiled here too, to show why the engine keeps it eager
    compiled = replace(compiled_stages(), route=torch.compile(route, fullgraph=True, options={"cpp.threads": 1}))
    t0 = time.perf_counter()
    for T in BUCKETS:
        for name, a in stage_args(T, dtype).items():
            getattr(compiled, name)(*a)
    print(f"compiled {len(BUCKETS)} buckets in {time.perf_counter() - t0:.1f} s, {torch.get_num_threads()} threads")
    rows = []
    for T in (1, 16, 64, 256):
        for name, a in stage_args(T, dtype).items():
            eager_us = median_us(lambda: getattr(EAGER, name)(*a), n)
            compiled_us = median_us(lambda: getattr(compiled, name)(*a), n)
            rows.append({"T": T, "stage": name, "eager_us": eager_us, "compiled_us": compiled_us,
                         "speedup": eager_us / compiled_us})
    print_table(rows, ["T", "stage", "eager_us", "compiled_us", "speedup"])
    print(f"wrote {save('stages', {'dtype': args.dtype, 'rows': rows, 'date': time.strftime('%Y-%m-%d')})}")


if __name__ == "__main__":
    main()
