"""The attention batch description and a dense per-sequence KV cache.

Legend: T tokens of the flat batch, B sequences, L layers, K key/value heads, S cache length,
H head dim, N query heads.

The model never sees how keys are stored: each attention layer calls `cache.attend(...)`, so a paged
cache (the engine's) or no cache at all can be injected in place of this one.
"""
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.attention import cached_attention


@dataclass(frozen=True)
class AttentionBatch:
    """Where each token of a flat batch sits.

    seq_idx_T: row of the batch (0..B-1) the token belongs to. tok_idx_T: its index among its
    sequence's tokens in this call. positions_T: absolute position (int64). slots_B: cache row of
    each sequence. kv_lens_B: each sequence's context length (cached plus new) after this call.
    max_q_len: longest chunk of one sequence in this call. max_kv_len: max of kv_lens_B.
    """

    seq_idx_T: torch.Tensor
    tok_idx_T: torch.Tensor
    positions_T: torch.Tensor
    slots_B: torch.Tensor
    kv_lens_B: torch.Tensor
    max_q_len: int
    max_kv_len: int
    first_slot: int | None = None  # set when slots_B is first_slot, first_slot+1, ...: caches can slice, not gather

    @classmethod
    def build(cls, q_lens: list[int], ctx_lens: list[int], slots: list[int], device: torch.device | str = "cpu") -> "AttentionBatch":
        """Batch of B sequences; sequence b adds q_lens[b] tokens after ctx_lens[b] cached ones."""
        q = torch.tensor(q_lens, dtype=torch.long)
        seq_idx = torch.repeat_interleave(torch.arange(len(q_lens)), q)
        starts = torch.cumsum(q, 0) - q
        tok_idx = torch.arange(int(q.sum())) - starts[seq_idx]
        positions = torch.tensor(ctx_lens, dtype=torch.long)[seq_idx] + tok_idx
        kv_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        return cls(seq_idx.to(device), tok_idx.to(device), positions.to(device),
                   torch.tensor(slots, dtype=torch.long, device=device),
                   torch.tensor(kv_lens, dtype=torch.long, device=device), max(q_lens), max(kv_lens),
                   slots[0] if contiguous else None)


class KVCache(Protocol):
    def attend(self, layer: int, q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor,
               batch: AttentionBatch, scale: float, sliding_window: int | None) -> torch.Tensor:
        """Store this call's keys and values, then return attention output o_TNH."""
        ...


class DenseKVCache:
    """One contiguous (K, S, H) region per sequence slot and layer: k[l] is (slots, K, S, H)."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len

    def attend(self, layer: int, q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor,
               batch: AttentionBatch, scale: float, sliding_window: int | None) -> torch.Tensor:
        if batch.max_kv_len > self.max_len:
            raise ValueError(f"context of {batch.max_kv_len} tokens exceeds the KV cache length {self.max_len}")
        slot_T = batch.slots_B[batch.seq_idx_T]
        self.k[layer][slot_T, :, batch.positions_T] = k_TKH
        self.v[layer][slot_T, :, batch.positions_T] = v_TKH
        S, B, first = batch.max_kv_len, batch.slots_B.numel(), batch.first_slot
        if first is not None:
            k_BKSH, v_BKSH = self.k[layer][first:first + B, :, :S], self.v[layer][first:first + B, :, :S]  # views
        else:
            k_BKSH, v_BKSH = self.k[layer][batch.slots_B, :, :S], self.v[layer][batch.slots_B, :, :S]
        return cached_attention(q_TNH, k_BKSH, v_BKSH, batch.seq_idx_T, batch.tok_idx_T, batch.positions_T,
                                batch.max_q_len, scale, sliding_window)
