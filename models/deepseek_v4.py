"""DeepSeek-V4's layers (transformers' DeepseekV4ForCausalLM): its attention, the caches it reads, and
the manifold-constrained hyper-connections (mHC) that replace the residual stream.

Legend: T tokens of the flat batch, B sequences, D hidden, N query heads, H head dim (one key = value
head shared by all query heads), R rotary dims (the last R of a head, pairs (0, 1), (2, 3), ...),
W sliding window, r a compressor's rate, F its features per token, J windows, n the hyper-connection
streams (hc_mult), G output groups, P pages, E entries per page, S state slots.

Attention (V4Attention). Queries come from a low-rank q_a -> q_a_norm -> q_b, each head normalised
without weight; one key = value row per token (kv_proj, kv_norm). Every layer attends to the last W
tokens (its sliding window); a compressed layer also attends to entries that summarise each r tokens
("csa": r = 4, the entries a lightning indexer scores highest, index_topk of them; "hca": r = 128,
all of them). An entry of window w is the softmax-gated sum of its tokens' compressor rows (CSA:
the first half of window w - 1's rows beside the second half of window w's), normalised and roped
at position w r; a query at p sees the entries of windows that end at or before p. Sink logits join
every softmax; the output is roped back (-sin) at the query's position, then projected per group
of heads (o_a_proj) and mixed (o_b_proj). Sliding layers rope with the main rope, compressed
layers with compress_rope (both on the last R dims of each head).

What a sequence keeps (V4Cache, made by models/kv_cache.make_paged_cache): per layer its last W key
rows in a ring (slot s, position p at p % W) and, per compressor, the rows of its pending partial
window (and, CSA, of the last complete one, which the next entry overlaps) in float32; both live in
state slots like linear attention's (one per running sequence). The entries are paged: entry w of
a sequence lives in page table[w r // page_size], row (w r % page_size) // r, so a page of
page_size tokens holds max(1, page_size // r) entries. A cache without V4 storage (training)
computes every sequence from position 0 and keeps nothing.

mHC (HyperConnection): the residual is n streams (T, n, D). Before attention and before the MLP a
learned map of the normalised streams gives pre (T, n), post (T, n) and comb (T, n, n, projected
towards doubly stochastic by Sinkhorn-Knopp); the block's input is the pre-weighted sum of the
streams, and its output x enters as streams' = post x + comb^T streams. The MLP's input leaves the
attention worker as for any family (experts see (T, D) rows); its post and comb wait with the streams
for its output (the residual models/moe_decoder.DecoderLayer.attention passes on is that triple). The
model's output is hc_head's weighted sum of the streams, then the final norm.
"""
import torch
import torch.nn.functional as F
from torch import nn

from kernels import native
from kernels.ops import KernelOps
from kernels.rotary import RopeConfig, RotaryEmbedding
from models.kv_cache import AttentionBatch
from models.mla import Float32Linear
from models.v4_config import V4Config

# gathered values at once (queries x keys x head dim, or queries x index heads x entries), per chunk of queries
ROWS_PER_CHUNK = 1 << 24


def rope_tail(x: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor) -> torch.Tensor:
    """x (T, ..., X) with its last 2 R2 values rotated in pairs (0, 1), (2, 3), ... by cos/sin
    (T, R2) float32, computed in float32 (transformers' DeepSeek-V4 apply_rotary_pos_emb)."""
    R = 2 * cos_TR2.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    cos, sin = cos_TR2.view(shape), sin_TR2.view(shape)
    rope = x[..., -R:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-R], rotated.to(x.dtype)), dim=-1)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class KeepsFloat32(nn.Module):
    """A module whose parameters named in float32_params stay float32 whatever dtype the model is cast
    to (transformers keeps them so: _keep_in_fp32_modules)."""

    float32_params: tuple[str, ...] = ()

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        for name in self.float32_params:
            p = getattr(self, name)
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        return out


