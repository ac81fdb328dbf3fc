"""Triton decode attention of DeepSeek-V4's attention layers, same contract as
kernels.compressed_attention.compressed_decode_attention.

Legend: B sequences, N query heads, H head dim (keys = values), S ring slots, W window length,
P pages, E entries per page, M max pages per sequence, K chosen-entry columns per sequence.

One program per (sequence, block of BLOCK_N heads) runs one online softmax over the sequence's
window, read from its ring slot in tiles of BLOCK_T positions (only positions >= 0 are visited), then
over its chosen entries in tiles of BLOCK_T columns, each found through the page table by index
(an unused column, -1, reads nothing); the sink logit joins the denominator at the end. Every row is
both the key and the value, so a tile is read once for the scores and the weighted sum, for all
heads at once (one shared kv head). Heads are padded to BLOCK_N >= 16 and tiles to BLOCK_T >= 16
(tl.dot's minimum). The window holds the query's own position, so the running max is finite after
the first tile and an all-unused entry tile adds nothing.
"""
import math

import torch
import triton
import triton.language as tl

from kernels.compressed_attention import _check

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK_N = 16
LOG2E: tl.constexpr = 1.4426950408889634


@triton.jit
def _compressed_decode_kernel(q_ptr, ring_ptr, slot_ptr, lens_ptr, pages_ptr, table_ptr, idx_ptr, sinks_ptr, o_ptr,
                              sq_b, sq_n, sq_h, sr_s, sr_w, sr_h, sp_p, sp_e, sp_h, st_b, st_m, si_b, si_k,
                              so_b, so_n, so_h, N, K, qk_scale,
                              W: tl.constexpr, H: tl.constexpr, RATE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                              HAS_SINKS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # int64: b * stride may pass 2**31 on big batches
    heads = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_t = tl.arange(0, BLOCK_T)
    n_ok = heads < N
    h_ok = offs_h < H
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_n + offs_h[None, :] * sq_h,
                mask=n_ok[:, None] & h_ok[None, :], other=0.0)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    ring = ring_ptr + tl.load(slot_ptr + b).to(tl.int64) * sr_s
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)  # running max of the log2-domain scores
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)

    # The window: positions max(0, p - W + 1) .. p (p = seq_len - 1), position pos at ring row pos % W.
    for t0 in range(tl.maximum(seq_len - W, 0), seq_len, BLOCK_T):
        pos = t0 + offs_t
        ok = pos < seq_len
        kv = tl.load(ring + (pos % W)[:, None] * sr_w + offs_h[None, :] * sr_h,
                     mask=ok[:, None] & h_ok[None, :], other=0.0)
        # "ieee" keeps float32 inputs out of TF32 (it is ignored for 16-bit inputs).
        s = tl.dot(q, tl.trans(kv), input_precision="ieee") * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the first tile holds position p
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # probabilities go to the cache's dtype before the product, as the torch reference does
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision="ieee")
        m_i = m_new

    # The chosen entries: entry w at page table[b, w * RATE // BLOCK_SIZE], row (w * RATE % BLOCK_SIZE) // RATE.
    for k0 in range(0, K, BLOCK_T):
        cols = k0 + offs_t
        w = tl.load(idx_ptr + b * si_b + cols * si_k, mask=cols < K, other=-1).to(tl.int64)
        ok = w >= 0
        tok = tl.where(ok, w, 0) * RATE
        page = tl.load(table_ptr + b * st_b + (tok // BLOCK_SIZE) * st_m, mask=ok, other=0).to(tl.int64)
        row = (tok % BLOCK_SIZE) // RATE
        kv = tl.load(pages_ptr + page[:, None] * sp_p + row[:, None] * sp_e + offs_h[None, :] * sp_h,
                     mask=ok[:, None] & h_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(kv), input_precision="ieee") * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # m_i is finite: an all-unused tile leaves it as it is
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision="ieee")
        m_i = m_new

    if HAS_SINKS:  # the sink's exp joins the denominator only (log2 domain)
        sink = tl.load(sinks_ptr + heads, mask=n_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = l_i + tl.exp2(sink - m_i)
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * so_b + heads[:, None] * so_n + offs_h[None, :] * so_h, out.to(o_ptr.dtype.element_ty),
             mask=n_ok[:, None] & h_ok[None, :])


def compressed_decode_attention(q_BNH: torch.Tensor, ring_SWH: torch.Tensor, slot_B: torch.Tensor,
                                lens_B: torch.Tensor, pages_PEH: torch.Tensor, table_BM: torch.Tensor,
                                idx_BK: torch.Tensor, rate: int, block_size: int, sinks_N: torch.Tensor | None,
                                scale: float) -> torch.Tensor:
    """Decode attention of one query per sequence over its window and its chosen compressed entries;
    returns o_BNH in q's dtype.

    Contract as kernels.compressed_attention.compressed_decode_attention, with q, ring and pages of
    one dtype of fp16/bf16/fp32 (any strides) on one device; lens_B in [1, ...] is not checked (that
    would sync with the GPU); ring rows outside a window, pages and table entries no used column
    points at are never read.
    """
    _check(q_BNH, ring_SWH, slot_B, lens_B, pages_PEH, table_BM, idx_BK, rate, block_size, sinks_N)
    if q_BNH.dtype not in _DTYPES or ring_SWH.dtype != q_BNH.dtype:
        raise ValueError(f"q, ring and pages must share one dtype of {_DTYPES}; got {q_BNH.dtype}, {ring_SWH.dtype}")
    tensors = (q_BNH, ring_SWH, slot_B, lens_B, pages_PEH, table_BM, idx_BK) + (() if sinks_N is None else (sinks_N,))
    if len({t.device for t in tensors}) != 1:
        raise ValueError("all tensors must be on one device")
    (B, N, H), W, K = q_BNH.shape, ring_SWH.shape[1], idx_BK.shape[1]
    o_BNH = torch.empty((B, N, H), dtype=q_BNH.dtype, device=q_BNH.device)
    if B == 0:
        return o_BNH
    sinks = q_BNH if sinks_N is None else sinks_N.contiguous()  # (a placeholder pointer without sinks)
    if table_BM.numel() == 0 or idx_BK.numel() == 0:  # no entry is read: no empty tensor goes to the kernel
        K, table_BM, idx_BK = 0, slot_B[:, None], slot_B[:, None]
    BLOCK_N = max(16, min(MAX_BLOCK_N, triton.next_power_of_2(N)))
    BLOCK_H = max(16, triton.next_power_of_2(H))
    BLOCK_T = 16 if BLOCK_H >= 512 else 32
    _compressed_decode_kernel[(B, triton.cdiv(N, BLOCK_N))](
        q_BNH, ring_SWH, slot_B, lens_B, pages_PEH, table_BM, idx_BK, sinks, o_BNH,
        *q_BNH.stride(), *ring_SWH.stride(), *pages_PEH.stride(), *table_BM.stride(), *idx_BK.stride(),
        *o_BNH.stride(), N, K, scale * math.log2(math.e),
        W=W, H=H, RATE=rate, BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, BLOCK_T=BLOCK_T,
        HAS_SINKS=sinks_N is not None)
    return o_BNH
