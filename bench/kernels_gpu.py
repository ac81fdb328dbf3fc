"""Triton kernels against the torch references and against the roofline, on a CUDA GPU.

    python bench/kernels_gpu.py [--tokens 1 2 4 ... 512] [--context 2048]

Ops: fused MoE, routing, fused add + RMSNorm, rotary, paged decode attention, at the layer shapes of
OLMoE-1B-7B and Qwen3-30B-A3B, and MLA latent decode attention at DeepSeek-V3's (128 heads, latent
512 + rope 64), bfloat16, for 1 to 512 tokens (decode attention: that many sequences of --context
tokens). The roofline of each case is max(bytes moved / copy bandwidth, FLOPs / matmul rate), both
measured at the start of the same run; "roof" is roofline time over measured time (1.0 = at the
hardware's limit). "err" is the Triton output's error against the reference: relative to the
reference's largest value for the MoE, RMSNorm and rotary; absolute for the attentions and the
routing weights (1.0 where routing chose other experts). Cases over TOL stay in the table and the
JSON, and the run exits non-zero after writing both. Writes bench/results/kernels_gpu.json with the
device named. Needs CUDA: there is no meaningful CPU run of this benchmark.
"""
import argparse
import sys
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from kernels.ops import torch_ops, triton_ops  # noqa: E402

# name: hidden D, experts E, top-k K, expert intermediate I, query heads N, kv heads KV, head dim H
MODELS = {"olmoe-1b-7b": (2048, 64, 8, 1024, 16, 16, 128), "qwen3-30b-a3b": (2048, 128, 8, 768, 32, 4, 128)}
# name: query heads N, latent C, rope dim R, softmax scale (qk head dim nope 128 + rope 64)
MLA_MODELS = {"deepseek-v3": (128, 512, 64, 192 ** -0.5)}
DEV = "cuda"  # module constants, so that the row functions can be tried elsewhere
DT = torch.bfloat16
PAGE = 16
TOL = 2e-2


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def hardware() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read plus write, bf16 matmul FLOP/s)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (bench_ms(lambda: dst.copy_(src)) * 1e-3)
    a = torch.randn(8192, 8192, dtype=DT, device=DEV)
    rate = 2 * 8192 ** 3 / (bench_ms(lambda: a @ a) * 1e-3)
    return bw, rate


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def abs_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


def row(op: str, model: str, T: int, ref_ms: float, tri_ms: float, nbytes: float, flops: float,
        bw: float, rate: float, err: float) -> dict:
    roof_ms = 1e3 * max(nbytes / bw, flops / rate)
    return {"op": op, "model": model, "tokens": T, "torch_ms": ref_ms, "triton_ms": tri_ms,
            "speedup": ref_ms / tri_ms, "roofline_ms": roof_ms, "roof": roof_ms / tri_ms,
            "GB/s": nbytes / (tri_ms * 1e-3) / 1e9, "err": err}


def moe_rows(name, D, E, K, I, tokens, ref, tri, bw, rate) -> Iterator[dict]:
    w13 = torch.randn(E, 2 * I, D, dtype=DT, device=DEV) / D ** 0.5
    w2 = torch.randn(E, D, I, dtype=DT, device=DEV) / I ** 0.5
    for T in tokens:
        x = torch.randn(T, D, dtype=DT, device=DEV)
        logits = torch.randn(T, E, device=DEV)
        w, ids = ref.topk_route(logits, K, "softmax", True)
        err = rel_err(tri.fused_moe(x, w13, w2, w, ids), ref.fused_moe(x, w13, w2, w, ids))
        active = ids.unique().numel()
        nbytes = 2 * (active * 3 * D * I + 2 * T * D + 2 * T * K * (I + D))
        yield row("fused_moe", name, T, bench_ms(lambda: ref.fused_moe(x, w13, w2, w, ids)),
                  bench_ms(lambda: tri.fused_moe(x, w13, w2, w, ids)), nbytes, 6 * T * K * D * I, bw, rate, err)
        w_tri, ids_tri = tri.topk_route(logits, K, "softmax", True)
        err = abs_err(w_tri, w) if torch.equal(ids_tri, ids) else 1.0  # another expert chosen
        yield row("topk_route", name, T, bench_ms(lambda: ref.topk_route(logits, K, "softmax", True)),
                  bench_ms(lambda: tri.topk_route(logits, K, "softmax", True)), 4 * T * E + 12 * T * K,
                  5 * T * E, bw, rate, err)
        res, wn = torch.randn_like(x), torch.randn(D, dtype=DT, device=DEV)
        got, want = tri.fused_add_rms_norm(x, res, wn, 1e-6), ref.fused_add_rms_norm(x, res, wn, 1e-6)
        err = max(rel_err(a, b) for a, b in zip(got, want))
        yield row("add_rms_norm", name, T, bench_ms(lambda: ref.fused_add_rms_norm(x, res, wn, 1e-6)),
                  bench_ms(lambda: tri.fused_add_rms_norm(x, res, wn, 1e-6)), 2 * 4 * T * D + 2 * D,
                  4 * T * D, bw, rate, err)


