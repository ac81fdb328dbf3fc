"""LLM.generate and the `shuttle generate` command on a tiny checkpoint with a real tokenizer."""
import json
import os
import subprocess
import sys

import pytest

from server import LLM, SamplingParams
from tests.conftest import PROMPTS


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
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids
    unseeded = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    mixed = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [unseeded, sp, unseeded])
    assert mixed[1].outputs[0].token_ids == alone
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
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]])
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="leaves no room in the context"):
        llm.generate([[3] * llm.cfg.max_model_len])


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
def test_cli_builtin_model(tmp_path):
    r = _shuttle("generate", "--prompt", "Hello", "--max-tokens", "4", "--json", env={"SHUTTLE_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "UNTRAINED" in r.stderr and len(json.loads(r.stdout.splitlines()[-1])["token_ids"]) <= 4
