"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention: MLA over the index_topk tokens its indexer
scores highest; models/mla.py Indexer, models/kv_cache.sparse_latent_attention; GLM-5's "shared"
layers attend to the tokens the last layer with an indexer chose) against transformers:
config.json as transformers fills it, logits with prompts longer than index_topk (the sparse path,
which a dense MLA misses by far, as it misses GLM-5 where a shared layer chooses its own tokens,
takes an earlier layer's choice or ropes the index in halves), greedy ids through LLM with
preemption, chunked prefill and prefix hits, in pools of two micro-batches (each keeps its own
choice), and training."""
import pytest
import torch

from models.config import ConfigError, ModelConfig
from models.loader import load_model
from server import LLM, SamplingParams
from tests.conftest import PROMPTS, assert_close_to_transformers, hf_model, our_logits, transformers_greedy
from tests.test_more_families import GREEDY_PROMPTS, corpus  # noqa: F401 (a fixture)
from tests.test_qwen3_next import LONG

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
DSA = ["deepseek_v32", "glm_moe_dsa"]
_EXPECTED: dict = {}


def expected(make_checkpoint, family: str) -> tuple:
    """(checkpoint, transformers' greedy ids for GREEDY_PROMPTS), computed once per family."""
    if family not in _EXPECTED:
        d = make_checkpoint(family)
        _EXPECTED[family] = d, transformers_greedy(d, GREEDY_PROMPTS, GREEDY.max_tokens)
    return _EXPECTED[family]


def test_config_reads_as_transformers_fills_it():
    import transformers

    minimal = {"architectures": ["DeepseekV32ForCausalLM"], "num_hidden_layers": 6, "vocab_size": 512}
    c, theirs = ModelConfig.from_dict(minimal), transformers.DeepseekV32Config(**minimal)
    m = c.mla
    assert (m.index_heads, m.index_head_dim, m.index_topk) == (theirs.index_n_heads, theirs.index_head_dim,
                                                               theirs.index_topk)
    assert [("sparse" if x else "dense") for x in c.moe_layers] == theirs.mlp_layer_types
    assert m.rope_interleave and c.router.scaling == 2.5 and c.router.correction_bias and c.num_experts == 256
    # the cache keeps each token's latent, roped key and index key
    assert c.kv_bytes_per_token(torch.bfloat16) == 6 * (512 + 64 + 128) * 2
    explicit = ModelConfig.from_dict({**minimal, "mlp_layer_types": ["dense", "sparse"] * 3})
    assert explicit.moe_layers == (False, True) * 3


@pytest.mark.parametrize("fields", [{}, {"index_topk_freq": 3, "index_skip_topk_offset": 1}, {"index_topk_freq": 4},
                                    {"index_topk_pattern": "FSSFFS"}, {"index_topk_pattern": ["full", "shared"] * 3},
                                    {"indexer_types": ["full"] * 5 + ["shared"], "index_topk_freq": 2}],
                         ids=["all-full", "every-3rd", "offset-2", "pattern", "pattern-list", "indexer_types"])
def test_glm5_config_reads_as_transformers_fills_it(fields):
    """GLM-5's own defaults (32 index heads, one expert group, ...) and which layers run an indexer:
    indexer_types, else index_topk_pattern, else index_topk_freq from index_skip_topk_offset."""
    import transformers

    minimal = {"architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 6, "vocab_size": 512, **fields}
    c, theirs = ModelConfig.from_dict(minimal), transformers.GlmMoeDsaConfig(**minimal)
    m = c.mla
    assert m.index_layers == tuple(t == "full" for t in theirs.indexer_types)
    assert (m.index_heads, m.index_head_dim, m.index_topk, m.q_lora_rank, m.qk_nope_head_dim, m.v_head_dim) == (
        theirs.index_n_heads, theirs.index_head_dim, theirs.index_topk, theirs.q_lora_rank, theirs.qk_nope_head_dim,
        theirs.v_head_dim)
    assert [("sparse" if x else "dense") for x in c.moe_layers] == theirs.mlp_layer_types
    assert (c.router.num_groups, c.router.topk_groups, c.rms_norm_eps, c.max_position_embeddings) == (
        theirs.n_group, theirs.topk_group, theirs.rms_norm_eps, theirs.max_position_embeddings)
    assert m.rope_interleave and m.index_rope_interleave and c.router.scaling == 2.5 and c.router.correction_bias
    # every layer caches its latent and roped key; only those with an indexer an index key
    assert c.kv_bytes_per_token(torch.bfloat16) == (6 * (512 + 64) + 128 * sum(m.index_layers)) * 2


@pytest.mark.parametrize("family, cls", [("deepseek_v32", "DeepseekV32ForCausalLM"),
                                         ("glm_moe_dsa", "GlmMoeDsaForCausalLM")])
def test_sizes_count_what_transformers_builds(family, cls):
    """The planner's sizes (ModelConfig.total_params) count the indexers where they run; transformers
    keeps the correction bias as a buffer, not a parameter."""
    import transformers

    from tests.conftest import hf_config

    model = getattr(transformers, cls)(hf_config(family))
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    ours = ModelConfig.from_dict({**hf_config(family).to_dict(), "architectures": [cls]})
    assert ours.total_params() == sum(p.numel() for p in model.parameters()) + buffers


@pytest.mark.parametrize("family", DSA)
@pytest.mark.parametrize("change,match", [
    ({"q_lora_rank": None}, "q_lora_rank must be set for {family}"),
    ({"index_head_dim": 32}, r"index_head_dim \(32\) must be at least qk_rope_head_dim \(64\)"),
    ({"index_topk": 0}, "index_topk must be positive"),
    ({"mlp_layer_types": ["dense"]}, "mlp_layer_types must list num_hidden_layers=6 entries"),
    ({"attention_dropout": 0.1}, r"attention_dropout=0.1 is not supported \(only 0\)"),
])
def test_refusals_name_the_field(family, change, match):
    arch = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[family]
    raw = {"architectures": [arch], "num_hidden_layers": 6, "vocab_size": 512, **change}
    with pytest.raises(ConfigError, match=match.format(family=family)):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("change,match", [
    # a shared layer 0 has no earlier choice to reuse (transformers' forward fails on it)
    ({"indexer_types": ["shared"] + ["full"] * 5}, "indexer_types must start with a 'full' layer"),
    ({"index_topk_freq": 2, "index_skip_topk_offset": 0}, "indexer_types must start with a 'full' layer"),
    ({"index_topk_pattern": "SFFFFF"}, "index_topk_pattern must start with a 'full' layer"),
    ({"indexer_types": ["full", "dense"] * 3}, "indexer_types must list num_hidden_layers=6 entries of 'full' / 'shared'"),
    ({"indexer_types": ["full"] * 5}, "indexer_types must list num_hidden_layers=6 entries"),
    ({"index_topk_pattern": "FSXFFF"}, "index_topk_pattern must be a string of 'F' / 'S'"),
])
def test_glm5_refusals_name_the_field(change, match):
    raw = {"architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 6, "vocab_size": 512, **change}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 1.0, "rope_theta": 10000.0, "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("family,overrides", [
    ("deepseek_v32", {}),
    # the top 9 by 24 index heads of 8 dims (6 of them roped), yarn rope with mscale, every layer MoE
    ("deepseek_v32", {"index_topk": 9, "index_n_heads": 24, "index_head_dim": 8, "mlp_layer_types": ["sparse"] * 3,
                      "rope_parameters": YARN}),
    ("glm_moe_dsa", {}),  # layers 1 and 3 reuse the choices of layers 0 and 2
    # layers 1 and 2 both reuse layer 0's choice, the top 9 by 24 index heads of 8, yarn rope
    ("glm_moe_dsa", {"index_topk": 9, "index_n_heads": 24, "index_head_dim": 8, "index_topk_freq": 3,
                     "rope_parameters": YARN}),
], ids=["v32-top5", "v32-top9-yarn-all-moe", "glm5-top5", "glm5-top9-yarn-shared-twice"])
def test_logits_equal_transformers(make_checkpoint, family, overrides):
    d = make_checkpoint(family, **overrides)
    model = load_model(d, kernels="torch")
    prompts = [*PROMPTS, LONG[:40]]  # 1 to 40 tokens against a top-5 / top-9
    assert_close_to_transformers(our_logits(model, prompts), hf_model(d), prompts)


@pytest.mark.parametrize("family", DSA)
def test_greedy_through_llm_with_preemption_chunked_prefill_and_prefix_hits(make_checkpoint, family):
    """18 KV blocks of 4 for 4 sequences of up to 35 tokens (preemptions), 5 tokens a step (prefill
    chunks of 1 to 4 beside sparse decodes) and 12 shared prompt tokens (prefix hits: the index keys
    are paged with the latents)."""
    d, want = expected(make_checkpoint, family)
    llm = LLM(d, num_kv_blocks=18, block_size=4, max_num_seqs=4, max_num_batched_tokens=5)
    assert [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, GREEDY)] == want
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.prefix_hits > 0 and eng.blocks.num_free_blocks == 18
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("family", DSA)
def test_pools_equal_transformers(make_checkpoint, family):
    """Two micro-batches through the layers in turn: each keeps its own choice of tokens (GLM-5)."""
    d, want = expected(make_checkpoint, family)
    llm = LLM(d, num_kv_blocks=96, colocated=False, attention_workers=1, expert_workers=2, micro_batches=2,
              torch_threads=1)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, GREEDY)] == want
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", DSA)
def test_train_loss_equals_transformers_and_the_result_serves(make_checkpoint, corpus, tmp_path, family):  # noqa: F811
    """Rows of 19 and 16 tokens against a top-5: training attends sparsely too, as transformers does
    (GLM-5's shared layers with the choices of the layers before them)."""
    from tests.test_more_families import test_train_loss_equals_transformers_and_the_result_serves as check

    check(make_checkpoint, corpus, tmp_path, family)


def test_fp8_block_checkpoint_serves_as_its_dequantised_weights(make_checkpoint, tmp_path):
    """DeepSeek-V3.2 as published: every projection, the indexer's wq_b and wk among them, FP8 with
    128 x 128 block scales (partial blocks at these sizes). Served as shipped (the CPU default for an
    FP8 checkpoint), its greedy ids are transformers' on the dequantised float checkpoint."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.test_deepseek import _quantize_checkpoint

    src = make_checkpoint("deepseek_v32", hidden_size=200, moe_intermediate_size=132, intermediate_size=136)
    dequantised = _quantize_checkpoint(src, tmp_path / "fp8", extra=(".indexer.wq_b.", ".indexer.wk."))
    shipped = load_file(next((tmp_path / "fp8").glob("*.safetensors")))
    assert shipped["model.layers.0.self_attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    deq = tmp_path / "deq"
    shutil.copytree(src, deq)
    f = next(deq.glob("*.safetensors"))
    save_file({**load_file(f), **dequantised}, f, metadata={"format": "pt"})
    prompts = GREEDY_PROMPTS[:2]
    want = transformers_greedy(deq, prompts, 8)
    llm = LLM(tmp_path / "fp8")
    try:
        assert llm.engine_cfg.quantization == "fp8"
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                                                      ignore_eos=True))]
    finally:
        llm.shutdown()
    assert got == want
