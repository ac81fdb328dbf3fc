"""Speculative decoding (--speculative-config, attention_nodes/speculative.py): n-gram drafts
verified in one forward pass. Greedy ids equal the engine's without speculation, and so do seeded
samples (each emitted token is one draw from the target distribution); drafts are accepted and
rejected in the runs checked (the counters say so), also with chunked prefill, preemption, stop
strings, logprobs and in pools."""
import time

import pytest

from attention_nodes.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from attention_nodes.speculative import propose_ngram
from clients.bench_metrics import spec_counters, spec_decode_stats
from server import LLM, SamplingParams
from tests.conftest import PROMPTS

# drafting at every batch these tests run (the default disable_by_batch_size turns it off above 4)
EVERY_BATCH = {"disable_by_batch_size": 64}
NGRAM_ARGS = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
NGRAM = {**NGRAM_ARGS, **EVERY_BATCH}
# Prompts that repeat themselves give the lookup something to find; the tiny random model's greedy
# outputs loop, so drafts from its own output get accepted too.
SPEC_PROMPTS = [*PROMPTS, [9, 8, 7, 6, 9, 8, 7, 6, 9, 8, 7], [40, 41, 42, 40, 41, 42, 40, 41]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_propose_ngram_takes_the_longest_suffix_at_its_latest_occurrence():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, 1, 5) == [4, 1, 2]
    assert propose_ngram([7, 1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 2) == [8, 1]  # latest earlier "1 2"
    assert propose_ngram([5, 1, 2, 3, 6, 2, 3, 7, 3], 2, 1, 3) == [7, 3]  # "3" alone: the latest
    assert propose_ngram([1, 2, 3, 9, 2, 3], 3, 2, 3) == [9, 2, 3]  # "2 3", not the longer "1 2 3"
    assert propose_ngram([1, 2, 3, 9, 2, 3], 3, 3, 3) == []  # no earlier "9 2 3"
    assert propose_ngram([1, 2, 3, 4, 5], 3, 1, 5) == []
    assert propose_ngram([4, 4], 3, 1, 5) == [4]  # only what follows the match
    assert propose_ngram([4], 3, 1, 5) == [] and propose_ngram([1, 1, 1], 0, 1, 2) == []


@pytest.mark.parametrize("bad, match", [
    ({"method": "eagle", "num_speculative_tokens": 1}, "not supported; choose from ngram, mtp, draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 1}, "draft_model needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 1, "model": "/x"}, "'model' is for method draft_model"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "token_map": "m.json"}, "'token_map' is for method mtp"),
    ({"method": "mtp", "num_speculative_tokens": 2, "token_map": 7}, "token_map must be a file's path"),
    ("{not json", "JSON object"),
])
def test_bad_speculative_configs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(bad)


def test_prompt_lookup_bounds_default_as_vllm():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').prompt_lookup_min == 5
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint("mixtral")


@pytest.fixture(scope="module")
def plain(ckpt):
    llm = LLM(ckpt)
    yield llm
    llm.shutdown()


def _ids(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


def _spec(llm: LLM) -> dict:
    return llm.engine.stats()["spec_decode"]


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 12}],
                         ids=["plain", "chunked-8", "preempting"])
def test_greedy_and_seeded_ids_equal_without_speculation(ckpt, plain, kwargs):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=2, ignore_eos=True)
    want_greedy, want_seeded = _ids(plain, SPEC_PROMPTS, GREEDY), _ids(plain, SPEC_PROMPTS, seeded)
    llm = LLM(ckpt, speculative_config=NGRAM, **kwargs)
    try:
        assert _ids(llm, SPEC_PROMPTS, GREEDY) == want_greedy
        assert _ids(llm, SPEC_PROMPTS, seeded) == want_seeded
        spec = _spec(llm)
        if kwargs.get("num_kv_blocks"):
            assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    # drafts were proposed, some accepted (a repeated pattern), some rejected
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
    assert spec["accepted_per_pos"][0] >= spec["accepted_per_pos"][1] >= spec["accepted_per_pos"][2]
    assert sum(spec["accepted_per_pos"]) == spec["num_accepted_tokens"]


