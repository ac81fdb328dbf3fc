"""What models/config.py reads family by family: transformers 5's defaults for fields a config.json
leaves out (DEFAULTS, DEFAULT_THETA, GPT_OSS_ROPE), DBRX's own field names, and the readers of the
families whose config.json lays a model out its own way (FIELDS), and the language model of a
multimodal config.json (text_config: Llama 4, Qwen3.5-MoE).

Each reader turns a config.json (already merged with DEFAULTS) into the ModelConfig fields that
differ from the generic reading, following transformers' definition of the family; every field
transformers reads is used or refused with a ConfigError naming it.
- Llama 4: interleaved dense and MoE layers (moe_layers / interleave_moe_layer_step, dense layers of
  intermediate_size_mlp), a shared expert of intermediate_size beside top-1 sigmoid routing that
  weighs the expert's input, layers without rope (no_rope_layers / no_rope_layer_interval) that
  attend globally with temperature tuning, rope layers that attend within chunks
  (attention_chunk_size, layer_types) with a weightless q/k L2 norm, and its complex-pair rope.
- MiMo-V2-Flash: full and sliding-window layers (layer_types) where the sliding ones have twice the
  kv heads, attention sinks and their own rope (rope_parameters per layer type: theta, partial
  rotary factor); value heads narrower than query/key heads (v_head_dim), scaled by
  attention_value_scale; dense and MoE layers (mlp_layer_types); DeepSeek-V3's routing without a
  shared expert.
- Qwen3-Next: gated DeltaNet layers (linear_attention) and full-attention layers (layer_types, by
  default every full_attention_interval-th), the full ones with a sigmoid output gate per head, q/k
  norms and partial rotary (0.25); Qwen2-MoE's gated shared expert beside softmax routing;
  RMSNorms that scale by 1 + weight; dense layers by mlp_only_layers / decoder_sparse_step.
- GLM-5 (glm_moe_dsa; its attention is models/config.py's DSA): indexer_types, which layers run
  their indexer and which reuse the last one's choice (indexer_layers).
- Qwen3.5-MoE (text): Qwen3-Next's layers with the linear layers' input projections split
  (in_proj_qkv of q, k, v one after the other; in_proj_z, in_proj_b, in_proj_a), experts in every
  layer, the router always renormalised, and multimodal rope (mrope_section), which for text (the
  three position ids equal) is plain rope over partial_rotary_factor (0.25) of each head.
"""
from typing import Any, Callable

from kernels.rotary import RopeConfig
from models.errors import ConfigError

RopeOf = Callable[[dict[str, Any]], RopeConfig]  # rope_parameters -> RopeConfig (models/config.py: _rope)

