"""LLM.generate and the `shuttle generate` command on a tiny checkpoint with a real tokenizer."""
import json
import os
import subprocess
import sys

import pytest
import torch

from server import LLM, SamplingParams
from tests.conftest import PROMPTS, hf_model


@pytest.fixture(scope="module")
def llm(make_checkpoint):
    return LLM(make_checkpoint("qwen3_moe"))


def test_text_prompts_of_different_lengths(llm):
    prompts = ["The for statement", "Hello", "A class definition defines a class object"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.prompt == p and out.prompt_token_ids == llm.tokenizer.encode(p)
        c = out.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    # batching does not change a greedy result
    alone = llm.generate(prompts[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert alone[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, presence_penalty=0.5,
                        frequency_penalty=0.3, repetition_penalty=1.2, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, repetition_penalty=1.5, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0.7, min_p=0.2, seed=7, n=2, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=1.3, top_k=5, frequency_penalty=1, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, top_p=0.5, presence_penalty=-1.0, ignore_eos=True)]
    prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[3], list(range(40, 70))]
    mixed = llm.generate(prompts[:2] + [PROMPTS[0]] + prompts[2:], others[:2] + [sp] + others[2:])
    assert mixed[2].outputs[0].token_ids == alone
    other = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_stop_string_and_stop_token(llm):
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPTS[0], sp)[0].outputs[0]
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip()
    cut = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))
    c = cut[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full.text[:full.text.find(stop)] and stop not in c.text
    tok = full.token_ids[5]
    c = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                               stop_token_ids=[tok]))[0].outputs[0]
    assert c.token_ids == full.token_ids[:full.token_ids.index(tok) + 1] and c.finish_reason == "stop"


def test_eos_ends_generation_unless_ignored(llm):
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPTS[3], sp)[0].outputs[0].token_ids
    llm.eos_token_ids = {full[3]}  # pretend the 4th generated token is the end of sequence
    try:
        c = llm.generate(PROMPTS[3], SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
        assert c.token_ids == full[:full.index(full[3]) + 1] and c.finish_reason == "stop"
    finally:
        llm.eos_token_ids = set()


def test_chat_uses_the_checkpoint_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert out[0].prompt == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert len(out[0].outputs[0].token_ids) == 3


def test_bad_requests(llm):
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p must be a finite number in"):
        SamplingParams(top_p=0)
    for bad in (dict(stop_token_ids=None), dict(stop_token_ids=["a"]), dict(seed=True), dict(ignore_eos="no"),
                dict(max_tokens=True), dict(temperature=float("nan")), dict(stop=5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]])
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="leaves no room in the context"):
        llm.generate([[3] * llm.cfg.max_model_len])


def test_n_samples(llm):
    sp = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    first = [c.token_ids for c in llm.generate(PROMPTS[0], sp)[0].outputs]
    assert len(first) == 3 and len({tuple(t) for t in first}) == 3
    assert [c.token_ids for c in llm.generate(PROMPTS[0], sp)[0].outputs] == first
    greedy = llm.generate(PROMPTS[0], SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert [c.index for c in greedy.outputs] == [0, 1, 2]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == greedy.outputs[2].token_ids
    assert greedy.outputs[0].text == greedy.outputs[2].text


def test_n_samples_share_the_prompt_blocks(llm, monkeypatch):
    prompt = list(range(300, 340))  # 40 tokens: 2 full blocks of 16, never seen by this engine before
    full = (len(prompt) - 1) // llm.engine.blocks.block_size * llm.engine.blocks.block_size
    engine, step, shared_steps = llm.engine, llm.engine.step, []

    def spy():
        out = step()
        for seqs in engine.requests.values():
            tables = [s.block_table[:full // engine.blocks.block_size] for s in seqs]
            if all(tables) and all(t == tables[0] for t in tables):
                assert all(engine.blocks.blocks[b].ref_count == 3 for b in tables[0])
                shared_steps.append(engine.num_steps)
        return out

    monkeypatch.setattr(engine, "step", spy)
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert len(shared_steps) >= 4  # the three held the same blocks while they decoded
    assert out.num_cached_tokens == full
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_logprobs_are_those_of_the_model(llm, make_checkpoint):
    ref = hf_model(make_checkpoint("qwen3_moe"))  # the float32 checkpoint the llm fixture serves
    greedy = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=11, logprobs=3, ignore_eos=True)
    for out, sp in zip(llm.generate([PROMPTS[0], PROMPTS[2]], [greedy, sampled]), [greedy, sampled]):
        c, n = out.outputs[0], len(out.prompt_token_ids)
        with torch.no_grad():
            logits = ref(torch.tensor([out.prompt_token_ids + c.token_ids])).logits[0, n - 1:-1].float()
        ref_lp = torch.log_softmax(logits, dim=-1)
        assert len(c.logprobs) == len(c.token_ids) == 6
        for tok, entry, row in zip(c.token_ids, c.logprobs, ref_lp):
            top = row.topk(3)
            assert set(entry) == set(top.indices.tolist()) | {tok}
            for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
                assert entry[tid].rank == rank and entry[tid].logprob == pytest.approx(value, abs=1e-4)
            assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
            assert entry[tok].rank == 1 + int((row > row[tok]).sum())
            assert entry[tok].decoded_token == llm.tokenizer.decode([tok])
            if sp.temperature == 0:
                assert entry[tok].rank == 1 and len(entry) == 3


def _stop_across_tokens(tokenizer, ids: list[int], text: str) -> tuple[str, int]:
    """A stop string that starts in one generated token and ends in the next, found first at that
    place in text. Returns it and how many tokens generation keeps (up to the one completing it)."""
    ends = [len(tokenizer.decode(ids[:j], skip_special_tokens=True)) for j in range(len(ids) + 1)]
    for k in range(len(ids) - 1):  # token k ends at ends[k + 1], token k + 1 starts there
        a, b, c = ends[k], ends[k + 1], ends[k + 2]
        if not (a < b < c) or not text.startswith(tokenizer.decode(ids[:k + 2], skip_special_tokens=True)):
            continue
        start = max(a, b - 2)
        stop = text[start:min(c, b + 2)]
        if "\ufffd" not in stop and stop.strip() and text.find(stop) == start:
            return stop, k + 2
    raise AssertionError(f"no stop string across a token boundary in {text!r}")


def test_stop_strings_across_tokens_and_stop_token_ids(llm):
    greedy = dict(max_tokens=16, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPTS[2], SamplingParams(**greedy))[0].outputs[0]
    stop, keep = _stop_across_tokens(llm.tokenizer, full.token_ids, full.text)
    at = full.text.find(stop)
    cut = llm.generate(PROMPTS[2], SamplingParams(**greedy, stop=["never in this text", stop]))[0].outputs[0]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == full.token_ids[:keep] and cut.text == full.text[:at]
    kept = llm.generate(PROMPTS[2], SamplingParams(**greedy, stop=stop, include_stop_str_in_output=True))[0].outputs[0]
    assert kept.token_ids == full.token_ids[:keep] and kept.text == full.text[:at + len(stop)]
    assert kept.text.endswith(stop) and (kept.finish_reason, kept.stop_reason) == ("stop", stop)
    tok = full.token_ids[4]
    c = llm.generate(PROMPTS[2], SamplingParams(**greedy, stop_token_ids=[1, tok]))[0].outputs[0]
    assert c.token_ids == full.token_ids[:full.token_ids.index(tok) + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", tok)


def test_penalties_change_greedy_output_and_filters_are_applied(llm):
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    base = llm.generate(PROMPTS[2], SamplingParams(**greedy))[0].outputs[0].token_ids
    assert len(set(base)) < len(base) - 3  # the tiny model repeats itself
    for penalty in [dict(presence_penalty=1.5), dict(frequency_penalty=1.5), dict(repetition_penalty=1.5)]:
        got = llm.generate(PROMPTS[2], SamplingParams(**greedy, **penalty))[0].outputs[0].token_ids
        assert got != base and len(set(got)) > len(set(base)), penalty
    # Filters that leave only the most likely token make sampling greedy; looser ones still run.
    for only_top in [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6)]:
        sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=True, **only_top)
        assert llm.generate(PROMPTS[2], sp)[0].outputs[0].token_ids == base, only_top
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1, ignore_eos=True)
    c = llm.generate(PROMPTS[2], sp)[0].outputs[0]
    assert len(c.token_ids) == 12 and c.finish_reason == "length"


