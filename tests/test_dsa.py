"""DeepSeek-V3.2 (DeepSeek Sparse Attention: MLA over the index_topk tokens its indexer scores
highest; models/mla.py Indexer, models/kv_cache.sparse_latent_attention) against transformers:
config.json as transformers fills it, logits with prompts longer than index_topk (the sparse path,
which a dense MLA misses by far), greedy ids through LLM with preemption, chunked prefill and
prefix hits, in pools, and training."""
import pytest
import torch

from models.config import ConfigError, ModelConfig
from models.loader import load_model
from server import LLM, SamplingParams
from tests.conftest import PROMPTS, assert_close_to_transformers, hf_model, our_logits
from tests.test_more_families import GREEDY_PROMPTS, corpus  # noqa: F401 (a fixture)
from tests.test_qwen3_next import LONG

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
_EXPECTED: dict = {}


def expected(make_checkpoint) -> tuple:
    """(checkpoint, transformers' greedy ids for GREEDY_PROMPTS), computed once."""
    if not _EXPECTED:
        d = make_checkpoint("deepseek_v32")
        ref = hf_model(d)
        ref.generation_config.eos_token_id = None
        _EXPECTED["v"] = d, [ref.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                          pad_token_id=1)[0, len(p):].tolist() for p in GREEDY_PROMPTS]
    return _EXPECTED["v"]


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


@pytest.mark.parametrize("change,match", [
    ({"q_lora_rank": None}, "q_lora_rank must be set for deepseek_v32"),
    ({"index_head_dim": 32}, r"index_head_dim \(32\) must be at least qk_rope_head_dim \(64\)"),
    ({"index_topk": 0}, "index_topk must be positive"),
    ({"mlp_layer_types": ["dense"]}, "mlp_layer_types must list num_hidden_layers=6 entries"),
])
def test_refusals_name_the_field(change, match):
    raw = {"architectures": ["DeepseekV32ForCausalLM"], "num_hidden_layers": 6, "vocab_size": 512, **change}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("overrides", [
    {},
    # the top 9 by 24 index heads of 8 dims (6 of them roped), yarn rope with mscale, every layer MoE
    {"index_topk": 9, "index_n_heads": 24, "index_head_dim": 8, "mlp_layer_types": ["sparse"] * 3,
     "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0, "beta_fast": 32.0,
                         "beta_slow": 1.0}},
], ids=["top5", "top9-yarn-all-moe"])
def test_logits_equal_transformers(make_checkpoint, overrides):
    d = make_checkpoint("deepseek_v32", **overrides)
    model = load_model(d, kernels="torch")
    prompts = [*PROMPTS, LONG[:40]]  # 1 to 40 tokens against a top-5 / top-9
    assert_close_to_transformers(our_logits(model, prompts), hf_model(d), prompts)


def test_greedy_through_llm_with_preemption_chunked_prefill_and_prefix_hits(make_checkpoint):
    """18 KV blocks of 4 for 4 sequences of up to 35 tokens (preemptions), 5 tokens a step (prefill
    chunks of 1 to 4 beside sparse decodes) and 12 shared prompt tokens (prefix hits: the index keys
    are paged with the latents)."""
    d, want = expected(make_checkpoint)
    llm = LLM(d, num_kv_blocks=18, block_size=4, max_num_seqs=4, max_num_batched_tokens=5)
    assert [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, GREEDY)] == want
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.prefix_hits > 0 and eng.blocks.num_free_blocks == 18
    llm.shutdown()


@pytest.mark.slow
def test_pools_equal_transformers(make_checkpoint):
    d, want = expected(make_checkpoint)
    llm = LLM(d, num_kv_blocks=96, colocated=False, attention_workers=1, expert_workers=2, micro_batches=2,
              torch_threads=1)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, GREEDY)] == want
    finally:
        llm.shutdown()


def test_train_loss_equals_transformers_and_the_result_serves(make_checkpoint, corpus, tmp_path):  # noqa: F811
    """Rows of 19 and 16 tokens against a top-5: training attends sparsely too, as transformers does."""
    from tests.test_more_families import test_train_loss_equals_transformers_and_the_result_serves as check

    check(make_checkpoint, corpus, tmp_path, "deepseek_v32")
