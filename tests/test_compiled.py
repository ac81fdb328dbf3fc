"""The compiled decode stages (models/stages.py) against the eager oracle.

Compiling costs tens of seconds on a cold inductor cache, so these tests compile one family, the
one whose stages take the most branches: GLM-4.5 (q/k/v biases, per-head q/k norm, partial rotary
on strided views, grouped sigmoid routing with the correction bias and scaling, a dense first
layer, a shared expert). The other families call the same three stage functions with other
constants: no q/k norm or the whole-projection one (the same rms_norm over a wider last axis),
full rotary (the same apply_rotary_ on whole heads), softmax routing with or without
renormalisation; DeepSeek's MLA layers use only the residual-norm and routing stages. The
checkpoint is float32, where the fused kernels' rounding differences (summation order) stay far
below the gaps between the top logits.
"""
import pytest
import torch
from torch._dynamo.utils import counters

from attention_nodes.config import EngineConfig

FAMILY = "glm4_moe"
PROMPTS = [[5, 17, 33, 100, 250, 7, 9, 11, 13, 200, 301, 45, 46, 47], [400, 3], [77, 78, 79, 80, 81, 82, 83], [12]]


def _greedy(llm, prompts: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    from server import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_greedy_ids_equal_eager(make_checkpoint):
    """Prefill chunks (T >= 2), decode at batch 4 (T >= 2) and at batch 1 (T = 1) give the eager
    engine's greedy ids, and serving compiles nothing after start-up."""
    from server import LLM

    d = make_checkpoint(FAMILY)
    eager = LLM(d, num_kv_blocks=64, enforce_eager=True)
    compiled = LLM(d, num_kv_blocks=64, enforce_eager=False)
    assert compiled.engine.runner.compiled and not eager.engine.runner.compiled
    assert compiled.engine.runner.model.model.layers[1].mlp.stages.compiled
    graphs = _graphs()
    assert _greedy(compiled, PROMPTS) == _greedy(eager, PROMPTS)
    assert _greedy(compiled, PROMPTS[:1]) == _greedy(eager, PROMPTS[:1])
    assert _graphs() == graphs, "serving compiled a graph (warm-up missed a bucket or a guard)"


@pytest.mark.slow
def test_compiled_pools_equal_eager(make_checkpoint):
    """1 attention worker (compiled stages) + 1 expert worker, 2 micro-batches: greedy ids equal the
    eager colocated engine's (the worker process finds the test process's graphs in inductor's
    on-disk cache)."""
    from server import LLM

    d = make_checkpoint(FAMILY)
    want = _greedy(LLM(d, num_kv_blocks=64, enforce_eager=True), PROMPTS)
    llm = LLM(d, num_kv_blocks=64, colocated=False, micro_batches=2, torch_threads=1, enforce_eager=False)
    try:
        assert _greedy(llm, PROMPTS) == want
    finally:
        llm.shutdown()


def test_enforce_eager_config(monkeypatch):
    """The flag is one EngineConfig field; the environment only fills in an unset value."""
    from server.cli import build_parser
    from server.llm import engine_config
    from server.roles import engine_config_from_json, engine_config_to_json

    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig("m", enforce_eager="yes")
    monkeypatch.setenv("SHUTTLE_ENFORCE_EAGER", "0")
    assert engine_config(None).enforce_eager is False
    assert engine_config_from_json(engine_config_to_json(engine_config(None))).enforce_eager is False  # --role
    assert engine_config(None, enforce_eager=True).enforce_eager is True
    monkeypatch.setenv("SHUTTLE_ENFORCE_EAGER", "maybe")
    with pytest.raises(ValueError, match="SHUTTLE_ENFORCE_EAGER"):
        engine_config(None)
    args = build_parser().parse_args(["serve", "--no-enforce-eager"])
    assert args.enforce_eager is False
    assert build_parser().parse_args(["serve"]).enforce_eager is None