def test_a_mixed_batch_verifies_as_plain_decoding(ckpt, plain):
    """One batch of greedy requests (plain, with penalties and min_tokens, with logprobs: all their
    draft positions sampled in one sampler call, drafts accepted in Python) and seeded sampled ones
    (verified position by position): every request's tokens and logprobs are the plain engine's for
    the same batch; drafts are accepted and rejected, and a call samples several positions of one
    sequence."""
    params = [GREEDY,
              SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.2, frequency_penalty=0.1, min_tokens=6,
                             stop_token_ids=[SPEC_PROMPTS[-1][1]]),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, min_tokens=20, logprobs=1),
              SamplingParams(max_tokens=16, temperature=0.7, seed=3, ignore_eos=True, logprobs=1)]
    calls = []  # per sampler call, its rows beyond one per request (each request has its own params)
    llm = LLM(ckpt, speculative_config=NGRAM)
    sampler = llm.engine.sampler

    def spy(logits, rows):
        calls.append(len(rows) - len({id(r.params) for r in rows}))
        return sampler(logits, rows)

    llm.engine.sampler = spy
    try:
        want = plain.generate(SPEC_PROMPTS, params)
        got = llm.generate(SPEC_PROMPTS, params)
        spec = _spec(llm)
    finally:
        llm.shutdown()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert (g.outputs[0].logprobs is None) == (w.outputs[0].logprobs is None)
        for a, b in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
            assert {t: round(v.logprob, 4) for t, v in a.items()} == {t: round(v.logprob, 4) for t, v in b.items()}
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
    assert max(calls) > 0


def test_stops_logprobs_and_batch_size_switch(ckpt, plain, caplog):
    """max_tokens, stop token ids and stop strings cut a multi-token step where they hit; logprobs
    come per emitted token; above disable_by_batch_size nothing is drafted (logged)."""
    prompt = SPEC_PROMPTS[-1]
    base = plain.generate([prompt], GREEDY)[0].outputs[0]
    stop_tok = base.token_ids[9]
    stop_str = plain.tokenizer.decode(base.token_ids[5:7])
    cases = [SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok]),
             SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop_str]),
             SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)]
    want = [plain.generate([prompt], p)[0].outputs[0] for p in cases]
    llm = LLM(ckpt, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    try:
        got = [llm.generate([prompt], p)[0].outputs[0] for p in cases]
        assert _spec(llm)["num_accepted_tokens"] > 0
        with caplog.at_level("INFO", logger="shuttle"):
            llm.generate(SPEC_PROMPTS, GREEDY)
    finally:
        llm.shutdown()
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                         w.stop_reason)
    assert [list(e) for e in got[3].logprobs] == [list(e) for e in want[3].logprobs]
    for g, w in zip(got[3].logprobs, want[3].logprobs):
        assert [round(v.logprob, 4) for v in g.values()] == [round(v.logprob, 4) for v in w.values()]
    assert any("speculative decoding off" in r.getMessage() for r in caplog.records)


def test_pools_verify_drafts_as_colocated(ckpt, plain):
    want = _ids(plain, SPEC_PROMPTS, GREEDY)
    llm = LLM(ckpt, speculative_config=NGRAM, colocated=False, attention_workers=1, expert_workers=2,
              micro_batches=2)
    try:
        assert _ids(llm, SPEC_PROMPTS, GREEDY) == want
        # The worker reports its Stats every 0.25 s and once when it parks, on another channel
        # than the tokens: wait for the report that counts every token generate returned.
        emitted, deadline = sum(len(i) for o in want for i in o), time.monotonic() + 10
        while llm.engine.stats()["generated_tokens"] < emitted and time.monotonic() < deadline:
            time.sleep(0.05)
        spec = llm.engine.stats()["spec_decode"]
    finally:
        llm.shutdown()
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]


