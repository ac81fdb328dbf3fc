"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2, and the sparse form of V3.2 and GLM-5), as transformers
defines it.

Legend: T tokens, D hidden, N heads, P qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim,
C kv_lora_rank, W = C + R (the cached width), B sequences, S cached tokens; the indexer's
H index heads of I dims.

Each token's keys and values come from one latent: kv_a_proj_with_mqa(x) = [latent_C, k_pe_R];
the latent is normalised (kv_a_layernorm) and kv_b_proj expands it to every head's key part (P)
and value (V); k_pe is roped and shared by all heads. The KV cache keeps only [latent, roped k_pe]
(W values per token and layer). Two equal ways to attend over it:
- expanded (prefill): kv_b_proj over the cached latents, then ordinary attention with P+R keys;
- absorbed (decode): q_nope goes through kv_b's key part (q_C = W_uk^T q_nope), so scores are
  [q_C, q_pe] . [latent, k_pe] against the cache itself, the output is a weighted sum of latents
  (C per head) which kv_b's value part (W_uv) and o_proj turn back into D.
The cache decides which (models/kv_cache.py: MLA caches call `expand` or `absorb_query` / `output`).

DeepSeek Sparse Attention (V3.2): a lightweight `Indexer` gives each token an index key (I values,
cached beside its latent) and each query H index heads with weights; a query's score of cached
token t is sum_h w_h relu(q_h . k_t / sqrt(I)) / sqrt(H), and it attends (absorbed, in the latent
space) only to the index_topk tokens scoring highest among those it may see. Where no sequence of
the step has more than index_topk tokens that is every visible token: plain MLA, as transformers
(whose top-k then selects them all). GLM-5 ropes the indexer's dims in interleaved pairs (V3.2: the
halves), and only some layers run an indexer (MLAConfig.index_layers, its indexer_types "full"): the
others ("shared", without indexer weights or cached index keys) attend to the tokens the last full
layer chose for the same queries.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ops import KernelOps
from models.config import ModelConfig
from models.kv_cache import AttentionBatch, LatentKVCache
from models.norm import RMSNorm

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


