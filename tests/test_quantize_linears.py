"""quantize_linears: with --quantization int8 or fp8, the attention projections (and any dense MLP) are
quantised at load in the same format as the experts; the LM head and the routers stay in the dtype.
The oracle is transformers on the float checkpoint with those weights replaced by their dequantised
values, which the served model's own codes give (the fused q/k/v split back into q, k and v): the
same numbers, so the model must equal it up to summation order. Sizes are odd (hidden 200, experts
of 136): FP8's 128 x 128 blocks at the edges are partial, and the fused q/k/v's straddle q and k."""
import pytest
import torch
from safetensors.torch import load_file

from kernels.fp8_weights import Fp8Weight
from kernels.int8 import Int8Weight, quantize_int8
from kernels.quant import dequantize_fp8_blocks, quantize_fp8_blocks
from server import LLM, SamplingParams
from tests.conftest import FAMILIES, PROMPTS
from tests.test_fp8_serving import SIZES, _with
from tests.test_quantization import _prompt_logprobs
from tests.test_sampling_features import reference_prompt_logprobs

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
FORMATS = {"int8": Int8Weight, "fp8": Fp8Weight}


@pytest.fixture(scope="module")
def src(make_checkpoint):
    return make_checkpoint("qwen3_moe", **SIZES)


def _served_as_float(llm: LLM, src_weights: dict[str, torch.Tensor], quantization: str) -> dict[str, torch.Tensor]:
    """The checkpoint's q/k/v/o weights as the served model's codes dequantise, and its experts as the
    format quantises them (gate and up apart, as a checkpoint stores them)."""
    cfg, out = llm.cfg, {}
    for i, layer in enumerate(llm.engine.runner.model.model.layers):
        attn, pre = layer.self_attn, f"model.layers.{i}.self_attn."
        qkv = attn.qkv_proj.weight.int8.dequantize()
        out.update(zip((pre + f"{p}_proj.weight" for p in "qkv"), qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size])))
        out[pre + "o_proj.weight"] = attn.o_proj.weight.int8.dequantize()
    for name, w in src_weights.items():
        if ".experts." in name:
            out[name] = (quantize_int8(w).dequantize() if quantization == "int8"
                         else dequantize_fp8_blocks(*quantize_fp8_blocks(w), (128, 128)))
    return out


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_linears_equal_transformers_on_their_dequantised_weights(src, quantization, tmp_path):
    plain = LLM(src)
    try:
        want_bytes = plain.engine.runner.resident_bytes
    finally:
        plain.shutdown()
    llm = LLM(src, quantization=quantization, quantize_linears=True)
    try:
        model = llm.engine.runner.model
        for layer in model.model.layers:
            assert all(isinstance(p.weight.int8, FORMATS[quantization])
                       for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj))
            assert layer.mlp.gate.cpu_weight.int8 is None  # the router stays in the dtype
        assert model.lm_head.weight.int8 is None
        ref = _with(src, tmp_path / "deq", _served_as_float(llm, load_file(next(src.glob("*.safetensors"))),
                                                             quantization))
        got = [_prompt_logprobs(llm, p) for p in PROMPTS[:2]]
        got_bytes = llm.engine.runner.resident_bytes
    finally:
        llm.shutdown()
    for prompt, lp in zip(PROMPTS[:2], got):
        torch.testing.assert_close(lp, reference_prompt_logprobs(ref, prompt), atol=1e-4, rtol=0)
    # float32 q/k/v/o become a byte per weight plus scales; the LM head, norms and routers stay
    assert got_bytes["embedding"] == want_bytes["embedding"]
    assert got_bytes["other"] < want_bytes["other"]