def test_served_with_speculation_streams_the_same_tokens(ckpt, plain):
    """`shuttle serve --speculative-config`: the official client streams what the engine gives without
    speculation; /v1/models shows the config and /metrics vLLM's counters."""
    import json

    import httpx
    import openai

    from clients.live_server import LiveServer
    from tests.test_bench_serve import run_bench

    prompt = SPEC_PROMPTS[-1]
    want = plain.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0].text
    with LiveServer(["--model", str(ckpt), "--served-model-name", "tiny", "--colocated",
                     "--speculative-config", json.dumps(NGRAM_ARGS)]) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
        [model] = client.models.list().data
        assert model.model_extra["speculative_config"] == {**NGRAM_ARGS, "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE}
        metrics = httpx.get(f"{srv.url}/metrics").text
        # `shuttle bench serve` reports the run's acceptance as vLLM's does, from /metrics before and after
        result = run_bench(["--base-url", srv.url, "--num-prompts", "4", "--input-len", "12", "--output-len", "16",
                            "--ignore-eos", "--disable-tqdm"])
        after = spec_counters(httpx.get(f"{srv.url}/metrics").text)
    drafts = [line for line in metrics.splitlines() if line.startswith("shuttle_spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0
    assert 'shuttle_spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"}' in metrics
    before = spec_counters(metrics)
    n, accepted = (after[k] - before[k] for k in ("num_drafts", "num_accepted_tokens"))
    # (the bench's 1-token readiness request ran between `metrics` and the bench's own first read)
    assert 0 < result["spec_decode_num_drafts"] <= n and result["spec_decode_accepted_tokens"] <= accepted
    assert result["spec_decode_acceptance_length"] == pytest.approx(
        1 + result["spec_decode_accepted_tokens"] / result["spec_decode_num_drafts"])
    assert len(result["spec_decode_per_position_acceptance_rates"]) == NGRAM["num_speculative_tokens"]


def test_spec_counters_read_shuttle_and_vllm_pages():
    page = "\n".join([
        "# HELP x", 'shuttle_spec_decode_num_drafts_total{model_name="m"} 10.0',
        'shuttle_spec_decode_num_draft_tokens_total{model_name="m"} 30.0',
        'shuttle_spec_decode_num_accepted_tokens_total{model_name="m"} 12.0',
        'shuttle_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 7.0',
        'shuttle_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 5.0',
        'shuttle_spec_decode_num_drafts_created 1.7e9'])
    c = spec_counters(page)
    assert c == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12, "per_pos": {0: 7, 1: 5}}
    vllm = page.replace("shuttle_spec_decode_", "vllm:spec_decode_")
    for was, now in (("} 10.0", "} 14.0"), ("} 30.0", "} 42.0"), ("} 12.0", "} 14.0"), ("} 7.0", "} 9.0")):
        vllm = vllm.replace(was, now)
    stats = spec_decode_stats(c, spec_counters(vllm))
    assert (stats["num_drafts"], stats["draft_tokens"], stats["accepted_tokens"]) == (4, 12, 2)
    assert stats["acceptance_rate"] == pytest.approx(100 * 2 / 12) and stats["acceptance_length"] == 1.5
    assert stats["per_position_acceptance_rates"] == [0.5, 0.0]
    assert spec_counters("shuttle_requests_total 3.0") is None and spec_decode_stats(c, c) is None


def test_rejected_drafts_back_off(ckpt, plain, monkeypatch):
    """Drafts that are always rejected: after r rejections in a row the sequence goes backoff(r)
    decode steps (1, 3, 7, 15) without drafts, so 24 greedy tokens verify drafts at decode steps
    0, 2, 6 and 14 only; the output is the plain engine's."""
    import attention_nodes.engine as engine_module
    from attention_nodes.speculative import backoff

    assert [backoff(r) for r in range(6)] == [0, 1, 3, 7, 15, 15]
    assert [backoff(r, 1) for r in range(6)] == [0, 0, 1, 3, 7, 15]  # (MTP drafts: speculative.TOLERATED_MISSES)
    prompt = SPEC_PROMPTS[0]
    want = _ids(plain, [prompt], GREEDY)
    never = next(t for t in range(plain.engine.model_cfg.vocab_size) if t not in want[0][0])
    monkeypatch.setattr(engine_module, "propose_ngram", lambda ids, k, lo, hi: [never] * k)
    llm = LLM(ckpt, speculative_config=NGRAM)
    try:
        assert _ids(llm, [prompt], GREEDY) == want
        spec = _spec(llm)
    finally:
        llm.shutdown()
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (4, 12, 0)
