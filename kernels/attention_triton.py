"""Triton decode attention over a paged KV cache (split-KV "flash decoding"), same contract as
kernels.attention.paged_decode_attention.

Legend: B sequences, N query heads, K kv heads, G = N / K query heads per kv head, H query/key head
dim, V value head dim (V <= H: MiMo-V2-Flash's values are narrower), P pages in the cache, S token
slots per page, M max pages per sequence (block table width), C splits of each sequence's keys
(num_splits).

One program per (sequence, kv head, split) handles all G query heads of its kv head, so each key and
value is read once per group; the G rows are padded to BLOCK_G >= 16 because tl.dot needs every
block dim >= 16. Keys are gathered token by token through the block table (page j // S, slot j % S),
so a tile of BLOCK_S tokens may span several small pages and S need not be a power of two.
Attention sinks (gpt-oss, one logit per query head) join the softmax's denominator only: with one
split as exp2(sink - m) next to the running sum, with several in the combine kernel next to the splits'
weights, so no split needs to know about them.
"""
import math

import torch
import triton
import triton.language as tl

MAX_BLOCK_S = 64  # keys per tile; tl.dot needs >= 16
TILE_BYTES = 16384  # cap on one K or V tile, so pipelined copies of both fit in shared memory at H = 256
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256  # below this the extra combine pass costs more than the parallelism gains
NO_WINDOW = 2**31 - 1  # "no sliding window" is a window longer than any int32 context
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, start_ptr, out_ptr, lse_ptr, sinks_ptr,
                  sq_b, sq_n, sq_h, sk_p, sk_s, sk_k, sk_h, sv_p, sv_s, sv_k, sv_h, st_b, st_m,
                  so_b, so_n, so_c, so_h, qk_scale, window,
                  G: tl.constexpr, H: tl.constexpr, V: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  HAS_SINKS: tl.constexpr, HAS_START: tl.constexpr):
    """Attention of G query heads over one split of one sequence's visible keys (online softmax)."""
    b = tl.program_id(0).to(tl.int64)  # int64: b * stride may pass 2**31 on big batches
    kv = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_V)
    offs_s = tl.arange(0, BLOCK_S)
    g_ok = offs_g < G
    h_ok = offs_h < H
    v_ok = offs_v < V
    heads = kv * G + offs_g

    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    # The query sits at p = seq_len - 1; keys j > p - window are visible, i.e. j >= seq_len - window.
    lo = tl.maximum(seq_len - window, 0)
    if HAS_START:  # and keys before the sequence's given first visible one are hidden
        lo = tl.maximum(lo, tl.load(start_ptr + b).to(tl.int32))
    # Each sequence splits its own visible range evenly (whole tiles), so short and long sequences
    # in one batch are both balanced; splits past the end are empty and write lse = -inf.
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_S) * BLOCK_S
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_n + offs_h[None, :] * sq_h,
                mask=g_ok[:, None] & h_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the log2-domain scores
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_G, BLOCK_V], tl.float32)
    for t0 in range(start, end, BLOCK_S):  # only tiles inside [lo, seq_len) are visited
        tok = t0 + offs_s
        tok_ok = tok < end
        # Masked lanes never read the table past the sequence's last page (it may hold -1).
        page = tl.load(table_ptr + b * st_b + (tok // PAGE) * st_m, mask=tok_ok, other=0).to(tl.int64)
        slot = tok % PAGE
        k = tl.load(k_ptr + page[:, None] * sk_p + slot[:, None] * sk_s + kv * sk_k + offs_h[None, :] * sk_h,
                    mask=tok_ok[:, None] & h_ok[None, :], other=0.0)
        v = tl.load(v_ptr + page[:, None] * sv_p + slot[:, None] * sv_s + kv * sv_k + offs_v[None, :] * sv_h,
                    mask=tok_ok[:, None] & v_ok[None, :], other=0.0)
        # "ieee" keeps float32 inputs out of TF32 (it is ignored for 16-bit inputs).
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every visited tile has a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # Probabilities go to V's dtype before the product, as the torch reference does.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # Normalise by this split's own sum; an empty split (l_i == 0) writes 0 and weight lse = -inf.
    if HAS_SINKS and NUM_SPLITS == 1:  # the sink's exp joins the only split's sum (log2 domain)
        sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = l_i + tl.exp2(sink - m_i)
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(out_ptr + b * so_b + heads[:, None] * so_n + split * so_c + offs_v[None, :] * so_h,
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & v_ok[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        n_heads = tl.num_programs(1) * G
        tl.store(lse_ptr + (b * n_heads + heads) * NUM_SPLITS + split, lse, mask=g_ok)


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, o_ptr, sinks_ptr, so_b, so_n, so_v,
                    V: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_C: tl.constexpr,
                    BLOCK_V: tl.constexpr, HAS_SINKS: tl.constexpr):
    """o[b, n] = sum_c w_c * part[b, n, c] with w_c = softmax_c(lse[b, n, c]) (log2 domain); a sink
    adds exp2(sink) to the softmax's denominator."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1)
    row = b * tl.num_programs(1) + n
    offs_c = tl.arange(0, BLOCK_C)
    offs_v = tl.arange(0, BLOCK_V)
    c_ok = offs_c < NUM_SPLITS
    lse = tl.load(lse_ptr + row * NUM_SPLITS + offs_c, mask=c_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)  # at least one split is non-empty, so the max is finite
    w = tl.exp2(lse - top)
    part = tl.load(part_ptr + (row * NUM_SPLITS + offs_c[:, None]) * V + offs_v[None, :],
                   mask=c_ok[:, None] & (offs_v[None, :] < V), other=0.0)
    denominator = tl.sum(w, axis=0)
    if HAS_SINKS:
        denominator += tl.exp2(tl.load(sinks_ptr + n).to(tl.float32) * 1.4426950408889634 - top)
    out = tl.sum(w[:, None] * part, axis=0) / denominator
    tl.store(o_ptr + b * so_b + n * so_n + offs_v * so_v, out.to(o_ptr.dtype.element_ty), mask=offs_v < V)


def num_splits_heuristic(batch: int, kv_heads: int, longest: int, device: torch.device) -> int:
    """Splits per sequence so that batch * kv_heads * splits roughly fills the GPU twice over.

    longest: an upper bound on the keys any sequence attends to. Few (sequence, kv head) programs
    and long contexts get up to MAX_SPLITS splits; large batches or short contexts get 1.
    """
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    by_occupancy = triton.cdiv(2 * sms, max(batch * kv_heads, 1))
    by_length = triton.cdiv(max(longest, 1), MIN_KEYS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
              sliding_window: int | None, num_splits: int | None, start: torch.Tensor | None) -> None:
    """Raise ValueError for anything the kernels cannot handle (see paged_decode_attention)."""
    if q.dim() != 3 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or v.shape[3] > k.shape[3]:
        raise ValueError(f"expected q (B, N, H), k cache (P, S, K, H) and v cache (P, S, K, V), V <= H; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype of {_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    (B, N, H), K = q.shape, k.shape[2]
    if k.shape[3] != H or K < 1 or N % K:
        raise ValueError(f"q (B, N, H) = {tuple(q.shape)} does not fit caches (P, S, K, H) = {tuple(k.shape)}: "
                         "need the same H and N % K == 0")
    if table.dim() != 2 or table.shape[0] != B or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32/int64 of shape (B={B}, M); got {table.dtype} {tuple(table.shape)}")
    if lens.shape != (B,) or lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32/int64 of shape ({B},); got {lens.dtype} {tuple(lens.shape)}")
    if start is not None and (start.shape != (B,) or start.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"start must be int32/int64 of shape ({B},); got {start.dtype} {tuple(start.shape)}")
    if len({t.device for t in (q, k, v, table, lens) + (() if start is None else (start,))}) != 1:
        raise ValueError("q, caches, block_table, seq_lens and start must be on one device")
    if sliding_window is not None and (isinstance(sliding_window, bool) or sliding_window < 0):
        raise ValueError(f"sliding_window must be None or an int >= 0 (0 = none); got {sliding_window!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1; got {num_splits!r}")


def paged_decode_attention(
    q_BNH: torch.Tensor,
    k_cache_PSKH: torch.Tensor,
    v_cache_PSKH: torch.Tensor,
    block_table_BM: torch.Tensor,
    seq_lens_B: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks_N: torch.Tensor | None = None,
    start_B: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over a paged KV cache; returns o_BNV in q's dtype.

    Contract as kernels.attention.paged_decode_attention: q_BNH (any strides) is the query at position
    seq_lens_B[b] - 1; k_cache_PSKH (P, S, K, H) and v_cache_PSKH (P, S, K, V), V <= H, fp16/bf16/fp32
    like q, any strides (e.g. a slice of a bigger cache); block_table_BM int32/int64, entries past a
    sequence's last page are never read; seq_lens_B int32/int64, each in [1, M * S] (not checked: that
    would sync with the GPU). sliding_window: keys j > p - w are visible (None or 0: all keys j <= p).
    start_B: optional int32/int64 (B,) first visible key of each sequence (keys j >= start_B[b], below
    seq_lens_B[b]), combined with the window; splits divide what remains visible.
    sinks_N: optional (N,) per-head sink logits, any float dtype (an extra softmax column, dropped).
    num_splits: split each sequence's visible keys into this many parts whose partial results are
    combined by a second kernel (flash decoding); None picks num_splits_heuristic, bounding the
    longest context by M * S (and the window) rather than reading seq_lens back from the GPU.
    """
    _validate(q_BNH, k_cache_PSKH, v_cache_PSKH, block_table_BM, seq_lens_B, sliding_window, num_splits, start_B)
    (B, N, H), (S, K), V = q_BNH.shape, k_cache_PSKH.shape[1:3], v_cache_PSKH.shape[3]
    if sinks_N is not None and (tuple(sinks_N.shape) != (N,) or sinks_N.device != q_BNH.device):
        raise ValueError(f"sinks must be ({N},) on {q_BNH.device}; got {tuple(sinks_N.shape)} on {sinks_N.device}")
    sinks = q_BNH if sinks_N is None else sinks_N.contiguous()  # (a placeholder pointer without sinks)
    o_BNV = torch.empty((B, N, V), dtype=q_BNH.dtype, device=q_BNH.device)
    if B == 0:
        return o_BNV
    window = sliding_window or NO_WINDOW
    if num_splits is None:
        longest = min(block_table_BM.shape[1] * S, window)
        num_splits = num_splits_heuristic(B, K, longest, q_BNH.device)
    G = N // K
    BLOCK_G, BLOCK_H, BLOCK_V = (max(16, triton.next_power_of_2(n)) for n in (G, H, V))
    BLOCK_S = min(MAX_BLOCK_S, max(16, TILE_BYTES // (BLOCK_H * q_BNH.element_size())))
    if num_splits == 1:  # the only split is already normalised: write o directly
        out, lse, out_strides = o_BNV, o_BNV, (*o_BNV.stride()[:2], 0, o_BNV.stride(2))
    else:
        out = torch.empty((B, N, num_splits, V), dtype=torch.float32, device=q_BNH.device)
        lse = torch.empty((B, N, num_splits), dtype=torch.float32, device=q_BNH.device)
        out_strides = out.stride()
    _split_kernel[(B, K, num_splits)](
        q_BNH, k_cache_PSKH, v_cache_PSKH, block_table_BM, seq_lens_B, seq_lens_B if start_B is None else start_B,
        out, lse, sinks,
        *q_BNH.stride(), *k_cache_PSKH.stride(), *v_cache_PSKH.stride(), *block_table_BM.stride(),
        *out_strides, scale * math.log2(math.e), window,  # log2(e) folded in so the kernel uses exp2
        G=G, H=H, V=V, PAGE=S, BLOCK_G=BLOCK_G, BLOCK_H=BLOCK_H, BLOCK_V=BLOCK_V, BLOCK_S=BLOCK_S,
        NUM_SPLITS=num_splits, HAS_SINKS=sinks_N is not None, HAS_START=start_B is not None)
    if num_splits > 1:
        _combine_kernel[(B, N)](out, lse, o_BNV, sinks, *o_BNV.stride(), V=V, NUM_SPLITS=num_splits,
                                BLOCK_C=triton.next_power_of_2(num_splits), BLOCK_V=BLOCK_V,
                                HAS_SINKS=sinks_N is not None)
    return o_BNV