def _shuttle(*args, env=None):
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_cli_generate_json(make_checkpoint):
    d = make_checkpoint("mixtral")
    r = _shuttle("generate", "--model", str(d), "--prompt", "The for statement", "--prompt", "x",
                 "--max-tokens", "6", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["prompt"] for row in rows] == ["The for statement", "x"]
    expected = LLM(d).generate(["The for statement", "x"], SamplingParams(max_tokens=6, temperature=0,
                                                                           ignore_eos=True))
    for row, out in zip(rows, expected):
        assert row["token_ids"] == out.outputs[0].token_ids and row["text"] == out.outputs[0].text
        assert row["prompt_token_ids"] == out.prompt_token_ids


def test_cli_reports_bad_checkpoint(tmp_path):
    r = _shuttle("generate", "--model", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "config.json: file not found" in r.stderr


@pytest.mark.slow
def test_cli_builtin_model():
    """Without --model, generate runs the committed built-in model (tests/test_builtin.py checks its text)."""
    r = _shuttle("generate", "--prompt", "Hello", "--max-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.splitlines()[-1])["token_ids"]) <= 4


def test_cli_launcher_flags_reach_the_parallel_config():
    """--launcher ray and its flags become ParallelConfig fields (resources as sorted pairs); bad
    resources name the field; Ray's flags without --launcher ray are refused."""
    from server.cli import _deployment_kwargs, build_parser
    from server.llm import engine_config

    def par(*flags):
        args = build_parser().parse_args(["serve", *flags])
        return engine_config(None, **_deployment_kwargs(args, disaggregate_by_default=True)).parallel

    p = par("--launcher", "ray", "--ray-address", "auto", "--transport", "nixl",
            "--attention-resources", '{"H20": 1}', "--expert-resources", '{"L40S": 0.5, "A": 2}')
    assert (p.colocated, p.launcher, p.ray_address, p.transport) == (False, "ray", "auto", "nixl")
    assert p.attention_resources == (("H20", 1.0),) and p.expert_resources == (("A", 2.0), ("L40S", 0.5))
    assert par().launcher == "spawn" and par().expert_resources == ()
    with pytest.raises(ValueError, match=r"parallel.expert_resources must be a JSON object"):
        par("--launcher", "ray", "--expert-resources", "{H20: 1}")
    with pytest.raises(ValueError, match=r"parallel.attention_resources must map Ray resource names"):
        par("--launcher", "ray", "--attention-resources", '{"H20": -1}')
    with pytest.raises(ValueError, match=r"need parallel.launcher='ray'"):
        par("--expert-resources", '{"H20": 1}')
    with pytest.raises(ValueError, match=r"--colocated .* takes no pool flag .* \(given: --m2n-dtype, --eplb\)"):
        par("--colocated", "--m2n-dtype", "fp8", "--eplb")
