"""The compiled decode stages (models/stages.py) against the eager oracle.

Compiling costs tens of seconds on a cold inductor cache, so the checks that also watch what is
compiled (no graph after start-up, the pools) use one family, the one whose stages take the most
branches: GLM-4.5 (q/k/v biases, per-head q/k norm, partial rotary on strided views, grouped
sigmoid routing with the correction bias and scaling, a dense first layer, a shared expert). Greedy
ids are compared on every family as well (about 3 s each, cold): the stage functions take other
branches per family, and one of them (no q/k norm with full rotary: Mixtral, Qwen2-MoE, gpt-oss)
returned wrong rows (at T >= 2, and at T = 1 after graphs of another head size) until q_k_v_heads
stopped rotating its inputs in place when compiled; and a second head shape in one process failed to
compile until each head spec got its own compiled function.
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


# (Qwen3.5-MoE's stages are Qwen3-Next's: only its linear layers' eager input projections differ;
# DeepSeek-V3.2's and GLM-5's are DeepSeek-V3's MLA stages, the indexer and sparse attention eager;
# DeepSeek-V4's attention and hash routing are eager, its norms and routing the other families' stages)
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in (FAMILY, "qwen3_5_moe", "deepseek_v32",
                                                                       "glm_moe_dsa", "deepseek_v4")])
def test_compiled_greedy_ids_every_family(make_checkpoint, family):
    """Prefill chunks and decode at batch 4 and 1 give the eager engine's greedy ids on every family."""
    from server import LLM

    d = make_checkpoint(family)
    eager = LLM(d, num_kv_blocks=64, enforce_eager=True)
    compiled = LLM(d, num_kv_blocks=64, enforce_eager=False)
    assert compiled.engine.runner.compiled
    assert _greedy(compiled, PROMPTS) == _greedy(eager, PROMPTS)
    assert _greedy(compiled, PROMPTS[:1]) == _greedy(eager, PROMPTS[:1])


def test_compiled_second_head_shape_in_one_process(make_checkpoint):
    """Two compiled models of other head shapes in one process (Mixtral, then a Qwen3-MoE with one
    KV head, head size 12 and a per-head q/k norm) start and equal eager: with one compiled heads
    function for both, the second failed at start-up (inductor NameError)."""
    from server import LLM

    for d in (make_checkpoint("mixtral"),
              make_checkpoint("qwen3_moe", hidden_size=72, num_attention_heads=6, head_dim=12, num_key_value_heads=1)):
        compiled = LLM(d, num_kv_blocks=64, enforce_eager=False)
        assert _greedy(compiled, PROMPTS) == _greedy(LLM(d, num_kv_blocks=64, enforce_eager=True), PROMPTS)


def test_compiled_heads_equal_eager():
    """q_k_v_heads compiled, on the fused projection's column slices (rows (N + 2K) H apart), returns
    eager's q, k and v, at T = 1 and in the symbolic-T graph (T = 2, 5), for head specs in turn, as
    models of several shapes compiled in one process call it: the graph must not hand back aliases
    of inputs it rotated in place, which torch rebuilt with contiguous strides (T >= 2) or, after
    another head size, without their storage offset (T = 1); and a spec with one KV head, another
    head size and a per-head q/k norm after another spec must compile (with one function for all
    specs its widths went symbolic and its T = 1 graph raised NameError in inductor's code)."""
    from kernels.ops import torch_ops
    from models.stages import HeadSpec, compiled_stages, interned, q_k_v_heads

    ops = torch_ops()
    heads = compiled_stages().q_k_v_heads
    g = torch.Generator().manual_seed(0)
    for N, K, H, rope_dim, qk_norm, clip in ((4, 2, 20, 20, "none", None), (6, 1, 12, 12, "per_head", None),
                                             (4, 2, 16, 8, "none", None), (4, 2, 16, 16, "full", 0.5)):
        spec = interned(HeadSpec(N, K, H, rope_dim, qk_norm, 1e-6, clip))
        norm_w = {"full": (N * H, K * H), "per_head": (H, H)}.get(qk_norm)
        q_norm_w, k_norm_w = (torch.rand(n, generator=g) + 0.5 for n in norm_w) if norm_w else (None, None)
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
    from pools.roles import engine_config_from_json, engine_config_to_json
    from server.cli import build_parser
    from server.llm import engine_config

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
