"""Serving a plan: `shuttle serve --plan` and LLM(plan=...) run the plan's pools, and give the
colocated engine's greedy output; plans this host cannot run are refused with exit code 2."""
import json
import re

import httpx
import pytest

from clients.live_server import LiveServer
from planner.shapes import shape_from
from server.llm import LLM

PROMPTS = ["the quick brown fox", "a b c d e f g", "hello"]


def write_plan(path, model, **dep) -> str:
    d = {"colocated": False, "attention_workers": 1, "expert_workers": 1, "micro_batches": 2, "max_num_seqs": 8,
         "torch_threads": 1, "transport": "shm", "attention_device": "cpu", "expert_device": "cpu", **dep}
    path.write_text(json.dumps({"version": 1, "model": {"name": "tiny", "path": str(model),
                                                        "config_hash": shape_from(model).config_hash},
                                "hardware": {"attention": {"name": "host"}, "expert": {"name": "host"}},
                                "deployment": d, "predicted": {}, "estimated": False}))
    return str(path)


@pytest.fixture(scope="module")
def model_and_reference(make_checkpoint):
    model = make_checkpoint("mixtral")
    llm = LLM(model)
    from attention_nodes.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    llm.shutdown()
    return model, ref, params


def test_llm_plan_equals_colocated(model_and_reference, tmp_path):
    model, ref, params = model_and_reference
    llm = LLM(plan=write_plan(tmp_path / "plan.json", model))
    try:
        assert llm.engine.cfg.parallel.micro_batches == 2 and llm.engine.cfg.scheduler.max_num_seqs == 8
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == ref
    finally:
        llm.shutdown()


def test_serve_plan_equals_colocated(model_and_reference, tmp_path):
    model, ref, params = model_and_reference
    plan = write_plan(tmp_path / "plan.json", model)
    with LiveServer(["--plan", plan]) as srv:
        got = []
        for prompt in PROMPTS:
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": str(model), "prompt": prompt, "max_tokens": 8,
                                                              "temperature": 0, "ignore_eos": True},
                          timeout=60)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0])
        assert "shuttle-attention-a0" in srv.children() and "shuttle-expert-e0" in srv.children()
        applied = re.search(r"--plan \S+: (.*)", srv.log())  # the server says what the plan set
        assert applied and "2 micro-batch(es)" in applied.group(1) and "batch up to 8 sequences" in applied.group(1)
    llm = LLM(model)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    llm.shutdown()
    assert [c["text"] for c in got] == texts


def test_plans_this_host_cannot_run_are_refused(model_and_reference, tmp_path, capsys):
    from server.cli import main

    model, _, _ = model_and_reference
    big = write_plan(tmp_path / "big.json", model, attention_workers=40, expert_workers=40)
    gpu = write_plan(tmp_path / "gpu.json", model, attention_device="cuda", expert_device="cuda")
    other = write_plan(tmp_path / "other.json", "dbrx")
    cases = [(big, "bigger than this host"), (other, "is for model tiny (config"), (tmp_path / "none.json", "not found")]
    import torch
    if not torch.cuda.is_available():
        cases.append((gpu, "this host has none"))
    for plan, message in cases:
        assert main(["generate", "--model", str(model), "--plan", str(plan), "--prompt", "x"]) == 2
        assert message in capsys.readouterr().err
    assert main(["generate", "--model", str(model), "--plan", big, "--micro-batches", "2", "--prompt", "x"]) == 2
    assert "--plan sets the deployment" in capsys.readouterr().err


def test_colocated_honours_torch_threads(model_and_reference):
    """A colocated plan (or --torch-threads) sets the threads of the process the engine runs in."""
    import torch

    model, _, _ = model_and_reference
    before = torch.get_num_threads()
    try:
        LLM(model, torch_threads=1).shutdown()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
