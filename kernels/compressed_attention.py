"""Decode attention of DeepSeek-V4's attention layers (torch reference): one shared key=value head
over a sliding window plus chosen compressed entries, with per-head sinks.

Legend: B sequences, N query heads, H head dim (keys and values are the same rows), S state slots of
the window ring, W window length, P pages of compressed entries, E entries per page, M max pages per
sequence, K chosen-entry columns per sequence.

Each sequence's query (at position p = lens_B[b] - 1) attends to the union of
- its window: positions max(0, p - W + 1) .. p, read from its ring slot slot_B[b] at p % W (the ring
  already holds position p); positions below 0 (sequences shorter than W) are not keys;
- its chosen compressed entries idx_BK[b] (int64, -1 = unused column, anywhere in the row): entry w
  lives at pages_PEH[table_BM[b, w * rate // block_size], (w * rate % block_size) // rate]
  (E = max(1, block_size // rate): several entries per page when rate < block_size, one per page else).
The window's logits, the entries' logits and the sink logit (sinks_N, one per head, an extra column
that takes probability and gives no value: gpt-oss's, kernels/attention.py) share one float32 softmax
per (sequence, head). The window always holds position p, so no row is empty.

As the other references: scores in the cache's dtype then float32, probabilities cast back to the
cache's dtype before the weighted sum. Rows that are not keys (stale ring rows, the rows an unused
column points at) are zeroed before use, so whatever they hold (NaN included) never reaches the
output. The batch runs in chunks of sequences whose gathered rows stay under GATHERED_PER_CHUNK values.
"""
import torch

# Rows gathered at once, per chunk of sequences: at most this many values ((W + K) * max(H, N) per sequence).
GATHERED_PER_CHUNK = 1 << 24


