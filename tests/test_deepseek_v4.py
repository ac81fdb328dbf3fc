"""DeepSeek-V4 (models/deepseek_v4.py) against transformers' DeepseekV4ForCausalLM: its config.json read
as transformers fills it, the released tensor names, logits with prompts past the window and several
compressed windows long (the last one partial) where the indexer keeps fewer entries than there are,
greedy ids through LLM with preemption and chunked prefill down to one token, pools (1 + 2, m = 2),
and training. The routers' sqrtsoftplus and hash routing are checked here; the decode op in
tests/test_compressed_attention.py."""
import json
import logging

import pytest
import torch

from models.config import ConfigError, ModelConfig
from models.checkpoint import v4_checkpoint_name, v4_model_name
from models.loader import load_model
from server import LLM, SamplingParams
from tests.conftest import assert_close_to_transformers, hf_model, our_logits, transformers_greedy

# 39 tokens: 6 windows of the sliding layers, 9 CSA entries (the indexer keeps 3) and a partial fourth
# window of 8 in the HCA layer; the others shorter than a window or an entry
PROMPTS = [[(7 * i) % 500 + 2 for i in range(39)], [5, 17, 33, 100, 250, 7, 9, 11, 13, 200], [400, 3], [12]]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
_EXPECTED: dict = {}


def expected(make_checkpoint) -> tuple:
    if not _EXPECTED:
        d = make_checkpoint("deepseek_v4")
        _EXPECTED["v4"] = d, transformers_greedy(d, PROMPTS, GREEDY.max_tokens)
    return _EXPECTED["v4"]


def test_config_reads_as_transformers_fills_it():
    import transformers

    minimal = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 6, "vocab_size": 512}
    c, theirs = ModelConfig.from_dict(minimal), transformers.DeepseekV4Config(**minimal)
    kinds = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
    assert [kinds[t] for t in c.v4.layer_types] == theirs.layer_types
    assert ["hash_moe" if h else "moe" for h in c.v4.hash_layers] == theirs.mlp_layer_types
    assert (c.v4.csa_rate, c.v4.hca_rate) == (4, 128) and c.v4.rope_dim == theirs.qk_rope_head_dim == 64
    assert (c.num_kv_heads, c.head_dim, c.v4.window, c.v4.hc_mult, c.v4.index_topk) == (1, 512, 128, 4, 512)
    assert c.router.scoring == "sqrtsoftplus" and c.router.renormalize and c.router.scaling == 1.5
    assert c.expert_act.limit == 10.0 and c.v4.compress_rope.theta == 160000.0 and c.rope.theta == 10000.0
    # legacy fields: compress_ratios per layer, num_hash_layers, a top-level yarn for the compressed layers
    legacy = ModelConfig.from_dict({**minimal, "compress_ratios": [0, 4, 128, 4, 0, 128], "num_hash_layers": 1,
                                    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}})
    assert legacy.v4.layer_types == ("sliding", "csa", "hca", "csa", "sliding", "hca")
    assert legacy.v4.hash_layers == (True,) + (False,) * 5
    assert legacy.v4.compress_rope.rope_type == "yarn" and legacy.v4.compress_rope.attention_factor == 1.0
    assert legacy.rope.rope_type == "default"


def test_sizes_and_names_match_transformers(make_checkpoint):
    """The planner's parameter count is what transformers holds (its state dict: the correction biases
    and token tables are buffers there); every tensor transformers writes maps to a parameter and
    back, with and without the "model." prefix of the released files."""
    import transformers
    from safetensors import safe_open

    d = make_checkpoint("deepseek_v4")
    raw = json.loads((d / "config.json").read_text())
    theirs = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(
        **{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version", "dtype")}))
    assert ModelConfig.from_dict(raw).total_params() == sum(t.numel() for t in theirs.state_dict().values())
    ours = {n for n, _ in load_model(d).named_parameters()}
    with safe_open(str(next(d.glob("*.safetensors"))), "pt") as f:
        names = [n for n in f.keys() if ".experts." not in n]
    assert {v4_model_name(n) for n in names} == {n for n in ours if ".experts." not in n}
    assert all(v4_model_name(v4_checkpoint_name(n)) == n for n in ours)
    assert v4_model_name("layers.3.attn.indexer.compressor.ape") == v4_model_name("model.layers.3.attn.indexer.compressor.ape")
    assert v4_model_name("embed.weight") == "model.embed_tokens.weight" and v4_model_name("hc_head_fn") == "model.hc_head.hc_fn"


@pytest.mark.parametrize("change,match", [
    ({"num_key_value_heads": 2}, "one key/value head"),
    ({"o_groups": 3}, "o_groups"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"compress_rates": {"compressed_sparse_attention": 6}}, "power of two"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"index_head_dim": 32}, "index_head_dim"),
])
def test_bad_configs_name_the_field(change, match):
    raw = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 2, "vocab_size": 64, **change}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_routing_sqrtsoftplus_and_hash():
    from kernels.routing import hash_route, topk_route

    logits = torch.randn(9, 6)
    scores = torch.nn.functional.softplus(logits).sqrt()
    bias = torch.rand(6)
    w, ids = topk_route(logits, 2, "sqrtsoftplus", True, correction_bias_E=bias, scaling=1.5)
    assert torch.equal(ids, (scores + bias).topk(2).indices)
    want = scores.gather(1, ids)
    torch.testing.assert_close(w, want / want.sum(-1, keepdim=True) * 1.5)
    table = torch.tensor([[3, 1], [0, 5]])
    w, ids = hash_route(logits[:2], table, "sqrtsoftplus", True, 2.0)
    assert torch.equal(ids, table)
    torch.testing.assert_close(w, scores[:2].gather(1, table) / scores[:2].gather(1, table).sum(-1, keepdim=True) * 2)


