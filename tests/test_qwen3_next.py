"""Qwen3-Next (gated DeltaNet layers beside gated full attention; models/linear_attention.py) against
transformers: its config.json read as transformers fills it, logits with prompts longer than a
delta-rule chunk, greedy ids through LLM with preemption and chunked prefill down to one token,
seeded samples reproducible, the per-sequence state slots given back, pools over shm and tcp, a
served stream, and training. Qwen3.5-MoE (the same layers with split linear projections, as
Qwen3_5MoeForCausalLM and as a Qwen3_5MoeForConditionalGeneration's language model): its config,
logits, greedy ids and training. (The delta rule and convolution themselves: tests/test_delta_rule.py.)"""
import logging

import pytest
import torch

from models.config import ConfigError, ModelConfig
from models.loader import load_model
from server import LLM, SamplingParams
from tests.conftest import PROMPTS, assert_close_to_transformers, hf_model, our_logits, transformers_greedy
from tests.test_more_families import GREEDY_PROMPTS, corpus  # noqa: F401 (a fixture)

LONG = [(7 * i) % 500 + 2 for i in range(150)]  # three chunks of the chunked delta rule (64 tokens each)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
_EXPECTED: dict = {}


def expected(make_checkpoint, family: str = "qwen3_next", params: SamplingParams = GREEDY) -> tuple:
    """(checkpoint, transformers' greedy ids for GREEDY_PROMPTS, params.max_tokens each), computed once."""
    if family not in _EXPECTED:
        d = make_checkpoint(family)
        _EXPECTED[family] = d, transformers_greedy(d, GREEDY_PROMPTS, params.max_tokens)
    return _EXPECTED[family]


def test_config_reads_as_transformers_fills_it():
    import transformers

    minimal = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 8, "vocab_size": 512}
    c, theirs = ModelConfig.from_dict(minimal), transformers.Qwen3NextConfig(**minimal)
    assert [("linear_attention" if c.is_linear(i) else "full_attention") for i in range(8)] == theirs.layer_types
    la = c.linear_attention
    assert (la.key_heads, la.value_heads, la.key_dim, la.value_dim, la.conv_kernel) == (
        theirs.linear_num_key_heads, theirs.linear_num_value_heads, theirs.linear_key_head_dim,
        theirs.linear_value_head_dim, theirs.linear_conv_kernel_dim)
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_experts, c.top_k) == (
        theirs.hidden_size, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim,
        theirs.num_experts, theirs.num_experts_per_tok)
    assert c.rotary_dim == 64 and c.shared_expert_gate and c.attn_output_gate and c.norm_offset == 1.0
    assert c.router.scoring == "softmax" and c.router.renormalize and c.qk_norm == "per_head"
    # KV only in the full-attention layers; the state per sequence: conv inputs and a float32 matrix
    assert c.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 256 * 2
    assert c.state_bytes_per_sequence(torch.bfloat16) == 6 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    small = {**minimal, "hidden_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4,
             "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
             "linear_value_head_dim": 12, "intermediate_size": 40, "moe_intermediate_size": 8,
             "shared_expert_intermediate_size": 8, "mlp_only_layers": [2]}
    model_params = sum(p.numel() for p in transformers.Qwen3NextForCausalLM(
        transformers.Qwen3NextConfig(**small)).parameters())
    small = ModelConfig.from_dict(small)
    assert small.total_params() == model_params  # the planner's sizes count what transformers builds


