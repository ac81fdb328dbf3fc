"""The configs of the attention variants that are more than a head count: Multi-head Latent Attention
(DeepSeek-V2/V3, Kimi K2; with DeepSeek Sparse Attention's indexer in V3.2 and GLM-5) and Gated
DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE), with MLA's reader; and the readers of every
family's rotary embedding, partial rotary and sliding windows. models/config.py composes them into
ModelConfig (DeepSeek-V4's attention has models/v4_config.py).
"""
import math
from dataclasses import dataclass
from typing import Any

import torch

from kernels.rotary import ROPE_TYPES, RopeConfig
from models import families
from models.errors import ConfigError

MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")  # MLA with DeepSeek Sparse Attention's indexer
PARTIAL_ROTARY_FAMILIES = {"glm4_moe": 0.5, "minimax_m2": 1.0, "qwen3_next": 0.25, "qwen3_5_moe": 0.25}


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


def read_rotary_dim(raw: dict[str, Any], family: str, head_dim: int, src: str) -> int | None:
    """Partial rotary: partial_rotary_factor in rope_parameters (transformers 5) or at the top level,
    else MiniMax-M2's rotary_dim, else the family's default (GLM: 0.5, as transformers assumes).
    None when every dim is rotated."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if family not in PARTIAL_ROTARY_FAMILIES:
        if factor is not None and float(factor) != 1.0:
            raise ConfigError(f"{src}: partial_rotary_factor != 1 is not supported by {family}")
        return None
    if factor is None and family == "minimax_m2" and raw.get("rotary_dim") is not None:
        factor = int(raw["rotary_dim"]) / head_dim
    factor = PARTIAL_ROTARY_FAMILIES[family] if factor is None else float(factor)
    dim = int(head_dim * factor)  # (transformers' rounding)
    if not 0 < factor <= 1 or dim % 2 or dim == 0:
        raise ConfigError(f"{src}: partial_rotary_factor {factor} gives {dim} rotary dims of head_dim {head_dim}; "
                          f"need an even number in [2, head_dim]")
    return None if dim == head_dim else dim


def read_sliding_windows(raw: dict[str, Any], family: str, layers: int, src: str) -> tuple[int | None, ...]:
    """Per-layer window, following each family's transformers definition."""
    window = raw.get("sliding_window") or None
    if family in ("olmoe", "glm4_moe", "minimax_m2", "dbrx", "llama4", *MLA_FAMILIES):
        return (None,) * layers
    if family == "gpt_oss":  # layer_types, by default sliding and full alternating from layer 0
        types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(layers)]
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ConfigError(f"{src}: layer_types must list num_hidden_layers={layers} entries of "
                              f"'sliding_attention' / 'full_attention', got {types}")
        if "sliding_attention" in types and (window is None or int(window) <= 0):
            raise ConfigError(f"{src}: sliding_window must be a positive int when layer_types has "
                              f"'sliding_attention' layers, got {raw.get('sliding_window')!r}")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if family == "mixtral":
        return (window,) * layers
    use = bool(raw.get("use_sliding_window", False))
    if family == "qwen3_moe":
        return ((window if use else None),) * layers
    # qwen2_moe: explicit layer_types (transformers 5), else its default pattern.
    types = raw.get("layer_types")
    if types is None:
        max_window_layers = int(raw.get("max_window_layers", 28))
        types = [
            "sliding_attention" if (i + 1) % 2 and i < max_window_layers and use else "full_attention"
            for i in range(layers)
        ]
    if len(types) != layers:
        raise ConfigError(f"{src}: layer_types has {len(types)} entries, expected num_hidden_layers={layers}")
    window = window if use else None
    return tuple(window if t == "sliding_attention" else None for t in types)


def read_rope(raw: dict[str, Any], family: str, max_pos: int, src: str) -> RopeConfig:
    """The rotary embedding: rope_parameters (transformers 5) or rope_scaling and rope_theta (4), else the family's defaults."""
    default = families.GPT_OSS_ROPE if family == "gpt_oss" else {}
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or default)
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{src}: per-layer-type rope_parameters are not supported by {family}")
    theta = params.get("rope_theta", raw.get("rope_theta", families.DEFAULT_THETA.get(family, 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{src}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    needed = {"linear": ["factor"], "dynamic": ["factor"], "llama3": ["factor", "low_freq_factor", "high_freq_factor"]}
    for key in needed.get(rope_type, []):
        if params.get(key) is None:
            raise ConfigError(f"{src}: rope_parameters.{key} is required for rope type {rope_type!r}")
    orig = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))

    def opt(key: str) -> float | None:
        return None if params.get(key) is None else float(params[key])

    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=opt("factor"),
        max_position_embeddings=max_pos,
        original_max_position_embeddings=int(orig) if orig is not None else None,
        attention_factor=opt("attention_factor"),
        beta_fast=opt("beta_fast"),
        beta_slow=opt("beta_slow"),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        low_freq_factor=opt("low_freq_factor"),
        high_freq_factor=opt("high_freq_factor"),
    )