def rotary_row(name, N, KV, H, T, ref, tri, bw, rate) -> dict:
    """q and k rotated in place as strided views of one fused qkv projection, as the model has them."""
    qkv = torch.randn(T, (N + 2 * KV) * H, dtype=DT, device=DEV)
    q, k = qkv[:, :N * H].view(T, N, H), qkv[:, N * H:(N + KV) * H].view(T, KV, H)
    angle = torch.rand(T, H // 2, device=DEV) * 100
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(DT), torch.cat([angle.sin()] * 2, -1).to(DT)
    want = ref.apply_rotary_(q.clone(), k.clone(), cos, sin)
    got = tri.apply_rotary_(q.clone(), k.clone(), cos, sin)
    err = max(rel_err(a, b) for a, b in zip(got, want))
    nbytes = 2 * (2 * T * (N + KV) * H + 2 * T * H)
    return row("rotary", name, T, bench_ms(lambda: ref.apply_rotary_(q, k, cos, sin)),
               bench_ms(lambda: tri.apply_rotary_(q, k, cos, sin)), nbytes, 6 * T * (N + KV) * H, bw, rate, err)


def paged_table(B: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table (B, pages per sequence) of shuffled pages, seq_lens (B,) all `context`)."""
    pages_per_seq = -(-context // PAGE)
    table = torch.randperm(B * pages_per_seq, device=DEV, dtype=torch.int32).view(B, pages_per_seq)
    return table, torch.full((B,), context, dtype=torch.int32, device=DEV)


def attention_rows(name, N, KV, H, tokens, context, ref, tri, bw, rate) -> Iterator[dict]:
    for B in tokens:
        yield rotary_row(name, N, KV, H, B, ref, tri, bw, rate)
        table, lens = paged_table(B, context)
        k_cache = torch.randn(table.numel(), PAGE, KV, H, dtype=DT, device=DEV)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(B, N, H, dtype=DT, device=DEV)
        scale = H ** -0.5
        err = abs_err(tri.paged_decode_attention(q, k_cache, v_cache, table, lens, scale),
                      ref.paged_decode_attention(q, k_cache, v_cache, table, lens, scale))
        nbytes = 2 * (2 * B * context * KV * H + 2 * B * N * H)
        yield row("decode_attention", name, B,
                  bench_ms(lambda: ref.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)),
                  bench_ms(lambda: tri.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)),
                  nbytes, 4 * B * N * context * H, bw, rate, err)
        del k_cache, v_cache


def mla_rows(name, N, C, R, scale, tokens, context, ref, tri, bw, rate) -> Iterator[dict]:
    """Latent decode attention: every head reads the same (C + R)-wide rows; values are their first C."""
    W = C + R
    for B in tokens:
        table, lens = paged_table(B, context)
        cache = torch.randn(table.numel(), PAGE, W, dtype=DT, device=DEV)
        q = torch.randn(B, N, W, dtype=DT, device=DEV)
        err = abs_err(tri.paged_latent_decode_attention(q, cache, table, lens, scale, C),
                      ref.paged_latent_decode_attention(q, cache, table, lens, scale, C))
        nbytes = 2 * (B * context * W + B * N * (W + C))
        yield row("mla_decode_attention", name, B,
                  bench_ms(lambda: ref.paged_latent_decode_attention(q, cache, table, lens, scale, C)),
                  bench_ms(lambda: tri.paged_latent_decode_attention(q, cache, table, lens, scale, C)),
                  nbytes, 2 * B * N * context * (W + C), bw, rate, err)
        del cache


def all_rows(tokens, context, ref, tri, bw, rate) -> Iterator[dict]:
    for name, (D, E, K, I, N, KV, H) in MODELS.items():
        yield from moe_rows(name, D, E, K, I, tokens, ref, tri, bw, rate)
        yield from attention_rows(name, N, KV, H, tokens, context, ref, tri, bw, rate)
    for name, (N, C, R, scale) in MLA_MODELS.items():
        yield from mla_rows(name, N, C, R, scale, tokens, context, ref, tri, bw, rate)


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
    rows, interrupted = [], False
    try:  # rows are kept as they come, so that a run stopped by SIGINT (a time limit) still reports them
        for r in all_rows(args.tokens, args.context, ref, tri, bw, rate):
            print(f"{r['op']} {r['model']} {r['tokens']}: torch {r['torch_ms']:.3g} ms, triton {r['triton_ms']:.3g} ms")
            rows.append(r)
    except KeyboardInterrupt:
        interrupted = True
        print(f"interrupted after {len(rows)} rows")
    rows.sort(key=lambda r: (r["op"], r["model"], r["tokens"]))
    print_table(rows, ["op", "model", "tokens", "torch_ms", "triton_ms", "speedup", "roofline_ms", "roof", "GB/s",
                       "err"])
    bad = [f"{r['op']} {r['model']} T={r['tokens']}: err {r['err']:.3g}" for r in rows if not r["err"] <= TOL]
    path = save("kernels_gpu", {"dtype": "bfloat16", "copy_GBps": bw / 1e9, "matmul_TFLOPs": rate / 1e12,
                                "context": args.context, "interrupted": interrupted, "tolerance": TOL,
                                "over_tolerance": bad, "rows": rows}, device="cuda")
    print(f"wrote {path}")
    if bad:
        sys.exit(f"Triton output off the reference by more than {TOL}:\n  " + "\n  ".join(bad))
    if interrupted:
        sys.exit("interrupted: the table and the JSON hold the rows measured until then")


if __name__ == "__main__":
    main()
