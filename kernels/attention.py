"""Causal attention of a flat batch of query tokens against per-sequence KV caches.

Legend: T query tokens (all sequences, flattened), B sequences, Q longest query chunk of a sequence,
S cached keys per sequence (the longest context in the batch), N query heads, K key/value heads
(N % K == 0, grouped-query attention), H head dim, G = N / K query heads per kv head.

Attention sinks (gpt-oss): sinks_N holds one learned logit per query head, appended as an extra
column to that head's scaled scores before the softmax and dropped after it, so a head may put
weight "nowhere" (the outputs are scaled down by the sink's share).

CPU decode path (paged_decode_attention, paged_latent_decode_attention, and cached_attention's
one-token case; paged_decode_attention runs the native kernel instead, pages read in place, where
it takes the batch and kernels/choice.py measured it faster at the batch size): the visible pages
are gathered into one (B, S', K, H) tensor in the compute dtype, and torch's fused flash-attention
CPU kernel runs with each kv head's G query heads as its G "query rows", so every key is read once
per group, and the kernel splits (sequence, kv head) pairs across torch's intra-op threads. A
key-padding bias masks each sequence's tail (and what lies outside its sliding window or before its
given first visible key: Llama 4's chunks); sinks rescale the output with the kernel's log-sum-exp
(o * sigmoid(lse - sink)), which is exactly the extra softmax column. The kernel wants one head size:
values narrower than keys (MiMo-V2-Flash) are gathered zero-padded and the zero columns dropped. The
compute dtype is float32 for bf16/fp16 where oneDNN has no fast path for them (AVX2-only CPUs
emulate reduced-precision GEMMs about 10x slower than float32); the softmax is float32 in every case.
The *_reference functions (two batched matmuls over every page, any device) are the oracles and the
baselines of bench/kernels_cpu.py.
"""
import torch
import torch.nn.functional as F

from kernels import native

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CHUNK_BYTES = 256 << 20  # cap on the gathered K plus V of one flash call; bigger batches go in chunks


def _visible(qpos: torch.Tensor, S: int, sliding_window: int | None) -> torch.Tensor:
    """mask[..., j]: key j is visible from a query at position qpos (causal, optional window)."""
    key_pos = torch.arange(S, device=qpos.device)
    mask = key_pos <= qpos[..., None]
    if sliding_window:
        mask &= key_pos > (qpos[..., None] - sliding_window)
    return mask


def _needs_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> bool:
    """Whether cached_attention must take the reference: not on the CPU, values narrower than keys
    (the flash kernel wants equal head sizes), or autograd recording (training)."""
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    return q.device.type != "cpu" or v.shape[-1] != k.shape[-1] or grads


