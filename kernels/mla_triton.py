"""Triton decode attention of MLA in the latent space over a paged cache, same contract as
kernels.attention.paged_latent_decode_attention.

Legend: B sequences, N query heads, W cached width (latent C + rope R), P pages, S token slots per
page, M max pages per sequence.

One program per (sequence, block of BLOCK_N heads) walks the sequence's tokens in tiles of BLOCK_S
rows gathered through the block table, with an online softmax. Each cached row is both the key (all
W values) and the value (its first C values), so a tile is read once for the scores and the
weighted sum: every head shares the one latent "kv head", which is what makes MLA decode cheap on
memory. Rows are padded to BLOCK_N >= 16 heads and BLOCK_S >= 16 tokens (tl.dot's minimum).
"""
import math

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK_N = 16


@triton.jit
def _latent_decode_kernel(q_ptr, kv_ptr, table_ptr, lens_ptr, o_ptr,
                          sq_b, sq_n, sq_w, skv_p, skv_s, skv_w, st_b, st_m, so_b, so_n, so_c,
                          N, W, C, qk_scale, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # int64: b * stride may pass 2**31 on big batches
    heads = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    offs_s = tl.arange(0, BLOCK_S)
    n_ok = heads < N
    w_ok = offs_w < W
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_n + offs_w[None, :] * sq_w,
                mask=n_ok[:, None] & w_ok[None, :], other=0.0)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)  # running max of the log2-domain scores
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for t0 in range(0, seq_len, BLOCK_S):
        tok = t0 + offs_s
        tok_ok = tok < seq_len
        page = tl.load(table_ptr + b * st_b + (tok // PAGE) * st_m, mask=tok_ok, other=0).to(tl.int64)
        kv = tl.load(kv_ptr + page[:, None] * skv_p + (tok % PAGE)[:, None] * skv_s + offs_w[None, :] * skv_w,
                     mask=tok_ok[:, None] & w_ok[None, :], other=0.0)
        # "ieee" keeps float32 inputs out of TF32 (it is ignored for 16-bit inputs).
        s = tl.dot(q, tl.trans(kv), input_precision="ieee") * qk_scale
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.where(offs_w[None, :] < C, kv, 0.0).to(kv.dtype)  # the value is the latent part of the row
        # probabilities go to the cache's dtype before the product, as the torch reference does
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * so_b + heads[:, None] * so_n + offs_w[None, :] * so_c, out.to(o_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (offs_w[None, :] < C))


def paged_latent_decode_attention(q_BNW: torch.Tensor, cache_PSW: torch.Tensor, block_table_BM: torch.Tensor,
                                  seq_lens_B: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    """MLA decode over a paged latent cache; returns o_BNC (C = latent_dim) in q's dtype.

    Contract as kernels.attention.paged_latent_decode_attention: q_BNW (any strides) is the absorbed
    query at position seq_lens_B[b] - 1; cache_PSW (P, S, W) fp16/bf16/fp32 like q; block_table_BM
    int32/int64 (entries past a sequence's last page are never read); seq_lens_B int32/int64 >= 1.
    """
    if q_BNW.dim() != 3 or cache_PSW.dim() != 3 or q_BNW.shape[2] != cache_PSW.shape[2]:
        raise ValueError(f"expected q (B, N, W) and a cache (P, S, W) of the same W; got q {tuple(q_BNW.shape)}, "
                         f"cache {tuple(cache_PSW.shape)}")
    if q_BNW.dtype not in _DTYPES or cache_PSW.dtype != q_BNW.dtype:
        raise ValueError(f"q and the cache must share one dtype of {_DTYPES}; got {q_BNW.dtype}, {cache_PSW.dtype}")
    (B, N, W), S = q_BNW.shape, cache_PSW.shape[1]
    if not 0 < latent_dim <= W:
        raise ValueError(f"latent_dim must be in [1, W={W}], got {latent_dim}")
    if block_table_BM.dim() != 2 or block_table_BM.shape[0] != B or seq_lens_B.shape != (B,):
        raise ValueError(f"block_table must be (B={B}, M) and seq_lens ({B},); got {tuple(block_table_BM.shape)}, "
                         f"{tuple(seq_lens_B.shape)}")
    o_BNC = torch.empty((B, N, latent_dim), dtype=q_BNW.dtype, device=q_BNW.device)
    if B == 0:
        return o_BNC
    BLOCK_N = max(16, min(MAX_BLOCK_N, triton.next_power_of_2(N)))
    BLOCK_W = max(16, triton.next_power_of_2(W))
    BLOCK_S = 16 if BLOCK_W >= 512 else 32
    _latent_decode_kernel[(B, triton.cdiv(N, BLOCK_N))](
        q_BNW, cache_PSW, block_table_BM, seq_lens_B, o_BNC, *q_BNW.stride(), *cache_PSW.stride(),
        *block_table_BM.stride(), *o_BNC.stride(), N, W, latent_dim, scale * math.log2(math.e),
        PAGE=S, BLOCK_N=BLOCK_N, BLOCK_W=BLOCK_W, BLOCK_S=BLOCK_S)
    return o_BNC