class Float32Norm(KeepsFloat32):
    """An RMSNorm whose weight stays float32 (transformers keeps V4's kv norms so); y in x's dtype."""

    float32_params = ("weight",)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight.float() * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class Rope:
    """cos/sin (T, R/2) float32 of one of V4's two ropes, by position."""

    def __init__(self, cfg: RopeConfig, rope_dim: int):
        self.cfg, self.dim, self.table = cfg, rope_dim, None

    def __call__(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is None:
            self.table = RotaryEmbedding(self.cfg, self.dim, positions_T.device)
        cos, sin = self.table(positions_T, torch.float32)
        return cos[:, :self.dim // 2], sin[:, :self.dim // 2]


class GroupedLinear(nn.Module):
    """o_a_proj: each of G groups of heads' outputs (T, G, X) projected by its own (Y, X) block of
    weight (G Y, X) -> (T, G, Y)."""

    def __init__(self, inputs: int, outputs: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(outputs, inputs))

    def forward(self, x_TGX: torch.Tensor) -> torch.Tensor:
        w_GYX = self.weight.view(self.groups, -1, x_TGX.shape[-1])
        return torch.bmm(x_TGX.transpose(0, 1), w_GYX.transpose(1, 2)).transpose(0, 1)


class Compression(KeepsFloat32):
    """A compressor (or the indexer's): kv_proj and gate_proj (float32, F = 2 X with overlap, else X),
    the gates' position_bias (r, F), kv_norm over the X values of an entry."""

    float32_params = ("position_bias",)

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        F_ = 2 * width if overlap else width
        self.kv_proj = Float32Linear(hidden, F_)
        self.gate_proj = Float32Linear(hidden, F_)
        self.position_bias = nn.Parameter(torch.zeros(rate, F_))
        self.kv_norm = Float32Norm(width, eps)


    def entries(self, x_TD: torch.Tensor, batch: AttentionBatch, q_lens_B: torch.Tensor, rope: Rope,
                state: "tuple[torch.Tensor, torch.Tensor] | None") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The entries this call completes: (entries_BJX float32, their ids w_BJ, valid_BJ). Each
        sequence's stream of rows is [its last complete window (overlap)] [its pending rows] [this
        call's tokens]; state (kv, gate) (S, rows, F) holds the first two and gets what is left over."""
        r, ov, X = self.rate, int(self.overlap), self.width
        kv_TF, gate_TF = self.kv_proj(x_TD), self.gate_proj(x_TD)
        if state is not None and batch.max_q_len == 1:
            return self._decode_entries(kv_TF, gate_TF, batch, rope, state)
        B, dev = q_lens_B.numel(), x_TD.device
        ctx_B = batch.kv_lens_B - q_lens_B
        pend_B = ctx_B % r
        held_B = ov * r + pend_B  # rows of the stream before this call's (from the state; void without one)
        if state is None and int(ctx_B.max()) > 0:
            raise ValueError("DeepSeek-V4 attention without its cache: every sequence must start at position 0")
        L_B = held_B + q_lens_B
        L = -(-int(L_B.max()) // r) * r
        s_L = torch.arange(L, device=dev)
        starts_B = torch.cumsum(q_lens_B, 0) - q_lens_B
        T = kv_TF.shape[0]
        # source rows: [each sequence's state rows] [this call's tokens] [a zero row]
        rows = 0 if state is None else state[0].shape[1]
        src = [kv_TF, gate_TF]
        if state is not None:
            src = [torch.cat((st[batch.state_slots_B].reshape(B * rows, -1), x)) for st, x in zip(state, src)]
        src = [torch.cat((x, x.new_zeros(1, x.shape[1]))) for x in src]
        zero = B * rows + T
        new_BL = s_L[None, :] - held_B[:, None]
        old_BL = (torch.arange(B, device=dev)[:, None] * rows + s_L[None, :]) if state is not None else zero
        idx_BL = torch.where(new_BL < 0, old_BL, B * rows + starts_B[:, None] + new_BL)
        idx_BL = torch.where(s_L[None, :] < L_B[:, None], idx_BL, zero)
        kv_BLF, gate_BLF = src[0][idx_BL], src[1][idx_BL]
        # the stream's first row sits at position (ctx // r - ov) r; rows before position 0 or past the end are void
        first_B = (ctx_B // r - ov) * r
        pos_BL = first_B[:, None] + s_L[None, :]
        void_BL = (pos_BL < 0) | (s_L[None, :] >= L_B[:, None])
        if state is not None:  # what stays: the last complete window (overlap) and the rows past it
            keep_B = L_B - (batch.kv_lens_B % r) - ov * r
            take_BR = (keep_B[:, None] + torch.arange(rows, device=dev)[None, :]).clamp_(max=L - 1)
            state[0].index_copy_(0, batch.state_slots_B, kv_BLF.gather(1, take_BR[..., None].expand(-1, -1, kv_BLF.shape[-1])))
            state[1].index_copy_(0, batch.state_slots_B, gate_BLF.gather(1, take_BR[..., None].expand(-1, -1, kv_BLF.shape[-1])))
        J = L // r
        gate_BLF = (gate_BLF.view(B, J, r, -1) + self.position_bias).view(B, L, -1)
        gate_BLF = gate_BLF.masked_fill(void_BL[..., None], float("-inf"))
        kv_BJrF, gate_BJrF = kv_BLF.view(B, J, r, -1), gate_BLF.view(B, J, r, -1)
        if ov:  # entry j: window j - 1's first halves beside window j's second halves
            kv_BJsX = torch.cat((kv_BJrF[:, :-1, :, :X], kv_BJrF[:, 1:, :, X:]), dim=2)
            gate_BJsX = torch.cat((gate_BJrF[:, :-1, :, :X], gate_BJrF[:, 1:, :, X:]), dim=2)
        else:
            kv_BJsX, gate_BJsX = kv_BJrF, gate_BJrF
        probs = gate_BJsX.softmax(dim=2).nan_to_num(0.0)  # (an entry of void rows only is never valid)
        entries_BJX = self.kv_norm((kv_BJsX * probs).sum(dim=2))
        j_J = torch.arange(ov, J, device=dev)
        ids_BJ = first_B[:, None] // r + j_J[None, :]
        valid_BJ = ((j_J[None, :] + 1) * r <= L_B[:, None]) & (ids_BJ >= 0)
        return self._roped(entries_BJX, ids_BJ, rope), ids_BJ, valid_BJ

    def _roped(self, entries_BJX: torch.Tensor, ids_BJ: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Entries roped at their windows' first positions (w r)."""
        B, X = entries_BJX.shape[0], self.width
        cos, sin = rope((ids_BJ.clamp(min=0) * self.rate).reshape(-1))
        return rope_tail(entries_BJX.reshape(-1, X), cos, sin).view(B, -1, X)

    def _decode_entries(self, kv_BF, gate_BF, batch: AttentionBatch, rope: Rope, state):
        """entries() for one token per sequence: the row joins the sequence's pending ones in the
        state; only the sequences whose window it completes compute an entry (then, with overlap,
        that window becomes the last complete one)."""
        r, ov, X = self.rate, int(self.overlap), self.width
        lens_B, slots_B = batch.kv_lens_B, batch.state_slots_B
        row_B = ov * r + (lens_B - 1) % r
        state[0][slots_B, row_B] = kv_BF
        state[1][slots_B, row_B] = gate_BF
        done = torch.nonzero(lens_B % r == 0)[:, 0]
        B = lens_B.numel()
        if done.numel() == 0:
            empty = kv_BF.new_empty(B, 0, X)
            return empty, lens_B.new_empty(B, 0), torch.zeros(B, 0, dtype=torch.bool, device=lens_B.device)
        slots = slots_B[done]
        kv, gate = state[0][slots], state[1][slots]  # (D, rows, F)
        gate = gate + torch.cat((self.position_bias,) * (1 + ov))  # (rows of the last window and this one)
        if ov:
            first = (lens_B[done] <= r)[:, None, None]  # no window before this one
            kv_s = torch.cat((kv[:, :r, :X], kv[:, r:, X:]), dim=1)
            gate_s = torch.cat((gate[:, :r, :X].masked_fill(first, float("-inf")), gate[:, r:, X:]), dim=1)
            state[0][slots, :r] = kv[:, r:]
            state[1][slots, :r] = state[1][slots, r:]
        else:
            kv_s, gate_s = kv, gate
        entry_DX = self.kv_norm((kv_s * gate_s.softmax(dim=1)).sum(dim=1))
        ids_B1 = (lens_B // r - 1)[:, None]
        entries_B1X = kv_BF.new_zeros(B, 1, X).index_copy_(0, done, entry_DX[:, None])
        valid_B1 = torch.zeros(B, 1, dtype=torch.bool, device=lens_B.device).index_fill_(0, done, True)
        return self._roped(entries_B1X, ids_B1, rope), ids_B1, valid_B1


class Indexer(Compression):
    """The lightning indexer of a CSA layer: a compression of its own (index entries, index_head_dim
    wide), q_b_proj from the query's latent, and scorer.weights_proj (float32)."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, rate: int, eps: float):
        super().__init__(hidden, head_dim, rate, True, eps)
        self.heads, self.head_dim = heads, head_dim
        self.q_b_proj = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = Float32Linear(hidden, heads)


class V4Attention(KeepsFloat32):
    """One DeepSeek-V4 attention layer (see the module docstring); parameter names follow
    transformers' (self_attn.q_a_proj, ..., compressor.indexer.scorer.weights_proj)."""

    float32_params = ("sinks",)

    def __init__(self, cfg, layer: int, ops: KernelOps):
        super().__init__()
        v4: V4Config = cfg.v4
        self.layer, self.v4, self.ops = layer, v4, ops
        D, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.num_heads, self.head_dim, self.eps = N, H, cfg.rms_norm_eps
        self.rate, self.csa = v4.rate(layer), v4.is_csa(layer)
        self.scale = H ** -0.5
        self.q_a_proj = nn.Linear(D, v4.q_lora_rank, bias=False)
        self.q_a_norm = Float32Norm(v4.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(v4.q_lora_rank, N * H, bias=False)
        self.kv_proj = nn.Linear(D, H, bias=False)
        self.kv_norm = Float32Norm(H, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(N * H // v4.o_groups, v4.o_groups * v4.o_lora_rank, v4.o_groups)
        self.o_b_proj = nn.Linear(v4.o_groups * v4.o_lora_rank, D, bias=False)
        self.sinks = nn.Parameter(torch.zeros(N))
        self.compressor = None
        if self.rate:
            self.compressor = Compression(D, H, self.rate, self.csa, cfg.rms_norm_eps)
            if self.csa:
                self.compressor.indexer = Indexer(D, v4.q_lora_rank, v4.index_heads, v4.index_head_dim, self.rate,
                                                  cfg.rms_norm_eps)
        self.rope = Rope(v4.compress_rope if self.rate else cfg.rope, v4.rope_dim)
        self.index_rope = Rope(v4.compress_rope, v4.rope_dim) if self.csa else None


    def forward(self, x_TD: torch.Tensor, cos_sin, cache, batch: AttentionBatch) -> torch.Tensor:
        T, N, H = x_TD.shape[0], self.num_heads, self.head_dim
        store = getattr(cache, "v4", None)  # (models/kv_cache.V4Cache)
        cos, sin = self.rope(batch.positions_T)
        q_res_TQ = self.q_a_norm(self.q_a_proj(x_TD))
        q_TNH = unweighted_rms_norm(self.q_b_proj(q_res_TQ).view(T, N, H), self.eps)
        q_TNH = rope_tail(q_TNH, cos, sin)
        kv_TH = rope_tail(self.kv_norm(self.kv_proj(x_TD)), cos, sin)
        B = batch.kv_lens_B.numel()
        q_lens_B = (torch.bincount(batch.seq_idx_T, minlength=B) if batch.max_q_len > 1
                    else torch.ones(B, dtype=torch.long, device=x_TD.device))
        if store is not None and batch.max_q_len == 1:  # decode: the op reads the ring and pages in place
            o_TNH = self._decode(q_TNH, kv_TH, x_TD, q_res_TQ, batch, q_lens_B, store)
        else:
            win_keys = self._window(kv_TH, batch, q_lens_B, store)
            extra = self._entries(x_TD, q_res_TQ, batch, q_lens_B, store) if self.rate else None
            o_TNH = self._attend(q_TNH, win_keys, extra, batch)
        o_TNH = rope_tail(o_TNH, cos, -sin)
        G = self.v4.o_groups
        return self.o_b_proj(self.o_a_proj(o_TNH.reshape(T, G, -1)).reshape(T, -1))

    def _decode(self, q_BNH, kv_BH, x_BD, q_res_BQ, batch, q_lens_B, store) -> torch.Tensor:
        """One token per sequence: this step's row into the ring, the new entries into their pages, then
        the decode op (kernels/compressed_attention.py) over the window and the chosen (CSA) or all
        (HCA) entries."""
        ring, slots_B, lens_B = store.ring[self.layer], batch.state_slots_B, batch.kv_lens_B
        ring[slots_B, batch.positions_T % self.v4.window] = kv_BH.to(ring.dtype)
        B, size = q_BNH.shape[0], store.block_size
        if not self.rate:
            pages, rate = store.no_entries, size
            idx_BK = lens_B.new_empty(B, 0)
        else:
            pages, rate = store.entries[self.layer], self.rate
            _, idx_BK = self._entries(x_BD, q_res_BQ, batch, q_lens_B, store, read=False)
            if idx_BK is None:  # HCA: every complete window's entry
                n = int((lens_B // rate).max())
                w_n = torch.arange(n, device=lens_B.device)
                idx_BK = torch.where(w_n[None, :] < (lens_B // rate)[:, None], w_n[None, :], -1)
        return self.ops.compressed_decode_attention(q_BNH.to(ring.dtype), ring, slots_B, lens_B, pages,
                                                    batch.block_table_BM, idx_BK, rate, size, self.sinks, self.scale)

    def _window(self, kv_TH: torch.Tensor, batch: AttentionBatch, q_lens_B: torch.Tensor, store):
        """(ext_BXH, ext_valid_BX): per sequence the W - 1 key rows before this call (from the ring)
        then this call's, so that query i of a sequence sees ext[i : i + W]; the ring gets this
        call's last W rows."""
        W, H, dev = self.v4.window, kv_TH.shape[-1], kv_TH.device
        B, Q = q_lens_B.numel(), batch.max_q_len
        ctx_B = batch.kv_lens_B - q_lens_B
        pos_BO = ctx_B[:, None] - (W - 1) + torch.arange(W - 1, device=dev)[None, :]
        if store is None:
            old_BOH = kv_TH.new_zeros(B, W - 1, H)
        else:
            ring = store.ring[self.layer]
            old_BOH = ring[batch.state_slots_B[:, None], pos_BO % W]
        new_BQH = kv_TH.new_zeros(B, Q, H).index_put_((batch.seq_idx_T, batch.tok_idx_T), kv_TH)
        ext_BXH = torch.cat((old_BOH.to(kv_TH.dtype), new_BQH), dim=1)
        ext_valid_BX = torch.cat((pos_BO >= 0, torch.arange(Q, device=dev)[None, :] < q_lens_B[:, None]), dim=1)
        if store is not None:
            last_T = batch.tok_idx_T >= q_lens_B[batch.seq_idx_T] - W
            slot_T = batch.state_slots_B[batch.seq_idx_T]
            store.ring[self.layer][slot_T[last_T], batch.positions_T[last_T] % W] = kv_TH[last_T].to(store.ring[self.layer].dtype)
        return ext_BXH, ext_valid_BX

    def _entries(self, x_TD, q_res_TQ, batch, q_lens_B, store, read: bool = True):
        """The compressed entries each query may see: (entries_BnH (all of each sequence's, by id; None
        unless `read`), choice_TK (entry ids per query, -1 for none) or None for all visible ones)."""
        comp = self.compressor
        r = self.rate
        state = None if store is None else (store.buf_kv[self.layer], store.buf_gate[self.layer])
        new_BJH, ids_BJ, valid_BJ = comp.entries(x_TD, batch, q_lens_B, self.rope, state)
        all_BnH = self._all_entries(new_BJH, ids_BJ, valid_BJ, batch, store,
                                    None if store is None else store.entries[self.layer], read)
        if not self.csa:
            return all_BnH, None
        idx = comp.indexer
        istate = None if store is None else (store.ibuf_kv[self.layer], store.ibuf_gate[self.layer])
        inew, iids, ivalid = idx.entries(x_TD, batch, q_lens_B, self.index_rope, istate)
        iall_BnI = self._all_entries(inew, iids, ivalid, batch, store,
                                     None if store is None else store.index_entries[self.layer])
        T = x_TD.shape[0]
        Hi, I = idx.heads, idx.head_dim
        cos, sin = self.index_rope(batch.positions_T)
        qi_THI = rope_tail(idx.q_b_proj(q_res_TQ).view(T, Hi, I), cos, sin).float()
        w_TH = idx.scorer.weights_proj(x_TD) * Hi ** -0.5
        n = iall_BnI.shape[1]
        k = min(self.v4.index_topk, n)
        limit_T = (batch.positions_T + 1) // r
        rows = max(1, ROWS_PER_CHUNK // max(1, Hi * n))
        choice = []
        for start in range(0, T, rows):  # (chunks of queries, never one per token)
            t = slice(start, start + rows)
            keys_tnI = iall_BnI[batch.seq_idx_T[t]].float()
            scores_tHn = torch.bmm(qi_THI[t], keys_tnI.transpose(1, 2)).relu_() * I ** -0.5
            scores_tn = torch.bmm(w_TH[t][:, None, :], scores_tHn)[:, 0]
            future = torch.arange(n, device=x_TD.device)[None, :] >= limit_T[t][:, None]
            top_tK = scores_tn.masked_fill(future, float("-inf")).topk(k, dim=-1).indices
            choice.append(torch.where(top_tK >= limit_T[t][:, None], -1, top_tK))
        return all_BnH, torch.cat(choice) if choice else None

    def _all_entries(self, new_BJX, ids_BJ, valid_BJ, batch, store, pages, read: bool = True):
        """Each sequence's entries by id (B, n, X), n = the most any sequence has after this call;
        with a cache the new ones are written to their pages first and all are read from there
        (`read` False: only written, None returned)."""
        r, B, X = self.rate, ids_BJ.shape[0], new_BJX.shape[-1]
        n = int((batch.kv_lens_B // r).max())
        if pages is None:  # from position 0: the new entries are all of them, ids 0, 1, ...
            out = new_BJX.new_zeros(B, n, X)
            m = min(n, new_BJX.shape[1])
            return out.index_copy_(1, torch.arange(m, device=out.device), new_BJX[:, :m]) if m else out
        size, E = store.block_size, pages.shape[1]
        flat = pages.view(-1, X)
        table = batch.block_table_BM.long()
        if bool(valid_BJ.any()):
            b_V = torch.nonzero(valid_BJ)[:, 0]
            w_V = ids_BJ[valid_BJ]
            rows_V = table[b_V, (w_V * r) // size] * E + (w_V * r % size) // r
            flat.index_copy_(0, rows_V, new_BJX[valid_BJ].to(flat.dtype))
        if not read:
            return None
        if n == 0:
            return flat.new_zeros(B, 0, X)
        w_n = torch.arange(n, device=flat.device)
        page_Bn = table[:, ((w_n * r) // size).clamp(max=table.shape[1] - 1)]
        rows_Bn = page_Bn.clamp(min=0) * E + (w_n * r % size)[None, :] // r
        return flat[rows_Bn]

    def _attend(self, q_TNH, win, extra, batch) -> torch.Tensor:
        """Softmax over each query's window rows, its visible entries and the sink; K = V."""
        ext_BXH, ext_valid_BX = win
        W, T, N, H = self.v4.window, *q_TNH.shape
        dev = q_TNH.device
        entries_BnH, choice_TK = extra if extra is not None else (None, None)
        n = 0 if entries_BnH is None else entries_BnH.shape[1]
        width = W + (n if choice_TK is None else choice_TK.shape[1])
        rows = max(1, ROWS_PER_CHUNK // max(1, width * H))
        off_W = torch.arange(W, device=dev)
        out = []
        for start in range(0, T, rows):
            t = slice(start, start + rows)
            b_t = batch.seq_idx_T[t]
            at_tW = batch.tok_idx_T[t][:, None] + off_W[None, :]
            keys = [ext_BXH[b_t[:, None], at_tW]]
            valid = [ext_valid_BX[b_t[:, None], at_tW]]
            if entries_BnH is not None:
                limit_t = (batch.positions_T[t] + 1) // self.rate
                if choice_TK is None:
                    keys.append(entries_BnH[b_t].to(q_TNH.dtype))
                    valid.append(torch.arange(n, device=dev)[None, :] < limit_t[:, None])
                else:
                    c_tK = choice_TK[t]
                    keys.append(entries_BnH[b_t[:, None], c_tK.clamp(min=0)].to(q_TNH.dtype))
                    valid.append(c_tK >= 0)
            keys_tXH, valid_tX = torch.cat(keys, dim=1), torch.cat(valid, dim=1)
            logits_tNX = torch.bmm(q_TNH[t], keys_tXH.transpose(1, 2)).float() * self.scale
            logits_tNX = logits_tNX.masked_fill(~valid_tX[:, None, :], float("-inf"))
            sink_tN1 = self.sinks.float().view(1, N, 1).expand(logits_tNX.shape[0], N, 1)
            probs = torch.cat((logits_tNX, sink_tN1), dim=-1).softmax(-1)[..., :-1]
            out.append(torch.bmm(probs.to(keys_tXH.dtype), keys_tXH))
        return torch.cat(out) if out else q_TNH.new_empty(0, N, H)


class HyperConnection(KeepsFloat32):
    """One mHC map (attn_hc or ffn_hc): fn ((2 + n) n, n D), base ((2 + n) n), scale (3), float32."""

    float32_params = ("fn", "base", "scale")

    def __init__(self, hidden: int, n: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))


    def forward(self, streams_TnD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post_Tn, comb_Tnn, the block's input (T, D))."""
        n, T = self.n, streams_TnD.shape[0]
        flat = unweighted_rms_norm(streams_TnD.reshape(T, -1).float(), self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        if native.eager_cpu(mixed, self.base):  # (one C pass instead of ~120 small ops)
            pre, post, comb = native.hyper_weights(mixed, self.base, self.scale, n, self.iters, self.eps)
        else:
            pre_w, post_w, comb_w = mixed.split((n, n, n * n), dim=-1)
            pre_b, post_b, comb_b = self.base.split((n, n, n * n))
            pre_s, post_s, comb_s = self.scale.unbind(0)
            pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
            post = 2 * torch.sigmoid(post_w * post_s + post_b)
            comb = torch.softmax(comb_w.view(T, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
            for _ in range(self.iters - 1):
                comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
                comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams_TnD).sum(dim=1).to(streams_TnD.dtype)
        return post, comb, collapsed


def expand(streams_TnD: torch.Tensor, post_Tn: torch.Tensor, comb_Tnn: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
    """streams' = post x + comb^T streams (in the streams' dtype)."""
    dtype = streams_TnD.dtype
    return post_Tn.to(dtype).unsqueeze(-1) * x_TD.unsqueeze(-2) + torch.matmul(comb_Tnn.to(dtype).transpose(-1, -2),
                                                                                streams_TnD)


class HyperHead(KeepsFloat32):
    """hc_head: the final weighted sum of the streams (hc_fn (n, n D), hc_base (n), hc_scale (1), float32)."""

    float32_params = ("hc_fn", "hc_base", "hc_scale")

    def __init__(self, hidden: int, n: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))


    def forward(self, streams_TnD: torch.Tensor) -> torch.Tensor:
        T = streams_TnD.shape[0]
        flat = unweighted_rms_norm(streams_TnD.reshape(T, -1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams_TnD).sum(dim=1).to(streams_TnD.dtype)
