"""FP8 block and MXFP4 weights served as stored on the Triton op table (models/triton_quant.py, the
kernels of kernels/quant_triton.py; interpreted on the CPU, compiled on a GPU): colocated and in
pools, the checkpoint's codes as shipped or a float checkpoint's quantised at load, against
transformers on the dequantised weights and against the CPU's quantised path."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kernels.quant import dequantize_fp8_blocks, dequantize_mxfp4, quantize_fp8_blocks, quantize_mxfp4
from models.triton_quant import Fp8TritonExperts, Fp8TritonLinear, Mxfp4TritonExperts
from server import LLM, SamplingParams
from tests.conftest import PROMPTS
from tests.test_fp8_serving import SIZES, _with
from tests.test_quantization import _prompt_logprobs
from tests.test_sampling_features import reference_prompt_logprobs

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)  # (each interpreted forward takes seconds)


def _modules(llm, kind) -> list:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, kind)]


def _greedy(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]


@pytest.fixture(scope="module")
def fp8(make_checkpoint, tmp_path_factory) -> dict:
    """src: a float32 Qwen3-MoE of odd sizes (partial edge blocks); fp8: it with every q/k/v/o and
    expert weight FP8 in 128 x 128 blocks; deq: src with those weights dequantised."""
    from tests.test_deepseek import _quantize_checkpoint

    d = tmp_path_factory.mktemp("triton_fp8")
    src = make_checkpoint("qwen3_moe", **SIZES)
    return {"src": src, "fp8": d / "fp8", "deq": _with(src, d / "deq", _quantize_checkpoint(src, d / "fp8"))}


def test_fp8_checkpoint_on_triton_as_shipped(fp8):
    """FP8 is the default for an FP8 checkpoint on Triton kernels too: the experts and the FP8 linears keep
    the checkpoint's codes, bit for bit; prompt log-probs equal transformers on the dequantised
    checkpoint (float32), colocated and in pools; greedy ids equal the CPU's FP8 path's."""
    llm = LLM(fp8["fp8"], kernels="triton")
    try:
        assert llm.engine_cfg.quantization == "fp8"
        experts, linears = _modules(llm, Fp8TritonExperts), _modules(llm, Fp8TritonLinear)
        assert len(experts) == llm.cfg.num_layers and len(linears) == 4 * llm.cfg.num_layers  # q, k, v, o
        with safe_open(next(fp8["fp8"].glob("*.safetensors")), framework="pt") as h:
            name = "model.layers.1.mlp.experts.3.down_proj.weight"
            codes, scale = h.get_tensor(name), h.get_tensor(name + "_scale_inv")
            o_codes = h.get_tensor("model.layers.1.self_attn.o_proj.weight")
        assert torch.equal(experts[1].w2[3].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(experts[1].s2[3], scale.float())
        o_proj = llm.engine.runner.model.model.layers[1].self_attn.o_proj
        assert isinstance(o_proj, Fp8TritonLinear) and torch.equal(o_proj.codes.view(torch.uint8), o_codes.view(torch.uint8))
        want = reference_prompt_logprobs(fp8["deq"], PROMPTS[0])
        torch.testing.assert_close(_prompt_logprobs(llm, PROMPTS[0]), want, atol=1e-4, rtol=0)
        got = _greedy(llm)
        resident = llm.engine.runner.resident_bytes["experts"]
    finally:
        llm.shutdown()
    assert resident == sum(b.numel() * b.element_size() for m in experts for b in m.buffers())
    cpu = LLM(fp8["fp8"])  # the CPU's FP8 kernels (kernels/fp8_weights.py)
    try:
        assert cpu.engine_cfg.quantization == "fp8" and _greedy(cpu) == got
    finally:
        cpu.shutdown()
    pools = LLM(fp8["fp8"], kernels="triton", colocated=False, attention_workers=1, expert_workers=1)
    try:
        torch.testing.assert_close(_prompt_logprobs(pools, PROMPTS[0]), want, atol=1e-4, rtol=0)
        rows = {(r["pool"], r["kind"]): r["bytes"] for r in pools.engine.stats()["weights"]}
    finally:
        pools.shutdown()
    assert rows[("expert", "experts")] == resident


def test_quantization_fp8_of_a_float_checkpoint_on_triton(fp8, tmp_path):
    """--quantization fp8 --quantize-linears on Triton: the experts (gate and up apart) and every linear
    but the LM head quantised at load in 128 x 128 blocks; equal to transformers on the float checkpoint
    with those weights replaced by their dequantised FP8."""
    src = fp8["src"]
    tensors = load_file(next(src.glob("*.safetensors")))
    deq = {n: dequantize_fp8_blocks(*quantize_fp8_blocks(w), (128, 128)) for n, w in tensors.items()
           if n.endswith("proj.weight") and "lm_head" not in n}
    ref = _with(src, tmp_path / "deq", deq)
    llm = LLM(src, kernels="triton", quantization="fp8", quantize_linears=True)
    try:
        assert len(_modules(llm, Fp8TritonExperts)) == llm.cfg.num_layers
        assert not isinstance(llm.engine.runner.model.lm_head, Fp8TritonLinear)
        torch.testing.assert_close(_prompt_logprobs(llm, PROMPTS[0]), reference_prompt_logprobs(ref, PROMPTS[0]),
                                   atol=1e-4, rtol=0)
    finally:
        llm.shutdown()


def test_gpt_oss_mxfp4_on_triton_as_shipped(gpt_oss_mxfp4):
    """gpt-oss's MXFP4 experts on Triton: the blocks as shipped (gate and up rows apart, never
    dequantised), prompt log-probs equal to the dequantised checkpoint's on the torch references."""
    plain = LLM(gpt_oss_mxfp4, kernels="torch")
    try:
        want = _prompt_logprobs(plain, PROMPTS[0])
    finally:
        plain.shutdown()
    llm = LLM(gpt_oss_mxfp4, kernels="triton", quantization="mxfp4")
    try:
        experts = _modules(llm, Mxfp4TritonExperts)
        assert len(experts) == llm.cfg.num_layers
        q = load_file(gpt_oss_mxfp4 / "model.safetensors")
        gate_then_up = torch.cat((torch.arange(0, 128, 2), torch.arange(1, 128, 2)))
        assert torch.equal(experts[1].w13_blocks, q["model.layers.1.mlp.experts.gate_up_proj_blocks"][:, gate_then_up])
        torch.testing.assert_close(_prompt_logprobs(llm, PROMPTS[0]), want, atol=1e-4, rtol=0)
        runner = llm.engine.runner
        assert runner.resident_bytes["experts"] <= 0.32 * runner.weight_bytes["experts"] // 2  # (bf16's bytes)
    finally:
        llm.shutdown()


