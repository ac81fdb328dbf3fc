"""The planner's model numbers are the engine's: for every family's config.json (the published
full-size ones, the configs shipped in planner/models, and tiny ones as transformers writes them)
the sizes, KV bytes and FLOPs per token that `shuttle plan` and `shuttle simulate` compute with
(planner.shapes -> models.config.ModelConfig -> planner.perf / planner.simulate) equal what
MoEForCausalLM builds from the engine's own ModelConfig (on the meta device: no memory) and the
KV cache it allocates."""
import json
from pathlib import Path

import pytest
import torch

from kernels.ops import torch_ops
from models.config import ARCHITECTURES, ConfigError, ModelConfig
from models.kv_cache import make_paged_cache
from models.moe_decoder import Experts, MoEForCausalLM, SparseMoE
from planner.hardware import Efficiency, HardwareKind
from planner.perf import RooflinePerf
from planner.shapes import MODELS_DIR, shape_from, shape_of
from planner.simulate import SimModel

# config.json as the checkpoints publish it (transformers 4 spelling)
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN15_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
              "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
              "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
              "num_experts_per_tok": 4, "decoder_sparse_step": 1, "norm_topk_prob": False, "vocab_size": 151936,
              "max_position_embeddings": 8192, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "hidden_act": "silu",
              "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
OLMOE = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024,
         "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
         "num_experts_per_tok": 8, "norm_topk_prob": False, "vocab_size": 50304, "max_position_embeddings": 4096,
         "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu", "clip_qkv": None,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
DEEPSEEK_V2 = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
               "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
               "num_hidden_layers": 60, "num_attention_heads": 128, "num_key_value_heads": 128,
               "n_shared_experts": 2, "n_routed_experts": 160, "routed_scaling_factor": 16.0, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
               "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3, "num_experts_per_tok": 6,
               "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False, "scoring_func": "softmax",
               "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
               "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
               "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
               "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "ep_size": 1,
               "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
               "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
               "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
               "rms_norm_eps": 1e-6, "rope_theta": 10000,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"},
               "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
               "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                       "weight_block_size": [128, 128]}}
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
           "n_routed_experts": 384, "num_attention_heads": 64, "num_key_value_heads": 64,
           "routed_scaling_factor": 2.827, "first_k_dense_replace": 1, "vocab_size": 163840}
GLM_45 = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "eos_token_id": [151329, 151336, 151338],
          "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5,
          "intermediate_size": 12288, "max_position_embeddings": 131072, "model_type": "glm4_moe",
          "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
          "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
          "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_hidden_layers": 92, "num_key_value_heads": 8,
          "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
          "torch_dtype": "bfloat16", "use_qk_norm": True, "vocab_size": 151552}
MINIMAX_M2 = {"architectures": ["MiniMaxM2ForCausalLM"], "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
              "intermediate_size": 1536, "max_position_embeddings": 196608, "model_type": "minimax_m2",
              "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62,
              "num_key_value_heads": 8, "num_local_experts": 256, "rms_norm_eps": 1e-06, "rope_theta": 5000000,
              "rotary_dim": 64, "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
              "qk_norm_type": "per_layer", "torch_dtype": "bfloat16", "vocab_size": 200064,
              "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                                      "weight_block_size": [128, 128]}}
GPT_OSS_120B = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
                "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
                "initial_context_length": 4096, "intermediate_size": 2880,
                "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
                "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
                "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128, "pad_token_id": 199999,
                "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                                   "model.layers.*.mlp.router", "model.embed_tokens",
                                                                   "lm_head"], "quant_method": "mxfp4"},
                "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                        "original_max_position_embeddings": 4096,
                                                        "rope_type": "yarn", "truncate": False},
                "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
                "vocab_size": 201088, "torch_dtype": "bfloat16"}
