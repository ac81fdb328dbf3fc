"""--quantization int8: expert weights kept as int8 codes with per-channel scales (kernels/int8.py),
quantised at load (w8a8_int8: their activations quantised per token too). The oracle is transformers on a checkpoint whose expert weights were replaced by
their dequantised codes (q * scale): the same numbers, so the int8 model must equal it up to
summation order, colocated and in pools; the experts' resident bytes shrink to what int8 holds, and
the start-up log, engine stats and /metrics say so."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.int8 import quantize_int8
from server import LLM, SamplingParams
from server.metrics import _EngineCollector
from tests.conftest import PROMPTS
from tests.test_sampling_features import reference_prompt_logprobs

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def dequantised_copy(ckpt: Path, out: Path) -> Path:
    """ckpt with every expert weight (Mixtral's experts.E.w1/w2/w3, (out, in)) replaced by q * scale."""
    shutil.copytree(ckpt, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        for name, w in tensors.items():
            if ".experts." in name and name.endswith(".weight"):
                tensors[name] = quantize_int8(w).dequantize().to(w.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def ckpts(make_checkpoint, tmp_path_factory):
    ckpt = make_checkpoint("mixtral")
    return ckpt, dequantised_copy(ckpt, tmp_path_factory.mktemp("int8") / "dequantised")


def expert_weights(llm: LLM) -> list:
    from models.cpu_inference import PackedExperts

    return [w for m in llm.engine.runner.model.modules() if isinstance(m, PackedExperts)
            for w in (*m.w13_packed, *m.w2_packed)]


@pytest.fixture(scope="module")
def llm_int8(ckpts):
    llm = LLM(ckpts[0], quantization="int8")
    yield llm
    llm.shutdown()


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])


def test_int8_experts_equal_transformers_on_their_dequantised_weights(ckpts, llm_int8, caplog):
    ckpt, deq = ckpts
    assert all(w.int8 is not None for w in expert_weights(llm_int8))
    for prompt in PROMPTS[:3]:
        torch.testing.assert_close(_prompt_logprobs(llm_int8, prompt), reference_prompt_logprobs(deq, prompt),
                                   atol=1e-4, rtol=0)
    with caplog.at_level("INFO", logger="shuttle"):
        plain = LLM(deq)  # the dequantised weights served in float32: the same greedy tokens
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
        full = plain.engine.runner.resident_bytes
    finally:
        plain.shutdown()
    assert [o.outputs[0].token_ids for o in llm_int8.generate(PROMPTS, GREEDY)] == want
    # resident bytes: codes are a quarter of float32's bytes; the scales (4 bytes per output channel
    # of 48-64 inputs) and the panels' padding add some
    int8 = llm_int8.engine.runner.resident_bytes
    assert 0.2 < int8["experts"] / full["experts"] < 0.4
    assert int8["embedding"] == full["embedding"] > 0 and int8["other"] == full["other"] > 0
    assert any("weights:" in r.getMessage() and "resident" in r.getMessage() for r in caplog.records)
    stats = llm_int8.engine.stats()
    assert stats["weight_bytes"] == int8
    [metric] = [m for m in _EngineCollector(lambda: stats, "m").collect() if m.name == "shuttle_weight_bytes"]
    assert {(s.labels["pool"], s.labels["kind"]): s.value for s in metric.samples} == \
        {("colocated", k): float(v) for k, v in int8.items()}


def test_int8_in_bf16_within_bf16s_tolerance(ckpts):
    llm = LLM(ckpts[0], dtype="bfloat16", quantization="experts_int8")  # vLLM's name
    try:
        assert all(w.int8 is not None for w in expert_weights(llm))
        got = _prompt_logprobs(llm, PROMPTS[0])
    finally:
        llm.shutdown()
    torch.testing.assert_close(got, reference_prompt_logprobs(ckpts[1], PROMPTS[0]), atol=0.1, rtol=0.05)


@pytest.fixture(scope="module")
def llm_w8a8(ckpts):
    llm = LLM(ckpts[0], quantization="w8a8_int8")
    yield llm
    llm.shutdown()


def test_w8a8_int8_quantises_the_activations_too(llm_int8, llm_w8a8):
    """w8a8_int8 keeps int8's codes and bytes and quantises the experts' inputs per token as well
    (kernels/int8.py: the VNNI kernel, or its torch path): its log-probabilities move off int8's by
    about what 8-bit activations cost, not by summation order only."""
    from kernels.int8 import fused_moe_int8_reference

    blocks = [m for m in llm_w8a8.engine.runner.model.modules() if getattr(m, "int8", None) is not None]
    assert blocks and all(m.int8.act_int8 and m.act_int8 for m in blocks)
    assert llm_w8a8.engine.runner.resident_bytes == llm_int8.engine.runner.resident_bytes
    got, base = _prompt_logprobs(llm_w8a8, PROMPTS[0]), _prompt_logprobs(llm_int8, PROMPTS[0])
    assert 1e-4 < (got - base).abs().max() < 0.1
    x = torch.randn(5, blocks[0].int8.hidden)
    ids, w = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 1]]), torch.rand(5, 2)
    torch.testing.assert_close(blocks[0](x, ids, w), fused_moe_int8_reference(x, ids, w, blocks[0].int8))


def test_pools_serve_int8_experts(ckpts, llm_int8, llm_w8a8):
    """w8a8_int8 in pools: the expert worker quantises its batches' activations per token, so its
    greedy ids are the colocated engine's; it holds the int8 experts, the attention worker none."""
    want = [o.outputs[0].token_ids for o in llm_w8a8.generate(PROMPTS, GREEDY)]
    llm = LLM(ckpts[0], quantization="w8a8_int8", colocated=False, attention_workers=1, expert_workers=1)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        rows = {(r["pool"], r["kind"]): r["bytes"] for r in llm.engine.stats()["weights"]}
    finally:
        llm.shutdown()
    assert rows[("expert", "experts")] == llm_int8.engine.runner.resident_bytes["experts"]
    assert rows[("attention", "experts")] == 0