def test_mxfp4_experts_of_a_float_model_and_regrouping(make_checkpoint):
    """Mxfp4TritonExperts of float experts hold quantize_mxfp4's blocks; regrouping experts (an expert
    worker's re-placement) keeps each expert's blocks, scales and biases and its outputs."""
    from expert_nodes.placement import regroup
    from models.loader import load_model

    experts = load_model(make_checkpoint("gpt_oss", hidden_size=64, intermediate_size=32)).model.layers[0].mlp.experts
    mx = Mxfp4TritonExperts(experts)
    blocks, scales = quantize_mxfp4(experts.w2.detach())
    assert torch.equal(mx.w2_blocks, blocks) and torch.equal(mx.w2_scales, scales)
    assert torch.equal(dequantize_mxfp4(mx.w2_blocks, mx.w2_scales), dequantize_mxfp4(blocks, scales))
    two = regroup([(mx, 3), (mx, 0)])
    assert isinstance(two, Mxfp4TritonExperts) and torch.equal(two.w13_blocks[0], mx.w13_blocks[3])
    g = torch.Generator().manual_seed(0)
    x, wk = torch.randn(4, 64, generator=g), torch.rand(4, 2, generator=g)
    local = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]])
    torch.testing.assert_close(two(x, local, wk), mx(x, torch.tensor([3, 0])[local], wk), rtol=1e-5, atol=1e-6)


def test_fp8_experts_quantised_apart_when_the_scale_shapes_coincide():
    """I = 72 with 128 x 128 blocks: w13 quantised as one matrix and gate / up apart both have 2 scale rows;
    Fp8TritonExperts quantises them apart and says so, and equals the torch reference on its dequantised
    weights (read as one matrix, the up rows would take the gate's second scale)."""
    from kernels.moe import fused_moe
    from kernels.ops import torch_ops
    from models.moe_decoder import Experts

    E, D, I = 3, 64, 72
    g = torch.Generator().manual_seed(0)
    experts = Experts(E, D, I, torch_ops())
    with torch.no_grad():
        experts.w13.copy_(torch.randn(E, 2 * I, D, generator=g) * torch.linspace(0.1, 3, 2 * I)[:, None])
        experts.w2.copy_(torch.randn(E, D, I, generator=g))
    fp8 = Fp8TritonExperts(experts)
    assert fp8.s13.shape == (E, 2, 1)
    deq = lambda q, s: dequantize_fp8_blocks(q, s, (128, 128))  # noqa: E731
    w13 = torch.stack([torch.cat((deq(fp8.w13[e, :I], fp8.s13[e, :1]), deq(fp8.w13[e, I:], fp8.s13[e, 1:])))
                       for e in range(E)])
    w2 = torch.stack([deq(fp8.w2[e], fp8.s2[e]) for e in range(E)])
    x, wk = torch.randn(5, D, generator=g), torch.rand(5, 2, generator=g)
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [2, 1]])
    torch.testing.assert_close(fp8(x, ids, wk), fused_moe(x, w13, w2, wk, ids), rtol=1e-4, atol=1e-4)


def test_triton_refuses_what_it_has_no_kernels_for(fp8):
    for q in ("int8", "w8a8_int8"):
        with pytest.raises(ValueError, match=r"runs the experts only on CPU workers with torch kernels \(kernels/"
                                             r"int8.py; Triton serves fp8 and mxfp4\)"):
            LLM(fp8["src"], quantization=q, kernels="triton")
    from attention_nodes.config import EngineConfig, ParallelConfig

    with pytest.raises(ValueError, match=r"quantize_linears runs the quantised linears on the CPU with torch kernels "
                                         r"\(or fp8 with Triton kernels\); got the attention side on 'cuda', kernels 'torch'"):
        EngineConfig(str(fp8["src"]), device="cuda", kernels="torch", quantization="fp8", quantize_linears=True,
                     parallel=ParallelConfig(False, expert_device="cpu"))