class KVUpProjection(nn.Module):
    """kv_b_proj: weight (N*(P+V), C), kept a plain parameter (never packed for oneDNN) because
    the absorbed decode reads its key and value parts as (N, P, C) and (N, V, C) views."""

    def __init__(self, latent: int, out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, latent))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MLAttention(nn.Module):
    """Parameter names follow the checkpoints: q_proj or q_a_proj/q_a_layernorm/q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj."""

    def __init__(self, cfg: ModelConfig, layer: int, ops: KernelOps):
        super().__init__()
        assert cfg.mla is not None
        self.layer, self.cfg, self.m, self.ops = layer, cfg, cfg.mla, ops
        m, D, N = cfg.mla, cfg.hidden_size, cfg.num_heads
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(D, N * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, m.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = nn.Linear(m.q_lora_rank, N * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, m.cache_width, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = KVUpProjection(m.kv_lora_rank, N * (m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = nn.Linear(N * m.v_head_dim, D, bias=cfg.o_bias)
        self.indexer = Indexer(cfg) if m.index_topk and m.runs_indexer(layer) else None
        # a later layer reuses this one's choice of tokens (GLM-5's "shared" layers): the cache keeps it
        self.keep_choice = bool(m.index_topk) and layer + 1 < cfg.num_layers and not m.index_layers[layer + 1]

    def forward(self, x_TD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], cache: LatentKVCache,
                batch: AttentionBatch) -> torch.Tensor:
        m, T, N = self.m, x_TD.shape[0], self.cfg.num_heads
        q_resid = None if m.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x_TD))
        q = self.q_proj(x_TD) if q_resid is None else self.q_b_proj(q_resid)
        q_TNH = q.view(T, N, m.qk_head_dim)
        kv_TW = self.kv_a_proj_with_mqa(x_TD)
        latent_TC = self.kv_a_layernorm(kv_TW[:, :m.kv_lora_rank])
        q_pe_TNR, k_pe_T1R = q_TNH[..., m.qk_nope_head_dim:], kv_TW[:, None, m.kv_lora_rank:]
        if m.rope_interleave:
            # pairs (0,1), (2,3), ... -> the halves layout, so the neox rotation gives transformers'
            # interleaved result (its output is in this layout too, or a permutation of it for V2,
            # the same for q and k: the scores are equal)
            q_pe_TNR, k_pe_T1R = _deinterleave(q_pe_TNR), _deinterleave(k_pe_T1R)
        else:
            q_pe_TNR, k_pe_T1R = q_pe_TNR.clone(), k_pe_T1R.clone()
        q_pe_TNR, k_pe_T1R = self.ops.apply_rotary_(q_pe_TNR, k_pe_T1R, *cos_sin)
        cached_TW = torch.cat((latent_TC, k_pe_T1R[:, 0]), dim=-1)
        index = None
        if self.indexer is not None:
            index = self.indexer(x_TD, q_resid, cos_sin, self.ops, self.layer, self.keep_choice)
        elif m.index_topk:  # (a shared layer: the choice of the last layer that ran its indexer)
            index = IndexQuery(m.index_topk, m.index_source(self.layer), keep=self.keep_choice)
        o_TNV = cache.attend_latent(self.layer, q_TNH[..., :m.qk_nope_head_dim], q_pe_TNR, cached_TW, batch,
                                    m.softmax_scale, self, index)
        return self.o_proj(o_TNV.reshape(T, N * m.v_head_dim))

    # --- the two ways to use the cached latents (called by the cache) ---

    def expand(self, cached_XW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached [latent, k_pe] rows (any leading shape X) -> (keys (X, N, P+R), values (X, N, V))."""
        m, N = self.m, self.cfg.num_heads
        kv = self.kv_b_proj(cached_XW[..., :m.kv_lora_rank]).view(*cached_XW.shape[:-1], N, -1)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_pe = cached_XW[..., None, m.kv_lora_rank:].expand(*k_nope.shape[:-1], m.qk_rope_head_dim)
        return torch.cat((k_nope, k_pe), dim=-1), v

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's key part W_uk (N, P, C) and value part transposed, W_uv^T (N, C, V), both
        contiguous: strided bf16 batched matmuls took 7x longer on the CPU. Kept until the weight
        changes (its storage or version), so decode steps copy nothing; with gradients enabled
        (training never calls this, but a caller might) the views are used as they are."""
        m, w = self.m, self.kv_b_proj.weight
        w_NXC = w.view(self.cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w_NXC[:, :m.qk_nope_head_dim], w_NXC[:, m.qk_nope_head_dim:].transpose(1, 2)
        if torch.is_grad_enabled() and w.requires_grad:
            return w_uk, w_uv
        key = (w.data_ptr(), 0 if w.is_inference() else w._version, w.dtype)  # (inference tensors have no version)
        if getattr(self, "_absorbed_key", None) != key:
            self._absorbed, self._absorbed_key = (w_uk.contiguous(), w_uv.contiguous()), key
        return self._absorbed

    def absorb_query(self, q_nope_TNP: torch.Tensor, q_pe_TNR: torch.Tensor) -> torch.Tensor:
        """The query in the cache's space: [W_uk^T q_nope, q_pe], (T, N, W)."""
        q_latent_NTC = torch.bmm(q_nope_TNP.transpose(0, 1), self._kv_b()[0])
        return torch.cat((q_latent_NTC.transpose(0, 1), q_pe_TNR), dim=-1)

    def output(self, o_latent_TNC: torch.Tensor) -> torch.Tensor:
        """Attention-weighted latents (T, N, C) -> per-head values (T, N, V) through W_uv."""
        return torch.bmm(o_latent_TNC.transpose(0, 1), self._kv_b()[1]).transpose(0, 1)


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer, also GLM-5's (names as the checkpoints: wq_b, wk, k_norm,
    weights_proj). Returns an IndexQuery: the query's H heads (T, H, I) and weights (T, H), float32,
    and the token's index key (T, I) for the cache; the first R dims of queries and keys are roped
    (V3.2: the halves layout, unlike MLA's interleaved pairs; GLM-5: interleaved pairs, turned into
    the halves layout first as MLAttention does: the same permutation of q and k, equal scores). No
    gradient flows through the choice it makes (transformers runs it under no_grad; its weights do
    not train)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.mla
        self.heads, self.dim, self.topk, self.rope = m.index_heads, m.index_head_dim, m.index_topk, m.qk_rope_head_dim
        self.interleave = m.index_rope_interleave
        self.wq_b = nn.Linear(m.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = Float32Linear(cfg.hidden_size, self.heads)

    @torch.no_grad()
    def forward(self, x_TD: torch.Tensor, q_resid_TQ: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ops: KernelOps, layer: int, keep: bool = False) -> "IndexQuery":
        T, R = x_TD.shape[0], self.rope
        q_THI = self.wq_b(q_resid_TQ).view(T, self.heads, self.dim)
        k_T1I = self.k_norm(self.wk(x_TD)).view(T, 1, self.dim)
        q_pe, k_pe = q_THI[..., :R], k_T1I[..., :R]
        q_pe, k_pe = (_deinterleave(q_pe), _deinterleave(k_pe)) if self.interleave else (q_pe.clone(), k_pe.clone())
        q_pe, k_pe = ops.apply_rotary_(q_pe, k_pe, *cos_sin)
        q_THI = torch.cat((q_pe, q_THI[..., R:]), dim=-1).float() * self.dim ** -0.5
        k_TI = torch.cat((k_pe, k_T1I[..., R:]), dim=-1)[:, 0]
        w_TH = self.weights_proj(x_TD) * self.heads ** -0.5
        return IndexQuery(self.topk, layer, q_THI, w_TH, k_TI, keep)


class Float32Linear(nn.Module):
    """A bias-free linear whose weight stays float32 whatever dtype the model is cast to, applied to
    float32 inputs (transformers keeps the indexer's weights_proj in float32: _keep_in_fp32_modules).
    Not an nn.Linear, so CPU inference leaves it unpacked (it is (H, D), a few KiB)."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, inputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        if self.weight.is_floating_point() and self.weight.dtype != torch.float32:
            self.weight.data = self.weight.data.float()
        return out


class IndexQuery(NamedTuple):
    """What an MLA layer with DeepSeek Sparse Attention gives its cache: from its Indexer, the
    queries' index heads and weights and this call's index keys (Indexer.forward); from a layer
    that reuses an earlier layer's choice of tokens (GLM-5's "shared" layers), only which layer
    made it (source). keep: a later layer reuses this choice, so the cache leaves it on the call's
    AttentionBatch (models/kv_cache.sparse_latent_attention)."""

    topk: int
    source: int  # the layer whose choice of tokens this one attends to (itself where it runs its indexer)
    q_THI: torch.Tensor | None = None  # float32, scaled by I^-1/2
    w_TH: torch.Tensor | None = None  # float32, scaled by H^-1/2
    k_TI: torch.Tensor | None = None  # this call's index keys, to cache
    keep: bool = False


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
