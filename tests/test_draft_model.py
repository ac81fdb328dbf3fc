"""Draft-model speculation (method draft_model, attention_nodes/draft_model.py): a smaller checkpoint
proposes the drafts over the target's block tables. Greedy and seeded ids equal the engine's without
speculation, with drafts fully accepted (the target drafting for itself) and mostly rejected (another
random model), also with chunked prefill and preemption (which sends the draft model back over the
recomputed positions); a draft model that cannot share the target's token ids is refused."""
import pytest

from attention_nodes.draft_model import DraftModel
from models.config import ModelConfig
from models.errors import ConfigError
from models.kv_cache import cache_bytes_per_block
from server import LLM, SamplingParams
from tests.test_speculative import EVERY_BATCH, GREEDY, SPEC_PROMPTS, ckpt, plain  # noqa: F401 (fixtures: the tiny Mixtral, its plain engine)

SEEDED = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=2, ignore_eos=True)


def _config(model, k: int) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, **EVERY_BATCH}


def _ids(llm: LLM, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(SPEC_PROMPTS, params)]


@pytest.fixture(scope="module")
def small_draft(make_checkpoint):
    """Another random model with the target's vocabulary: one layer, other weights."""
    return make_checkpoint("mixtral", seed=5, num_hidden_layers=1)


@pytest.fixture(scope="module")
def want(plain):
    return _ids(plain, GREEDY), _ids(plain, SEEDED)


@pytest.mark.parametrize("which, k, kwargs", [
    ("self", 3, {}), ("self", 2, {"num_kv_blocks": 12}), ("small", 3, {}), ("small", 1, {"max_num_batched_tokens": 8}),
    ("small", 3, {"num_kv_blocks": 12}),
], ids=["self-k3", "self-k2-preempting", "small-k3", "small-k1-chunked-8", "small-k3-preempting"])
def test_greedy_and_seeded_ids_equal_without_speculation(ckpt, small_draft, want, which, k, kwargs):
    llm = LLM(ckpt, speculative_config=_config(ckpt if which == "self" else small_draft, k), **kwargs)
    try:
        greedy = _ids(llm, GREEDY)
        spec = llm.engine.stats()["spec_decode"]  # (of the greedy requests)
        assert (greedy, _ids(llm, SEEDED)) == want
        preempted = llm.engine.scheduler.num_preemptions
    finally:
        llm.shutdown()
    assert spec["num_drafts"] > 0
    if "num_kv_blocks" in kwargs:
        assert preempted > 0
    if which == "self":  # the target's own argmax (float32): every greedy draft is accepted
        assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
    else:
        assert 0 <= spec["num_accepted_tokens"] < 0.5 * spec["num_draft_tokens"]


def test_the_kv_budget_counts_both_caches_and_the_blocks_are_shared(ckpt, small_draft):
    llm = LLM(ckpt, speculative_config=_config(small_draft, 2))
    try:
        runner = llm.engine.runner
        drafter = runner.drafter
        assert isinstance(drafter, DraftModel)
        target, draft = ModelConfig.from_pretrained(ckpt), ModelConfig.from_pretrained(small_draft)
        assert runner._block_bytes() == (cache_bytes_per_block(target, runner.block_size, runner.dtype)
                                         + cache_bytes_per_block(draft, runner.block_size, runner.dtype))
        assert drafter.runner.num_blocks == runner.num_blocks
        assert drafter.runner.cache.k[0].shape[:2] == runner.cache.k[0].shape[:2]  # (blocks, block size) alike
    finally:
        llm.shutdown()


def test_a_draft_model_with_a_larger_vocabulary_is_refused(ckpt, make_checkpoint):
    big = make_checkpoint("mixtral", vocab_size=ModelConfig.from_pretrained(ckpt).vocab_size + 64)
    with pytest.raises(ConfigError, match=f"speculative_config model {big}: its vocabulary"):
        LLM(ckpt, speculative_config=_config(big, 2))


def test_pools_draft_on_the_attention_worker(ckpt, small_draft, want):
    """1 + 1 pools at m = 2: the attention worker holds the draft model (its experts with it) and
    verifies, the expert worker sees the target's rows only."""
    llm = LLM(ckpt, speculative_config=_config(small_draft, 2), colocated=False, attention_workers=1,
              expert_workers=1, micro_batches=2)
    try:
        assert _ids(llm, GREEDY) == want[0]
    finally:
        llm.shutdown()