@pytest.mark.parametrize("change,match", [
    ({"linear_num_value_heads": 5}, r"linear_num_value_heads \(5\) must be a multiple of linear_num_key_heads"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types must list num_hidden_layers=8 entries"),
    ({"layer_types": ["sliding_attention"] * 8}, "layer_types must list num_hidden_layers=8 entries"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim must be a positive int"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
    ({"head_dim": 20}, "partial_rotary_factor 0.25 gives 5 rotary dims of head_dim 20"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
])
def test_refusals_name_the_field(change, match):
    raw = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 8, "vocab_size": 512, **change}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("overrides", [
    {},
    # one value head per key head, 3 conv taps, the default layer pattern (every 4th full), MoE on
    # every second layer, q/k/v/o biases, tied embeddings
    {"linear_num_value_heads": 3, "linear_conv_kernel_dim": 3, "layer_types": None, "num_hidden_layers": 4,
     "mlp_only_layers": [], "decoder_sparse_step": 2, "attention_bias": True, "tie_word_embeddings": True},
], ids=["default", "plain-heads-biases"])
def test_logits_equal_transformers(make_checkpoint, overrides):
    d = make_checkpoint("qwen3_next", **overrides)
    model = load_model(d, kernels="torch")
    prompts = [*PROMPTS, LONG]
    assert_close_to_transformers(our_logits(model, prompts), hf_model(d), prompts)


def test_greedy_through_llm_with_preemption_and_chunked_prefill(make_checkpoint, caplog):
    """LLM over 20 KV blocks of 4 for 4 sequences of up to 43 tokens (preemptions: a preempted
    sequence starts its state again from zeros), with 16 tokens a step and with 3 (prompts in
    chunks of 1 to 3 tokens beside the others' decodes: the state carried from chunk to chunk
    through the chunked and the recurrent forms); seeded n=2 samples equal across the two. Prefix caching is off (logged), every
    block and state slot comes back, and speculative decoding is refused."""
    d, want = expected(make_checkpoint)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2, ignore_eos=True)
    samples = []
    for kw in ({"num_kv_blocks": 20, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16},
               {"max_num_batched_tokens": 3, "max_num_seqs": 4}):
        with caplog.at_level(logging.INFO, logger="shuttle"):
            llm = LLM(d, **kw)
        assert "prefix caching off" in caplog.text
        assert [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, GREEDY)] == want
        samples.append([[c.token_ids for c in o.outputs] for o in llm.generate(GREEDY_PROMPTS[:2], seeded)])
        eng = llm.engine
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and eng.blocks.prefix_hits == 0
        assert sorted(eng.blocks.free_state_slots) == list(range(4))
        if kw.get("num_kv_blocks"):
            assert eng.scheduler.num_preemptions > 0
        llm.shutdown()
    assert samples[0] == samples[1]
    with pytest.raises(ValueError, match="speculative decoding is not supported for Qwen3NextForCausalLM"):
        LLM(d, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_pools_equal_transformers(make_checkpoint, transport):
    """1 attention worker (every state and cache) + 2 expert workers (the MoE layers only), 2 micro-batches."""
    d, want = expected(make_checkpoint)
    llm = LLM(d, num_kv_blocks=96, colocated=False, attention_workers=1, expert_workers=2, micro_batches=2,
              transport=transport, torch_threads=1)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, GREEDY)] == want
    finally:
        llm.shutdown()


def test_served_stream_equals_transformers(make_checkpoint):
    """`shuttle serve --model DIR` streams, through the official client, transformers' greedy text;
    the start-up log and /metrics give the state capacity (one state per sequence that can run)."""
    import re

    import httpx
    import openai

    from clients.live_server import LiveServer

    d, want = expected(make_checkpoint)
    with LiveServer(["--model", str(d), "--max-num-seqs", "8"]) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-")
        stream = client.completions.create(model=str(d), prompt=GREEDY_PROMPTS[0], max_tokens=GREEDY.max_tokens,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].text for c in stream)
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert re.search(r"^shuttle_linear_state_slots\{[^}]*\} 8\.0$", metrics, re.M), metrics
        assert "per-sequence state: 8 sequences" in srv.log()
    from transformers import AutoTokenizer

    assert text == AutoTokenizer.from_pretrained(d).decode(want[0])


def test_train_loss_equals_transformers_and_the_result_serves(make_checkpoint, corpus, tmp_path):  # noqa: F811
    """`shuttle train` on Qwen3-Next: the loss equals transformers', two steps lower it, and the saved
    checkpoint (norms stored as weight - 1 again) serves equal to the trained model."""
    from tests.test_more_families import test_train_loss_equals_transformers_and_the_result_serves as check

    check(make_checkpoint, corpus, tmp_path, "qwen3_next")


