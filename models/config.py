"""ModelConfig: one frozen description of a supported MoE decoder, read from a Hugging Face config.json.

Both writers are understood: transformers 4 (`torch_dtype`, top-level `rope_theta`, `rope_scaling`)
and transformers 5 (`dtype`, `rope_parameters`, `layer_types`). Errors name the file and the field.
"""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.rotary import ROPE_TYPES, RopeConfig

# architectures entry -> family; each family's semantics follow transformers' definition of it.
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_THETA = {"mixtral": 1e6}


class ConfigError(ValueError):
    """A config.json that Shuttle cannot serve; the message names the file and the field."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of one MoE decoder. Per-layer fields are tuples of length num_layers."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers (mlp_only_layers, decoder_sparse_step)
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    router_weights_fp32: bool  # Mixtral weighs expert outputs with float32 router weights; others round first
    moe_layers: tuple[bool, ...]
    sliding_windows: tuple[int | None, ...]
    qkv_bias: bool
    o_bias: bool
    qk_norm: str  # "none", "per_head" (Qwen3-MoE) or "full" (OLMoE: over the whole projection)
    clip_qkv: float | None
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype  # the checkpoint's dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest context served: max_position_embeddings, extended by linear, dynamic and yarn
        scaling (as vLLM derives it)."""
        r = self.rope
        if r.rope_type in ("linear", "dynamic") and r.factor:
            return max(self.max_position_embeddings, int(self.max_position_embeddings * r.factor))
        if r.rope_type == "yarn" and r.factor:
            base = r.original_max_position_embeddings or self.max_position_embeddings
            return max(self.max_position_embeddings, int(base * r.factor))
        return self.max_position_embeddings

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: file not found (a checkpoint directory needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        return _parse(raw, source)


def _parse(raw: dict[str, Any], src: str) -> ModelConfig:
    def get(key: str, default: Any = None, *aliases: str) -> Any:
        for k in (key, *aliases):
            if raw.get(k) is not None:
                return raw[k]
        return default

    def need(key: str, *aliases: str) -> Any:
        value = get(key, None, *aliases)
        if value is None:
            raise ConfigError(f"{src}: required field '{key}' is missing")
        return value

    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(
            f"{src}: architectures {archs} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    family = ARCHITECTURES[arch]
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{src}: hidden_act={act!r} is not supported (only 'silu')")

    hidden, layers, heads = int(need("hidden_size")), int(need("num_hidden_layers")), int(need("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads", heads))
    head_dim = int(get("head_dim", hidden // heads))
    if heads % kv_heads:
        raise ConfigError(f"{src}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if head_dim % 2:
        raise ConfigError(f"{src}: head_dim ({head_dim}) must be even for rotary embeddings")
    num_experts = int(need("num_local_experts", "num_experts"))
    top_k = int(need("num_experts_per_tok"))
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"{src}: num_experts_per_tok ({top_k}) must be in [1, num_experts={num_experts}]")

    if family == "mixtral":
        moe_layers = (True,) * layers
        moe_inter = int(need("intermediate_size"))
    else:
        step = int(get("decoder_sparse_step", 1))
        mlp_only = set(get("mlp_only_layers", []))
        moe_layers = tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(layers))
        moe_inter = int(need("moe_intermediate_size")) if family != "olmoe" else int(need("intermediate_size"))
    max_pos = int(get("max_position_embeddings", 4096))
    dtype_name = str(get("dtype", "float32", "torch_dtype")).replace("torch.", "")
    if dtype_name not in DTYPES:
        raise ConfigError(f"{src}: dtype {dtype_name!r} is not supported; supported: {', '.join(DTYPES)}")
    eos = get("eos_token_id", [])
    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(get("intermediate_size", moe_inter)),
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0)) if family == "qwen2_moe" else 0,
        num_experts=num_experts,
        top_k=top_k,
        norm_topk_prob=True if family == "mixtral" else bool(get("norm_topk_prob", False)),
        router_weights_fp32=family == "mixtral",
        moe_layers=moe_layers,
        sliding_windows=_sliding_windows(raw, family, layers, src),
        qkv_bias=bool(get("qkv_bias", True)) if family == "qwen2_moe" else bool(get("attention_bias", False)),
        o_bias=family in ("qwen3_moe", "olmoe") and bool(get("attention_bias", False)),
        qk_norm={"qwen3_moe": "per_head", "olmoe": "full"}.get(family, "none"),
        clip_qkv=get("clip_qkv") if family == "olmoe" else None,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope=_rope(raw, family, max_pos, src),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        dtype=DTYPES[dtype_name],
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
        bos_token_id=get("bos_token_id"),
    )


def _sliding_windows(raw: dict[str, Any], family: str, layers: int, src: str) -> tuple[int | None, ...]:
    """Per-layer window, following each family's transformers definition."""
    window = raw.get("sliding_window") or None
    if family == "olmoe":
        return (None,) * layers
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


def _rope(raw: dict[str, Any], family: str, max_pos: int, src: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{src}: per-layer-type rope_parameters are not supported by {family}")
    theta = params.get("rope_theta", raw.get("rope_theta", _DEFAULT_THETA.get(family, 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{src}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    needed = {"linear": ["factor"], "dynamic": ["factor"], "llama3": ["factor", "low_freq_factor", "high_freq_factor"]}
    for key in needed.get(rope_type, []):
        if params.get(key) is None:
            raise ConfigError(f"{src}: rope_parameters.{key} is required for rope type {rope_type!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{src}: rope_parameters.partial_rotary_factor != 1 is not supported by {family}")
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