# Llama 4 as Meta publishes it: the language model in text_config beside the vision tower's (left
# out here: not served); Maverick interleaves dense layers (intermediate_size_mlp) with MoE ones
LLAMA4_SCOUT_TEXT = {"attention_bias": False, "attention_chunk_size": 8192, "attention_dropout": 0.0, "attn_scale": 0.1,
                     "attn_temperature_tuning": True, "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
                     "floor_scale": 8192, "for_llm_compressor": False, "head_dim": 128, "hidden_act": "silu",
                     "hidden_size": 5120, "interleave_moe_layer_step": 1, "intermediate_size": 8192,
                     "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760, "model_type": "llama4_text",
                     "no_rope_layers": [], "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48,
                     "num_key_value_heads": 8, "num_local_experts": 16, "output_router_logits": False,
                     "pad_token_id": 200018, "rms_norm_eps": 1e-05,
                     "rope_scaling": {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
                     "torch_dtype": "bfloat16", "use_cache": True, "use_qk_norm": True, "vocab_size": 202048}
LLAMA4_SCOUT = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "torch_dtype": "bfloat16",
                "boi_token_index": 200080, "eoi_token_index": 200081, "image_token_index": 200092,
                "text_config": LLAMA4_SCOUT_TEXT, "vision_config": {"model_type": "llama4_vision_model"}}
LLAMA4_MAVERICK = {**LLAMA4_SCOUT, "text_config": {**LLAMA4_SCOUT_TEXT, "interleave_moe_layer_step": 2,
                                                   "num_local_experts": 128, "use_qk_norm": False,
                                                   "max_position_embeddings": 1048576,
                                                   "rope_scaling": None}}
# MiMo-V2-Flash as transformers 5 writes it (the sliding layers' kv heads doubled, values of 128)
MIMO_V2_FLASH = {"architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash", "attention_bias": False,
                 "attention_value_scale": 0.707, "head_dim": 192, "hidden_act": "silu", "hidden_size": 4096,
                 "intermediate_size": 16384, "max_position_embeddings": 262144, "moe_intermediate_size": 2048,
                 "n_group": 1, "n_routed_experts": 256, "norm_topk_prob": True, "num_attention_heads": 64,
                 "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-05,
                 "routed_scaling_factor": None, "sliding_window": 128, "topk_group": 1, "v_head_dim": 128,
                 "vocab_size": 152576, "torch_dtype": "bfloat16"}
# name -> (config.json, published total parameters without MTP layers; Llama 4: 109B and 400B with
# the vision tower, which is left out)
PUBLISHED = {"mixtral-8x7b": (MIXTRAL_8X7B, 46.7e9), "qwen1.5-moe-a2.7b": (QWEN15_MOE, 14.3e9),
             "olmoe-1b-7b": (OLMOE, 6.9e9), "deepseek-v2": (DEEPSEEK_V2, 236e9), "deepseek-v3": (DEEPSEEK_V3, 671e9),
             "kimi-k2": (KIMI_K2, 1.04e12), "glm-4.5": (GLM_45, 355e9), "minimax-m2": (MINIMAX_M2, 230e9),
             "gpt-oss-120b": (GPT_OSS_120B, 116.8e9), "llama-4-scout": (LLAMA4_SCOUT, 109e9),
             "llama-4-maverick": (LLAMA4_MAVERICK, 400e9), "mimo-v2-flash": (MIMO_V2_FLASH, 309e9)}
