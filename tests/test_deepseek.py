"""DeepSeek-V2/V3 (and Kimi K2): MLA over the latent paged cache, grouped routing, shared experts,
dense first layers, MTP layers, against transformers; the engine (preemption, prefix hits) and pools."""
import json
import logging
import math
import random
import shutil

import pytest
import torch

from attention_nodes.config import CacheConfig, EngineConfig, SchedulerConfig
from attention_nodes.engine import LLMEngine
from kernels.ops import torch_ops
from models.config import ConfigError, ModelConfig
from models.kv_cache import PagedLatentCache, make_paged_cache
from models.loader import load_model
from server import LLM, SamplingParams
from tests.conftest import PROMPTS, assert_close_to_transformers, hf_model, our_logits, paged_batch

YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32,
        "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}
VARIANTS = [
    ("deepseek_v3", {}),  # q_lora_rank 24, 4 groups top-2, non-zero correction bias, 2 shared experts, 1 dense layer
    ("deepseek_v3", {"q_lora_rank": None, "first_k_dense_replace": 0, "rope_parameters": YARN, "n_group": 2,
                     "topk_group": 1, "n_shared_experts": 3, "num_experts_per_tok": 3, "norm_topk_prob": False}),
    ("deepseek_v3", {"rope_interleave": False, "n_group": 1, "topk_group": 1, "hidden_size": 40,
                     "num_attention_heads": 5, "num_key_value_heads": 5, "attention_bias": True}),  # Kimi-K2-like
    ("deepseek_v2", {"mlp_bias": True}),  # greedy, q_lora_rank None, 6 experts, biased dense and shared MLPs
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 2, "q_lora_rank": 16,
                     "rope_parameters": YARN, "routed_scaling_factor": 1.5, "first_k_dense_replace": 2}),
]
IDS = ["v3", "v3-yarn-noqlora", "v3-kimi-odd", "v2", "v2-grouped-yarn"]


@pytest.mark.parametrize("family,overrides", VARIANTS, ids=IDS)
def test_logits_equal_transformers(make_checkpoint, family, overrides):
    d = make_checkpoint(family, **overrides)
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.mla is not None
    assert_close_to_transformers(our_logits(load_model(d), PROMPTS), hf_model(d), PROMPTS)


def test_bfloat16_checkpoint_close_to_transformers(make_checkpoint):
    """bf16 weights, the correction bias kept float32 (as transformers keeps it), the latent cache in bf16."""
    d = make_checkpoint("deepseek_v3", dtype="bfloat16")
    ours, ref = load_model(d), hf_model(d, torch.bfloat16)
    assert ours.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    batch, blocks = paged_batch(PROMPTS[:1])
    cache = make_paged_cache(ours.cfg, blocks, 4, torch.bfloat16, "cpu", torch_ops())
    with torch.no_grad():
        got = ours.logits(ours(torch.tensor(PROMPTS[0]), batch, cache))
        expected = ref(torch.tensor([PROMPTS[0]])).logits[0].float()
    assert (got - expected).abs().max().item() < 3e-2 * expected.abs().max().item()


@pytest.mark.parametrize("family,overrides", [VARIANTS[i] for i in (1, 4)], ids=[IDS[i] for i in (1, 4)])
def test_greedy_generation_equals_transformers(make_checkpoint, family, overrides):
    d = make_checkpoint(family, **overrides)
    ref = hf_model(d)
    ref.generation_config.eos_token_id = None
    outs = LLM(d).generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for p, out in zip(PROMPTS, outs):
        expected = ref.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=1)[0, len(p):]
        assert out.outputs[0].token_ids == expected.tolist(), f"prompt {p}"


