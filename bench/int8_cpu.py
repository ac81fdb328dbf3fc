"""Weight-only INT8 linear (kernels/int8.int8_linear) against the bf16 linear Shuttle runs today and
torch's own int8 kernel, bf16 activations, at Mixtral-like weight shapes and 1-256 rows:

  int8_*     kernels.int8.int8_linear on quantize_int8's panels, each kernel that runs here forced:
             fma (AVX512's FMA on codes widened in registers; AVX2 where there is no AVX-512), bf16dot
             and amx (each panel dequantised once to bf16, then AVX-512 BF16 / AMX-BF16)
  bf16       kernels.cpu_linear.cpu_linear on a CpuWeight of the bf16 weight: on a CPU with AVX-512
             BF16 our panels (native.gemm_bf16_panels), timed with each entry of the kernel choice
             table (bf16_avx512; bf16_amx where AMX runs), else oneDNN's packed bf16 GEMM (bf16)
  int8pack   torch._weight_int8pack_mm on the same codes (contiguous (O, I) int8) and bf16 scales

Each cell takes the median of --rounds rounds; in a round every candidate runs in turn (the order
reversed every other round), each for at least --min-ms of back-to-back calls. At 1 and 2 threads
(torch.set_num_threads, which the native kernels follow). best_int8 / best_bf16: the fastest int8
kernel / bf16 entry (what a measured choice picks: kernels/choice.py for bf16); int8_GBps: the int8
weight bytes over best_int8's time; int8_vs_bf16 > 1: int8 is faster.

    python bench/int8_cpu.py [--quick] [--rounds 5] [--min-ms 20]

--quick: the two smaller shapes, 3 rounds. Writes bench/results/int8_cpu.json (int8_cpu_quick.json).
"""
import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from kernels import int8, native  # noqa: E402
from kernels.choice import time_us  # noqa: E402
from kernels.cpu_linear import CpuWeight, cpu_linear  # noqa: E402
from kernels.int8 import int8_linear, int8_linear_reference, quantize_int8  # noqa: E402

SHAPES = [(1024, 2048), (2048, 1024), (4096, 14336)]  # (I, O)
ROWS = [1, 4, 16, 64, 256]


def int8_kernels() -> dict[str, int]:
    """The int8 kernels to time here: the FMA one (AVX-512, else AVX2) and the bf16 ones that run."""
    here = int8.kernels()
    if not here:
        raise SystemExit("the int8 kernels are unavailable here (see the log)")
    kernels = {"int8_fma": int8.AVX512 if int8.AVX512 in here else int8.AVX2}
    for name, k in (("int8_bf16dot", int8.BF16DOT), ("int8_amx", int8.AMX)):
        if k in here:
            kernels[name] = k
    return kernels


def alternating(fns: dict[str, Callable[[], object]], rounds: int, min_s: float) -> dict[str, float]:
    """Median seconds per call of each function, the functions taking turns each round (the order
    reversed every other round) so that load shifts hit all alike."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            times[k].append(time_us(fns[k], min_s) / 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def bf16_candidates(cw: CpuWeight) -> dict[str, Callable[[torch.Tensor], object]]:
    """The bf16 linear as cpu_linear runs it, once per choice-table entry where our panels hold it."""
    if cw.panels is None:
        return {"bf16": lambda x: cpu_linear(x, cw)}

    def entry(which: int) -> Callable[[torch.Tensor], object]:
        b_of = native.bucket

        def run(x):
            native.set_kernel_choice(native.GEMM, b_of(x.shape[0]), which)
            return cpu_linear(x, cw)
        return run

    kernels = {"bf16_avx512": entry(native.AVX512)}
    if native.amx():
        kernels["bf16_amx"] = entry(native.AMX)
    return kernels


def shape_rows(I: int, O: int, rows: list[int], threads: list[int], rounds: int, min_s: float) -> list[dict]:
    g = torch.Generator().manual_seed(I * 7 + O)
    w = (torch.randn(O, I, generator=g) / I ** 0.5).bfloat16()
    q = quantize_int8(w)
    codes, scales16 = q.codes().contiguous(), q.scale.bfloat16()
    cw = CpuWeight(w)
    bf16 = bf16_candidates(cw)
    del w
    kernels = int8_kernels()
    out = []
    for T in rows:
        x = torch.randn(T, I, generator=g).bfloat16()
        want = int8_linear_reference(x, q).float()
        for name, k in kernels.items():
            err = (int8_linear(x, q, kernel=k).float() - want).abs().max().item()
            assert err <= 2e-2 * max(1.0, want.abs().max().item()), f"{name} T={T}: max error {err}"
        fns = {**{name: (lambda k=k: int8_linear(x, q, kernel=k)) for name, k in kernels.items()},
               **{name: (lambda f=f: f(x)) for name, f in bf16.items()},
               "int8pack": lambda: torch._weight_int8pack_mm(x, codes, scales16)}
        for n in threads:
            torch.set_num_threads(n)
            t = alternating(fns, rounds, min_s)
            best_int8 = min(kernels, key=t.get)
            best_bf16 = min(bf16, key=t.get)
            row = {"I": I, "O": O, "T": T, "threads": n, **{f"{k}_us": 1e6 * v for k, v in t.items()},
                   "best_int8": best_int8, "best_bf16": best_bf16,
                   "int8_GBps": q.nbytes / t[best_int8] / 1e9,
                   "int8_vs_bf16": t[best_bf16] / t[best_int8], "int8_vs_int8pack": t["int8pack"] / t[best_int8]}
            out.append(row)
            print(row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-ms", type=float, default=20.0)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    shapes = SHAPES[:2] if args.quick else SHAPES
    rounds = 3 if args.quick else args.rounds
    old = torch.get_num_threads()
    rows = []
    with torch.inference_mode():
        for I, O in shapes:
            rows += shape_rows(I, O, ROWS, args.threads, rounds, args.min_ms / 1e3)
    torch.set_num_threads(old)
    timed = [c for c in rows[0] if c.endswith("_us")]
    print_table(rows, ["I", "O", "T", "threads", *timed, "best_int8", "best_bf16", "int8_GBps", "int8_vs_bf16",
                       "int8_vs_int8pack"])
    path = save("int8_cpu_quick" if args.quick else "int8_cpu",
                {"int8_fma_kernel": "avx512" if int8.avx512() else "avx2", "rounds": rounds, "min_ms": args.min_ms,
                 "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
