"""Engine-level request features: prompt logprobs (against transformers), logit_bias, and the same
results through the disaggregated pools (sampling and logits live on the attention workers)."""
import pytest
import torch

from server import LLM, SamplingParams
from tests.conftest import hf_model

PROMPT = [5, 17, 33, 100, 250, 7, 9, 11, 13, 200, 301, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59,
          60, 61, 62, 63, 64, 65, 66, 67, 68]  # 35 tokens: more than two KV blocks and two prefill chunks


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    # a 16-token step budget splits the prompt into chunks: prompt logprobs must span them
    return LLM(ckpt, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)


def reference_prompt_logprobs(ckpt, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logprobs = hf_model(ckpt)(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


def test_prompt_logprobs_equal_transformers(ckpt, llm):
    want = reference_prompt_logprobs(ckpt, PROMPT)
    for run in range(2):  # the second run's prompt is in the prefix cache: it must not skip it
        out = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, n=2))[0]
        plp = out.prompt_logprobs
        assert plp[0] is None and len(plp) == len(PROMPT)
        got = torch.tensor([plp[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for i in range(1, len(PROMPT)):
            top = sorted((lp for lp in plp[i].values() if lp.rank <= 3), key=lambda lp: lp.rank)
            assert [lp.rank for lp in top] == [1, 2, 3] and top[0].logprob >= top[2].logprob
            assert plp[i][PROMPT[i]].rank >= 1


def test_logit_bias_bans_and_forces(llm):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    base = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    banned = {t: -100.0 for t in set(base)}
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias=banned))
    assert not set(out[0].outputs[0].token_ids) & set(base)
    forced = llm.generate([PROMPT, PROMPT[:5]], [SamplingParams(max_tokens=6, temperature=1.0, seed=1, logit_bias={77: 100}),
                                                 greedy])
    assert forced[0].outputs[0].token_ids == [77] * 6
    assert forced[1].outputs[0].token_ids == llm.generate([PROMPT[:5]], greedy)[0].outputs[0].token_ids  # row alone


def test_bad_values_name_the_field(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="logit_bias has token ids"):
        llm.generate([PROMPT], SamplingParams(logit_bias={10 ** 6: 1.0}))


@pytest.mark.slow
def test_through_the_pools(ckpt, llm):
    """Prompt logprobs and logit_bias over 1 attention + 1 expert worker, 2 micro-batches, equal colocated."""
    params = [SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, logit_bias={9: 5.0}, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0, logit_bias={77: 100}, ignore_eos=True)]
    pools = LLM(ckpt, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, colocated=False, micro_batches=2,
                torch_threads=1)
    try:
        got = pools.generate([PROMPT, PROMPT[:7]], params)
    finally:
        pools.shutdown()
    want = llm.generate([PROMPT, PROMPT[:7]], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[1].outputs[0].token_ids == [77] * 4
    g = [plp[t].logprob for plp, t in zip(got[0].prompt_logprobs[1:], PROMPT[1:])]
    w = [plp[t].logprob for plp, t in zip(want[0].prompt_logprobs[1:], PROMPT[1:])]
    torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=0)


def test_token_bitmask_equals_xgrammars():
    import xgrammar as xgr

    from kernels.sampling import apply_token_bitmask_

    g = torch.Generator().manual_seed(0)
    for V in (31, 32, 1000, 4096):
        logits = torch.randn(5, V, generator=g)
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, (V + 31) // 32), dtype=torch.int32, generator=g)
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=V, indices=[0, 2, 3])
        got = apply_token_bitmask_(logits.clone(), bitmask, [0, 2, 3])
        assert torch.equal(got, want)


def test_structured_rows_keep_to_their_grammar(llm):
    """A batch mixing a choice, a regex and a free row: each constrained row matches; the free row is
    what it is alone (the masks touch only their rows)."""
    import re

    from attention_nodes.structured import StructuredOutputs

    free = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = llm.generate(["The list", "The dict", "The set"], [
        SamplingParams(max_tokens=8, temperature=1.0, seed=0, structured_outputs=StructuredOutputs("choice", '["ab", "cd"]')),
        SamplingParams(max_tokens=8, temperature=1.0, seed=0, structured_outputs={"kind": "regex", "spec": "[0-9]{3}"}),
        free])
    assert outs[0].outputs[0].text in ("ab", "cd") and outs[0].outputs[0].finish_reason == "stop"
    assert re.fullmatch("[0-9]{3}", outs[1].outputs[0].text)
    assert outs[2].outputs[0].token_ids == llm.generate(["The set"], free)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="structured_outputs regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs("regex", "(")))