# transformers' default_theta
DEFAULT_THETA = {"mixtral": 1e6, "minimax_m2": 5e6, "gpt_oss": 150000.0, "llama4": 500000.0}
# transformers 5's defaults for fields a config.json may leave out, where they differ from the
# generic ones of models/config.py (which families without an entry keep)
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                     "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                     "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
                     "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                     "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
                     "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 163840,
                     "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "index_topk": 2048,
                     "index_head_dim": 128, "index_n_heads": 64, "first_k_dense_replace": 3},
    "glm_moe_dsa": {"vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
                    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64,
                    "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
                    "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 202752,
                    "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1, "index_topk": 2048,
                    "index_head_dim": 128, "index_n_heads": 32, "first_k_dense_replace": 3},
    "glm4_moe": {"num_key_value_heads": 8, "num_experts_per_tok": 8, "n_routed_experts": 128,
                 "moe_intermediate_size": 1408, "intermediate_size": 10944, "rms_norm_eps": 1e-5,
                 "max_position_embeddings": 131072},
    "minimax_m2": {"num_key_value_heads": 8, "head_dim": 128, "num_experts_per_tok": 8, "num_local_experts": 256,
                   "intermediate_size": 1536, "rms_norm_eps": 1e-6, "max_position_embeddings": 196608},
    "gpt_oss": {"num_key_value_heads": 8, "head_dim": 64, "num_experts_per_tok": 4, "num_local_experts": 128,
                "intermediate_size": 2880, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "sliding_window": 128},
    "llama4": {"num_key_value_heads": 8, "head_dim": 128, "num_experts_per_tok": 1, "num_local_experts": 16,
               "intermediate_size": 8192, "intermediate_size_mlp": 16384, "rms_norm_eps": 1e-5,
               "max_position_embeddings": 131072, "attention_chunk_size": 8192, "bos_token_id": 1, "eos_token_id": 2},
    "qwen3_next": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48, "num_attention_heads": 16,
                   "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                   "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
                   "num_experts": 512, "norm_topk_prob": True, "vocab_size": 151936},
    "qwen3_5_moe": {"hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                    "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8,
                    "num_experts": 256, "vocab_size": 248320},
    "deepseek_v4": {"vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
                    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
                    "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1,
                    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576,
                    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20,
                    "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024,
                    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "rms_norm_eps": 1e-6,
                    "bos_token_id": 0, "eos_token_id": 1},
    "mimo_v2_flash": {"num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128, "num_experts_per_tok": 8,
                      "n_routed_experts": 256, "moe_intermediate_size": 2048, "intermediate_size": 16384,
                      "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "sliding_window": 129,
                      "attention_value_scale": 0.707, "bos_token_id": 1},
}
# gpt-oss's rope when config.json gives neither rope_parameters nor rope_scaling
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def dbrx_fields(raw: dict[str, Any], src: str) -> dict[str, Any]:
    """DBRX's config.json (d_model, n_heads, attn_config, ffn_config, ...) in the field names the
    other families use: grouped-query attention with clipped q/k/v, experts in every layer, softmax
    routing renormalised over the top-k (moe_normalize_expert_weights)."""
    attn, ffn = raw.get("attn_config") or {}, raw.get("ffn_config") or {}
    fields = {"hidden_size": raw.get("d_model"), "num_attention_heads": raw.get("n_heads"),
              "num_hidden_layers": raw.get("n_layers"), "max_position_embeddings": raw.get("max_seq_len"),
              "num_key_value_heads": attn.get("kv_n_heads"), "clip_qkv": attn.get("clip_qkv"),
              "rope_theta": attn.get("rope_theta"), "intermediate_size": ffn.get("ffn_hidden_size"),
              "num_local_experts": ffn.get("moe_num_experts"), "num_experts_per_tok": ffn.get("moe_top_k"),
              "hidden_act": (ffn.get("ffn_act_fn") or {}).get("name", "silu"),
              "norm_topk_prob": ffn.get("moe_normalize_expert_weights", 1) is not None}
    for key, theirs in (("hidden_size", "d_model"), ("num_attention_heads", "n_heads"),
                        ("num_hidden_layers", "n_layers"), ("intermediate_size", "ffn_config.ffn_hidden_size"),
                        ("num_local_experts", "ffn_config.moe_num_experts"),
                        ("num_experts_per_tok", "ffn_config.moe_top_k")):
        if fields[key] is None:
            raise ConfigError(f"{src}: required field '{theirs}' is missing")
    return {**raw, **{k: v for k, v in fields.items() if v is not None}}


def text_config(raw: dict[str, Any], family: str, src: str) -> dict[str, Any]:
    """A multimodal config.json (Llama4ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration)
    holds the language model in text_config: its fields, with the top level's dtype, quantization and
    token ids where text_config has none. Qwen3.5-MoE's wrapper ties its lm_head by the top level's
    tie_word_embeddings (default false), whatever text_config says. A text model's (llama4_text,
    qwen3_5_moe_text) config.json is flat and returned as it is."""
    text = raw.get("text_config")
    if text is None:
        return raw
    if not isinstance(text, dict):
        raise ConfigError(f"{src}: text_config must be an object")
    inherited = ("dtype", "torch_dtype", "quantization_config", "bos_token_id", "eos_token_id", "pad_token_id")
    own = {"tie_word_embeddings": bool(raw.get("tie_word_embeddings", False))} if family == "qwen3_5_moe" else {}
    return {**{k: raw[k] for k in inherited if raw.get(k) is not None}, **text, **own,
            "architectures": raw.get("architectures") or [], "model_type": raw.get("model_type")}