def test_unsupported_quantizations_are_refused(ckpts, tmp_path):
    ckpt = ckpts[0]
    with pytest.raises(ValueError, match="'int4' is not supported; choose from none, int8, w8a8_int8, fp8"):
        LLM(ckpt, quantization="int4")
    with pytest.raises(ValueError, match="CPU workers with torch kernels"):
        LLM(ckpt, quantization="int8", kernels="triton")
    # the experts' device decides: a GPU attention pool may feed int8 experts on CPU workers
    from attention_nodes.config import EngineConfig, ParallelConfig
    EngineConfig(str(ckpt), device="cuda", parallel=ParallelConfig(False, expert_device="cpu"), quantization="int8")
    for colocated, expert_device in ((True, None), (False, "cuda")):
        with pytest.raises(ValueError, match="experts on 'cuda'"):
            EngineConfig(str(ckpt), device="cuda", parallel=ParallelConfig(colocated, expert_device=expert_device),
                         quantization="int8")
    fp8 = tmp_path / "fp8"
    shutil.copytree(ckpt, fp8)
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="already FP8 block-quantised"):
        LLM(fp8, quantization="int8")


@pytest.mark.parametrize("variant", ["silu", "biased_clamped"])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_packed_int8_experts_equal_fused_moe_on_dequantised_weights(variant, T):
    """PackedExperts(experts, "int8"): SiLU experts without biases run the fused int8 block, others
    (gpt-oss's biases and clamped SwiGLU) int8_linear per expert; both equal the reference MoE on the
    dequantised weights, and regrouped experts (EPLB) the same."""
    from expert_nodes.placement import regroup
    from kernels.moe import SwiGLU, fused_moe
    from kernels.ops import torch_ops
    from models.cpu_inference import PackedExperts
    from models.moe_decoder import Experts

    g = torch.Generator().manual_seed(T)
    E, D, I, K = 6, 40, 27, 2
    act = SwiGLU() if variant == "silu" else SwiGLU(alpha=1.702, limit=0.5, up_offset=1.0)
    experts = Experts(E, D, I, torch_ops(), bias=variant != "silu", act=act).eval()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    deq13 = torch.stack([quantize_int8(w).dequantize() for w in experts.w13.detach()])
    deq2 = torch.stack([quantize_int8(w).dequantize() for w in experts.w2.detach()])
    packed = PackedExperts(experts, "int8")
    assert (packed.int8 is not None) == (variant == "silu")
    if variant != "silu":
        with pytest.raises(ValueError, match="w8a8_int8 runs SiLU experts without biases"):
            PackedExperts(experts, "w8a8_int8")
    else:  # w8a8: the same codes, regrouped with their activations still quantised
        assert regroup([(PackedExperts(experts, "w8a8_int8"), e) for e in (4, 1)]).int8.act_int8
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    want = fused_moe(x, deq13, deq2, w, ids, b13_EI2=experts.b13, b2_ED=experts.b2, act=act, upcast_min_rows=None)
    torch.testing.assert_close(packed(x, ids, w), want, atol=1e-5, rtol=1e-5)
    # two of its experts regrouped, as a re-placement holds them: their ids renumbered 0, 1
    pick = [4, 1]
    sub = regroup([(packed, e) for e in pick])
    local = torch.tensor(pick)[torch.randint(0, 2, (T, K), generator=g)]
    local_ids = (local == pick[1]).long()
    want = fused_moe(x, deq13[pick], deq2[pick], w, local_ids, act=act, upcast_min_rows=None,
                     b13_EI2=None if experts.b13 is None else experts.b13.detach()[pick],
                     b2_ED=None if experts.b2 is None else experts.b2.detach()[pick])
    torch.testing.assert_close(sub(x, local_ids, w), want, atol=1e-5, rtol=1e-5)


def test_cpu_kv_budget_gets_what_int8_freed(ckpts, monkeypatch, caplog):
    """On the CPU the default KV budget is the unquantised model's plus what quantising freed, so the
    weights and the cache take the same memory as before; the log says how much of it came so."""
    from attention_nodes import model_runner
    from attention_nodes.config import CacheConfig, EngineConfig

    monkeypatch.setattr(model_runner, "CPU_DEFAULT_KV_GIB", 2 ** -14)  # 64 KiB: below the full-context need
    plain = model_runner.ModelRunner(EngineConfig(str(ckpts[0])))
    with caplog.at_level("INFO", logger="shuttle"):
        int8 = model_runner.ModelRunner(EngineConfig(str(ckpts[0]), quantization="int8"))
    per_block = plain._block_bytes()
    assert plain.freed_bytes == 0 and plain.num_blocks == 2 ** 16 // per_block
    freed = sum(int8.weight_bytes.values()) - sum(int8.resident_bytes.values())
    assert freed > 0 and int8.freed_bytes == freed
    assert int8.num_blocks == (2 ** 16 + freed) // per_block > plain.num_blocks
    assert any("freed by int8 weights" in r.getMessage() for r in caplog.records)
    # an explicit budget is the user's: nothing added
    explicit = model_runner.ModelRunner(EngineConfig(str(ckpts[0]), quantization="int8", cache=CacheConfig(num_blocks=4)))
    assert explicit.num_blocks == 4 and explicit.kv_from_freed == 0