def test_pools_quantize_the_attention_workers_linears(src):
    """In pools the attention worker holds the quantised linears, and serves the colocated engine's
    greedy ids."""
    colocated = LLM(src, quantization="int8", quantize_linears=True)
    try:
        want = [o.outputs[0].token_ids for o in colocated.generate(PROMPTS, GREEDY)]
        other = colocated.engine.runner.resident_bytes["other"]
    finally:
        colocated.shutdown()
    llm = LLM(src, quantization="int8", quantize_linears=True, colocated=False, attention_workers=1, expert_workers=1)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        rows = {(r["pool"], r["kind"]): r["bytes"] for r in llm.engine.stats()["weights"]}
    finally:
        llm.shutdown()
    assert rows[("attention", "other")] == other


def test_quantize_linears_refusals_and_flags(src):
    from attention_nodes.config import EngineConfig, ParallelConfig
    from pools.roles import engine_config_from_json, engine_config_to_json
    from server.cli import build_parser

    for quantization in (None, "mxfp4", "w8a8_int8"):
        with pytest.raises(ValueError, match="quantize_linears quantises the linear layers as --quantization int8 "
                                             "or fp8 does the experts"):
            EngineConfig(str(src), quantization=quantization, quantize_linears=True)
    with pytest.raises(ValueError, match=r"on the CPU with torch kernels \(or fp8 with Triton kernels\); got the attention "
                                         r"side on 'cuda', kernels None, quantization 'int8'"):
        EngineConfig(str(src), device="cuda", parallel=ParallelConfig(False, expert_device="cpu"), quantization="int8",
                     quantize_linears=True)
    with pytest.raises(ValueError, match="quantize_linears must be true or false"):
        EngineConfig(str(src), quantization="int8", quantize_linears="yes")
    cfg = EngineConfig(str(src), quantization="fp8", quantize_linears=True)
    assert engine_config_from_json(engine_config_to_json(cfg)).quantize_linears
    args = build_parser().parse_args(["serve", "--quantization", "int8", "--quantize-linears"])
    assert args.quantize_linears and not build_parser().parse_args(["serve"]).quantize_linears


def test_quantised_linears_alone_measure_their_block_choice(monkeypatch):
    """A process whose quantised linears have no int8 / FP8 experts beside them (an attention worker)
    still times the int8 (FP8) block's kernels, on its largest int8 (FP8) linear's shape, so its
    linears take the measured kernel per row count as a colocated engine's do."""
    from torch import nn

    from kernels import choice
    from models.cpu_inference import PackedLinear, choose_kernels, quantized_linear_weight

    asked = {}
    monkeypatch.setattr(choice, "configure", lambda op, shapes: asked.setdefault(op, shapes))
    tree = nn.ModuleList([PackedLinear(nn.Linear(64, 96, bias=False), quantized_linear_weight(torch.randn(96, 64), q))
                          for q in ("int8", "fp8")] + [PackedLinear(nn.Linear(64, 32, bias=False),
                                                                    quantized_linear_weight(torch.randn(32, 64), "int8"))])
    choose_kernels(tree)
    assert asked["int8_moe"] == [(64, 48)] and asked["fp8_moe"] == [(64, 48)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_every_family_serves_quantized_linears(family, quantization, make_checkpoint):
    """Every family (MLA, DSA indexers, linear attention, sinks, DeepSeek-V4's compressors ...) serves
    with its linears quantised too: fewer resident bytes beside the experts, and prompt log-probabilities
    near those with the experts alone quantised (the median over positions: DSA's top-k choice may flip
    at a position, 2.3 apart at one of GLM-5's here)."""
    ckpt = make_checkpoint(family)
    logprobs, other = {}, {}
    for linears in (False, True):
        llm = LLM(ckpt, quantization=quantization, quantize_linears=linears)
        try:
            logprobs[linears] = _prompt_logprobs(llm, PROMPTS[0])
            llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            other[linears] = llm.engine.runner.resident_bytes["other"]
        finally:
            llm.shutdown()
    assert torch.isfinite(logprobs[True]).all() and other[True] < other[False]
    assert (logprobs[True] - logprobs[False]).abs().median() < {"int8": 0.05, "fp8": 0.25}[quantization]