def cached_attention(
    q_TNH: torch.Tensor,
    k_BKSH: torch.Tensor,
    v_BKSH: torch.Tensor,
    seq_idx_T: torch.Tensor,
    tok_idx_T: torch.Tensor,
    positions_T: torch.Tensor,
    max_q_len: int,
    scale: float,
    sliding_window: int | None = None,
    sinks_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for prefill, decode, or any mix of the two in one call.

    Query token t belongs to sequence seq_idx_T[t], is the tok_idx_T[t]-th query of that sequence in
    this call, and sits at absolute position positions_T[t]. Key j of sequence b (the cache row
    k_BKSH[b, :, j]) is visible to a query at position p when j <= p and, with a sliding window w,
    j > p - w (transformers' convention). The caches must already hold this call's keys.
    sinks_N: optional per-head sink logits (see the module docstring). Returns o_TNH in q's dtype.
    On the CPU both cases run torch's flash kernel (module docstring); elsewhere, for values narrower
    than keys, and where autograd records (training: the kernel's log-sum-exp, which the sinks use,
    carries no gradient), cached_attention_reference.
    """
    if _needs_reference(q_TNH, k_BKSH, v_BKSH, sinks_N):
        return cached_attention_reference(q_TNH, k_BKSH, v_BKSH, seq_idx_T, tok_idx_T, positions_T, max_q_len, scale,
                                          sliding_window, sinks_N)
    if max_q_len == 1:
        return _decode_attention(q_TNH, k_BKSH, v_BKSH, seq_idx_T, positions_T, scale, sliding_window, sinks_N)
    B, K, S, H = k_BKSH.shape
    N = q_TNH.shape[1]
    dt = q_TNH.dtype
    q_BQNH = q_TNH.new_zeros(B, max_q_len, N, H)
    q_BQNH[seq_idx_T, tok_idx_T] = q_TNH
    if B == 1 and not sliding_window and int(positions_T[0]) == 0:  # one prompt from its start: plain causal
        bias, causal = None, True
    else:  # padding rows see key 0 only, so no row of the softmax is empty (no NaN); they are dropped below
        qpos_BQ = torch.zeros(B, max_q_len, dtype=torch.long, device=q_TNH.device)
        qpos_BQ[seq_idx_T, tok_idx_T] = positions_T
        hidden_BQS = ~_visible(qpos_BQ, S, sliding_window)
        bias = torch.zeros(B, 1, max_q_len, S, dtype=dt).masked_fill_(hidden_BQS[:, None], float("-inf"))
        causal = False
    k_BKSH, v_BKSH = (t.to(dt) if t.stride(-1) == 1 else t.to(dt).contiguous() for t in (k_BKSH, v_BKSH))
    o_BNQH, lse_BNQ = _flash_cpu(q_BQNH.transpose(1, 2), k_BKSH, v_BKSH, is_causal=causal, attn_mask=bias,
                                 scale=scale)
    if sinks_N is not None:
        o_BNQH = o_BNQH * torch.sigmoid(lse_BNQ - sinks_N.float()[:, None])[..., None].to(dt)
    return o_BNQH.transpose(1, 2)[seq_idx_T, tok_idx_T]


def cached_attention_reference(q_TNH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                               seq_idx_T: torch.Tensor, tok_idx_T: torch.Tensor, positions_T: torch.Tensor,
                               max_q_len: int, scale: float, sliding_window: int | None = None,
                               sinks_N: torch.Tensor | None = None) -> torch.Tensor:
    """cached_attention written plainly (any device): queries padded per sequence, a boolean mask,
    scaled_dot_product_attention (or the matmul formulation with sinks), in the inputs' dtype."""
    B, S = k_BKSH.shape[0], k_BKSH.shape[2]
    N, H = q_TNH.shape[1:]
    if max_q_len == 1:
        return _decode_attention_reference(q_TNH, k_BKSH, v_BKSH, seq_idx_T, positions_T, scale, sliding_window,
                                           sinks_N)
    q_BQNH = q_TNH.new_zeros(B, max_q_len, N, H)
    q_BQNH[seq_idx_T, tok_idx_T] = q_TNH
    # Padding rows see key 0 only, so no row of the softmax is empty (no NaN); they are dropped below.
    qpos_BQ = torch.zeros(B, max_q_len, dtype=torch.long, device=q_TNH.device)
    qpos_BQ[seq_idx_T, tok_idx_T] = positions_T
    mask_BQS = _visible(qpos_BQ, S, sliding_window)
    if sinks_N is not None:
        return _sink_attention(q_BQNH, k_BKSH, v_BKSH, mask_BQS, scale, sinks_N)[seq_idx_T, tok_idx_T]
    o_BNQH = F.scaled_dot_product_attention(
        q_BQNH.transpose(1, 2), k_BKSH, v_BKSH, attn_mask=mask_BQS[:, None], scale=scale,
        enable_gqa=N != k_BKSH.shape[1],
    )
    return o_BNQH.transpose(1, 2)[seq_idx_T, tok_idx_T]


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 scores (masked entries -inf); with sinks (broadcastable to
    scores[..., :1]), each row gets the sink as an extra logit, dropped after the softmax."""
    if sinks is None:
        return scores.softmax(-1)
    combined = torch.cat((scores, sinks.float().expand(*scores.shape[:-1], 1)), dim=-1)
    return combined.softmax(-1)[..., :-1]


def _sink_attention(q_BQNH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor, mask_BQS: torch.Tensor,
                    scale: float, sinks_N: torch.Tensor) -> torch.Tensor:
    """Prefill attention with sinks, written out (scaled_dot_product_attention has no sink column):
    scores (B, K, G, Q, S) in float32, masked, softmaxed with the sinks, cast back before V.
    Returns o_BQNH."""
    B, Q, N, H = q_BQNH.shape
    K = k_BKSH.shape[1]
    q_BKGQH = q_BQNH.permute(0, 2, 1, 3).reshape(B, K, N // K, Q, H)
    scores = torch.matmul(q_BKGQH, k_BKSH[:, :, None].transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask_BQS[:, None, None], float("-inf"))
    probs = _softmax_with_sinks(scores, sinks_N.view(1, K, N // K, 1, 1))
    o_BKGQV = torch.matmul(probs.to(v_BKSH.dtype), v_BKSH[:, :, None])
    return o_BKGQV.reshape(B, N, Q, -1).transpose(1, 2)


def _decode_attention(q_TNH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor, seq_idx_T: torch.Tensor,
                      positions_T: torch.Tensor, scale: float, sliding_window: int | None,
                      sinks_N: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over dense (B, K, S, H) caches (any strides): the flash path of the
    module docstring on the CPU, _decode_attention_reference elsewhere. Returns o_TNH in q's dtype."""
    B, K, S, H = k_BKSH.shape
    N = q_TNH.shape[1]
    if _needs_reference(q_TNH, k_BKSH, v_BKSH, sinks_N):
        return _decode_attention_reference(q_TNH, k_BKSH, v_BKSH, seq_idx_T, positions_T, scale, sliding_window,
                                           sinks_N)
    dt = q_TNH.dtype
    q_BNH = q_TNH.new_zeros(B, N, H)
    q_BNH[seq_idx_T] = q_TNH
    qpos_B = torch.zeros(B, dtype=torch.long, device=q_TNH.device)
    qpos_B[seq_idx_T] = positions_T
    hidden_BS = ~_visible(qpos_B, S, sliding_window)
    bias_BS = torch.zeros(B, S, dtype=dt).masked_fill_(hidden_BS, float("-inf"))
    o_BKGH = _flash_decode(q_BNH.view(B, K, N // K, H), k_BKSH.to(dt), v_BKSH.to(dt), bias_BS, scale, sinks_N)
    return o_BKGH.reshape(B, N, H)[seq_idx_T]


def _flash_decode(q_BKGH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor, bias_BS: torch.Tensor,
                  scale: float, sinks_N: torch.Tensor | None) -> torch.Tensor:
    """The G query heads of each kv head as G query rows of torch's flash-attention CPU kernel.

    q_BKGH, k_BKSH, v_BKSH: one dtype, any strides (a tensor whose last dim is not unit-strided is
    copied). bias_BS: 0 for visible keys, -inf for hidden ones, in q's dtype (at least one visible per
    row). sinks_N: optional per-head sink logits, applied as o * sigmoid(lse - sink). Returns o_BKGH
    in q's dtype.
    """
    B, K, G, _ = q_BKGH.shape
    q_BKGH, k_BKSH, v_BKSH = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_BKGH, k_BKSH, v_BKSH))
    o_BKGH, lse_BKG = _flash_cpu(q_BKGH, k_BKSH, v_BKSH, attn_mask=bias_BS[:, None, None, :], scale=scale)
    if sinks_N is None:
        return o_BKGH
    keep_BKG = torch.sigmoid(lse_BKG - sinks_N.float().view(1, K, G))
    return o_BKGH * keep_BKG[..., None].to(o_BKGH.dtype)


def _first_visible(seq_lens_B: torch.Tensor, sliding_window: int | None,
                   start_B: torch.Tensor | None) -> torch.Tensor | None:
    """Each sequence's first visible key (int64) under a window and/or given starts; None: key 0."""
    lens_B = seq_lens_B.long()
    first_B = (lens_B - sliding_window).clamp_(min=0) if sliding_window else None
    if start_B is None:
        return first_B
    return start_B.long() if first_B is None else torch.maximum(first_B, start_B.long())


def _visible_pages(block_table_BM: torch.Tensor, seq_lens_B: torch.Tensor, page: int,
                   sliding_window: int | None, start_B: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    """(pages, first_B): each sequence's keys visible to its last token lie in its table entries
    first_B[b] .. first_B[b] + pages - 1 (pages: the same count for all; entries past a sequence's end
    are masked). With a window or starts only the pages they leave visible are gathered."""
    pages = -(-int(seq_lens_B.max()) // page)
    first_B = _first_visible(seq_lens_B, sliding_window, start_B)
    if first_B is None:
        return pages, torch.zeros_like(seq_lens_B, dtype=torch.long)
    first_B = first_B // page
    if start_B is None:  # w consecutive keys span at most this many pages (no read of the lengths)
        return min(pages, (sliding_window + page - 2) // page + 1), first_B
    return int((-(-seq_lens_B.long() // page) - first_B).max()), first_B


def _paged_flash_chunk(q_BNH: torch.Tensor, k_cache_PSKH: torch.Tensor, v_cache_PSKH: torch.Tensor | None,
                       page_BM: torch.Tensor, bias_BS: torch.Tensor, scale: float,
                       sinks_N: torch.Tensor | None) -> torch.Tensor:
    """Gather each sequence's pages page_BM, mask them with bias_BS (_gather_layout) and run the flash
    kernel. v_cache_PSKH None: the values are the keys (MLA's latent rows). Values narrower than the
    keys (V < H) are gathered zero-padded to H, as the kernel wants one head size, and the output's
    padding columns (zeros) dropped: exact. Returns o_BNV in the cache's dtype."""
    B, N, H = q_BNH.shape
    S, K = k_cache_PSKH.shape[1:3]
    pages = page_BM.shape[1]
    k_BKSH = k_cache_PSKH[page_BM].view(B, pages * S, K, H).transpose(1, 2)
    if v_cache_PSKH is None:
        v_BKSH = k_BKSH
    elif v_cache_PSKH.shape[-1] == H:
        v_BKSH = v_cache_PSKH[page_BM].view(B, pages * S, K, H).transpose(1, 2)
    else:
        V = v_cache_PSKH.shape[-1]
        v_BSKH = k_cache_PSKH.new_zeros(B, pages * S, K, H)
        v_BSKH[..., :V] = v_cache_PSKH[page_BM].view(B, pages * S, K, V)
        v_BKSH = v_BSKH.transpose(1, 2)
    q_BKGH = q_BNH.to(k_cache_PSKH.dtype).reshape(B, K, N // K, H)
    o_BNH = _flash_decode(q_BKGH, k_BKSH, v_BKSH, bias_BS, scale, sinks_N).view(B, N, H)
    return o_BNH if v_cache_PSKH is None or v_cache_PSKH.shape[-1] == H else o_BNH[..., :v_cache_PSKH.shape[-1]]


def _gather_layout(block_table_BM: torch.Tensor, seq_lens_B: torch.Tensor, first_B: torch.Tensor, pages: int,
                   S: int, hide_before_B: torch.Tensor | None, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """page_BM: the `pages` page ids each sequence gathers from its table entry first_B[b]; bias_BS
    (dt): 0 for its visible keys (before its length, from hide_before_B[b] where given), -inf else."""
    B = block_table_BM.shape[0]
    entry_BM = first_B[:, None] + torch.arange(pages, device=first_B.device)
    page_BM = block_table_BM.long().gather(1, entry_BM.clamp(max=block_table_BM.shape[1] - 1)).clamp(min=0)
    pos_BS = (entry_BM[:, :, None] * S + torch.arange(S, device=first_B.device)).view(B, pages * S)
    hidden_BS = pos_BS >= seq_lens_B.long()[:, None]
    if hide_before_B is not None:
        hidden_BS |= pos_BS < hide_before_B[:, None]
    return page_BM, torch.zeros(B, pages * S, dtype=dt).masked_fill_(hidden_BS, float("-inf"))


# Every layer of a decode step passes the same block-table and length tensors (AttentionBatch
# builds fresh ones each step), so what a step derives from them is computed once and reused: the
# last value of each kind and parameters (a window, a dtype) is kept with references to its inputs
# (identity, plus the in-place version counters, say it is still valid). Inference-mode tensors
# (the engine's) have no version counter: for them identity alone decides, as nothing writes a built
# batch's tensors in place. One entry per parameters, so layers that alternate (a window on every
# other layer, chunked and global layers) each keep theirs.
_LAST_PER_STEP: dict[tuple, tuple] = {}


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


def _per_step(kind: str, tensors: tuple[torch.Tensor | None, ...], params: tuple, make):
    """make(), or the value cached for this kind and params when the step's tensors are the same
    (block table, lengths, and the optional starts)."""
    slot = (kind, *params, *(t is None for t in tensors))
    versions = tuple(None if t is None else _version(t) for t in tensors)
    last = _LAST_PER_STEP.get(slot)
    if last is not None and all(a is b for a, b in zip(last[0], tensors)) and last[1] == versions:
        return last[2]
    value = make()
    _LAST_PER_STEP[slot] = (tensors, versions, value)
    return value


def _step_layout(block_table_BM: torch.Tensor, seq_lens_B: torch.Tensor, S: int, sliding_window: int | None,
                 start_B: torch.Tensor | None, dt: torch.dtype) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(pages, page_BM, bias_BS) of a whole decode batch, cached across the step's layers."""
    def make():
        pages, first_B = _visible_pages(block_table_BM, seq_lens_B, S, sliding_window, start_B)
        hide_before_B = _first_visible(seq_lens_B, sliding_window, start_B)
        return (pages, *_gather_layout(block_table_BM, seq_lens_B, first_B, pages, S, hide_before_B, dt))

    return _per_step("gather", (block_table_BM, seq_lens_B, start_B), (S, sliding_window, dt), make)


def _native_layout(block_table_BM: torch.Tensor, seq_lens_B: torch.Tensor, sliding_window: int | None,
                   start_B: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(table_BM, start_B, len_B) as the native kernel takes them (int64, contiguous; start_B the first
    visible key under the window and the given starts), cached across the step's layers: three ops a
    layer fewer (a decode step at batch 1 is about 800 small ops)."""
    def make():
        lens_B = seq_lens_B.long().contiguous()
        first_B = _first_visible(lens_B, sliding_window, start_B)
        first_B = torch.zeros_like(lens_B) if first_B is None else first_B.contiguous()
        return block_table_BM.long().contiguous(), first_B, lens_B

    return _per_step("native", (block_table_BM, seq_lens_B, start_B), (sliding_window,), make)


def _paged_flash(q_BNH: torch.Tensor, k_cache_PSKH: torch.Tensor, v_cache_PSKH: torch.Tensor | None,
                 block_table_BM: torch.Tensor, seq_lens_B: torch.Tensor, scale: float, sliding_window: int | None,
                 sinks_N: torch.Tensor | None, chunk_bytes: int = CHUNK_BYTES,
                 start_B: torch.Tensor | None = None) -> torch.Tensor:
    """_paged_flash_chunk over the whole batch, in chunks of sequences whose gathered K and V stay
    under chunk_bytes (one chunk up to e.g. 128 sequences of 2048 tokens at K=4, H=64 in bf16).
    Returns o_BNV in the cache's dtype."""
    B, N, H = q_BNH.shape
    S, K = k_cache_PSKH.shape[1:3]
    if B == 0:
        V = H if v_cache_PSKH is None else v_cache_PSKH.shape[-1]
        return q_BNH.new_empty(0, N, V, dtype=k_cache_PSKH.dtype)
    pages, page_BM, bias_BS = _step_layout(block_table_BM, seq_lens_B, S, sliding_window, start_B,
                                           k_cache_PSKH.dtype)
    step = max(1, chunk_bytes // (2 * pages * S * K * H * k_cache_PSKH.dtype.itemsize))
    if step >= B:
        return _paged_flash_chunk(q_BNH, k_cache_PSKH, v_cache_PSKH, page_BM, bias_BS, scale, sinks_N)
    return torch.cat([_paged_flash_chunk(q_BNH[i:i + step], k_cache_PSKH, v_cache_PSKH, page_BM[i:i + step],
                                         bias_BS[i:i + step], scale, sinks_N) for i in range(0, B, step)])


def _native_decode_ok(q_BNH: torch.Tensor, k_cache_PSKH: torch.Tensor, v_cache_PSKH: torch.Tensor) -> bool:
    """Whether the native kernel (kernels/csrc/paged_attention.c) takes this decode batch: it runs
    here, no autograd, bf16 or float32 q and caches (the caches of one dtype, with contiguous heads;
    values of any head size)."""
    return (k_cache_PSKH.dtype in native.ATTENTION_DTYPES and v_cache_PSKH.dtype == k_cache_PSKH.dtype
            and q_BNH.dtype in native.ATTENTION_DTYPES
            and k_cache_PSKH.stride(-1) == 1 and v_cache_PSKH.stride(-1) == 1 and q_BNH.shape[0] > 0
            and not (torch.is_grad_enabled() and q_BNH.requires_grad) and native.available())


def _paged_native(q_BNH: torch.Tensor, k_cache_PSKH: torch.Tensor, v_cache_PSKH: torch.Tensor,
                  block_table_BM: torch.Tensor, seq_lens_B: torch.Tensor, scale: float, sliding_window: int | None,
                  sinks_N: torch.Tensor | None, start_B: torch.Tensor | None = None) -> torch.Tensor:
    """paged_decode_attention by the native kernel: the pages are read in place, no gather."""
    B, N, H = q_BNH.shape
    K = k_cache_PSKH.shape[2]
    table_BM, first_B, lens_B = _native_layout(block_table_BM, seq_lens_B, sliding_window, start_B)
    # bf16 or float32 q is read as it is and o written in q's dtype (no casts around the call); with
    # sinks o stays float32 until it is rescaled.
    q_BKGH = q_BNH.reshape(B, K, N // K, H).contiguous()
    o_BKGV, lse_BKG = native.paged_decode_attention(q_BKGH, k_cache_PSKH, v_cache_PSKH, table_BM, first_B, lens_B,
                                                    scale, out_dtype=torch.float32 if sinks_N is not None else None)
    if sinks_N is not None:
        o_BKGV.mul_(torch.sigmoid(lse_BKG - sinks_N.float().view(1, K, N // K))[..., None])
    return o_BKGV.view(B, N, -1).to(q_BNH.dtype)


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
) -> torch.Tensor:
    """Decode attention over a paged KV cache: one query token per sequence.

    q_BNH: the query of sequence b, at position seq_lens_B[b] - 1. k_cache_PSKH: P pages of S token
    slots each, (P, S, K, H); v_cache_PSKH: (P, S, K, V), V <= H (values may be narrower than keys:
    MiMo-V2-Flash); token j of sequence b sits in page block_table_BM[b, j // S], slot j % S.
    block_table_BM: int32/int64 page ids (entries past a sequence's last page are ignored and may
    hold anything in [0, P) or -1). seq_lens_B: int32/int64 context length of each sequence including
    its new token (>= 1), whose key and value must already be in the cache. Visibility as in
    cached_attention (window: keys j > p - w); start_B: optional int32/int64 first visible key of each
    sequence (keys j >= start_B[b]; in [0, seq_lens_B[b]); Llama 4's chunked attention passes each
    chunk's start), combined with the window. sinks_N: optional per-head sink logits (float32 or q's
    dtype). Returns o_BNV in q's dtype.
    On the CPU: the native kernel where it takes the batch and kernels/choice.py measured it faster at
    this many sequences (op "attention"), else the flash path of the module docstring; elsewhere
    paged_decode_attention_reference.
    """
    if q_BNH.device.type != "cpu":
        return paged_decode_attention_reference(q_BNH, k_cache_PSKH, v_cache_PSKH, block_table_BM, seq_lens_B, scale,
                                                sliding_window, sinks_N, start_B)
    if _native_decode_ok(q_BNH, k_cache_PSKH, v_cache_PSKH) and native.runs_native("attention", q_BNH.shape[0]):
        return _paged_native(q_BNH, k_cache_PSKH, v_cache_PSKH, block_table_BM, seq_lens_B, scale, sliding_window,
                             sinks_N, start_B)
    return _paged_flash(q_BNH, k_cache_PSKH, v_cache_PSKH, block_table_BM, seq_lens_B, scale, sliding_window,
                        sinks_N, start_B=start_B).to(q_BNH.dtype)


def paged_latent_decode_attention(
    q_BNW: torch.Tensor,
    cache_PSW: torch.Tensor,
    block_table_BM: torch.Tensor,
    seq_lens_B: torch.Tensor,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """Decode attention of MLA in the latent space (absorbed weights): one query per sequence.

    q_BNW: each head's query in the cache's space, W = latent_dim + rope dim ([W_uk^T q_nope, q_pe]).
    cache_PSW: P pages of S token slots, each row [latent (latent_dim), roped key]; token j of
    sequence b sits in page block_table_BM[b, j // S], slot j % S. Keys are the whole rows, values
    their first latent_dim entries (one kv head shared by all N query heads). seq_lens_B: context
    length including the new token. Softmax in float32, as in paged_decode_attention.
    Returns o_BNC (C = latent_dim), the attention-weighted latents. On the CPU the flash kernel
    attends with the whole rows as values (its head sizes must match) and the first C outputs are kept.
    """
    if q_BNW.device.type != "cpu":
        return paged_latent_decode_attention_reference(q_BNW, cache_PSW, block_table_BM, seq_lens_B, scale,
                                                        latent_dim)
    o_BNW = _paged_flash(q_BNW, cache_PSW[:, :, None, :], None, block_table_BM, seq_lens_B, scale, None, None)
    return o_BNW[..., :latent_dim].to(q_BNW.dtype).contiguous()


def _decode_attention_reference(q_TNH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                                seq_idx_T: torch.Tensor, positions_T: torch.Tensor, scale: float,
                                sliding_window: int | None, sinks_N: torch.Tensor | None = None,
                                start_B: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence: two batched matmuls with the query heads grouped under their kv head.

    The softmax runs in float32 and its result is cast back before multiplying V (as transformers'
    eager attention does). start_B: optional first visible key of each sequence (keys j < start_B[b]
    are hidden as well).
    """
    B, K, S, H = k_BKSH.shape
    N = q_TNH.shape[1]
    q_BNH = q_TNH.new_zeros(B, N, H)
    q_BNH[seq_idx_T] = q_TNH
    q_BKGH = q_BNH.view(B, K, N // K, H)
    scores_BKGS = torch.matmul(q_BKGH, k_BKSH.transpose(-1, -2)).float() * scale
    qpos_B = torch.zeros(B, dtype=torch.long, device=q_TNH.device)
    qpos_B[seq_idx_T] = positions_T
    mask_BS = _visible(qpos_B, S, sliding_window)
    if start_B is not None:
        mask_BS &= torch.arange(S, device=q_TNH.device) >= start_B.to(q_TNH.device).long()[:, None]
    scores_BKGS = scores_BKGS.masked_fill(~mask_BS[:, None, None, :], float("-inf"))
    probs_BKGS = _softmax_with_sinks(scores_BKGS, None if sinks_N is None else sinks_N.view(1, K, N // K, 1))
    o_BKGV = torch.matmul(probs_BKGS.to(v_BKSH.dtype), v_BKSH)
    return o_BKGV.reshape(B, N, -1)[seq_idx_T]  # (values may be narrower than keys: MLA)


def gather_pages(cache_PSKH: torch.Tensor, block_table_BM: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Copy the first num_tokens token slots of each sequence's pages into one (B, K, S', H) view,
    S' = num_tokens rounded up to whole pages. Table entries of -1 read page 0 (masked later)."""
    B, S = block_table_BM.shape[0], cache_PSKH.shape[1]
    pages = -(-num_tokens // S)
    table_BM = block_table_BM[:, :pages].long().clamp(min=0)
    return cache_PSKH[table_BM].reshape(B, pages * S, *cache_PSKH.shape[2:]).transpose(1, 2)


def paged_decode_attention_reference(q_BNH: torch.Tensor, k_cache_PSKH: torch.Tensor, v_cache_PSKH: torch.Tensor,
                                     block_table_BM: torch.Tensor, seq_lens_B: torch.Tensor, scale: float,
                                     sliding_window: int | None = None, sinks_N: torch.Tensor | None = None,
                                     start_B: torch.Tensor | None = None) -> torch.Tensor:
    """paged_decode_attention written plainly (any device): every sequence's pages up to the longest
    context gathered in the cache's dtype, two batched matmuls, a float32 softmax. The oracle."""
    B = block_table_BM.shape[0]
    longest = int(seq_lens_B.max()) if B else 0
    k_BKSH = gather_pages(k_cache_PSKH, block_table_BM, longest)
    v_BKSH = gather_pages(v_cache_PSKH, block_table_BM, longest)
    seq_idx_B = torch.arange(B, device=q_BNH.device)
    return _decode_attention_reference(q_BNH, k_BKSH, v_BKSH, seq_idx_B, seq_lens_B.long() - 1, scale,
                                       sliding_window, sinks_N, start_B)


def paged_latent_decode_attention_reference(q_BNW: torch.Tensor, cache_PSW: torch.Tensor,
                                            block_table_BM: torch.Tensor, seq_lens_B: torch.Tensor, scale: float,
                                            latent_dim: int) -> torch.Tensor:
    """paged_latent_decode_attention written plainly (any device), as paged_decode_attention_reference."""
    B = block_table_BM.shape[0]
    longest = int(seq_lens_B.max()) if B else 0
    kv_B1SW = gather_pages(cache_PSW[:, :, None, :], block_table_BM, longest)
    seq_idx_B = torch.arange(B, device=q_BNW.device)
    return _decode_attention_reference(q_BNW, kv_B1SW, kv_B1SW[..., :latent_dim], seq_idx_B, seq_lens_B.long() - 1,
                                       scale, None)
