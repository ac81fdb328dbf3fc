"""The fused int8 MoE block (kernels/int8.fused_moe_int8, kernels/csrc/moe_int8.c) against the int8 path
Shuttle runs today and the fused bf16 block, bf16 activations, at Mixtral-like shapes (E = 8 experts,
top-2, uniform random routing) and 1-256 tokens:

  int8_fused    fused_moe_int8 with its default kernels (AMX for experts of AMX_MIN_ROWS rows or more
                where AMX runs, else the AVX-512 FMA kernel, else AVX2)
  int8_fused_*  the same with one kernel forced for every expert, each that runs here: fma (AVX-512,
                else AVX2), bf16dot, amx
  w8a8_fused    fused_moe_int8 on the same codes as w8a8 experts (activations quantised per token, int8 x
                int8 with AVX-512 VNNI), where VNNI runs here: another format (other numbers), timed beside
  int8_packed   kernels.moe.fused_moe_packed on CpuWeight.quantized(quantize_int8(w)) (int8_linear twice per
                expert, torch's permute / SiLU * up / unpermute)
  bf16_*        native.fused_moe_bf16 on ExpertPanels of the same bf16 weights, timed with each entry
                of the kernel choice table (bf16_avx512; bf16_amx where AMX runs); on a CPU without
                AVX-512 BF16, fused_moe_packed on CpuWeight(w) (bf16)

Each cell takes the median of --rounds rounds; in a round every candidate runs in turn (the order
reversed every other round), each for at least --min-ms of back-to-back calls. best_fused: the
fastest int8_fused* column; fused_vs_packed / fused_vs_bf16 > 1: int8_fused (the default) is faster
than int8_packed / the fastest bf16 entry; w8a8_vs_bf16 likewise for w8a8_fused; int8_GBps: the int8 weight bytes of the experts with rows
over int8_fused's time.

    python bench/moe_int8.py [--quick] [--rounds 3] [--min-ms 50] [--threads 2]

--quick: only D=1024, I=2048. Writes bench/results/moe_int8.json (moe_int8_quick.json).
"""
import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from bench.int8_cpu import alternating  # noqa: E402
from kernels import int8, native  # noqa: E402
from kernels.cpu_linear import CpuWeight, ExpertPanels  # noqa: E402
from kernels.moe import fused_moe_packed  # noqa: E402

SHAPES = [(1024, 2048), (4096, 14336)]  # (D, I)
TOKENS = [1, 4, 16, 64, 256]
E, K = 8, 2


def fused_kernels() -> dict[str, int | None]:
    """fused_moe_int8's kernel argument per column: the default, then each kernel forced."""
    here = int8.kernels()
    if not here:
        raise SystemExit("the int8 kernels are unavailable here (see the log)")
    kernels = {"int8_fused": None, "int8_fused_fma": int8.AVX512 if int8.AVX512 in here else int8.AVX2}
    for name, k in (("int8_fused_bf16dot", int8.BF16DOT), ("int8_fused_amx", int8.AMX)):
        if k in here:
            kernels[name] = k
    return kernels


def bf16_candidates(w13: list[torch.Tensor], w2: list[torch.Tensor], inter: int) -> dict[str, Callable]:
    """The bf16 block as Shuttle runs it: the fused kernel on ExpertPanels, once per choice-table entry
    (every row bucket set alike), or fused_moe_packed on bf16 CpuWeights without AVX-512 BF16."""
    if not native.avx512_bf16():
        c13, c2 = [CpuWeight(w) for w in w13], [CpuWeight(w) for w in w2]
        return {"bf16_packed": lambda x, ids, wk: fused_moe_packed(x, c13, c2, wk, ids)}
    p13 = [ExpertPanels(w, True, inter) for w in w13]
    p2 = [ExpertPanels(w, False, inter) for w in w2]
    table = (torch.tensor([p.panels.data_ptr() for p in p13]), torch.tensor([p.panels.data_ptr() for p in p2]),
             p13[0].inter_padded)

    def entry(which: int) -> Callable:
        def run(x, ids, wk):
            for b in range(native.kernel_buckets()):
                native.set_kernel_choice(native.MOE, b, which)
            return native.fused_moe_bf16(x, ids, wk, *table)
        run.panels = (p13, p2)  # (the table holds their addresses only)
        return run

    out = {"bf16_avx512": entry(native.AVX512)}
    if native.amx():
        out["bf16_amx"] = entry(native.AMX)
    return out


