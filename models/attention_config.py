"""The configs of the attention variants that are more than a head count: Multi-head Latent Attention
(DeepSeek-V2/V3, Kimi K2; with DeepSeek Sparse Attention's indexer in V3.2 and GLM-5) and Gated
DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE), with MLA's reader. models/config.py composes them
into ModelConfig (DeepSeek-V4's attention has models/v4_config.py).
"""
import math
from dataclasses import dataclass
from typing import Any

import torch

from kernels.rotary import RopeConfig
from models import families
from models.errors import ConfigError

MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")  # MLA with DeepSeek Sparse Attention's indexer


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2/V3). Queries: q_proj, or q_a_proj -> q_a_layernorm ->
    q_b_proj when q_lora_rank is set; keys and values come from one kv_lora_rank latent per token
    (plus one qk_rope_head_dim roped key shared by all heads), which is what the KV cache stores.
    softmax_scale: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times yarn's mscale(mscale_all_dim)**2."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rope dims pair up as (0, 1), (2, 3), ... instead of the two halves
    softmax_scale: float
    # DeepSeek Sparse Attention (V3.2, GLM-5; models/mla.py Indexer): each query attends to the index_topk
    # cached tokens its index_heads heads of index_head_dim score highest (0: dense MLA); the cache
    # keeps each token's index key (index_head_dim values) beside its latent
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # with index_topk, one per layer: True where the layer runs its own indexer, False where it reuses
    # the choice of the last layer before it that did (GLM-5's indexer_types "shared": such a layer has
    # no indexer weights and caches no index keys); V3.2: all True
    index_layers: tuple[bool, ...] = ()
    index_rope_interleave: bool = False  # the indexer's rope dims pair up as (0, 1), ... (GLM-5), not halves (V3.2)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per token and layer: the latent and the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def runs_indexer(self, layer: int) -> bool:
        """Whether `layer` scores tokens with its own indexer (and caches index keys)."""
        return self.index_topk > 0 and self.index_layers[layer]

    def index_source(self, layer: int) -> int | None:
        """The layer whose choice of tokens `layer` reuses (the last one up to it that runs its
        indexer: itself if it does), or None without sparse attention."""
        if not self.index_topk:
            return None
        return max(i for i in range(layer + 1) if self.index_layers[i])


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5-MoE; models/linear_attention.py): key_heads query/key
    heads of key_dim, value_heads (a multiple of key_heads) value heads of value_dim, a depthwise causal
    convolution of conv_kernel taps over q, k and v. Each sequence carries, per linear layer, the
    convolution's last conv_kernel - 1 inputs and a (value_heads, key_dim, value_dim) float32 state.
    split_projections: the checkpoint's input projections are Qwen3.5's in_proj_qkv (q of every key
    head, then k, then v), in_proj_z, in_proj_b and in_proj_a, not Qwen3-Next's in_proj_qkvz and
    in_proj_ba grouped per key head (the same weights, laid out differently)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    split_projections: bool = False

    @property
    def conv_dim(self) -> int:
        """Channels convolved: q and k of every key head, v of every value head."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One sequence's state in one layer: the convolution's inputs in `dtype`, the recurrent
        state in float32."""
        return self.conv_dim * (self.conv_kernel - 1) * dtype.itemsize + self.value_heads * self.key_dim * self.value_dim * 4

    def params(self, hidden: int) -> int:
        """One layer's parameters: the input projections (q, k, v, z, b, a), conv1d, dt_bias, A_log, the
        gated norm, out_proj."""
        v = self.value_heads * self.value_dim
        return (hidden * (self.conv_dim + v + 2 * self.value_heads) + self.conv_dim * self.conv_kernel
                + 2 * self.value_heads + self.value_dim + v * hidden)


def read_mla(raw: dict[str, Any], family: str, layers: int, src: str) -> MLAConfig:
    """MLA shapes (the softmax scale is filled in by with_mla_scale once the rope is known)."""
    def need(key: str) -> int:
        if raw.get(key) is None:
            raise ConfigError(f"{src}: required field '{key}' is missing")
        value = int(raw[key])
        if value <= 0:
            raise ConfigError(f"{src}: {key} must be positive, got {value}")
        return value

    rope_dim = need("qk_rope_head_dim")
    if rope_dim % 2:
        raise ConfigError(f"{src}: qk_rope_head_dim ({rope_dim}) must be even for rotary embeddings")
    q_lora = raw.get("q_lora_rank")
    if q_lora is not None and int(q_lora) <= 0:
        raise ConfigError(f"{src}: q_lora_rank must be positive or null, got {q_lora}")
    # V2 always pairs rope dims interleaved (and V3.2, GLM-5); V3 configs say so (rope_interleave, default true)
    interleave = family in ("deepseek_v2", *DSA_FAMILIES)
    index = {}
    if family in DSA_FAMILIES:  # (transformers' attention has no q_proj path there: the indexer reads q_a)
        if q_lora is None:
            raise ConfigError(f"{src}: q_lora_rank must be set for {family} (its indexer reads the query latent)")
        families.check_no_dropout(raw, src)  # (transformers drops attention weights out in training)
        index = dict(index_heads=need("index_n_heads"), index_head_dim=need("index_head_dim"),
                     index_topk=need("index_topk"), index_rope_interleave=family == "glm_moe_dsa",
                     index_layers=(families.indexer_layers(raw, layers, src) if family == "glm_moe_dsa"
                                   else (True,) * layers))
        if index["index_head_dim"] < rope_dim:
            raise ConfigError(f"{src}: index_head_dim ({index['index_head_dim']}) must be at least qk_rope_head_dim "
                              f"({rope_dim}): the indexer ropes the first qk_rope_head_dim of its heads")
    return MLAConfig(q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=need("kv_lora_rank"),
                     qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=rope_dim, v_head_dim=need("v_head_dim"),
                     rope_interleave=interleave or bool(raw.get("rope_interleave", True)), softmax_scale=0.0, **index)


def with_mla_scale(mla: MLAConfig, rope: RopeConfig) -> MLAConfig:
    """transformers' yarn_apply_mscale: with a scaled rope and mscale_all_dim, the softmax scale is
    multiplied by mscale(factor, mscale_all_dim) squared."""
    scale = mla.qk_head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor and rope.factor > 1:
        m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= m * m
    return MLAConfig(**{**mla.__dict__, "softmax_scale": scale})
