"""Triton kernels against the torch references and against the roofline, on a CUDA GPU.

    python bench/kernels_gpu.py [--tokens 1 2 4 ... 512] [--context 2048]

Ops: fused MoE, routing, fused add + RMSNorm, paged decode attention, at the layer shapes of
OLMoE-1B-7B and Qwen3-30B-A3B, bfloat16, for 1 to 512 tokens (decode attention: that many
sequences of --context tokens). The roofline of each case is max(bytes moved / copy bandwidth,
FLOPs / matmul rate), both measured at the start of the same run; "roof" is roofline time over
measured time (1.0 = at the hardware's limit). Writes bench/results/kernels_gpu.json with the
device named. Needs CUDA: there is no meaningful CPU run of this benchmark.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from kernels.ops import torch_ops, triton_ops  # noqa: E402

# name: hidden D, experts E, top-k K, expert intermediate I, query heads N, kv heads KV, head dim H
MODELS = {"olmoe-1b-7b": (2048, 64, 8, 1024, 16, 16, 128), "qwen3-30b-a3b": (2048, 128, 8, 768, 32, 4, 128)}
DT = torch.bfloat16
PAGE = 16


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def hardware() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read plus write, bf16 matmul FLOP/s)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (bench_ms(lambda: dst.copy_(src)) * 1e-3)
    a = torch.randn(8192, 8192, dtype=DT, device="cuda")
    rate = 2 * 8192 ** 3 / (bench_ms(lambda: a @ a) * 1e-3)
    return bw, rate


def row(op: str, model: str, T: int, ref_ms: float, tri_ms: float, nbytes: float, flops: float,
        bw: float, rate: float) -> dict:
    roof_ms = 1e3 * max(nbytes / bw, flops / rate)
    return {"op": op, "model": model, "tokens": T, "torch_ms": ref_ms, "triton_ms": tri_ms,
            "speedup": ref_ms / tri_ms, "roofline_ms": roof_ms, "roof": roof_ms / tri_ms,
            "GB/s": nbytes / (tri_ms * 1e-3) / 1e9}


def moe_rows(name, D, E, K, I, tokens, ref, tri, bw, rate) -> list[dict]:
    w13 = torch.randn(E, 2 * I, D, dtype=DT, device="cuda") / D ** 0.5
    w2 = torch.randn(E, D, I, dtype=DT, device="cuda") / I ** 0.5
    rows = []
    for T in tokens:
        x = torch.randn(T, D, dtype=DT, device="cuda")
        logits = torch.randn(T, E, device="cuda")
        w, ids = ref.topk_route(logits, K, "softmax", True)
        y_ref, y_tri = ref.fused_moe(x, w13, w2, w, ids), tri.fused_moe(x, w13, w2, w, ids)
        err = ((y_tri.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
        assert err < 2e-2, f"fused_moe {name} T={T}: relative error {err}"
        active = ids.unique().numel()
        nbytes = 2 * (active * 3 * D * I + 2 * T * D + 2 * T * K * (I + D))
        rows.append(row("fused_moe", name, T, bench_ms(lambda: ref.fused_moe(x, w13, w2, w, ids)),
                        bench_ms(lambda: tri.fused_moe(x, w13, w2, w, ids)), nbytes, 6 * T * K * D * I, bw, rate))
        rows.append(row("topk_route", name, T, bench_ms(lambda: ref.topk_route(logits, K, "softmax", True)),
                        bench_ms(lambda: tri.topk_route(logits, K, "softmax", True)), 4 * T * E + 12 * T * K,
                        5 * T * E, bw, rate))
        res, wn = torch.randn_like(x), torch.randn(D, dtype=DT, device="cuda")
        rows.append(row("add_rms_norm", name, T, bench_ms(lambda: ref.fused_add_rms_norm(x, res, wn, 1e-6)),
                        bench_ms(lambda: tri.fused_add_rms_norm(x, res, wn, 1e-6)), 2 * 4 * T * D + 2 * D,
                        4 * T * D, bw, rate))
    return rows


def attention_rows(name, N, KV, H, tokens, context, ref, tri, bw, rate) -> list[dict]:
    rows = []
    pages_per_seq = -(-context // PAGE)
    for B in tokens:
        P = B * pages_per_seq
        k_cache = torch.randn(P, PAGE, KV, H, dtype=DT, device="cuda")
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(P, device="cuda", dtype=torch.int32).view(B, pages_per_seq)
        lens = torch.full((B,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(B, N, H, dtype=DT, device="cuda")
        scale = H ** -0.5
        o_ref = ref.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
        o_tri = tri.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
        err = (o_tri.float() - o_ref.float()).abs().max().item()
        assert err < 2e-2, f"paged_decode_attention {name} B={B}: max error {err}"
        nbytes = 2 * (2 * B * context * KV * H + 2 * B * N * H)
        rows.append(row("decode_attention", name, B,
                        bench_ms(lambda: ref.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)),
                        bench_ms(lambda: tri.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)),
                        nbytes, 4 * B * N * context * H, bw, rate))
        del k_cache, v_cache
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--context", type=int, default=2048, help="tokens per sequence for decode attention")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels_gpu.py needs a CUDA GPU (the Triton kernels are tested on the CPU by "
                 "tests/test_triton_*.py under TRITON_INTERPRET=1; timing them there means nothing)")
    torch.manual_seed(0)
    ref, tri = torch_ops(), triton_ops()
    bw, rate = hardware()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s (read+write), bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    rows = []
    for name, (D, E, K, I, N, KV, H) in MODELS.items():
        rows += moe_rows(name, D, E, K, I, args.tokens, ref, tri, bw, rate)
        rows += attention_rows(name, N, KV, H, args.tokens, args.context, ref, tri, bw, rate)
    rows.sort(key=lambda r: (r["op"], r["model"], r["tokens"]))
    print_table(rows, ["op", "model", "tokens", "torch_ms", "triton_ms", "speedup", "roofline_ms", "roof", "GB/s"])
    path = save("kernels_gpu", {"dtype": "bfloat16", "copy_GBps": bw / 1e9, "matmul_TFLOPs": rate / 1e12,
                                "context": args.context, "rows": rows}, device="cuda")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
