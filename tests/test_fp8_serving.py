"""FP8 weights at rest (kernels/fp8_weights.py) end to end. An FP8 block-quantised checkpoint is served
with its E4M3 codes and scales as shipped where the experts run on CPU workers with torch kernels (the
experts through fused_moe_fp8, the FP8 q/k/v/o linears as Fp8Weight); `--quantization none`
dequantises it at load as before. `--quantization fp8` quantises a float checkpoint's experts at
load. The oracle is transformers on the dequantised float checkpoint: the same numbers, so the FP8
model must equal it up to summation order. Sizes are odd (hidden 200, experts of 136): the 128 x 128
blocks at the edges are partial."""
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kernels.fp8_weights import Fp8ExpertPanels, Fp8Weight
from kernels.quant import dequantize_fp8_blocks, quantize_fp8_blocks
from server import LLM, SamplingParams
from tests.conftest import PROMPTS
from tests.test_deepseek import _quantize_checkpoint
from tests.test_quantization import _prompt_logprobs, expert_weights
from tests.test_sampling_features import reference_prompt_logprobs

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SIZES = dict(hidden_size=200, head_dim=16, moe_intermediate_size=136)  # q 64, k/v 32 rows: whole panels


def _with(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of checkpoint src with `tensors` replacing its own."""
    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    save_file({**load_file(f), **tensors}, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def ckpts(make_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """src: a float32 Qwen3-MoE; fp8: it with every q/k/v/o and expert weight FP8 (128 x 128 blocks);
    deq: src with those weights dequantised (the FP8 checkpoint's values in float32)."""
    d = tmp_path_factory.mktemp("fp8_serving")
    src = make_checkpoint("qwen3_moe", **SIZES)
    dequantised = _quantize_checkpoint(src, d / "fp8")
    return {"src": src, "fp8": d / "fp8", "deq": _with(src, d / "deq", dequantised)}


@pytest.fixture(scope="module")
def llm_fp8(ckpts):
    llm = LLM(ckpts["fp8"])
    yield llm
    llm.shutdown()


def test_fp8_checkpoint_served_as_shipped_equals_transformers(ckpts, llm_fp8, caplog):
    assert llm_fp8.engine_cfg.quantization == "fp8"  # the default for an FP8 checkpoint on CPU workers
    experts = expert_weights(llm_fp8)
    assert experts and all(isinstance(w, Fp8ExpertPanels) for w in experts)
    attn = llm_fp8.engine.runner.model.model.layers[1].self_attn
    assert isinstance(attn.qkv_proj.weight.int8, Fp8Weight) and isinstance(attn.o_proj.weight.int8, Fp8Weight)
    # the codes and scales are the checkpoint's, bit for bit (no dequantise-requantise)
    f = next(ckpts["fp8"].glob("*.safetensors"))
    with safe_open(f, framework="pt") as h:
        name = "model.layers.1.mlp.experts.3.down_proj.weight"
        codes, scale = h.get_tensor(name), h.get_tensor(name + "_scale_inv")
        o_codes = h.get_tensor("model.layers.1.self_attn.o_proj.weight")
    down = [m for m in llm_fp8.engine.runner.model.modules() if hasattr(m, "fp8") and m.fp8 is not None][1].w2_packed[3]
    assert torch.equal(down.fp8.codes().view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(down.fp8.dequantize(), dequantize_fp8_blocks(codes, scale, (128, 128)))
    assert torch.equal(attn.o_proj.weight.int8.codes().view(torch.uint8), o_codes.view(torch.uint8))
    for prompt in PROMPTS[:3]:
        torch.testing.assert_close(_prompt_logprobs(llm_fp8, prompt), reference_prompt_logprobs(ckpts["deq"], prompt),
                                   atol=1e-4, rtol=0)
    with caplog.at_level(logging.INFO, logger="shuttle"):
        plain = LLM(ckpts["fp8"], quantization="none")  # today's path: dequantised at load
    try:
        assert plain.engine_cfg.quantization is None
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
        full = plain.engine.runner.resident_bytes
    finally:
        plain.shutdown()
    assert any("dequantised to float32 at load (--quantization none)" in r.getMessage() for r in caplog.records)
    assert [o.outputs[0].token_ids for o in llm_fp8.generate(PROMPTS, GREEDY)] == want
    # resident experts: their codes and scales exactly, about a quarter of float32's bytes
    fp8 = llm_fp8.engine.runner.resident_bytes
    assert fp8["experts"] == sum(w.fp8.panels.numel() + w.fp8.scales.numel() * 4 for w in experts)
    assert 0.2 < fp8["experts"] / full["experts"] < 0.35
    assert fp8["embedding"] == full["embedding"] and fp8["other"] < full["other"]
    assert llm_fp8.engine.stats()["weight_bytes"] == fp8


def test_fp8_as_shipped_logs_it(ckpts, caplog):
    from server.llm import engine_config

    with caplog.at_level(logging.INFO, logger="shuttle"):
        assert engine_config(ckpts["fp8"], device="cpu").quantization == "fp8"
    assert any("weights: FP8 as shipped" in r.getMessage() for r in caplog.records)
    # Triton kernels serve FP8 too (models/triton_quant.py); experts on a GPU with torch kernels do not
    assert engine_config(ckpts["fp8"], device="cpu", kernels="triton").quantization == "fp8"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shuttle"):
        assert engine_config(ckpts["fp8"], device="cuda", kernels="torch").quantization is None
    assert any("dequantised to float32 at load" in r.getMessage() for r in caplog.records)


def test_fp8_checkpoint_in_bf16_within_bf16s_tolerance(ckpts):
    llm = LLM(ckpts["fp8"], dtype="bfloat16")
    try:
        assert all(isinstance(w, Fp8ExpertPanels) for w in expert_weights(llm))
        got = _prompt_logprobs(llm, PROMPTS[0])
    finally:
        llm.shutdown()
    torch.testing.assert_close(got, reference_prompt_logprobs(ckpts["deq"], PROMPTS[0]), atol=0.1, rtol=0.05)


def test_pools_serve_fp8_as_shipped(ckpts, llm_fp8):
    want = [o.outputs[0].token_ids for o in llm_fp8.generate(PROMPTS, GREEDY)]
    llm = LLM(ckpts["fp8"], colocated=False, attention_workers=1, expert_workers=1)
    try:
        assert llm.engine_cfg.quantization == "fp8"
        before = {(r["pool"], r["kind"]): r["bytes"] for r in llm.engine.stats()["weights"]}  # (before any step)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        rows = {(r["pool"], r["kind"]): r["bytes"] for r in llm.engine.stats()["weights"]}
    finally:
        llm.shutdown()
    assert rows[("expert", "experts")] == before[("expert", "experts")]
    assert rows[("expert", "experts")] == llm_fp8.engine.runner.resident_bytes["experts"]
    assert rows[("attention", "experts")] == 0


def test_experts_an_fp8_checkpoint_stores_unquantised_are_served_as_stored(ckpts, tmp_path):
    """An FP8 checkpoint whose first layer's experts are stored unquantised (modules_to_not_convert, as
    releases leave some layers): those experts are served as stored, not quantised to FP8, colocated and
    on an expert worker, while the other layer's keep their FP8 codes; the oracle is transformers on the
    dequantised weights with those experts as stored."""
    import json

    from models.cpu_inference import PackedExperts

    first = "model.layers.0.mlp.experts."
    src = load_file(next(ckpts["src"].glob("*.safetensors")))
    mixed = tmp_path / "mixed"
    shutil.copytree(ckpts["fp8"], mixed)
    f = next(mixed.glob("*.safetensors"))
    tensors = {n: (src[n] if n.startswith(first) else t) for n, t in load_file(f).items()
               if not (n.startswith(first) and n.endswith("_scale_inv"))}
    save_file(tensors, f, metadata={"format": "pt"})
    raw = json.loads((mixed / "config.json").read_text())
    raw["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.mlp.experts"]
    (mixed / "config.json").write_text(json.dumps(raw))
    ref = _with(ckpts["deq"], tmp_path / "ref", {n: t for n, t in src.items() if n.startswith(first)})
    llm = LLM(mixed)
    try:
        assert llm.engine_cfg.quantization == "fp8"
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedExperts)]
        assert layers[0].fp8 is None and not any(isinstance(w, Fp8ExpertPanels) for w in layers[0].w13_packed)
        assert layers[1].fp8 is not None
        got = _prompt_logprobs(llm, PROMPTS[0])
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    torch.testing.assert_close(got, reference_prompt_logprobs(ref, PROMPTS[0]), atol=1e-4, rtol=0)
    pools = LLM(mixed, colocated=False, attention_workers=1, expert_workers=1)
    try:
        assert [o.outputs[0].token_ids for o in pools.generate(PROMPTS, GREEDY)] == want
    finally:
        pools.shutdown()


def test_quantization_fp8_of_a_float_checkpoint(ckpts, tmp_path):
    """--quantization fp8: the experts quantised at load in 128 x 128 blocks (gate and up apart, as a
    checkpoint stores them); equal to transformers on the float checkpoint with those experts
    replaced by their dequantised FP8."""
    src = ckpts["src"]
    deq = {n: dequantize_fp8_blocks(*quantize_fp8_blocks(w), (128, 128))
           for n, w in load_file(next(src.glob("*.safetensors"))).items() if ".experts." in n}
    ref = _with(src, tmp_path / "deq", deq)
    llm = LLM(src, quantization="fp8")
    try:
        assert all(isinstance(w, Fp8ExpertPanels) for w in expert_weights(llm))
        attn = llm.engine.runner.model.model.layers[0].self_attn
        assert attn.qkv_proj.weight.int8 is None  # the experts only, as int8's scope
        got = _prompt_logprobs(llm, PROMPTS[0])
    finally:
        llm.shutdown()
    torch.testing.assert_close(got, reference_prompt_logprobs(ref, PROMPTS[0]), atol=1e-4, rtol=0)


def test_fp8_refusals(ckpts):
    from attention_nodes.config import EngineConfig, ParallelConfig

    with pytest.raises(ValueError, match="already FP8 block-quantised; --quantization int8"):
        LLM(ckpts["fp8"], quantization="int8")
    for colocated, expert_device in ((True, None), (False, "cuda")):  # (Triton serves it: test_triton_quant_serving)
        with pytest.raises(ValueError, match=r"'fp8' runs the experts on CPU workers with torch kernels \(kernels/"
                                             r"fp8_weights.py\) or with Triton kernels; got experts on 'cuda', kernels "
                                             r"'torch'"):
            EngineConfig(str(ckpts["src"]), device="cuda", kernels="torch", quantization="fp8",
                         parallel=ParallelConfig(colocated, expert_device=expert_device))


def test_fp8_experts_served_from_codes_are_never_dequantised(ckpts):
    """keep_fp8 with per-expert FP8 tensors of SiLU experts: the stacked expert parameters are never
    filled nor given memory (zero-stride zeros), as the FP8 kernels take every expert's codes; colocated
    and an expert worker's share. Without keep_fp8 they hold the dequantised values."""
    from models.loader import load_experts, load_model

    E = 8  # (make_checkpoint's experts)
    experts = load_model(ckpts["fp8"], keep_fp8=True).model.layers[1].mlp.experts
    plain = load_model(ckpts["fp8"]).model.layers[1].mlp.experts
    for got, want in ((experts.w13, plain.w13), (experts.w2, plain.w2)):
        assert got.shape == want.shape and got.stride() == (0, 0, 0) and not got.any()
        assert want.stride() != (0, 0, 0) and want.abs().sum() > 0
    assert all((k, e) in experts.fp8_checkpoint for k in ("w1", "w3", "w2") for e in range(E))
    share = load_experts(ckpts["fp8"], [3, 1], keep_fp8=True)
    assert all(m.w13.stride() == (0, 0, 0) and ("w2", 1) in m.fp8_checkpoint for m in share.values())
    codes, scale = share[1].fp8_checkpoint["w2", 0]  # (local 0: expert 3)
    torch.testing.assert_close(dequantize_fp8_blocks(codes, scale, (128, 128)), plain.w2[3], rtol=0, atol=0)


def test_reader_hands_fp8_codes_as_shipped_and_names_bad_ones(tmp_path):
    from models.checkpoint import CheckpointError, CheckpointReader

    q, s = quantize_fp8_blocks(torch.randn(40, 70), (32, 32))
    nan = q.clone()
    nan.view(torch.uint8)[3, 5] = 0xFF
    save_file({"a.weight": q, "a.weight_scale_inv": s, "n.weight": nan, "n.weight_scale_inv": s.clone(),
               "m.weight": q.clone(), "b.weight": q.clone(), "b.weight_scale_inv": s[:1].clone()},
              tmp_path / "model.safetensors")
    reader = CheckpointReader(tmp_path, (32, 32))
    codes, scale = reader.read_fp8("a.weight")
    assert codes.dtype == torch.float8_e4m3fn and torch.equal(codes.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scale, s)
    for name, match in (("n.weight", "'n.weight' holds NaN codes"), ("m.weight", "'m.weight' has no 'm.weight_scale_inv'"),
                        ("b.weight", "'b.weight_scale_inv' has shape \\[1, 3\\], expected \\[2, 3\\]"),
                        ("x.weight", "no tensor 'x.weight'")):
        with pytest.raises(CheckpointError, match=match):
            reader.read_fp8(name)


def test_planner_knows_fp8_experts(ckpts):
    from models.config import ModelConfig
    from planner.shapes import quantization_of

    cfg = ModelConfig.from_pretrained(ckpts["fp8"])
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    # codes plus a float32 scale per 16-row panel per 128-input block: what Fp8ExpertPanels hold
    assert cfg.expert_bytes(torch.bfloat16, "fp8") == 3 * D * I + 4 * (2 * 9 * 2 + 13 * 2)
    assert cfg.expert_bytes(torch.bfloat16, "fp8") < 0.55 * cfg.expert_bytes(torch.bfloat16)
    assert quantization_of("fp8", cfg) == "fp8"
    with pytest.raises(ValueError, match="already FP8 block-quantised"):
        quantization_of("int8", cfg)
