"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2), as transformers defines it.

Legend: T tokens, D hidden, N heads, P qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim,
C kv_lora_rank, W = C + R (the cached width), B sequences, S cached tokens.

Each token's keys and values come from one latent: kv_a_proj_with_mqa(x) = [latent_C, k_pe_R];
the latent is normalised (kv_a_layernorm) and kv_b_proj expands it to every head's key part (P)
and value (V); k_pe is roped and shared by all heads. The KV cache keeps only [latent, roped k_pe]
(W values per token and layer). Two equal ways to attend over it:
- expanded (prefill): kv_b_proj over the cached latents, then ordinary attention with P+R keys;
- absorbed (decode): q_nope goes through kv_b's key part (q_C = W_uk^T q_nope), so scores are
  [q_C, q_pe] . [latent, k_pe] against the cache itself, the output is a weighted sum of latents
  (C per head) which kv_b's value part (W_uv) and o_proj turn back into D.
The cache decides which (models/kv_cache.py: MLA caches call `expand` or `absorb_query` / `output`).
"""
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

    def forward(self, x_TD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], cache: LatentKVCache,
                batch: AttentionBatch) -> torch.Tensor:
        m, T, N = self.m, x_TD.shape[0], self.cfg.num_heads
        q = self.q_proj(x_TD) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TD)))
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
        o_TNV = cache.attend_latent(self.layer, q_TNH[..., :m.qk_nope_head_dim], q_pe_TNR, cached_TW, batch,
                                    m.softmax_scale, self)
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


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