# --- Qwen3.5-MoE (text) ---

def test_qwen3_5_moe_config_reads_as_transformers_fills_it():
    """Both layouts: Qwen3_5MoeForCausalLM's flat config.json (model_type qwen3_5_moe_text) and
    Qwen3_5MoeForConditionalGeneration's text_config, whose top level gives the dtype and the lm_head
    tie (not text_config's). Read as transformers reads them: every layer MoE (decoder_sparse_step and
    mlp_only_layers unread), the router always renormalised (norm_topk_prob unread), mrope sections
    without effect on text; the planner's parameter count is what transformers builds."""
    import transformers

    minimal = {"num_hidden_layers": 8, "vocab_size": 512}
    flat = ModelConfig.from_dict({"architectures": ["Qwen3_5MoeForCausalLM"], **minimal, "mlp_only_layers": [1],
                                  "norm_topk_prob": False})
    by_type = ModelConfig.from_dict({"model_type": "qwen3_5_moe_text", **minimal})
    text = {**minimal, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
    nested = ModelConfig.from_dict({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                    "model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 2},
                                    "dtype": "bfloat16"})
    wrapper = transformers.Qwen3_5MoeConfig(text_config=text)
    for c, theirs in ((flat, transformers.Qwen3_5MoeTextConfig(**minimal)), (by_type, flat),
                      (nested, wrapper.text_config)):
        if isinstance(theirs, ModelConfig):
            assert theirs == c.__class__(**{**c.__dict__, "architecture": theirs.architecture})
            continue
        assert [("linear_attention" if c.is_linear(i) else "full_attention") for i in range(8)] == theirs.layer_types
        la = c.linear_attention
        assert (la.key_heads, la.value_heads, la.key_dim, la.value_dim, la.conv_kernel, la.split_projections) == (
            theirs.linear_num_key_heads, theirs.linear_num_value_heads, theirs.linear_key_head_dim,
            theirs.linear_value_head_dim, theirs.linear_conv_kernel_dim, True)
        assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_experts, c.top_k, c.vocab_size,
                c.moe_intermediate_size, c.shared_expert_intermediate_size, c.rms_norm_eps,
                c.max_position_embeddings, c.rope.theta) == (
            theirs.hidden_size, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim,
            theirs.num_experts, theirs.num_experts_per_tok, theirs.vocab_size, theirs.moe_intermediate_size,
            theirs.shared_expert_intermediate_size, theirs.rms_norm_eps, theirs.max_position_embeddings,
            theirs.rope_parameters["rope_theta"])
        assert c.rotary_dim == 64 and c.shared_expert_gate and c.attn_output_gate and c.norm_offset == 1.0
        assert c.router.scoring == "softmax" and c.router.renormalize and c.qk_norm == "per_head"
        assert all(c.moe_layers) and not c.o_bias and not c.qkv_bias
    assert (nested.architecture, nested.dtype, nested.tie_word_embeddings) == (
        "Qwen3_5MoeForConditionalGeneration", torch.bfloat16, wrapper.tie_word_embeddings)
    assert (flat.dtype, flat.tie_word_embeddings) == (torch.float32, False)
    small = {**minimal, "hidden_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4,
             "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 8,
             "linear_value_head_dim": 12, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12,
             "attention_bias": True, "num_hidden_layers": 4}
    model_params = sum(p.numel() for p in transformers.Qwen3_5MoeForCausalLM(
        transformers.Qwen3_5MoeTextConfig(**small)).parameters())
    assert ModelConfig.from_dict({"architectures": ["Qwen3_5MoeForCausalLM"], **small}).total_params() == model_params