def indexer_layers(raw: dict[str, Any], layers: int, src: str) -> tuple[bool, ...]:
    """GLM-5's indexer_types (transformers' GlmMoeDsaConfig.__post_init__) as one bool per layer: True
    where the layer runs its indexer ("full"), False where it reuses the choice of the last full layer
    before it ("shared"). Where indexer_types is absent: index_topk_pattern ("F"/"S" per layer, or a
    list of the names), else every index_topk_freq-th layer from index_skip_topk_offset - 1 on is full
    and the layers before it too (defaults 1 and 2: all full). Layer 0 must be full (a shared layer
    has no choice to reuse there; transformers' forward fails)."""
    types = raw.get("indexer_types")
    key = "indexer_types"
    if types is None and raw.get("index_topk_pattern") is not None:
        key, pattern = "index_topk_pattern", raw["index_topk_pattern"]
        if isinstance(pattern, str):
            if not set(pattern) <= {"F", "S"}:
                raise ConfigError(f"{src}: index_topk_pattern must be a string of 'F' / 'S', got {pattern!r}")
            pattern = [{"F": "full", "S": "shared"}[c] for c in pattern]
        types = pattern
    elif types is None:
        freq = max(int(raw.get("index_topk_freq") or 1), 1)
        offset = int(raw["index_skip_topk_offset"] if raw.get("index_skip_topk_offset") is not None else 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    types = layer_types({key: types}, key, ["full"] * layers, ("full", "shared"), src)
    if types[0] != "full":
        raise ConfigError(f"{src}: {key} must start with a 'full' layer (layer 0 has no earlier choice of tokens "
                          f"to share), got {types!r}")
    return tuple(t == "full" for t in types)


def check_no_dropout(raw: dict[str, Any], src: str) -> None:
    if float(raw.get("attention_dropout") or 0.0) != 0.0:
        raise ConfigError(f"{src}: attention_dropout={raw['attention_dropout']} is not supported (only 0)")


def llama4_fields(raw: dict[str, Any], layers: int, src: str, rope_of: RopeOf) -> dict[str, Any]:
    """ModelConfig fields of a Llama 4 text model (transformers' Llama4TextConfig.__post_init__)."""
    check_no_dropout(raw, src)
    top_k = int(raw.get("num_experts_per_tok") or 1)
    if top_k != 1:  # (models/moe_decoder.py: SparseMoE.start scales the one row each token sends)
        raise ConfigError(f"{src}: num_experts_per_tok={top_k} is not supported by llama4: its router weighs each "
                          f"expert's input, which is dispatched once per token (only 1 is supported)")
    if raw.get("moe_layers") is not None:
        moe = raw["moe_layers"]
        if not isinstance(moe, list) or not all(isinstance(i, int) and 0 <= i < layers for i in moe):
            raise ConfigError(f"{src}: moe_layers must list layer indices in [0, num_hidden_layers={layers}), "
                              f"got {moe}")
    else:
        step = int(raw.get("interleave_moe_layer_step") or 1)
        if step < 1:
            raise ConfigError(f"{src}: interleave_moe_layer_step must be >= 1, got {step}")
        moe = list(range(step - 1, layers, step))
    interval = int(raw.get("no_rope_layer_interval") or 4)
    no_rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]  # 1: the layer ropes
    if not isinstance(no_rope, list) or len(no_rope) < layers or not set(no_rope[:layers]) <= {0, 1}:
        raise ConfigError(f"{src}: no_rope_layers must list 0 or 1 for each of num_hidden_layers={layers} layers, "
                          f"got {no_rope!r}")
    ropes = tuple(bool(r) for r in no_rope[:layers])
    chunk = raw.get("attention_chunk_size")
    types = raw.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                       for r in ropes]
    if len(types) != layers or not set(types) <= {"chunked_attention", "full_attention"}:
        raise ConfigError(f"{src}: layer_types must list num_hidden_layers={layers} entries of 'chunked_attention' / "
                          f"'full_attention', got {types}")
    if "chunked_attention" in types and (not isinstance(chunk, int) or chunk <= 0):
        raise ConfigError(f"{src}: attention_chunk_size must be a positive int when layer_types has "
                          f"'chunked_attention' layers, got {chunk!r}")
    temperature = None
    if raw.get("attn_temperature_tuning", True) and not all(ropes):
        floor_scale, attn_scale = float(raw.get("floor_scale", 8192)), float(raw.get("attn_scale", 0.1))
        if floor_scale <= 0:
            raise ConfigError(f"{src}: floor_scale must be positive, got {floor_scale}")
        temperature = (floor_scale, attn_scale)
    inter = int(raw.get("intermediate_size") or 8192)
    return dict(
        moe_layers=tuple(i in set(moe) for i in range(layers)),
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=inter,  # one ungated shared expert of the experts' size
        intermediate_size=int(raw.get("intermediate_size_mlp") or 16384),
        rope_layers=None if all(ropes) else ropes,
        attention_chunks=tuple(chunk if t == "chunked_attention" else None for t in types),
        rope_interleave=True,
        qk_norm="l2" if raw.get("use_qk_norm", True) else "none",
        attn_temperature=temperature,
        router_scales_input=True,
    )


