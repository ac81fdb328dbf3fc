"""FP8 block-quantised weights at rest (kernels/fp8_weights.py) against today's path (the checkpoint
dequantised to bf16 at load) and int8, bf16 activations, 1-256 rows, 128 x 128 blocks:

linear (I, O):
  fp8       fp8_linear, its default kernel as served (kernels/choice.py's "fp8_moe" table, measured on
            FP8 experts of the MoE shape below: BF16DOT or AMX from its threshold, else the FMA one)
  fp8_fma   fp8_linear with the FMA kernel forced (AVX-512, else AVX2): what float32 x always runs
  bf16      kernels.cpu_linear.cpu_linear on a CpuWeight of the dequantised bf16 weight (our panels
            on AVX-512 BF16 CPUs, each row count on the kernel kernels/choice.py measured fastest for
            the shape, as served; else oneDNN)
  int8      int8_linear on quantize_int8 of the same dequantised weight, its default kernel
MoE block (E = 8 experts, top-2, D, I):
  fp8       fused_moe_fp8 on Fp8Experts, its default kernels (the same "fp8_moe" table)
  bf16      the fused bf16 block (native.fused_moe_bf16 on ExpertPanels) where AVX-512 BF16 runs, else
            kernels.moe.fused_moe_packed on bf16 CpuWeights
  int8      fused_moe_int8 on Int8Experts, its default kernels ("int8_moe")

Each cell is the median of --rounds rounds; in a round every candidate runs in turn (the order reversed
every other round), each for at least --min-ms of back-to-back calls. *_vs_bf16 > 1: faster than bf16.
fp8_GBps: the FP8 bytes read (linear: the weight; MoE: the experts with rows) over fp8's time. The
machine's load average is recorded beside the numbers: above 1.5 they are labelled noisy.

    python bench/fp8_weights.py [--rounds 3] [--min-ms 20]

Writes bench/results/fp8_weights.json.
"""
import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import ISA_FLAGS, print_table, save  # noqa: E402
from bench.int8_cpu import alternating  # noqa: E402
from bench.moe_int8 import E, K  # noqa: E402
from kernels import choice, fp8_weights as fp8, int8, native  # noqa: E402
from kernels.cpu_linear import CpuWeight, ExpertPanels, cpu_linear  # noqa: E402
from kernels.moe import fused_moe_packed  # noqa: E402
from kernels.quant import dequantize_fp8_blocks, quantize_fp8_blocks  # noqa: E402

LINEAR_SHAPES = [(1024, 2048), (4096, 14336)]  # (I, O)
MOE_SHAPES = [(1024, 2048)]  # (D, I)
ROWS = [1, 4, 16, 64, 256]
BLOCK = (128, 128)
NOISY_LOAD = 1.5