def shape_rows(D: int, I: int, tokens: list[int], threads: list[int], rounds: int, min_s: float) -> list[dict]:
    g = torch.Generator().manual_seed(D + I)
    w13 = [(torch.randn(2 * I, D, generator=g) / D ** 0.5).bfloat16() for _ in range(E)]
    w2 = [(torch.randn(D, I, generator=g) / I ** 0.5).bfloat16() for _ in range(E)]
    experts = int8.Int8Experts.quantize(w13, w2)
    w8a8 = int8.Int8Experts(experts.w13_E, experts.w2_E, act_int8=True) if int8.VNNI in int8.kernels() else None
    c13 = [CpuWeight.quantized(int8.quantize_int8(w)) for w in w13]
    c2 = [CpuWeight.quantized(int8.quantize_int8(w)) for w in w2]
    bf16 = bf16_candidates(w13, w2, I)
    del w13, w2
    fused = fused_kernels()
    expert_bytes = experts.w13_E[0].int8.nbytes + experts.w2_E[0].int8.nbytes
    out = []
    for T in tokens:
        x = torch.randn(T, D, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        wk = torch.softmax(torch.randn(T, K, generator=g), -1)
        want = fused_moe_packed(x, c13, c2, wk, ids).float()
        for name, k in fused.items():
            err = (int8.fused_moe_int8(x, ids, wk, experts, kernel=k).float() - want).abs().max().item()
            assert err <= 3e-2 * max(1.0, want.abs().max().item()), f"{name} T={T}: max error {err}"
        extra = {}
        if w8a8 is not None:
            ref = int8.fused_moe_int8_reference(x, ids, wk, w8a8).float()
            err = (int8.fused_moe_int8(x, ids, wk, w8a8).float() - ref).abs().max().item()
            assert err <= 3e-2 * max(1.0, ref.abs().max().item()), f"w8a8 T={T}: max error {err}"
            extra["w8a8_fused"] = lambda: int8.fused_moe_int8(x, ids, wk, w8a8)
        fns = {**{name: (lambda k=k: int8.fused_moe_int8(x, ids, wk, experts, kernel=k)) for name, k in fused.items()},
               **extra,
               "int8_packed": lambda: fused_moe_packed(x, c13, c2, wk, ids),
               **{name: (lambda f=f: f(x, ids, wk)) for name, f in bf16.items()}}
        for n in threads:
            torch.set_num_threads(n)
            t = alternating(fns, rounds, min_s)
            best_fused, best_bf16 = min(fused, key=t.get), min(bf16, key=t.get)
            row = {"D": D, "I": I, "T": T, "threads": n, **{f"{k}_us": 1e6 * v for k, v in t.items()},
                   "best_fused": best_fused, "best_bf16": best_bf16,
                   "fused_vs_packed": t["int8_packed"] / t["int8_fused"],
                   "fused_vs_bf16": t[best_bf16] / t["int8_fused"],
                   **({"w8a8_vs_bf16": t[best_bf16] / t["w8a8_fused"]} if "w8a8_fused" in t else {}),
                   "int8_GBps": expert_bytes * ids.unique().numel() / t["int8_fused"] / 1e9}
            out.append(row)
            print(row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-ms", type=float, default=50.0)
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    args = ap.parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    old = torch.get_num_threads()
    rows = []
    with torch.inference_mode():
        for D, I in shapes:
            rows += shape_rows(D, I, TOKENS, args.threads, args.rounds, args.min_ms / 1e3)
    torch.set_num_threads(old)
    timed = [c for c in rows[0] if c.endswith("_us")]
    print_table(rows, ["D", "I", "T", "threads", *timed, "best_fused", "best_bf16", "fused_vs_packed", "fused_vs_bf16",
                       *(["w8a8_vs_bf16"] if "w8a8_vs_bf16" in rows[0] else []), "int8_GBps"])
    path = save("moe_int8_quick" if args.quick else "moe_int8",
                {"E": E, "K": K, "x_dtype": "bfloat16", "rounds": args.rounds, "min_ms": args.min_ms, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