def test_the_cache_holds_latents_and_absorbed_decode_equals_expanded(make_checkpoint):
    d = make_checkpoint("deepseek_v3")
    cfg = ModelConfig.from_pretrained(d)
    m = cfg.mla
    assert cfg.kv_values_per_token_layer == m.kv_lora_rank + m.qk_rope_head_dim == 26
    assert cfg.kv_bytes_per_token(torch.bfloat16) == cfg.num_layers * 26 * 2
    cache = make_paged_cache(cfg, 8, 4, torch.float32, "cpu", torch_ops())
    assert isinstance(cache, PagedLatentCache)
    assert tuple(cache.kv[0].shape) == (8, 4, 26) and len(cache.kv) == cfg.num_layers
    # DeepSeek-V3's own shape: 576 values per token and layer instead of 128 heads x (192 keys + 128 values)
    v3 = ModelConfig.from_dict({"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 8, "hidden_size": 7168,
                                "num_hidden_layers": 61, "num_attention_heads": 128, "n_routed_experts": 256,
                                "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "kv_lora_rank": 512,
                                "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                                "v_head_dim": 128, "n_group": 8, "topk_group": 4})
    assert v3.kv_values_per_token_layer == 576 and v3.kv_bytes_per_token(torch.bfloat16) == 61 * 576 * 2
    # the planner's attention cost: each cached token costs every head its scores over 576 values and
    # a weighted sum of 512 latents (multiply-adds x 2), per layer
    assert v3.attention_flops_per_token(100) - v3.attention_flops_per_token(0) == 2 * 61 * 128 * 100 * (576 + 512)

    # one layer: the absorbed decode (the cache's decode path) equals the expanded attention
    model = load_model(d)
    attn = model.model.layers[1].self_attn
    torch.manual_seed(0)
    N, P, R, S = cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, 11
    q_nope, q_pe = torch.randn(3, N, P), torch.randn(3, N, R)
    pages = torch.randn(9, 4, 26)  # sequence b owns pages 3b..3b+2: its tokens are rows 12b.. of the flat view
    table = torch.arange(9).view(3, 3)
    lens = torch.tensor([S, 5, 9])
    with torch.no_grad():
        absorbed = cache._absorbed(q_nope, q_pe, pages, table, lens, m.softmax_scale, attn)
        for b in range(3):
            keys, values = attn.expand(pages.view(-1, 26)[b * 12:b * 12 + int(lens[b])])  # (S, N, H), (S, N, V)
            q = torch.cat((q_nope[b], q_pe[b]), -1)  # (N, H)
            probs = (torch.einsum("nh,snh->ns", q, keys) * m.softmax_scale).softmax(-1)
            torch.testing.assert_close(absorbed[b], torch.einsum("ns,snv->nv", probs, values), rtol=1e-5, atol=1e-5)


def engine(ckpt, num_blocks: int = 256, **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(str(ckpt), device="cpu", scheduler=SchedulerConfig(**sched),
                                  cache=CacheConfig(4, num_blocks, None, True)))


def run(eng: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    out = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for d in eng.step():
            out[d.request_id] += d.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_engine_preemption_chunked_prefill_and_prefix_hits_equal_transformers(make_checkpoint):
    ckpt = make_checkpoint("deepseek_v3")
    ref = hf_model(ckpt)
    ref.generation_config.eos_token_id = None
    rng = random.Random(3)
    shared = [rng.randrange(2, 500) for _ in range(12)]  # 3 full blocks every prompt shares
    prompts = [shared + [rng.randrange(2, 500) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    eng = engine(ckpt, num_blocks=24, max_num_seqs=6, max_num_batched_tokens=16)  # 96 slots for 6 x up to 37
    got = run(eng, prompts, 16)
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.prefix_hits > 0
    for p, ids in zip(prompts, got):
        want = ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=1)[0, len(p):]
        assert ids == want.tolist()
    assert eng.blocks.num_free_blocks == 24


@pytest.mark.slow
def test_pools_equal_colocated(make_checkpoint):
    """2 attention workers, 2 expert workers, 2 micro-batches: attention workers hold MLA, the router
    and the shared experts; expert workers the routed experts."""
    ckpt = make_checkpoint("deepseek_v3")
    prompts = [p for p in PROMPTS] + [[9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 20, 30], [33] * 5]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(ckpt, num_kv_blocks=96).generate(prompts, params)]
    llm = LLM(ckpt, num_kv_blocks=96, colocated=False, attention_workers=2, expert_workers=2, micro_batches=2,
              torch_threads=1)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    assert got == want


def test_mtp_layers_are_skipped_with_one_log_line(make_checkpoint, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    src = make_checkpoint("deepseek_v3")
    d = tmp_path / "mtp"
    shutil.copytree(src, d)
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.num_mtp_layers == 1  # transformers writes num_nextn_predict_layers = 1
    f = next(d.glob("*.safetensors"))
    tensors = load_file(f)
    L = cfg.num_layers
    for name in [n for n in tensors if n.startswith(f"model.layers.{L - 1}.")]:
        tensors[name.replace(f"layers.{L - 1}.", f"layers.{L}.")] = tensors[name].clone()
    tensors[f"model.layers.{L}.eh_proj.weight"] = torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size)
    tensors[f"model.layers.{L}.enorm.weight"] = torch.ones(cfg.hidden_size)
    save_file(tensors, f, metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="shuttle"):
        model = load_model(d)
    lines = [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and len(model.model.layers) == L
    # a layer past the MTP layers is still an unexpected tensor
    tensors[f"model.layers.{L + 1}.enorm.weight"] = torch.ones(cfg.hidden_size)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"unexpected tensor 'model.layers.{L + 1}.enorm.weight'"):
        load_model(d)


def _as_transformers4(raw: dict) -> dict:
    """A transformers-5 DeepSeek config.json the way the published checkpoints (transformers 4) spell it."""
    raw = dict(raw)
    rope = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    raw["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    raw["torch_dtype"] = raw.pop("dtype")
    raw.pop("head_dim", None)
    if raw["model_type"] == "deepseek_v3":
        raw.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    return raw


@pytest.mark.parametrize("i", [1, 4], ids=[IDS[1], IDS[4]])
def test_transformers4_config_and_kimi_k2(make_checkpoint, tmp_path, i):
    src = make_checkpoint(VARIANTS[i][0], **VARIANTS[i][1])
    raw = json.loads((src / "config.json").read_text())
    assert ModelConfig.from_dict(_as_transformers4(raw)) == ModelConfig.from_pretrained(src)
    if raw["model_type"] == "deepseek_v3":  # Kimi K2 declares the V3 architecture under its own model_type
        kimi = {**raw, "model_type": "kimi_k2"}
        assert ModelConfig.from_dict(kimi) == ModelConfig.from_pretrained(src)
        kimi.pop("architectures")
        assert ModelConfig.from_dict(kimi).family == "deepseek_v3"


@pytest.mark.parametrize("field,value,match", [
    ("n_group", 3, "n_group \\(3\\) must divide n_routed_experts"),
    ("topk_group", 5, "topk_group \\(5\\) must be in"),
    ("scoring_func", "relu", "scoring_func='relu' is not supported"),
    ("topk_method", "greedy", "topk_method='greedy' is not supported by deepseek_v3"),
    ("kv_lora_rank", None, "required field 'kv_lora_rank' is missing"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim \\(7\\) must be even"),
    ("num_experts_per_tok", 5, "exceeds the 4 experts of topk_group=2 groups of 2"),
    ("quantization_config", {"quant_method": "awq"}, "quant_method='awq' is not supported"),
    ("quantization_config", {"quant_method": "fp8"}, "weight_block_size must be two positive ints"),
])
def test_config_errors_name_the_field(make_checkpoint, field, value, match):
    raw = json.loads((make_checkpoint("deepseek_v3") / "config.json").read_text())
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict({**raw, field: value})


def _quantize_checkpoint(src, dst, block=(128, 128), extra: tuple[str, ...] = ()) -> dict:
    """Copy a checkpoint with every 2-D linear weight (attention, experts, shared experts, dense MLPs;
    not the embeddings, router, norms or lm_head, as DeepSeek publishes them; and names containing
    any of `extra`) stored as float8_e4m3fn plus a weight_scale_inv per block. Returns the
    dequantised float32 weights by name."""
    from safetensors.torch import load_file, save_file

    from kernels.quant import dequantize_fp8_blocks, quantize_fp8_blocks

    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    tensors, dequantised = load_file(f), {}
    for name in [n for n, t in tensors.items() if t.dim() == 2 and any(k in n for k in ("proj", *extra))]:
        q, scale = quantize_fp8_blocks(tensors[name], block)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
        dequantised[name] = dequantize_fp8_blocks(q, scale, block)
    save_file(tensors, f, metadata={"format": "pt"})
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(raw))
    return dequantised


def test_fp8_block_quantised_checkpoint_loads_as_its_dequantised_weights(make_checkpoint, tmp_path):
    # hidden 200, experts of 132 (transformers needs rows of 16-byte multiples): full and partial 128-blocks
    src = make_checkpoint("deepseek_v3", hidden_size=200, moe_intermediate_size=132, intermediate_size=136)
    dequantised = _quantize_checkpoint(src, tmp_path / "fp8")
    assert any(t.shape[0] % 128 and t.shape[1] % 128 for t in dequantised.values())
    fp8, plain = load_model(tmp_path / "fp8"), load_model(src)
    assert ModelConfig.from_pretrained(tmp_path / "fp8").fp8_block == (128, 128)
    params = dict(fp8.named_parameters())
    w = params["model.layers.0.self_attn.q_a_proj.weight"]
    assert torch.equal(w, dequantised["model.layers.0.self_attn.q_a_proj.weight"])
    assert (w - dict(plain.named_parameters())["model.layers.0.self_attn.q_a_proj.weight"]).abs().max() > 0
    experts = params["model.layers.1.mlp.experts.w13"]
    assert torch.equal(experts[3, 132:], dequantised["model.layers.1.mlp.experts.3.up_proj.weight"])
    # the served model equals transformers on the dequantised float checkpoint
    from safetensors.torch import load_file, save_file
    deq = tmp_path / "dequantised"
    shutil.copytree(src, deq)
    f = next(deq.glob("*.safetensors"))
    save_file({**load_file(f), **dequantised}, f, metadata={"format": "pt"})
    ref = hf_model(deq)
    batch, blocks = paged_batch(PROMPTS)
    cache = make_paged_cache(fp8.cfg, blocks, 4, torch.float32, "cpu", torch_ops())
    with torch.no_grad():
        got = fp8.logits(fp8(torch.tensor([t for p in PROMPTS for t in p]), batch, cache))
        want = torch.cat([ref(torch.tensor([p])).logits[0] for p in PROMPTS])
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    # expert workers read their experts' FP8 tensors the same way
    from models.loader import load_experts
    mine = load_experts(tmp_path / "fp8", [3, 5])
    assert torch.equal(mine[1].w13[0, 132:], dequantised["model.layers.1.mlp.experts.3.up_proj.weight"])


def test_fp8_weight_without_its_scale_is_an_error_naming_both(make_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    _quantize_checkpoint(make_checkpoint("deepseek_v3"), tmp_path / "fp8")
    f = next((tmp_path / "fp8").glob("*.safetensors"))
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: FP8 tensor 'model\.layers\.1\.self_attn\.kv_b_proj"
                                         r"\.weight' has no 'model\.layers\.1\.self_attn\.kv_b_proj\.weight_scale_inv'"):
        load_model(tmp_path / "fp8")
    tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"] = torch.ones(1, 1)
    tensors["model.layers.1.mlp.gates.weight_scale_inv"] = torch.ones(1, 1)  # a scale without its weight
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.1\.mlp\.gates\.weight_scale_inv'"):
        load_model(tmp_path / "fp8")


def test_kv_capacity_in_tokens_follows_the_latent_bytes(make_checkpoint):
    """A KV budget holds budget / (block_size x kv_bytes_per_token) blocks: the latent rows' bytes,
    not per-head keys and values; engine stats (and /metrics' shuttle_kv_cache_tokens) report it."""
    d = make_checkpoint("deepseek_v3")
    llm = LLM(d, kv_cache_gib=0.001, block_size=8)
    cfg, runner = llm.cfg, llm.engine.runner
    per_token = cfg.kv_bytes_per_token(torch.float32)
    assert per_token == cfg.num_layers * 26 * 4
    assert runner.num_blocks == int(0.001 * 2 ** 30 // (8 * per_token))
    stats = llm.engine.stats()
    assert stats["kv_cache_tokens"] == runner.num_blocks * 8
    m = cfg.mla
    per_head = cfg.num_layers * cfg.num_heads * (m.qk_head_dim + m.v_head_dim) * 4  # what MHA caches would take
    assert stats["kv_cache_tokens"] > 0.9 * 0.001 * 2 ** 30 / per_token > 4 * 0.001 * 2 ** 30 / per_head  # 4.6x at this tiny shape


def test_published_deepseek_v3_and_kimi_k2_config_json():
    """config.json as DeepSeek-V3 / Kimi K2 publish it (transformers 4 spelling, yarn, FP8, MTP)."""
    v3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
          "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
          "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
          "n_shared_experts": 1, "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5,
          "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
          "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
          "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
          "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
          "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                "type": "yarn"},
          "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
          "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}}
    cfg = ModelConfig.from_dict(v3)
    r = cfg.router
    assert (r.scoring, r.num_groups, r.topk_groups, r.group_score, r.scaling, r.renormalize, r.correction_bias) == \
        ("sigmoid", 8, 4, "top2_sum", 2.5, True, True)
    assert cfg.moe_layers[:4] == (False, False, False, True) and cfg.shared_expert_intermediate_size == 2048
    assert cfg.fp8_block == (128, 128) and cfg.num_mtp_layers == 1 and cfg.dtype == torch.bfloat16
    assert cfg.mla.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert cfg.rope.rope_type == "yarn" and cfg.head_dim == 64 and cfg.max_model_len == 163840
    kimi = {**v3, "model_type": "kimi_k2", "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
            "n_routed_experts": 384, "num_attention_heads": 64, "num_key_value_heads": 64, "routed_scaling_factor": 2.827, "first_k_dense_replace": 1}
    cfg = ModelConfig.from_dict(kimi)
    assert cfg.family == "deepseek_v3" and cfg.router.num_groups == 1 and cfg.num_experts == 384
    assert cfg.num_mtp_layers == 0 and cfg.kv_values_per_token_layer == 576


def test_a_new_deepseek_model_for_training():
    """shuttle train --family deepseek_v3 --num-experts 8 --set kv_lora_rank=16 ...: the config.json
    written is one the server reads, and the fresh model runs (the correction bias starts at 0)."""
    from training.config import new_model_config
    from training.model import Shard, build_model, forward_logits

    raw = new_model_config("deepseek_v3", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                           "num_key_value_heads": 2, "expert_intermediate_size": 16, "num_experts": 8,
                                           "num_experts_per_tok": 2, "vocab_size": 64, "kv_lora_rank": 16,
                                           "q_lora_rank": 12, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
                                           "v_head_dim": 8, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1})
    assert raw["n_routed_experts"] == 8 and raw["architectures"] == ["DeepseekV3ForCausalLM"]
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, Shard(tuple(range(8))), torch.device("cpu"), seed=1)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() == 0
    logits = forward_logits(model, torch.randint(0, 64, (2, 5)))
    assert logits.shape == (10, 64) and torch.isfinite(logits).all()