def checkpoint(O: int, I: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 checkpoint tensor (codes, scale_inv) and the bf16 weight today's loader makes of it."""
    q, s = quantize_fp8_blocks(torch.randn(O, I, generator=g) / I ** 0.5, BLOCK)
    return (q, s), dequantize_fp8_blocks(q, s, BLOCK, torch.bfloat16)


def linear_rows(I: int, O: int, rounds: int, min_s: float) -> list[dict]:
    g = torch.Generator().manual_seed(I + O)
    (q, s), w16 = checkpoint(O, I, g)
    wf, cw, wi = fp8.Fp8Weight.from_checkpoint(q, s, BLOCK), CpuWeight(w16), int8.quantize_int8(w16)
    fma = fp8.AVX512 if fp8.AVX512 in fp8.kernels() else fp8.AVX2
    if cw.panels is not None:  # bf16 as served: the measured kernel per row count (AMX where it won)
        choice.configure("gemm", [(cw.out_features, cw.panels.shape[1] * 2)])
    del q, w16
    out = []
    for T in ROWS:
        x = torch.randn(T, I, generator=g).bfloat16()
        want = fp8.fp8_linear_reference(x, wf).float()
        for k in (None, fma):
            err = (fp8.fp8_linear(x, wf, kernel=k).float() - want).abs().max().item()
            assert err <= 2e-2 * max(1.0, want.abs().max().item()), f"fp8 kernel {k} T={T}: max error {err}"
        t = alternating({"fp8": lambda: fp8.fp8_linear(x, wf), "fp8_fma": lambda: fp8.fp8_linear(x, wf, kernel=fma),
                         "bf16": lambda: cpu_linear(x, cw), "int8": lambda: int8.int8_linear(x, wi)}, rounds, min_s)
        row = {"op": "linear", "shape": f"{I}x{O}", "T": T, **{f"{k}_us": 1e6 * v for k, v in t.items()},
               "fp8_vs_bf16": t["bf16"] / t["fp8"], "fp8_vs_int8": t["int8"] / t["fp8"],
               "fp8_GBps": wf.nbytes / t["fp8"] / 1e9}
        out.append(row)
        print(row, flush=True)
    return out


def bf16_moe(w13: list[torch.Tensor], w2: list[torch.Tensor], inter: int):
    """Today's bf16 block: the fused AVX-512 BF16 kernel on ExpertPanels, else fused_moe_packed."""
    if not native.avx512_bf16():
        c13, c2 = [CpuWeight(w) for w in w13], [CpuWeight(w) for w in w2]
        return lambda x, ids, wk: fused_moe_packed(x, c13, c2, wk, ids)
    p13, p2 = [ExpertPanels(w, True, inter) for w in w13], [ExpertPanels(w, False, inter) for w in w2]
    choice.configure("moe", [(w2[0].shape[0], w2[0].shape[1])])  # as served (models/cpu_inference.choose_kernels)
    t13, t2 = torch.tensor([p.panels.data_ptr() for p in p13]), torch.tensor([p.panels.data_ptr() for p in p2])
    run = lambda x, ids, wk: native.fused_moe_bf16(x, ids, wk, t13, t2, p13[0].inter_padded)  # noqa: E731
    run.panels = (p13, p2)  # (the tables hold their addresses only)
    return run


def moe_rows(D: int, I: int, rounds: int, min_s: float) -> list[dict]:
    g = torch.Generator().manual_seed(D * I)
    gate, up, down = ([checkpoint(*shape, g) for _ in range(E)] for shape in ((I, D), (I, D), (D, I)))
    experts = fp8.Fp8Experts.from_checkpoint(*zip(*(c for c, _ in gate)), *zip(*(c for c, _ in up)),
                                             *zip(*(c for c, _ in down)), BLOCK)
    w13 = [torch.cat((a, b)) for (_, a), (_, b) in zip(gate, up)]
    w2 = [w for _, w in down]
    bf16, i8 = bf16_moe(w13, w2, I), int8.Int8Experts.quantize(w13, w2)
    del gate, up, down, w13, w2
    expert_bytes = experts.w13_E[0].fp8.nbytes + experts.w2_E[0].fp8.nbytes
    out = []
    for T in ROWS:
        x = torch.randn(T, D, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        wk = torch.softmax(torch.randn(T, K, generator=g), -1)
        want = fp8.fused_moe_fp8_reference(x, ids, wk, experts).float()
        err = (fp8.fused_moe_fp8(x, ids, wk, experts).float() - want).abs().max().item()
        assert err <= 3e-2 * max(1.0, want.abs().max().item()), f"fused_moe_fp8 T={T}: max error {err}"
        t = alternating({"fp8": lambda: fp8.fused_moe_fp8(x, ids, wk, experts), "bf16": lambda: bf16(x, ids, wk),
                         "int8": lambda: int8.fused_moe_int8(x, ids, wk, i8)}, rounds, min_s)
        row = {"op": f"moe E{E} top{K}", "shape": f"{D}x{I}", "T": T, **{f"{k}_us": 1e6 * v for k, v in t.items()},
               "fp8_vs_bf16": t["bf16"] / t["fp8"], "fp8_vs_int8": t["int8"] / t["fp8"],
               "fp8_GBps": expert_bytes * ids.unique().numel() / t["fp8"] / 1e9}
        out.append(row)
        print(row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-ms", type=float, default=20.0)
    args = ap.parse_args()
    if not fp8.available():
        raise SystemExit("the FP8 kernels are unavailable here (see the log)")
    isa = sorted(f for f in native.cpu_flags() if f in ISA_FLAGS + ("f16c",))
    load_before = os.getloadavg()[0]
    print(f"host: {native.cpu_model()}, {torch.get_num_threads()} threads; ISA: {' '.join(isa)}; "
          f"fp8 kernels here: {sorted(fp8.kernels())}; load average {load_before:.2f}", flush=True)
    rows = []
    for op in ("fp8_moe", "int8_moe"):  # each format's measured thresholds, as served beside such experts
        choice.configure(op, MOE_SHAPES)
    with torch.inference_mode():
        for I, O in LINEAR_SHAPES:
            rows += linear_rows(I, O, args.rounds, args.min_ms / 1e3)
        for D, I in MOE_SHAPES:
            rows += moe_rows(D, I, args.rounds, args.min_ms / 1e3)
    load_after = os.getloadavg()[0]
    noisy = max(load_before, load_after) >= NOISY_LOAD
    print_table(rows, ["op", "shape", "T", "fp8_us", "fp8_fma_us", "bf16_us", "int8_us", "fp8_vs_bf16", "fp8_vs_int8",
                       "fp8_GBps"])
    print(f"load average {load_before:.2f} before, {load_after:.2f} after" + ("  -- NOISY" if noisy else ""))
    path = save("fp8_weights", {"block": list(BLOCK), "x_dtype": "bfloat16", "rounds": args.rounds,
                                "min_ms": args.min_ms, "fp8_kernels": sorted(fp8.kernels()),
                                "load_average": [load_before, load_after], "noisy": noisy, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