@pytest.mark.parametrize("change,match", [
    ({"linear_num_value_heads": 5}, r"linear_num_value_heads \(5\) must be a multiple of linear_num_key_heads"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types must list num_hidden_layers=8 entries"),
    ({"linear_key_head_dim": -1}, "linear_key_head_dim must be a positive int"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
    ({"head_dim": 20}, "partial_rotary_factor 0.25 gives 5 rotary dims of head_dim 20"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e7}}, "rope type 'mrope' is not supported"),
])
@pytest.mark.parametrize("nested", [False, True], ids=["causal-lm", "conditional-generation"])
def test_qwen3_5_moe_refusals_name_the_field(change, match, nested):
    text = {"num_hidden_layers": 8, "vocab_size": 512, **change}
    raw = ({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text} if nested
           else {"architectures": ["Qwen3_5MoeForCausalLM"], **text})
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)
    if nested:
        with pytest.raises(ConfigError, match="text_config must be an object"):
            ModelConfig.from_dict({**raw, "text_config": [text]})


@pytest.mark.parametrize("overrides", [
    {},
    # one value head per key head, 3 conv taps, the default layer pattern (every 2nd full), q/k/v/o
    # biases, tied embeddings
    {"linear_num_value_heads": 2, "linear_conv_kernel_dim": 3, "layer_types": None, "num_hidden_layers": 2,
     "attention_bias": True, "tie_word_embeddings": True},
], ids=["default", "plain-heads-biases"])
def test_qwen3_5_moe_logits_equal_transformers(make_checkpoint, overrides):
    d = make_checkpoint("qwen3_5_moe", **overrides)
    model = load_model(d, kernels="torch")
    prompts = [*PROMPTS, LONG]
    assert_close_to_transformers(our_logits(model, prompts), hf_model(d), prompts)


def test_qwen3_5_moe_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """A Qwen3_5MoeForConditionalGeneration checkpoint (text_config; tensors under
    model.language_model., the vision tower under model.visual.) loads its language model only; its
    logits are the wrapper's on text (three equal position ids per token: its multimodal rope is
    plain rope); an expert worker's share loads from it too."""
    import transformers

    from models.builtin import randomize_biases, randomize_norms
    from models.loader import load_experts
    from tests.conftest import BASE, FAMILIES

    text = {**BASE, **FAMILIES["qwen3_5_moe"][1]}
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=vision)).save_pretrained(str(tmp_path))
    randomize_biases(tmp_path)
    randomize_norms(tmp_path)
    ref = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.architecture == "Qwen3_5MoeForConditionalGeneration" and cfg.num_layers == 3
    model = load_model(tmp_path, kernels="torch")
    prompts = [*PROMPTS, LONG]
    assert_close_to_transformers(our_logits(model, prompts), ref, prompts)
    mine = load_experts(tmp_path, [4, 2])  # an expert worker's share
    assert torch.equal(mine[1].w2[0], model.model.layers[1].mlp.experts.w2[4])


def test_qwen3_5_moe_greedy_through_llm_with_preemption_and_chunked_prefill(make_checkpoint):
    """LLM over 16 KV blocks of 4 for 4 sequences of up to 31 tokens, 16 tokens a step (preemptions;
    the 49 prompt tokens in chunks, beside the others' decodes): transformers' greedy ids; every block
    and state slot comes back."""
    short = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    d, want = expected(make_checkpoint, "qwen3_5_moe", short)
    llm = LLM(d, num_kv_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, short)] == want
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert sorted(eng.blocks.free_state_slots) == list(range(4))
    llm.shutdown()


def test_qwen3_5_moe_train_loss_equals_transformers_and_the_result_serves(make_checkpoint, corpus, tmp_path):  # noqa: F811
    """`shuttle train` on Qwen3.5-MoE: the loss equals transformers', two steps lower it, and the saved
    checkpoint (in_proj_qkv / z / b / a as read, norms stored as weight - 1) serves equal to the trained
    model. (Seed 1: from seed 0's weights, whose gradients equal transformers' too, two steps at lr 3e-3
    raise this tiny model's corpus loss by 0.016 before four lower it.)"""
    from tests.test_more_families import test_train_loss_equals_transformers_and_the_result_serves as check

    check(lambda family: make_checkpoint(family, seed=1), corpus, tmp_path, "qwen3_5_moe")
