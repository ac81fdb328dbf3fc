"""The model's logits and greedy tokens equal transformers' for every family and config option."""
import pytest
import torch

from models.config import ModelConfig
from models.kv_cache import AttentionBatch, DenseKVCache
from models.loader import load_model
from server import LLM, SamplingParams
from tests.conftest import PROMPTS, assert_close_to_transformers, hf_model

# (family, config overrides): every documented option of each family that changes the forward pass.
VARIANTS = [
    ("mixtral", {}),
    ("mixtral", {"sliding_window": 5}),
    ("mixtral", {"head_dim": 24, "tie_word_embeddings": True}),
    ("mixtral", {"num_key_value_heads": 4, "num_experts_per_tok": 1}),
    ("mixtral", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    # head_dim given: transformers' dynamic/yarn init fails on Mixtral's head_dim=None.
    ("mixtral", {"max_position_embeddings": 8, "head_dim": 16,  # prompts and generation pass 8: scaling kicks in
                 "rope_parameters": {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0}}),
    ("mixtral", {"head_dim": 16, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                     "original_max_position_embeddings": 64}}),
    ("mixtral", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 16}}),
    ("qwen2_moe", {}),
    ("qwen2_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2, "num_hidden_layers": 3}),
    ("qwen2_moe", {"mlp_only_layers": [0], "qkv_bias": False}),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2, "num_hidden_layers": 3}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": True, "attention_bias": True, "head_dim": 32, "mlp_only_layers": [1]}),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 6, "decoder_sparse_step": 2}),
    ("olmoe", {}),
    ("olmoe", {"clip_qkv": 0.5, "norm_topk_prob": True, "attention_bias": True, "num_experts_per_tok": 8}),
    # odd sizes: 3 heads, one kv head, 5 experts, top-3
    ("qwen2_moe", {"hidden_size": 72, "num_attention_heads": 3, "num_key_value_heads": 1, "num_experts": 5,
                   "num_experts_per_tok": 3, "moe_intermediate_size": 20, "shared_expert_intermediate_size": 36}),
    ("olmoe", {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3, "num_experts": 7,
               "intermediate_size": 24}),
]
IDS = [f"{f}-{'-'.join(k for k in o) or 'base'}-{i}" for i, (f, o) in enumerate(VARIANTS)]


@pytest.mark.parametrize("family,overrides", VARIANTS, ids=IDS)
def test_logits_equal_transformers(make_checkpoint, family, overrides):
    d = make_checkpoint(family, **overrides)
    cfg = ModelConfig.from_pretrained(d)
    ours, ref = load_model(d), hf_model(d)
    cache = DenseKVCache(cfg.num_layers, len(PROMPTS), 64, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    batch = AttentionBatch.build([len(p) for p in PROMPTS], [0] * len(PROMPTS), list(range(len(PROMPTS))))
    with torch.no_grad():
        logits = ours.logits(ours(torch.tensor([t for p in PROMPTS for t in p]), batch, cache))
    assert_close_to_transformers(logits, ref, PROMPTS)


GREEDY = [0, 1, 5, 6, 8, 9, 11, 12, 14, 15, 16, 17, 18]  # every family, windows, dynamic and yarn rope, dense layers


@pytest.mark.parametrize("family,overrides", [VARIANTS[i] for i in GREEDY], ids=[IDS[i] for i in GREEDY])
def test_greedy_generation_equals_transformers(make_checkpoint, family, overrides):
    d = make_checkpoint(family, **overrides)
    ref = hf_model(d)
    ref.generation_config.eos_token_id = None
    llm = LLM(d)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for p, out in zip(PROMPTS, outs):
        expected = ref.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=1)[0, len(p):]
        assert out.outputs[0].token_ids == expected.tolist(), f"prompt {p}"
        assert out.outputs[0].finish_reason == "length"


def test_bfloat16_checkpoint_close_to_transformers(make_checkpoint):
    d = make_checkpoint("qwen2_moe", dtype="bfloat16")
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.dtype == torch.bfloat16
    ours, ref = load_model(d), hf_model(d, torch.bfloat16)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    p = PROMPTS[0]
    cache = DenseKVCache(cfg.num_layers, 1, 32, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    with torch.no_grad():
        got = ours.logits(ours(torch.tensor(p), AttentionBatch.build([len(p)], [0], [0]), cache))
        expected = ref(torch.tensor([p])).logits[0].float()
    assert (got - expected).abs().max().item() < 3e-2 * expected.abs().max().item()


def test_dtype_override_runs_float32_checkpoint_in_bfloat16(make_checkpoint):
    d = make_checkpoint("mixtral")
    llm = LLM(d, dtype="bfloat16")
    assert llm.engine.runner.dtype == torch.bfloat16
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