def layer_types(raw: dict[str, Any], key: str, default: list[str], kinds: tuple[str, str], src: str) -> list[str]:
    """raw[key] (default where absent): one of `kinds` per layer, else a ConfigError naming the field."""
    types = raw.get(key) or default
    if not isinstance(types, list) or len(types) != len(default) or not set(types) <= set(kinds):
        raise ConfigError(f"{src}: {key} must list num_hidden_layers={len(default)} entries of "
                          f"{' / '.join(repr(k) for k in kinds)}, got {types!r}")
    return types


def _rotary_dims(params: dict[str, Any], head_dim: int, key: str, src: str) -> int:
    factor = float(params.get("partial_rotary_factor", 0.334))  # (transformers' default for MiMo)
    dim = int(head_dim * factor)  # (transformers' rounding)
    if not 0 < dim <= head_dim or dim % 2:
        raise ConfigError(f"{src}: rope_parameters.{key}.partial_rotary_factor {factor} gives {dim} rotary dims of "
                          f"head_dim {head_dim}; need an even number in [2, head_dim]")
    return dim


def mimo_fields(raw: dict[str, Any], layers: int, src: str, rope_of: RopeOf) -> dict[str, Any]:
    """ModelConfig fields of MiMo-V2-Flash (transformers' MiMoV2FlashConfig and MiMoV2FlashAttention)."""
    check_no_dropout(raw, src)
    types = layer_types(raw, "layer_types", ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                                              for i in range(layers)], ("full_attention", "sliding_attention"), src)
    mlp = layer_types(raw, "mlp_layer_types", ["dense"] + ["sparse"] * (layers - 1), ("dense", "sparse"), src)
    sliding = [t == "sliding_attention" for t in types]
    # the reference implementation's sliding_window_size counts the previous tokens, without the query
    window = raw["sliding_window_size"] + 1 if raw.get("sliding_window_size") is not None else raw.get("sliding_window")
    if any(sliding) and (not isinstance(window, int) or window <= 0):
        raise ConfigError(f"{src}: sliding_window must be a positive int when layer_types has 'sliding_attention' "
                          f"layers, got {window!r}")
    heads, kv = int(raw["num_attention_heads"]), int(raw["num_key_value_heads"])
    if any(sliding) and heads % (2 * kv):
        raise ConfigError(f"{src}: num_attention_heads ({heads}) must be a multiple of the sliding layers' "
                          f"2 x num_key_value_heads ({2 * kv})")
    head_dim, v_head_dim = int(raw["head_dim"]), int(raw["v_head_dim"])
    ropes = raw.get("rope_parameters") or {
        "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}
    for kind in set(types):
        if not isinstance(ropes.get(kind), dict):
            raise ConfigError(f"{src}: rope_parameters must hold an object for each layer type, '{kind}' has none")
    full = ropes.get("full_attention") or ropes["sliding_attention"]  # (a model without full layers)
    swa = ropes.get("sliding_attention") or full
    value_scale = raw.get("attention_value_scale")
    return dict(
        moe_layers=tuple(m == "sparse" for m in mlp),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        shared_expert_intermediate_size=0,
        sliding_windows=tuple(window if s else None for s in sliding),
        layer_kv_heads=tuple(2 * kv if s else kv for s in sliding),
        attention_sinks=any(sliding),
        sink_layers=tuple(sliding),
        v_head_dim=v_head_dim,
        v_scale=1.0 if value_scale is None else float(value_scale),
        rope=rope_of(full),
        rotary_dim=_rotary_dims(full, head_dim, "full_attention", src),
        sliding_rope=rope_of(swa),
        sliding_rotary_dim=_rotary_dims(swa, head_dim, "sliding_attention", src),
    )


def qwen3_next_fields(raw: dict[str, Any], layers: int, src: str, rope_of: RopeOf) -> dict[str, Any]:
    """ModelConfig fields of Qwen3-Next (transformers' Qwen3NextConfig and Qwen3NextDecoderLayer);
    linear_attention: LinearAttentionConfig's fields (models/attention_config.py; models/config.py builds it)."""
    check_no_dropout(raw, src)
    interval = int(raw.get("full_attention_interval") or 4)
    if interval < 1:
        raise ConfigError(f"{src}: full_attention_interval must be >= 1, got {interval}")
    types = layer_types(raw, "layer_types", ["linear_attention" if (i + 1) % interval else "full_attention"
                                              for i in range(layers)], ("linear_attention", "full_attention"), src)

    def positive(key: str, default: int) -> int:
        value = raw.get(key, default)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{src}: {key} must be a positive int, got {value!r}")
        return value

    la = dict(key_heads=positive("linear_num_key_heads", 16), value_heads=positive("linear_num_value_heads", 32),
              key_dim=positive("linear_key_head_dim", 128), value_dim=positive("linear_value_head_dim", 128),
              conv_kernel=positive("linear_conv_kernel_dim", 4))
    if la["value_heads"] % la["key_heads"]:
        raise ConfigError(f"{src}: linear_num_value_heads ({la['value_heads']}) must be a multiple of "
                          f"linear_num_key_heads ({la['key_heads']})")
    step, mlp_only = positive("decoder_sparse_step", 1), raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise ConfigError(f"{src}: mlp_only_layers must list layer indices, got {mlp_only!r}")
    experts = int(raw.get("num_experts") or 0)
    bias = bool(raw.get("attention_bias", False))
    return dict(
        moe_layers=tuple(i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(layers)),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(raw["shared_expert_intermediate_size"]),
        shared_expert_gate=True,
        qk_norm="per_head",
        o_bias=bias,
        linear_layers=tuple(t == "linear_attention" for t in types),
        linear_attention=la,
        attn_output_gate=True,
        norm_offset=1.0,
    )


def qwen3_5_moe_fields(raw: dict[str, Any], layers: int, src: str, rope_of: RopeOf) -> dict[str, Any]:
    """ModelConfig fields of Qwen3.5-MoE's language model (transformers' Qwen3_5MoeTextConfig and
    Qwen3_5MoeDecoderLayer): Qwen3-Next's, with the linear layers' projections split and experts in
    every layer (transformers reads neither decoder_sparse_step nor mlp_only_layers). Its rope's
    mrope_section / mrope_interleaved only choose which of the three position ids (temporal, height,
    width) each frequency takes; for text the three are equal, so they change nothing and are not read."""
    fields = qwen3_next_fields({**raw, "decoder_sparse_step": 1, "mlp_only_layers": []}, layers, src, rope_of)
    return {**fields, "moe_layers": (True,) * layers,
            "linear_attention": {**fields["linear_attention"], "split_projections": True}}


def deepseek_v4_fields(raw: dict[str, Any], layers: int, src: str, rope_of: RopeOf) -> dict[str, Any]:
    """ModelConfig fields of DeepSeek-V4 (transformers' DeepseekV4Config): layer_types (or the legacy
    compress_ratios 0 / 4 / 128; default two heavily compressed layers then compressed sparse and
    heavily compressed alternating), compress_rates, mlp_layer_types (or num_hash_layers; default 3
    hash-routed), two ropes (rope_parameters main and compress, or rope_theta and compress_rope_theta
    with a top-level yarn for the compressed layers, whose attention_factor is 1), mHC, the grouped
    output projection, sqrtsoftplus (or softmax / sigmoid) routing with a correction bias, always
    renormalised, clamped SwiGLU experts and shared experts. v4: models/deepseek_v4.V4Config's fields."""
    from kernels.moe import SwiGLU
    from kernels.routing import RouterConfig

    check_no_dropout(raw, src)

    def positive(key: str) -> int:
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{src}: {key} must be a positive int, got {value!r}")
        return value

    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(raw.get("compress_rates") or {})}
    for key, legacy in (("compressed_sparse_attention", "compress_rate_csa"), ("heavily_compressed_attention",
                                                                              "compress_rate_hca")):
        rates[key] = raw.get(legacy, rates[key])
        if not isinstance(rates[key], int) or rates[key] < 1 or rates[key] & (rates[key] - 1):
            raise ConfigError(f"{src}: compress_rates.{key} must be a power of two, got {rates[key]!r}")
    kinds = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
    by_ratio = {0: "sliding_attention", rates["compressed_sparse_attention"]: "compressed_sparse_attention",
                rates["heavily_compressed_attention"]: "heavily_compressed_attention"}
    default = ["heavily_compressed_attention"] * min(layers, 2) + [
        "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(layers - 2, 0))]
    if raw.get("layer_types") is None and isinstance(raw.get("compress_ratios"), list):
        ratios = raw["compress_ratios"][:layers]
        if any(r not in by_ratio for r in ratios):
            raise ConfigError(f"{src}: compress_ratios must hold 0 or the compress rates {sorted(by_ratio)}, got {ratios}")
        default = [by_ratio[r] for r in ratios]
    types = raw.get("layer_types") or default
    types = list(types)[:layers] if len(types) >= layers else types
    if len(types) != layers or any(t not in kinds for t in types):
        raise ConfigError(f"{src}: layer_types must list num_hidden_layers={layers} entries of {', '.join(kinds)}, "
                          f"got {types}")
    n_hash = raw.get("num_hash_layers", 3)
    mlp_types = raw.get("mlp_layer_types") or ["hash_moe"] * min(layers, n_hash) + ["moe"] * max(0, layers - n_hash)
    mlp_types = list(mlp_types)[:layers]
    if len(mlp_types) != layers or any(t not in ("hash_moe", "moe") for t in mlp_types):
        raise ConfigError(f"{src}: mlp_layer_types must list num_hidden_layers={layers} entries of hash_moe, moe, "
                          f"got {mlp_types}")
    head_dim = positive("head_dim")
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = raw.get("partial_rotary_factor")
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
        factor = main.get("partial_rotary_factor", factor)
    else:
        yarn = {k: v for k, v in params.items() if k not in ("main", "compress", "partial_rotary_factor")}
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        compress = {**yarn, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
        factor = params.get("partial_rotary_factor", factor)
    if compress.get("rope_type", compress.get("type")) == "yarn":
        compress.setdefault("attention_factor", 1.0)
    if factor is None:
        factor = 64 / 512 if raw.get("qk_rope_head_dim") is None else raw["qk_rope_head_dim"] / head_dim
    rope_dim = int(head_dim * float(factor))
    if rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(f"{src}: partial_rotary_factor {factor} gives {rope_dim} rotary dims of head_dim {head_dim}; "
                          f"need an even number in [2, head_dim]")
    heads, groups = positive("num_attention_heads"), positive("o_groups")
    if heads % groups:
        raise ConfigError(f"{src}: o_groups ({groups}) must divide num_attention_heads ({heads})")
    if int(raw.get("num_key_value_heads", 1)) != 1:
        raise ConfigError(f"{src}: DeepSeek-V4 attention has one key/value head, got num_key_value_heads="
                          f"{raw['num_key_value_heads']}")
    index_dim = positive("index_head_dim")
    if index_dim < rope_dim:
        raise ConfigError(f"{src}: index_head_dim ({index_dim}) must be at least the {rope_dim} rotary dims")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "softmax", "sigmoid"):
        raise ConfigError(f"{src}: scoring_func={scoring!r} is not supported; supported: sqrtsoftplus, softmax, sigmoid")
    top_k, inter = positive("num_experts_per_tok"), positive("moe_intermediate_size")
    limit = float(raw.get("swiglu_limit") or 0) or None
    return dict(
        moe_layers=(True,) * layers,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=inter * int(raw.get("n_shared_experts", 1)),
        sliding_windows=(None,) * layers,
        rope=rope_of(main),
        rotary_dim=rope_dim,
        router=RouterConfig(top_k, scoring, renormalize=True, scaling=float(raw.get("routed_scaling_factor", 1.5)),
                            correction_bias=True, weights_fp32=True),
        expert_act=SwiGLU(1.0, limit, 0.0),
        v4=dict(layer_types=tuple(kinds[t] for t in types), csa_rate=rates["compressed_sparse_attention"],
                hca_rate=rates["heavily_compressed_attention"], window=positive("sliding_window"),
                rope_dim=rope_dim, q_lora_rank=positive("q_lora_rank"), o_groups=groups,
                o_lora_rank=positive("o_lora_rank"), index_heads=positive("index_n_heads"), index_head_dim=index_dim,
                index_topk=positive("index_topk"), compress_rope=rope_of(compress), hc_mult=positive("hc_mult"),
                hc_iters=positive("hc_sinkhorn_iters"), hc_eps=float(raw.get("hc_eps", 1e-6)),
                hash_layers=tuple(t == "hash_moe" for t in mlp_types)),
    )


FIELDS = {"deepseek_v4": deepseek_v4_fields, "llama4": llama4_fields, "mimo_v2_flash": mimo_fields, "qwen3_next": qwen3_next_fields,
          "qwen3_5_moe": qwen3_5_moe_fields}