def test_native_hyper_weights_equal_torch(monkeypatch):
    """kernels/csrc/hyper.c gives the torch path's pre, post and comb (odd stream counts and iterations)."""
    from kernels import native
    from models.deepseek_v4 import HyperConnection

    if not native.available():
        pytest.skip("no native kernels here")
    for n, iters in ((1, 1), (3, 7), (4, 20)):
        h = HyperConnection(40, n, iters, 1e-6, 1e-6)
        torch.nn.init.normal_(h.fn, std=0.1), torch.nn.init.normal_(h.base, std=0.5), torch.nn.init.uniform_(h.scale, 0.5, 1.5)
        x = torch.randn(9, n, 40)
        with torch.no_grad():
            got = h(x)
            monkeypatch.setattr(native, "eager_cpu", lambda *t: False)
            want = h(x)
            monkeypatch.undo()
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_mtp_layers_are_skipped_with_one_line(make_checkpoint, tmp_path, caplog):
    """The released files' mtp.N.* tensors (not served) load as nothing, said once."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "with_mtp"
    shutil.copytree(make_checkpoint("deepseek_v4"), d)
    f = next(d.glob("*.safetensors"))
    tensors = load_file(f)
    tensors.update({"mtp.0.enorm.weight": torch.ones(64), "mtp.0.attn.wq_a.weight": torch.zeros(20, 64)})
    save_file(tensors, f, metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="shuttle"):
        load_model(d)
    assert "skipped 2 tensors of 1 multi-token-prediction layer(s)" in caplog.text


def test_logits_match_transformers(make_checkpoint):
    """Through the paged cache (entries in pages of 4, window and compressor rows in state slots) and
    without a cache (training's path), prompts batched together."""
    d = make_checkpoint("deepseek_v4")
    model, ref = load_model(d), hf_model(d)
    assert_close_to_transformers(our_logits(model, PROMPTS), ref, PROMPTS)
    from tests.conftest import paged_batch

    batch, _ = paged_batch(PROMPTS)
    with torch.no_grad():
        stateless = model.logits(model(torch.tensor([t for p in PROMPTS for t in p]), batch, object()))
    assert_close_to_transformers(stateless, ref, PROMPTS)


def test_greedy_through_llm_with_preemption_and_chunked_prefill(make_checkpoint, caplog):
    """transformers' greedy ids: pages of 4 (HCA's entries of 8 span two) with preemptions, and 3
    tokens a step (prompts in chunks of 1-3 beside decodes: the compressors' pending rows carried
    from chunk to chunk); pages of 16 (four CSA entries and two HCA ones a page). Prefix caching is
    off (logged), every block and state slot comes back, speculative decoding is refused."""
    d, want = expected(make_checkpoint)
    for kw in ({"num_kv_blocks": 14, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16},
               {"max_num_batched_tokens": 3, "max_num_seqs": 4}, {"block_size": 16, "max_num_seqs": 4}):
        with caplog.at_level(logging.INFO, logger="shuttle"):
            llm = LLM(d, **kw)
        assert "prefix caching off" in caplog.text and "per-sequence state: 4 sequences" in caplog.text
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want, kw
        eng = llm.engine
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and sorted(eng.blocks.free_state_slots) == [0, 1, 2, 3]
        if kw.get("num_kv_blocks"):
            assert eng.scheduler.num_preemptions > 0
        llm.shutdown()
    with pytest.raises(ValueError, match="speculative decoding is not supported for DeepseekV4ForCausalLM"):
        LLM(d, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.slow
def test_pools_give_transformers_greedy_ids(make_checkpoint):
    """1 attention worker + 2 expert workers, 2 micro-batches over shm: the expert workers see the
    collapsed MoE inputs only (the hash layers' experts are chosen on the attention side)."""
    d, want = expected(make_checkpoint)
    llm = LLM(d, num_kv_blocks=96, colocated=False, attention_workers=1, expert_workers=2, micro_batches=2,
              transport="shm", torch_threads=1)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    finally:
        llm.shutdown()


def test_train_loss_equals_transformers_and_the_result_serves(make_checkpoint, corpus, tmp_path):  # noqa: F811
    """`shuttle train` on DeepSeek-V4: the loss equals transformers', two steps lower it, and the saved
    checkpoint (the released names, token tables as int64) serves equal to the trained model and
    loads in transformers."""
    from tests.test_more_families import test_train_loss_equals_transformers_and_the_result_serves as check

    check(make_checkpoint, corpus, tmp_path, "deepseek_v4")


from tests.test_more_families import corpus  # noqa: E402,F401 (a fixture)