def _check(q_BNH: torch.Tensor, ring_SWH: torch.Tensor, slot_B: torch.Tensor, lens_B: torch.Tensor,
           pages_PEH: torch.Tensor, table_BM: torch.Tensor, idx_BK: torch.Tensor, rate: int, block_size: int,
           sinks_N: torch.Tensor | None) -> None:
    """Raise ValueError for arguments neither implementation takes (shared with the Triton twin)."""
    if q_BNH.dim() != 3 or ring_SWH.dim() != 3 or pages_PEH.dim() != 3:
        raise ValueError(f"expected q (B, N, H), ring (S, W, H) and pages (P, E, H); got q {tuple(q_BNH.shape)}, "
                         f"ring {tuple(ring_SWH.shape)}, pages {tuple(pages_PEH.shape)}")
    (B, N, H), W = q_BNH.shape, ring_SWH.shape[1]
    if ring_SWH.shape[2] != H or pages_PEH.shape[2] != H or W < 1:
        raise ValueError(f"q, ring and pages must share H = {H} (and W >= 1); got ring {tuple(ring_SWH.shape)}, "
                         f"pages {tuple(pages_PEH.shape)}")
    if pages_PEH.dtype != ring_SWH.dtype:
        raise ValueError(f"ring and pages must share one dtype; got {ring_SWH.dtype}, {pages_PEH.dtype}")
    if rate < 1 or block_size < 1 or rate & (rate - 1) or block_size & (block_size - 1):
        raise ValueError(f"rate and block_size must be powers of two; got {rate}, {block_size}")
    if pages_PEH.shape[1] != max(1, block_size // rate):
        raise ValueError(f"pages hold max(1, block_size // rate) = {max(1, block_size // rate)} entries each; "
                         f"got E = {pages_PEH.shape[1]}")
    for name, t in (("slot", slot_B), ("lens", lens_B)):
        if t.shape != (B,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 of shape ({B},); got {t.dtype} {tuple(t.shape)}")
    for name, t in (("table", table_BM), ("idx", idx_BK)):
        if t.dim() != 2 or t.shape[0] != B or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 of shape (B={B}, ...); got {t.dtype} {tuple(t.shape)}")
    if sinks_N is not None and tuple(sinks_N.shape) != (N,):
        raise ValueError(f"sinks must be ({N},); got {tuple(sinks_N.shape)}")


def _chunk(q_BNH: torch.Tensor, ring_SWH: torch.Tensor, slot_B: torch.Tensor, lens_B: torch.Tensor,
           pages_PEH: torch.Tensor, table_BM: torch.Tensor, idx_BK: torch.Tensor, rate: int, block_size: int,
           sinks_N: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The attention of a chunk of sequences; returns o_BNH in the cache's dtype."""
    W = ring_SWH.shape[1]
    dt, dev = ring_SWH.dtype, ring_SWH.device
    # Window: position lens - W + j for j < W (the last W positions), at ring row pos % W.
    pos_BW = lens_B.long()[:, None] - W + torch.arange(W, device=dev)
    win_ok_BW = pos_BW >= 0
    win_BWH = ring_SWH[slot_B.long()[:, None], pos_BW % W]
    # Entries: page table_BM[b, w * rate // block_size], row (w * rate % block_size) // rate.
    idx_BK = idx_BK.long()
    ent_ok_BK = idx_BK >= 0
    tok_BK = idx_BK.clamp(min=0) * rate
    col_BK = (tok_BK // block_size).clamp(max=max(table_BM.shape[1] - 1, 0))
    if table_BM.shape[1]:
        page_BK = table_BM.long().gather(1, col_BK).clamp(min=0)
    else:  # (no pages at all: every column is unused)
        page_BK = torch.zeros_like(idx_BK)
    ent_BKH = pages_PEH[page_BK, (tok_BK % block_size) // rate]
    ok_BT = torch.cat((win_ok_BW, ent_ok_BK), dim=1)  # T = W + K keys
    rows_BTH = torch.cat((win_BWH, ent_BKH), dim=1).masked_fill(~ok_BT[..., None], 0)
    logits_BNT = torch.bmm(q_BNH.to(dt), rows_BTH.transpose(1, 2)).float() * scale
    logits_BNT = logits_BNT.masked_fill(~ok_BT[:, None, :], float("-inf"))
    if sinks_N is not None:
        sink_BN1 = sinks_N.float().view(1, -1, 1).expand(logits_BNT.shape[0], -1, 1)
        probs_BNT = torch.cat((logits_BNT, sink_BN1), dim=-1).softmax(-1)[..., :-1]
    else:
        probs_BNT = logits_BNT.softmax(-1)
    return torch.bmm(probs_BNT.to(dt), rows_BTH)


def compressed_decode_attention(q_BNH: torch.Tensor, ring_SWH: torch.Tensor, slot_B: torch.Tensor,
                                lens_B: torch.Tensor, pages_PEH: torch.Tensor, table_BM: torch.Tensor,
                                idx_BK: torch.Tensor, rate: int, block_size: int, sinks_N: torch.Tensor | None,
                                scale: float) -> torch.Tensor:
    """Decode attention of one query per sequence over its window and its chosen compressed entries
    (module docstring); returns o_BNH in q's dtype.

    q_BNH (any strides); ring_SWH and pages_PEH one dtype (q is cast to it); slot_B, lens_B (each >= 1)
    int32/int64; table_BM int32/int64, entries no used column points at are never used; idx_BK
    int32/int64, -1 = unused; rate, block_size powers of two; sinks_N None or (N,) of any float dtype.
    """
    _check(q_BNH, ring_SWH, slot_B, lens_B, pages_PEH, table_BM, idx_BK, rate, block_size, sinks_N)
    (B, N, H), W, K = q_BNH.shape, ring_SWH.shape[1], idx_BK.shape[1]
    if B == 0:
        return q_BNH.new_empty(0, N, H)
    step = max(1, GATHERED_PER_CHUNK // ((W + K) * max(H, N)))
    out = [_chunk(q_BNH[i:i + step], ring_SWH, slot_B[i:i + step], lens_B[i:i + step], pages_PEH,
                  table_BM[i:i + step], idx_BK[i:i + step], rate, block_size, sinks_N, scale)
           for i in range(0, B, step)]
    return (out[0] if len(out) == 1 else torch.cat(out)).to(q_BNH.dtype)
