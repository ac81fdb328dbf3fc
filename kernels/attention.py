"""Causal attention of a flat batch of query tokens against per-sequence KV caches.

Legend: T query tokens (all sequences, flattened), B sequences, Q longest query chunk of a sequence,
S cached keys per sequence (the longest context in the batch), N query heads, K key/value heads
(N % K == 0, grouped-query attention), H head dim, G = N / K query heads per kv head.

Attention sinks (gpt-oss): sinks_N holds one learned logit per query head, appended as an extra
column to that head's scaled scores before the softmax and dropped after it, so a head may put
weight "nowhere" (the outputs are scaled down by the sink's share).
"""
import torch
import torch.nn.functional as F


def _visible(qpos: torch.Tensor, S: int, sliding_window: int | None) -> torch.Tensor:
    """mask[..., j]: key j is visible from a query at position qpos (causal, optional window)."""
    key_pos = torch.arange(S, device=qpos.device)
    mask = key_pos <= qpos[..., None]
    if sliding_window:
        mask &= key_pos > (qpos[..., None] - sliding_window)
    return mask


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
    """Reference attention for prefill, decode, or any mix of the two in one call.

    Query token t belongs to sequence seq_idx_T[t], is the tok_idx_T[t]-th query of that sequence in
    this call, and sits at absolute position positions_T[t]. Key j of sequence b (the cache row
    k_BKSH[b, :, j]) is visible to a query at position p when j <= p and, with a sliding window w,
    j > p - w (transformers' convention). The caches must already hold this call's keys.
    sinks_N: optional per-head sink logits (see the module docstring). Returns o_TNH in q's dtype.
    """
    B, S = k_BKSH.shape[0], k_BKSH.shape[2]
    N, H = q_TNH.shape[1:]
    if max_q_len == 1:
        return _decode_attention(q_TNH, k_BKSH, v_BKSH, seq_idx_T, positions_T, scale, sliding_window, sinks_N)
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
    """One query per sequence: two batched matmuls with the query heads grouped under their kv head.

    On the CPU this is about 10x faster than scaled_dot_product_attention with a mask for bf16.
    The softmax runs in float32 and its result is cast back before multiplying V (as transformers'
    eager attention does).
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


def paged_decode_attention(
    q_BNH: torch.Tensor,
    k_cache_PSKH: torch.Tensor,
    v_cache_PSKH: torch.Tensor,
    block_table_BM: torch.Tensor,
    seq_lens_B: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference decode attention over a paged KV cache: one query token per sequence.

    q_BNH: the query of sequence b, at position seq_lens_B[b] - 1. k_cache_PSKH / v_cache_PSKH:
    P pages of S token slots each, (P, S, K, H); token j of sequence b sits in page
    block_table_BM[b, j // S], slot j % S. block_table_BM: int32/int64 page ids (entries past a
    sequence's last page are ignored and may hold anything in [0, P) or -1). seq_lens_B: int32/int64
    context length of each sequence including its new token (>= 1), whose key and value must already
    be in the cache. Visibility as in cached_attention (window: keys j > p - w). sinks_N: optional
    per-head sink logits (float32 or q's dtype). Returns o_BNH.
    """
    B = block_table_BM.shape[0]
    longest = int(seq_lens_B.max()) if B else 0
    k_BKSH = gather_pages(k_cache_PSKH, block_table_BM, longest)
    v_BKSH = gather_pages(v_cache_PSKH, block_table_BM, longest)
    seq_idx_B = torch.arange(B, device=q_BNH.device)
    return _decode_attention(q_BNH, k_BKSH, v_BKSH, seq_idx_B, seq_lens_B.long() - 1, scale, sliding_window, sinks_N)


def paged_latent_decode_attention(
    q_BNW: torch.Tensor,
    cache_PSW: torch.Tensor,
    block_table_BM: torch.Tensor,
    seq_lens_B: torch.Tensor,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """Reference decode attention of MLA in the latent space (absorbed weights): one query per sequence.

    q_BNW: each head's query in the cache's space, W = latent_dim + rope dim ([W_uk^T q_nope, q_pe]).
    cache_PSW: P pages of S token slots, each row [latent (latent_dim), roped key]; token j of
    sequence b sits in page block_table_BM[b, j // S], slot j % S. Keys are the whole rows, values
    their first latent_dim entries (one kv head shared by all N query heads). seq_lens_B: context
    length including the new token. Softmax in float32, as in paged_decode_attention.
    Returns o_BNC (C = latent_dim), the attention-weighted latents.
    """
    B = block_table_BM.shape[0]
    longest = int(seq_lens_B.max()) if B else 0
    kv_B1SW = gather_pages(cache_PSW[:, :, None, :], block_table_BM, longest)
    seq_idx_B = torch.arange(B, device=q_BNW.device)
    return _decode_attention(q_BNW, kv_B1SW, kv_B1SW[..., :latent_dim], seq_idx_B, seq_lens_B.long() - 1, scale, None)
