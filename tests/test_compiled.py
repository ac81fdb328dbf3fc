"""The compiled decode stages (models/stages.py) against the eager oracle.

Compiling costs tens of seconds on a cold inductor cache, so the checks that also watch what is
compiled (no graph after start-up, the pools) use one family, the one whose stages take the most
branches: GLM-4.5 (q/k/v biases, per-head q/k norm, partial rotary on strided views, grouped
sigmoid routing with the correction bias and scaling, a dense first layer, a shared expert). Greedy
ids are compared on every family as well (about 3 s each, cold): the stage functions take other
branches per family, and one of them (no q/k norm with full rotary: Mixtral, Qwen2-MoE, gpt-oss)
returned wrong rows (at T >= 2, and at T = 1 after graphs of another head size) until q_k_v_heads
stopped rotating its inputs in place when compiled.
The checkpoints are float32, where the fused kernels' rounding differences (summation order) stay
far below the gaps between the top logits.
"""
import pytest
import torch
from torch._dynamo.utils import counters

from attention_nodes.config import EngineConfig
from tests.conftest import FAMILIES

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


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != FAMILY])
def test_compiled_greedy_ids_every_family(make_checkpoint, family):
    """Prefill chunks and decode at batch 4 and 1 give the eager engine's greedy ids on every family."""
    from server import LLM

    d = make_checkpoint(family)
    eager = LLM(d, num_kv_blocks=64, enforce_eager=True)
    compiled = LLM(d, num_kv_blocks=64, enforce_eager=False)
    assert compiled.engine.runner.compiled
    assert _greedy(compiled, PROMPTS) == _greedy(eager, PROMPTS)
    assert _greedy(compiled, PROMPTS[:1]) == _greedy(eager, PROMPTS[:1])


def test_compiled_heads_equal_eager():
    """q_k_v_heads compiled, on the fused projection's column slices (rows (N + 2K) H apart), returns
    eager's q, k and v, at T = 1 and in the symbolic-T graph (T = 2, 5), for head specs in turn (a
    later spec's graphs come after the function saw other T and head sizes, so dynamo makes more of
    them symbolic): the graph must not hand back aliases of inputs it rotated in place, which torch
    rebuilt with contiguous strides (T >= 2) or, after another head size, without their storage
    offset (T = 1)."""
    from kernels.ops import torch_ops
    from models.stages import HeadSpec, compiled_stages, interned, q_k_v_heads

    N, K, ops = 4, 2, torch_ops()
    heads = compiled_stages().q_k_v_heads
    g = torch.Generator().manual_seed(0)
    for H, rope_dim, qk_norm, clip in ((20, 20, "none", None), (16, 8, "none", None), (16, 16, "full", 0.5)):
        spec = interned(HeadSpec(N, K, H, rope_dim, qk_norm, 1e-6, clip))
        q_norm_w, k_norm_w = ((torch.rand(N * H, generator=g) + 0.5, torch.rand(K * H, generator=g) + 0.5)
                              if qk_norm == "full" else (None, None))
        for T in (1, 2, 5):
            qkv = torch.randn(T, (N + 2 * K) * H, generator=g)
            cos, sin = torch.randn(T, rope_dim, generator=g), torch.randn(T, rope_dim, generator=g)
            want = q_k_v_heads(*qkv.clone().split((N * H, K * H, K * H), -1), cos, sin, q_norm_w, k_norm_w, spec,
                               ops)
            got = heads(*qkv.clone().split((N * H, K * H, K * H), -1), cos, sin, q_norm_w, k_norm_w, spec, ops)
            for name, w, x in zip("qkv", want, got):
                torch.testing.assert_close(x, w, msg=lambda m: f"H {H} rope {rope_dim} {qk_norm} T={T} {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("family", [FAMILY, "mixtral"])
def test_compiled_pools_equal_eager(make_checkpoint, family):
    """1 attention worker (compiled stages) + 1 expert worker, 2 micro-batches: greedy ids equal the
    eager colocated engine's (the worker process finds the test process's graphs in inductor's
    on-disk cache). Mixtral: the heads stage without a q/k norm, in place when eager."""
    from server import LLM

    d = make_checkpoint(family)
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