SHIPPED = sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())
# tiny configs as transformers 5 writes them (tests/conftest.py), with dense layers placed every way
TINY = [(family, {}) for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                                    "glm4_moe", "minimax_m2", "gpt_oss", "llama4", "mimo_v2_flash")]
TINY += [("qwen2_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2}),
         ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
         ("deepseek_v3", {"num_hidden_layers": 4, "first_k_dense_replace": 2, "n_shared_experts": 3}),
         ("glm4_moe", {"tie_word_embeddings": True, "n_shared_experts": 2}),
         ("llama4", {"moe_layers": [2], "tie_word_embeddings": True}),
         ("mimo_v2_flash", {"attention_bias": True, "layer_types": None, "mlp_layer_types": ["sparse", "dense"] * 2})]


def tiny_config(family: str, overrides: dict) -> dict:
    from tests.conftest import hf_config

    raw = hf_config(family, **overrides).to_dict()
    raw["architectures"] = [next(a for a, f in ARCHITECTURES.items() if f == family)]
    return raw


def configs():
    for name, (raw, _) in PUBLISHED.items():
        yield pytest.param(raw, id=name)
    for name in SHIPPED:
        yield pytest.param(json.loads((MODELS_DIR / name / "config.json").read_text()), id=f"shipped-{name}")
    for family, overrides in TINY:
        yield pytest.param((family, overrides), id=f"tiny-{family}" + "".join(f"-{k}" for k in overrides))


def built(cfg: ModelConfig) -> MoEForCausalLM:
    """The model the engine builds from cfg, on the meta device, in the checkpoint's dtype."""
    with torch.device("meta"):
        return MoEForCausalLM(cfg, ops=torch_ops()).to(cfg.dtype)


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def probe(flops: bool) -> tuple[HardwareKind, Efficiency]:
    """A device whose roofline is all compute (1 TFLOP/s) or all memory (1 GB/s), without overheads."""
    big = 1e30
    hw = HardwareKind("probe", memory_gib=big, memory_bandwidth_gbs=big if flops else 1.0,
                      bf16_tflops=1.0 if flops else big, interconnect_gbs=big, nic_gbps=big, price_per_hour=1.0)
    return hw, Efficiency(flops=1.0, memory_bandwidth=1.0, network=1.0, layer_overhead_us=0.0,
                          message_latency_us=0.0, step_overhead_us=0.0)


@pytest.mark.parametrize("raw", configs())
def test_planner_numbers_are_the_built_models(raw):
    if isinstance(raw, tuple):
        raw = tiny_config(*raw)
    shape = shape_of(raw)
    c = shape.config
    if c.family == "dbrx":  # planned for, not served: the engine's reader refuses it
        with pytest.raises(ConfigError, match="is not supported"):
            ModelConfig.from_dict(raw)
    else:
        assert c == ModelConfig.from_dict(raw)  # one parser: the planner reads what the engine serves
    model = built(c)
    layers = list(model.model.layers)
    moe = [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoE)]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    expert_ids = {id(p) for m in experts for p in m.parameters()}
    non_expert = [p for p in model.parameters() if id(p) not in expert_ids]  # (tied weights once)

    # layers, MoE layers, dense layers, shared experts: the simulator's SimModel and the search's L_moe
    sim = SimModel.from_config(c)
    assert (sim.num_layers, sim.num_moe_layers, sim.num_experts, sim.top_k, sim.hidden_size, sim.dtype_bytes) == (
        len(layers), len(moe), experts[0].w13.shape[0], moe[0].route_spec(c.dtype).top_k,
        model.model.norm.weight.numel(), model.model.embed_tokens.weight.element_size())
    assert c.num_dense_layers == len(layers) - len(moe) == sum(not layer.is_moe for layer in layers)
    shared = {getattr(m, m.shared_name).gate_proj.out_features if m.shared_name else 0 for m in moe}
    assert shared == {c.shared_expert_intermediate_size}

    # parameters and their bytes: what an attention worker holds, one expert, the whole model
    assert c.expert_params() * c.num_experts * len(moe) == sum(p.numel() for m in experts for p in m.parameters())
    assert c.non_expert_params() == sum(p.numel() for p in non_expert)
    assert c.total_params() == sum(p.numel() for p in model.parameters())
    assert c.non_expert_bytes(c.dtype) == nbytes(non_expert)
    assert c.expert_bytes(c.dtype) * c.num_experts * len(moe) == nbytes(p for m in experts for p in m.parameters())

    # KV bytes per token: what the engine's paged cache allocates
    cache = make_paged_cache(c, 1, 16, c.dtype, "meta", torch_ops())
    tensors = [t for v in vars(cache).values() if isinstance(v, list) for t in v if isinstance(t, torch.Tensor)]
    if c.v4 is not None:  # (the entries' pages; its windows and compressor rows are per-sequence state)
        tensors = [*cache.v4.entries.values(), *cache.v4.index_entries.values()]
    assert c.kv_bytes_per_token(c.dtype) * 16 == nbytes(tensors)
    if c.v4 is not None:
        # past the window and index_topk the cost grows by context_flops a cached token and layer; the
        # roofline's per-token part (and its checks below) would need the window's and top-k's constants
        a, b = (4 * c.v4.index_topk + c.v4.window) * c.v4.hca_rate, (8 * c.v4.index_topk + c.v4.window) * c.v4.hca_rate
        grown = c.attention_flops_per_token(b) - c.attention_flops_per_token(a)
        assert grown == pytest.approx((b - a) * len(layers) * c.context_flops(), rel=1e-3)  # (context_flops is rounded)
        return

    # FLOPs per token: 2 x every matrix a token passes through outside the routed experts, and one
    # expert's matrices per (token, expert) pair
    weights = sum(p.numel() for layer in layers for p in layer.parameters() if p.dim() == 2 and id(p) not in expert_ids)
    assert c.non_expert_flops_per_token() == 2 * weights
    assert c.expert_flops_per_pair() == 2 * (experts[0].w13[0].numel() + experts[0].w2[0].numel())

    # the roofline's per-layer costs add up over the layers to the built model's
    hw, eff = probe(flops=True)
    perf = RooflinePerf(shape, hw, hw, eff)
    assert float(perf.attention(1, 0)) * 1e12 * len(layers) == pytest.approx(2 * weights, rel=1e-9)
    assert float(perf.attention(1, 100) - perf.attention(1, 0)) * 1e12 == pytest.approx(
        100 * c.context_flops(), rel=1e-9)
    assert float(perf.experts(1, 1)) * 1e12 == pytest.approx(c.expert_flops_per_pair(), rel=1e-9)
    hw, eff = probe(flops=False)
    perf = RooflinePerf(shape, hw, hw, eff)
    head = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    assert float(perf.attention(1, 0)) * 1e9 * len(layers) == pytest.approx(
        nbytes(p for p in non_expert if id(p) not in head), rel=1e-9)
    assert float(perf.attention(1, 16) - perf.attention(1, 0)) * 1e9 * len(layers) == pytest.approx(
        nbytes(tensors), rel=1e-9)
    assert float(perf.experts(1, 1)) * 1e9 == pytest.approx(nbytes(experts[0].parameters()) / c.num_experts,
                                                            rel=1e-9)
    # int8 experts (--quantization int8): the roofline reads their int8 bytes, at the same FLOPs
    int8 = RooflinePerf(shape, hw, hw, eff, "int8")
    assert float(int8.experts(1, 1)) * 1e9 == pytest.approx(c.expert_bytes(c.dtype, "int8"), rel=1e-9)


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_totals(name):
    raw, total = PUBLISHED[name]
    assert shape_of(raw).config.total_params() == pytest.approx(total, rel=0.02)


