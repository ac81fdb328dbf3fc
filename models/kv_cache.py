"""The attention batch description, a dense per-sequence KV cache, the engine's paged one, the
per-sequence states of linear-attention layers (LinearStates) and DeepSeek-V4's cache (V4Cache).

Legend: T tokens of the flat batch, B sequences, L layers, K key/value heads, S cache length,
H head dim, N query heads.

The model never sees how keys are stored: each attention layer calls `cache.attend(...)`, so a paged
cache (the engine's) or no cache at all can be injected in place of this one.
"""
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from kernels.ops import KernelOps
    from models.config import ModelConfig
from kernels.attention import cached_attention, gather_pages, paged_decode_attention, paged_latent_decode_attention


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
    block_table_BM: torch.Tensor | None = None  # paged caches: page ids of each sequence, -1 past its end
    slot_mapping_T: torch.Tensor | None = None  # paged caches: page * page_size + offset of each token
    # Steps that mix decodes with prefill chunks: (tokens of the one-token sequences, those sequences,
    # tokens of the others, an AttentionBatch of the others alone), so each part takes its own path.
    parts: "tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch] | None" = None
    # linear-attention layers (models/linear_attention.py): each sequence's state slot
    state_slots_B: torch.Tensor | None = None
    # DeepSeek Sparse Attention (sparse_latent_attention): {layer: (token index (T, k), valid (T, k))},
    # the last choice of tokens a layer made for this call that later layers reuse (GLM-5's "shared"
    # layers). Kept on the batch object, not the cache: micro-batches run layer by layer interleaved,
    # each with its own batch, so each finds its own choice.
    index_choice: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, q_lens: list[int], ctx_lens: list[int], slots: list[int], device: torch.device | str = "cpu") -> "AttentionBatch":
        """Batch of B sequences; sequence b adds q_lens[b] tokens after ctx_lens[b] cached ones."""
        seq_idx, tok_idx, positions, kv_lens = _token_layout(q_lens, ctx_lens)
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        slots_B = torch.tensor(slots, dtype=torch.long, device=device)
        return cls(seq_idx.to(device), tok_idx.to(device), positions.to(device), slots_B,
                   torch.tensor(kv_lens, dtype=torch.long, device=device), max(q_lens), max(kv_lens),
                   slots[0] if contiguous else None, state_slots_B=slots_B)


    @classmethod
    def build_paged(cls, q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]], block_size: int,
                    device: torch.device | str = "cpu", state_slots: list[int] | None = None) -> "AttentionBatch":
        """Batch over a paged cache: sequence b's tokens live in the pages block_tables[b] (and its
        linear-attention state in slot state_slots[b], for models with such layers)."""
        B = len(q_lens)
        if min(q_lens) == max(q_lens) == 1:
            return cls._decode_paged(ctx_lens, block_tables, block_size, device, state_slots)
        seq_idx, tok_idx, positions, kv_lens = _token_layout(q_lens, ctx_lens)
        table = _padded_table(block_tables)
        slots = table[seq_idx, positions // block_size] * block_size + positions % block_size
        parts = None
        if 1 < max(q_lens) and min(q_lens) == 1:
            decode_seqs = [b for b, n in enumerate(q_lens) if n == 1]
            prefill_seqs = [b for b, n in enumerate(q_lens) if n > 1]
            is_decode_T = torch.tensor(q_lens)[seq_idx] == 1
            parts = (torch.nonzero(is_decode_T)[:, 0].to(device), torch.tensor(decode_seqs, device=device),
                     torch.nonzero(~is_decode_T)[:, 0].to(device),
                     cls.build_paged([q_lens[b] for b in prefill_seqs], [ctx_lens[b] for b in prefill_seqs],
                                     [block_tables[b] for b in prefill_seqs], block_size, device,
                                     None if state_slots is None else [state_slots[b] for b in prefill_seqs]))
        return cls(seq_idx.to(device), tok_idx.to(device), positions.to(device), torch.arange(B, device=device),
                   torch.tensor(kv_lens, dtype=torch.long, device=device), max(q_lens), max(kv_lens), 0,
                   table.to(device=device, dtype=torch.int32), slots.to(device), parts,
                   None if state_slots is None else torch.tensor(state_slots, dtype=torch.long, device=device))

    @classmethod
    def _decode_paged(cls, ctx_lens: list[int], block_tables: list[list[int]], block_size: int,
                      device: torch.device | str, state_slots: list[int] | None) -> "AttentionBatch":
        """build_paged of a decode batch (one token per sequence, at its context length): the slots
        computed in numpy and each field made once (a decode step, a verify step's rows and each of
        the MTP layer's passes build one; numpy's small ops cost a fraction of torch's)."""
        B = len(ctx_lens)
        pos_B = np.asarray(ctx_lens, dtype=np.int64)
        table_BM = _padded_table_np(block_tables)
        slots_B = table_BM[np.arange(B), pos_B // block_size] * block_size + pos_B % block_size
        return cls(torch.arange(B, device=device), torch.zeros(B, dtype=torch.long, device=device),
                   torch.from_numpy(pos_B).to(device), torch.arange(B, device=device),
                   torch.from_numpy(pos_B + 1).to(device), 1, int(pos_B.max()) + 1, 0,
                   torch.from_numpy(table_BM.astype(np.int32)).to(device), torch.from_numpy(slots_B).to(device),
                   None, None if state_slots is None else torch.tensor(state_slots, dtype=torch.long, device=device))

    def decode_rows(self, rows_R: torch.Tensor, max_kv_len: int) -> "AttentionBatch":
        """This decode batch (one token per sequence, build_paged's) restricted to the rows rows_R, in
        that order (their block tables as wide as this batch's, -1 past each end); max_kv_len: the
        longest context among them. The MTP layer's first pass over a verify step's kept rows takes
        it instead of a build."""
        kv_lens_R = self.kv_lens_B[rows_R]
        R = kv_lens_R.shape[0]
        return AttentionBatch(self.seq_idx_T[:R], self.tok_idx_T[:R], self.positions_T[rows_R], self.slots_B[:R],
                              kv_lens_R, 1, max_kv_len, self.first_slot, self.block_table_BM[rows_R],
                              self.slot_mapping_T[rows_R],
                              state_slots_B=None if self.state_slots_B is None else self.state_slots_B[rows_R])

    def next_slots(self) -> "AttentionBatch":
        """This decode batch (one token per sequence, build_paged's) one position further, each token
        in the cache slot after its own: for a caller that knows none of them starts a new page (the
        MTP layer's chained drafts: three ops instead of a build)."""
        return AttentionBatch(self.seq_idx_T, self.tok_idx_T, self.positions_T + 1, self.slots_B, self.kv_lens_B + 1,
                              1, self.max_kv_len + 1, self.first_slot, self.block_table_BM, self.slot_mapping_T + 1,
                              state_slots_B=self.state_slots_B)


def _padded_table(block_tables: list[list[int]]) -> torch.Tensor:
    """(B, longest) int64 page ids, -1 past each table's end (see _padded_table_np)."""
    return torch.from_numpy(_padded_table_np(block_tables))


def _padded_table_np(block_tables: list[list[int]]) -> np.ndarray:
    """_padded_table as a numpy array. Up to 8 tables as padded lists in one array call (a decode step
    at batch 1: ~1.5 against 7 us); more by one flat read of all the ids and a masked store, not a
    padded list per row: 3x faster at 256 tables (0.18 against 0.59 ms at 50 pages, 0.43 against 1.39
    at 128), and a step builds it for every sequence."""
    if len(block_tables) <= 8:  # (a few tables: padded lists in one array call, a third of the ops' time)
        M = max(map(len, block_tables))
        return np.array([[*t, *[-1] * (M - len(t))] for t in block_tables], dtype=np.int64).reshape(len(block_tables), M)
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    M = int(lens.max())
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(lens.sum()))
    table = np.full((len(block_tables), M), -1, dtype=np.int64)
    table[np.arange(M)[None, :] < lens[:, None]] = flat
    return table


def _token_layout(q_lens: list[int], ctx_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(seq_idx_T, tok_idx_T, positions_T) on the CPU and kv_lens of a flat batch (see AttentionBatch)."""
    if min(q_lens) == max(q_lens) == 1:  # decode: one token per sequence, at its context length (five ops fewer a step)
        return (torch.arange(len(q_lens)), torch.zeros(len(q_lens), dtype=torch.long),
                torch.tensor(ctx_lens, dtype=torch.long), [c + 1 for c in ctx_lens])
    q = torch.tensor(q_lens, dtype=torch.long)
    seq_idx = torch.repeat_interleave(torch.arange(len(q_lens)), q)
    starts = torch.cumsum(q, 0) - q
    tok_idx = torch.arange(int(q.sum())) - starts[seq_idx]
    positions = torch.tensor(ctx_lens, dtype=torch.long)[seq_idx] + tok_idx
    return seq_idx, tok_idx, positions, [c + n for c, n in zip(ctx_lens, q_lens)]


class KVCache(Protocol):
    def attend(self, layer: int, q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor,
               batch: AttentionBatch, scale: float, sliding_window: int | None,
               sinks_N: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        """Store this call's keys and values, then return attention output o_TNH. sinks_N: per-head
        sink logits (gpt-oss; see kernels/attention.py), None for none. chunk: Llama 4's chunked
        attention (see chunked_attention), None for none."""
        ...


def chunked_attention(q_TNH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor, seq_idx_T: torch.Tensor,
                      tok_idx_T: torch.Tensor, positions_T: torch.Tensor, scale: float, chunk: int,
                      sinks_N: torch.Tensor | None = None) -> torch.Tensor:
    """cached_attention where a query at position p sees only the keys of its chunk, j in
    [p - p % chunk, p] (Llama 4's attention_chunk_size). Every (sequence, chunk) pair the queries
    touch becomes a sequence of its own whose keys start at the chunk's first position, so plain
    causal attention computes it; a pair's keys are gathered up to the furthest query position."""
    S = k_BKSH.shape[2]
    per_seq = -(-S // chunk)
    pairs_P, pair_T = torch.unique(seq_idx_T * per_seq + positions_T // chunk, return_inverse=True)
    seq_P, start_P = pairs_P // per_seq, pairs_P % per_seq * chunk
    pos_T = positions_T - start_P[pair_T]
    first_P = torch.full_like(pairs_P, tok_idx_T.numel()).scatter_reduce_(0, pair_T, tok_idx_T, "amin")
    tok_T = tok_idx_T - first_P[pair_T]
    # keys past S clamp to S - 1: they lie past every query of their pair, so causality hides them
    key_PL = (start_P[:, None] + torch.arange(int(pos_T.max()) + 1, device=q_TNH.device)).clamp_(max=S - 1)
    k_PKLH, v_PKLH = (t[seq_P[:, None], :, key_PL].transpose(1, 2) for t in (k_BKSH, v_BKSH))
    return cached_attention(q_TNH, k_PKLH, v_PKLH, pair_T, tok_T, pos_T, int(tok_T.max()) + 1, scale, None, sinks_N)


class LatentProjections(Protocol):
    """What an MLA layer lends its cache (models/mla.py: MLAttention): W = latent C + rope R."""

    def expand(self, cached_XW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached rows -> (keys (X, N, P+R), values (X, N, V))."""
        ...

    def absorb_query(self, q_nope_TNP: torch.Tensor, q_pe_TNR: torch.Tensor) -> torch.Tensor:
        """Queries -> the cache's space (T, N, W)."""
        ...

    def output(self, o_latent_TNC: torch.Tensor) -> torch.Tensor:
        """Attention-weighted latents (T, N, C) -> values (T, N, V)."""
        ...


class LatentKVCache(Protocol):
    def attend_latent(self, layer: int, q_nope_TNP: torch.Tensor, q_pe_TNR: torch.Tensor, cached_TW: torch.Tensor,
                      batch: AttentionBatch, scale: float, mla: LatentProjections, index=None) -> torch.Tensor:
        """Store this call's MLA rows [latent, roped key] (T, W), then return o_TNV. index: DeepSeek
        Sparse Attention's models/mla.IndexQuery (its keys stored too, where the layer has an indexer;
        sparse_latent_attention), or None."""
        ...


# Index scores computed at once, per chunk of queries: at most this many (query, index head, token) values.
SPARSE_SCORES_PER_CHUNK = 1 << 24


def sparse_latent_attention(q_nope_TNP: torch.Tensor, q_pe_TNR: torch.Tensor,
                            cached: "torch.Tensor | tuple[torch.Tensor, torch.Tensor, int]",
                            keys_BSI: torch.Tensor | None, batch: AttentionBatch, scale: float, mla: LatentProjections,
                            index) -> torch.Tensor:
    """DeepSeek Sparse Attention over the batch's B sequences' cached rows (`cached`: (B, S, W), or
    (pages (P, page, W), block table (B, M), S) to read only the chosen rows from the pages) and index
    keys (B, S, I): each query t scores the tokens of its sequence up to its position with the index
    (index.q_THI, index.w_TH: sum_h w_h relu(q_h . k_s)), keeps the index.topk highest (fewer where
    fewer are visible) and attends in the latent space (absorbed) to those alone. Queries run in
    chunks that bound the scores to SPARSE_SCORES_PER_CHUNK values. A layer without an indexer
    (index.q_THI None; keys_BSI unused) attends to the tokens layer index.source chose, which that
    layer left in batch.index_choice (index.keep; only the last such choice is kept). Returns o_TNV."""
    if isinstance(cached, torch.Tensor):
        S, W, dtype = cached.shape[1], cached.shape[2], cached.dtype
        rows_of = lambda b_c, idx_cK: cached[b_c[:, None], idx_cK]  # noqa: E731
    else:
        pages, table, S = cached
        size, W, dtype, flat = pages.shape[1], pages.shape[2], pages.dtype, pages.view(-1, pages.shape[2])
        rows_of = lambda b_c, idx_cK: flat[table[b_c[:, None], idx_cK // size].long() * size + idx_cK % size]  # noqa: E731
    T = q_nope_TNP.shape[0]
    C, N = W - q_pe_TNR.shape[-1], q_nope_TNP.shape[1]
    k = min(index.topk, S)
    own = batch.max_q_len == 1 and keys_BSI is not None and T == keys_BSI.shape[0]  # decode: token t is sequence t
    reused = None
    if index.q_THI is None:
        assert index.source in batch.index_choice, f"layer {index.source}'s choice of tokens is not on this batch"
        reused = batch.index_choice[index.source]
    q_TNW = mla.absorb_query(q_nope_TNP, q_pe_TNR).to(dtype)
    rows = max(1, SPARSE_SCORES_PER_CHUNK // (N * k if reused is not None else index.q_THI.shape[1] * S))
    out, chosen = [], []
    for start in range(0, T, rows):  # (chunks of queries, never one per token)
        t = slice(start, start + rows)
        b_c = batch.seq_idx_T[t]
        if reused is None:
            keys_cSI = keys_BSI[t] if own else keys_BSI[b_c]
            scores_cHS = torch.bmm(index.q_THI[t], keys_cSI.float().transpose(1, 2)).relu_()
            scores_cS = torch.bmm(index.w_TH[t][:, None, :], scores_cHS)[:, 0]
            visible_cS = torch.arange(S, device=b_c.device)[None, :] <= batch.positions_T[t][:, None]
            idx_cK = scores_cS.masked_fill(~visible_cS, float("-inf")).topk(k, dim=-1)[1]
            valid_cK = visible_cS.gather(1, idx_cK)  # (a query seeing fewer than k tokens gets invisible ones too)
            if index.keep:
                chosen.append((idx_cK, valid_cK))
        else:
            idx_cK, valid_cK = reused[0][t], reused[1][t]
        rows_cKW = rows_of(b_c, idx_cK)
        logits_cNK = torch.bmm(q_TNW[t], rows_cKW.transpose(1, 2)).float() * scale
        probs_cNK = logits_cNK.masked_fill(~valid_cK[:, None, :], float("-inf")).softmax(-1)
        out.append(torch.bmm(probs_cNK.to(rows_cKW.dtype), rows_cKW[..., :C]))
    if index.keep and reused is None:  # (a shared layer passes the choice it read on as it is)
        batch.index_choice.clear()
        batch.index_choice[index.source] = (torch.cat([c[0] for c in chosen]), torch.cat([c[1] for c in chosen]))
    return mla.output(torch.cat(out))


class DenseKVCache:
    """One contiguous (K, S, H) region per sequence slot and layer: k[l] is (slots, K, S, H)."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.linear_states: LinearStates | None = None  # (linear-attention layers; slots: the batch's slots_B)

    def attend(self, layer: int, q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor,
               batch: AttentionBatch, scale: float, sliding_window: int | None,
               sinks_N: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
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
        if chunk:
            return chunked_attention(q_TNH, k_BKSH, v_BKSH, batch.seq_idx_T, batch.tok_idx_T, batch.positions_T,
                                     scale, chunk, sinks_N)
        return cached_attention(q_TNH, k_BKSH, v_BKSH, batch.seq_idx_T, batch.tok_idx_T, batch.positions_T,
                                batch.max_q_len, scale, sliding_window, sinks_N)


class PagedKVCache:
    """Fixed-size pages shared by all sequences: k[l] is (P pages, S slots, K, H) and v[l] (P, S, K, V).

    Which pages a sequence owns is the block manager's business (attention_nodes/block_manager.py);
    the batch carries the block tables and each token's slot. Decode-only steps use the paged decode
    attention op given at construction (the Triton kernel on CUDA), also for values narrower than
    keys (MiMo-V2-Flash) and for chunked attention (Llama 4: each sequence from its chunk's start);
    steps with prefill gather each sequence's pages and run the reference attention. num_kv_heads:
    one count for every layer or one per layer (MiMo-V2-Flash); v_head_dim: the values' size (None:
    head_dim).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int | Sequence[int],
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 decode_attention: Callable = paged_decode_attention, v_head_dim: int | None = None):
        heads = [num_kv_heads] * num_layers if isinstance(num_kv_heads, int) else list(num_kv_heads)
        V = head_dim if v_head_dim is None else v_head_dim
        self.k = [torch.zeros((num_blocks, block_size, K, head_dim), dtype=dtype, device=device) for K in heads]
        self.v = [torch.zeros((num_blocks, block_size, K, V), dtype=dtype, device=device) for K in heads]
        self.decode_attention = decode_attention
        self.linear_states: LinearStates | None = None  # models with linear-attention layers
        self._chunk_start: tuple | None = None  # (lens_B, (chunk, version), start_B): the last chunked decode

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def attend(self, layer: int, q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor,
               batch: AttentionBatch, scale: float, sliding_window: int | None,
               sinks_N: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        assert batch.block_table_BM is not None and batch.slot_mapping_T is not None, "build the batch with build_paged"
        k_pages, v_pages = self.k[layer], self.v[layer]
        k_pages.view(-1, *k_pages.shape[2:]).index_copy_(0, batch.slot_mapping_T, k_TKH)
        v_pages.view(-1, *v_pages.shape[2:]).index_copy_(0, batch.slot_mapping_T, v_TKH)
        if batch.max_q_len == 1:  # one token per sequence, in sequence order
            return self._decode(q_TNH, k_pages, v_pages, batch.block_table_BM, batch.kv_lens_B, scale,
                                sliding_window, sinks_N, chunk)
        if batch.parts is not None:  # decodes through the decode op; only prefilling sequences are gathered
            decode_T, decode_B, prefill_T, prefill = batch.parts
            o_TNH = q_TNH.new_empty(*q_TNH.shape[:2], v_pages.shape[-1])  # (values may be narrower than keys)
            o_TNH[decode_T] = self._decode(q_TNH[decode_T], k_pages, v_pages, batch.block_table_BM[decode_B],
                                           batch.kv_lens_B[decode_B], scale, sliding_window, sinks_N, chunk)
            o_TNH[prefill_T] = self._gathered(q_TNH[prefill_T], k_pages, v_pages, prefill, scale, sliding_window,
                                              sinks_N, chunk)
            return o_TNH
        return self._gathered(q_TNH, k_pages, v_pages, batch, scale, sliding_window, sinks_N, chunk)

    def _decode(self, q_BNH: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table_BM: torch.Tensor,
                lens_B: torch.Tensor, scale: float, sliding_window: int | None, sinks_N: torch.Tensor | None,
                chunk: int | None) -> torch.Tensor:
        """The decode op, in place over the pages; with a chunk, each sequence sees the keys from its
        chunk's first position (the one holding its last token, p - p % chunk) to p, any chunk size."""
        if chunk is None:
            return self.decode_attention(q_BNH, k_pages, v_pages, table_BM, lens_B, scale, sliding_window, sinks_N)
        return self.decode_attention(q_BNH, k_pages, v_pages, table_BM, lens_B, scale, sliding_window, sinks_N,
                                     self._chunk_starts(lens_B, chunk))

    def _chunk_starts(self, lens_B: torch.Tensor, chunk: int) -> torch.Tensor:
        """start_B: each sequence's chunk start for its last token, computed once per step (every
        chunked layer of a step passes the same lengths tensor, and the decode op's per-step layout
        is reused only for the same start tensor)."""
        key = (chunk, -1 if lens_B.is_inference() else lens_B._version)  # (inference tensors: identity alone)
        last = self._chunk_start
        if last is not None and last[0] is lens_B and last[1] == key:
            return last[2]
        start_B = (lens_B - 1).div_(chunk, rounding_mode="floor").mul_(chunk)
        self._chunk_start = (lens_B, key, start_B)
        return start_B

    def _gathered(self, q_TNH: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: AttentionBatch,
                  scale: float, sliding_window: int | None, sinks_N: torch.Tensor | None,
                  chunk: int | None = None) -> torch.Tensor:
        """Reference attention over each sequence's pages copied into one (B, K, S, H) tensor."""
        k_BKSH = gather_pages(k_pages, batch.block_table_BM, batch.max_kv_len)
        v_BKSH = gather_pages(v_pages, batch.block_table_BM, batch.max_kv_len)
        if chunk:
            return chunked_attention(q_TNH, k_BKSH, v_BKSH, batch.seq_idx_T, batch.tok_idx_T, batch.positions_T,
                                     scale, chunk, sinks_N)
        return cached_attention(q_TNH, k_BKSH, v_BKSH, batch.seq_idx_T, batch.tok_idx_T, batch.positions_T,
                                batch.max_q_len, scale, sliding_window, sinks_N)


class PagedLatentCache:
    """The paged cache of Multi-head Latent Attention: kv[l] is (P pages, S slots, W) where each row
    is a token's normalised latent and its roped key (W = kv_lora_rank + qk_rope_head_dim), one
    "kv head" shared by all query heads instead of K keys and values per head.

    Decode-only steps attend in the latent space with the layer's absorbed projections through
    the decode op given at construction (paged_latent_decode_attention; the Triton kernel on CUDA);
    sequences with several new tokens (prefill chunks) gather their pages and expand the latents
    into per-head keys and values (cheaper per cached token when many queries share them).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, width: int, latent_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 decode_attention: Callable = paged_latent_decode_attention, index_dim: int = 0,
                 index_layers: "tuple[bool, ...] | None" = None):
        self.kv = [torch.zeros((num_blocks, block_size, width), dtype=dtype, device=device) for _ in range(num_layers)]
        self.latent_dim, self.decode_attention = latent_dim, decode_attention
        # DeepSeek Sparse Attention: each token's index key, paged as its latent row (I values), in the
        # layers that run an indexer (index_layers; default all); None in the others
        self.index_k = [torch.zeros((num_blocks, block_size, index_dim), dtype=dtype, device=device)
                        if index_dim and (index_layers is None or index_layers[i]) else None for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, width: int, dtype: torch.dtype) -> int:
        return num_layers * block_size * width * dtype.itemsize

    def attend_latent(self, layer: int, q_nope_TNP: torch.Tensor, q_pe_TNR: torch.Tensor, cached_TW: torch.Tensor,
                      batch: AttentionBatch, scale: float, mla: LatentProjections, index=None) -> torch.Tensor:
        assert batch.block_table_BM is not None and batch.slot_mapping_T is not None, "build the batch with build_paged"
        pages = self.kv[layer]
        pages.view(-1, pages.shape[-1]).index_copy_(0, batch.slot_mapping_T, cached_TW.to(pages.dtype))
        if index is not None:
            keys = self.index_k[layer]  # (None in a layer that reuses another's choice)
            if keys is not None:
                keys.view(-1, keys.shape[-1]).index_copy_(0, batch.slot_mapping_T, index.k_TI.to(keys.dtype))
            if batch.max_kv_len > index.topk:  # else every visible token is chosen: dense MLA below
                table, S = batch.block_table_BM, batch.max_kv_len
                keys_BSI = None if keys is None else gather_pages(keys[:, :, None, :], table, S)[:, 0]
                S_pages = -(-S // pages.shape[1]) * pages.shape[1]  # (gather_pages' length: whole pages)
                return sparse_latent_attention(q_nope_TNP, q_pe_TNR, (pages, table, S_pages), keys_BSI, batch, scale,
                                               mla, index)
        if batch.max_q_len == 1:
            return self._absorbed(q_nope_TNP, q_pe_TNR, pages, batch.block_table_BM, batch.kv_lens_B, scale, mla)
        if batch.parts is not None:
            decode_T, decode_B, prefill_T, prefill = batch.parts
            o_d = self._absorbed(q_nope_TNP[decode_T], q_pe_TNR[decode_T], pages, batch.block_table_BM[decode_B],
                                 batch.kv_lens_B[decode_B], scale, mla)
            o_TNV = o_d.new_empty(q_nope_TNP.shape[0], *o_d.shape[1:])
            o_TNV[decode_T] = o_d
            o_TNV[prefill_T] = self._expanded(q_nope_TNP[prefill_T], q_pe_TNR[prefill_T], pages, prefill, scale, mla)
            return o_TNV
        return self._expanded(q_nope_TNP, q_pe_TNR, pages, batch, scale, mla)

    def _absorbed(self, q_nope_TNP: torch.Tensor, q_pe_TNR: torch.Tensor, pages: torch.Tensor, table_BM: torch.Tensor,
                  lens_B: torch.Tensor, scale: float, mla: LatentProjections) -> torch.Tensor:
        q_TNW = mla.absorb_query(q_nope_TNP, q_pe_TNR).to(pages.dtype)
        return mla.output(self.decode_attention(q_TNW, pages, table_BM, lens_B, scale, self.latent_dim))

    @staticmethod
    def _expanded(q_nope_TNP: torch.Tensor, q_pe_TNR: torch.Tensor, pages: torch.Tensor, batch: AttentionBatch,
                  scale: float, mla: LatentProjections) -> torch.Tensor:
        cached_BSW = gather_pages(pages[:, :, None, :], batch.block_table_BM, batch.max_kv_len)[:, 0]
        k_BSNH, v_BSNV = mla.expand(cached_BSW)
        return cached_attention(torch.cat((q_nope_TNP, q_pe_TNR), dim=-1), k_BSNH.transpose(1, 2),
                                v_BSNV.transpose(1, 2), batch.seq_idx_T, batch.tok_idx_T, batch.positions_T,
                                batch.max_q_len, scale, None)


class LinearStates:
    """The per-sequence states of linear-attention layers (models/linear_attention.py): conv[l]
    (S slots, C channels, W = conv_kernel - 1 inputs) in the model's dtype and rec[l] (S, Hv, K, V)
    float32 for each linear layer l; slot s belongs to one running sequence at a time."""

    def __init__(self, cfg: "ModelConfig", num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        la = cfg.linear_attention
        layers = [i for i in range(cfg.num_layers) if cfg.is_linear(i)]
        self.num_slots = num_slots
        self.conv = {i: torch.zeros(num_slots, la.conv_dim, la.conv_kernel - 1, dtype=dtype, device=device)
                     for i in layers}
        self.rec = {i: torch.zeros(num_slots, la.value_heads, la.key_dim, la.value_dim, device=device)
                    for i in layers}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.conv, self.rec) for t in d.values())


class V4Cache:
    """What DeepSeek-V4's layers keep (models/deepseek_v4.py): per layer ring[l] (S, W, H); per
    compressed layer entries[l] (P, E, H), buf_kv[l] / buf_gate[l] (S, rows, F) float32; per CSA
    layer also index_entries[l] (P, E, I) and ibuf_kv[l] / ibuf_gate[l]."""

    def __init__(self, cfg, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype,
                 device: torch.device | str):
        v4 = cfg.v4
        H, I = cfg.head_dim, v4.index_head_dim
        self.block_size, self.num_slots = block_size, num_slots
        self.no_entries = torch.zeros(1, 1, H, dtype=dtype, device=device)  # (the decode op's pages in sliding layers)
        self.ring, self.entries, self.buf_kv, self.buf_gate = {}, {}, {}, {}
        self.index_entries, self.ibuf_kv, self.ibuf_gate = {}, {}, {}
        f32 = dict(dtype=torch.float32, device=device)
        for i in range(cfg.num_layers):
            self.ring[i] = torch.zeros(num_slots, v4.window, H, dtype=dtype, device=device)
            r = v4.rate(i)
            if not r:
                continue
            E, rows = v4.entries_per_page(r, block_size), v4.state_rows(i)
            self.entries[i] = torch.zeros(num_blocks, E, H, dtype=dtype, device=device)
            width = 2 * H if v4.is_csa(i) else H
            self.buf_kv[i], self.buf_gate[i] = torch.zeros(num_slots, rows, width, **f32), torch.zeros(num_slots, rows, width, **f32)
            if v4.is_csa(i):
                self.index_entries[i] = torch.zeros(num_blocks, E, I, dtype=dtype, device=device)
                self.ibuf_kv[i] = torch.zeros(num_slots, rows, 2 * I, **f32)
                self.ibuf_gate[i] = torch.zeros(num_slots, rows, 2 * I, **f32)


class V4PagedCache:
    """The engine's cache for DeepSeek-V4: its layers find their storage as `cache.v4`."""

    def __init__(self, store: V4Cache):
        self.v4 = store
        self.linear_states = None


def make_paged_cache(cfg: "ModelConfig", num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device | str, ops: "KernelOps",
                     state_slots: int = 0) -> "PagedKVCache | PagedLatentCache":
    """The engine's paged cache for a model: latent rows for MLA, per-head keys and values otherwise
    (none for linear-attention layers, which keep `state_slots` per-sequence states instead:
    cache.linear_states, models/linear_attention.py)."""
    if cfg.v4 is not None:  # (its window and compressor rows live in `state_slots` slots)
        return V4PagedCache(V4Cache(cfg, num_blocks, block_size, state_slots, dtype, device))
    if cfg.mla is not None:
        return PagedLatentCache(cfg.num_layers, num_blocks, block_size, cfg.mla.cache_width, cfg.mla.kv_lora_rank,
                                dtype, device, decode_attention=ops.paged_latent_decode_attention,
                                index_dim=cfg.mla.index_head_dim, index_layers=cfg.mla.index_layers or None)
    cache = PagedKVCache(cfg.num_layers, num_blocks, block_size,
                         [0 if cfg.is_linear(i) else cfg.kv_heads(i) for i in range(cfg.num_layers)],
                         cfg.head_dim, dtype, device, decode_attention=ops.paged_decode_attention, v_head_dim=cfg.v_dim)
    if cfg.linear_layers is not None:
        cache.linear_states = LinearStates(cfg, state_slots, dtype, device)
    return cache


def cache_bytes_per_block(cfg: "ModelConfig", block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of block_size tokens takes over all layers (from ModelConfig.kv_bytes_per_token;
    DeepSeek-V4: the entries its pages hold, models/deepseek_v4.V4Config.page_values)."""
    if cfg.v4 is not None:
        return cfg.v4.page_values(cfg.head_dim, block_size) * dtype.itemsize
    return block_size * cfg.kv_bytes_per_token(dtype)