def test_glm_45_and_deepseek_v3_as_the_engine_builds_them():
    """GLM-4.5: 3 dense layers, then 89 MoE layers with a shared expert of 1,536 (first_k_dense_replace,
    n_shared_experts); DeepSeek-V3: 3 dense, 58 MoE, MLA's 576 cached values per token and layer."""
    glm = shape_of(GLM_45).config
    assert (glm.num_layers, glm.num_dense_layers, glm.num_moe_layers, glm.shared_expert_intermediate_size) == (
        92, 3, 89, 1536)
    assert glm.kv_bytes_per_token(glm.dtype) == 92 * 2 * 8 * 128 * 2
    for v3 in (shape_of(DEEPSEEK_V3).config, shape_from("deepseek-v3").config):
        assert (v3.num_dense_layers, v3.num_moe_layers, v3.shared_expert_intermediate_size) == (3, 58, 2048)
        assert v3.kv_bytes_per_token(v3.dtype) == 61 * 576 * 2


def test_dbrx_is_read_for_planning_only(tmp_path):
    dbrx = shape_from("dbrx").config
    assert (dbrx.num_layers, dbrx.num_moe_layers, dbrx.num_experts, dbrx.top_k, dbrx.num_kv_heads) == (40, 40, 16, 4, 8)
    assert dbrx.moe_intermediate_size == 10752 and dbrx.clip_qkv == 8
    raw = json.loads((MODELS_DIR / "dbrx" / "config.json").read_text())
    del raw["ffn_config"]["moe_top_k"]
    with pytest.raises(ConfigError, match="'ffn_config.moe_top_k' is missing"):
        shape_of(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw | {"ffn_config": {}}))
    with pytest.raises(ConfigError, match="is not supported"):
        ModelConfig.from_pretrained(tmp_path)


def test_shape_from_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json there .* one of: .*mixtral-8x22b"):
        shape_from(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        shape_from(tmp_path)
    assert Path(shape_from("mixtral-8x22b").name) == Path("mixtral-8x22b")


@pytest.mark.parametrize("family,dtype,overrides", [
    ("mixtral", "float32", {}),
    ("mixtral", "bfloat16", {"intermediate_size": 21}),  # gate/up 42 rows and an odd down input: padded
    ("gpt_oss", "bfloat16", {}),  # expert biases, kept in the serving dtype
])
def test_int8_expert_bytes_are_what_a_quantised_worker_holds(make_checkpoint, family, dtype, overrides):
    """ModelConfig.expert_bytes(dtype, "int8") is the resident bytes (models.cpu_inference.
    resident_weight_bytes) of the experts quantised as serving quantises them (PackedExperts(experts,
    "int8")), up to kernels/int8.py's panel padding: each matrix's output channels (gate and up each)
    are padded to a multiple of PANEL = 16 (at most 15 rows of the even-padded input's codes + a
    4-byte scale each)
    and an odd input gets one zero code per row. Without padding (sizes multiples of 16) they are equal."""
    from kernels.int8 import PANEL
    from models.cpu_inference import PackedExperts, resident_weight_bytes
    from models.loader import load_experts

    ckpt = make_checkpoint(family, dtype, **overrides)
    c = ModelConfig.from_pretrained(ckpt)
    assert not c.mxfp4 and not c.fp8_block
    experts = load_experts(ckpt, list(range(c.num_experts)), c)
    held = torch.nn.ModuleList(PackedExperts(m, "int8") for m in experts.values())
    resident = resident_weight_bytes(held)["experts"]
    count = c.num_experts * c.num_moe_layers
    D, I = c.hidden_size, c.moe_intermediate_size
    # per expert: gate and up each padded to whole panels (the fused block's layout), down likewise
    bound = 2 * (PANEL - 1) * (D + 1 + 4) + 2 * I * (D % 2) + (PANEL - 1) * (I + 1 + 4) + D * (I % 2)
    assert 0 <= resident - count * c.expert_bytes(c.dtype, "int8") <= count * bound
    if (2 * I) % PANEL == D % PANEL == D % 2 == I % 2 == 0:
        assert resident == count * c.expert_bytes(c.dtype, "int8")
    else:
        assert resident > count * c.expert_bytes(c.dtype, "int8")
    # int8 is about a byte a weight: a quarter of float32's, half of bf16's (plus the scales)
    assert c.expert_bytes(c.dtype, "int8") < c.expert_bytes(c.dtype) / c.dtype.itemsize * 1.15
    assert c.expert_bytes(c.dtype, None) == c.expert_params() * c.dtype.itemsize  # unquantised: as before
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        c.expert_bytes(c.dtype, "int4")
    # fp8: a byte a weight plus a scale per panel of 16 rows per 128 inputs, what the fused FP8 block holds
    assert c.expert_bytes(c.dtype, "fp8") < c.expert_bytes(c.dtype) / c.dtype.itemsize * 1.15
    if I % PANEL == D % PANEL == 0 and not c.expert_bias:
        fp8 = resident_weight_bytes(torch.nn.ModuleList(PackedExperts(m, "fp8") for m in experts.values()))
        assert fp8["experts"] == count * c.expert_bytes(c.dtype, "fp8")


def test_mxfp4_expert_bytes_are_what_a_quantised_worker_holds(make_checkpoint):
    """ModelConfig.expert_bytes(dtype, "mxfp4") is the resident bytes of experts quantised as serving
    quantises them (PackedExperts(experts, "mxfp4")), where each matrix's rows fill whole panels of 16:
    half a byte a weight plus an E8M0 byte per row and 32 inputs, about 0.27x of bf16's bytes."""
    from models.cpu_inference import PackedExperts, resident_weight_bytes
    from models.loader import load_experts

    ckpt = make_checkpoint("mixtral", "bfloat16", hidden_size=64, intermediate_size=96)
    c = ModelConfig.from_pretrained(ckpt)
    experts = load_experts(ckpt, list(range(c.num_experts)), c)
    held = torch.nn.ModuleList(PackedExperts(m, "mxfp4") for m in experts.values())
    count = c.num_experts * c.num_moe_layers
    assert resident_weight_bytes(held)["experts"] == count * c.expert_bytes(c.dtype, "mxfp4")
    assert 0.26 < c.expert_bytes(c.dtype, "mxfp4") / c.expert_bytes(c.dtype) < 0.29


def test_quantization_names_and_checkpoints_already_quantised():
    import dataclasses

    from planner.shapes import quantization_of

    assert [quantization_of(n) for n in (None, "none", "int8", "experts_int8")] == [None, None, "int8", "int8"]
    with pytest.raises(ValueError, match="quantization 'int4' is not supported; choose from none, int8"):
        quantization_of("int4")
    c = shape_from("mixtral-8x22b").config
    assert quantization_of("int8", c) == "int8"
    with pytest.raises(ValueError, match="already FP8 block-quantised"):
        quantization_of("int8", dataclasses.replace(c, fp8_block=(128, 128)), "v3")
    assert quantization_of(None, dataclasses.replace(c, mxfp4=True)) is None
