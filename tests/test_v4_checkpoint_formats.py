"""DeepSeek-V4's released quantised checkpoint format, dequantised at load: the attention's dense linears
(and the shared experts) as FP8 E4M3 in blocks (partial ones here: blocks of 16 on 20/24/40-wide
matrices) with UE8M0 scales, the routed experts as packed FP4 (two E2M1 values per int8 byte, low nibble
first) with a scale per row per 32 inputs (UE8M0, or float32), scales named `X.scale` (the released
files) or `X.weight_scale_inv`. The tiny V4 checkpoint is quantised here by round-to-nearest, so its
dequantised values are exact; a plain float32 copy of them is the reference: Shuttle's logits on the
quantised checkpoint equal Shuttle's and transformers' on the copy."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import ConfigError, ModelConfig
from models.checkpoint import CheckpointError
from models.loader import load_experts, load_model
from tests.conftest import hf_config, hf_model, our_logits

PROMPTS = [[(7 * i) % 500 + 2 for i in range(21)], [5, 17, 33, 100, 250, 7, 9, 11, 13, 200], [12]]
BLOCK = (16, 16)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP8_LINEAR = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.shared_experts\.w[123])\.weight$")
ROUTED = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
_MADE: dict = {}


def pow2_scale(amax: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale 2 ** e, UE8M0 byte e + 127): the smallest power of two that maps amax into [-qmax, qmax]."""
    e = torch.ceil(torch.log2(amax.clamp(min=2.0 ** -100) / qmax)).clamp(-127, 127)
    return torch.exp2(e), (e + 127).to(torch.uint8)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 codes, UE8M0 bytes per BLOCK block, the dequantised float32 weight)."""
    O, I = w.shape
    bo, bi = -(-O // BLOCK[0]), -(-I // BLOCK[1])
    padded = w.new_zeros(bo * BLOCK[0], bi * BLOCK[1])
    padded[:O, :I] = w
    scale, byte = pow2_scale(padded.view(bo, BLOCK[0], bi, BLOCK[1]).abs().amax((1, 3)), 448.0)
    s = scale.repeat_interleave(BLOCK[0], 0)[:O].repeat_interleave(BLOCK[1], 1)[:, :I]
    codes = (w / s).to(torch.float8_e4m3fn)  # (round to nearest)
    return codes, byte, codes.float() * s


def quantize_fp4(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int8 (O, I / 2), scales (O, I / 32): UE8M0 bytes or float32, the dequantised float32 weight)."""
    groups = w.unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1)
    scale, byte = pow2_scale(amax, 6.0) if ue8m0 else (amax / 6.0, None)
    idx = (groups / scale[..., None])[..., None].sub(E2M1).abs().argmin(-1).flatten(-2)  # nearest E2M1 value
    packed = (idx[:, 0::2] | (idx[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, byte if ue8m0 else scale, (E2M1[idx].unflatten(-1, (-1, 32)) * scale[..., None]).flatten(-2)


def released_name(name: str) -> str:
    """A name as transformers saved it -> as DeepSeek released it (no "model.", embed, hc_head_*)."""
    return {"model.embed_tokens.weight": "embed.weight"}.get(name, re.sub(r"^model\.hc_head\.hc_", "hc_head_",
                                                                           name.removeprefix("model.")))


def quantised(make_checkpoint, tmp_path_factory, variant: str) -> tuple[Path, Path]:
    """(quantised checkpoint, its dequantised float32 copy). variant "released": released names, `.scale`,
    float8_e8m0fnu scales, top-level expert_dtype (V4's config.json); "float_experts": transformers'
    names, `weight_scale_inv`, the dense scales as uint8 bytes, the experts' as float32, expert_dtype in
    quantization_config (V4.1's)."""
    if variant in _MADE:
        return _MADE[variant]
    src = make_checkpoint("deepseek_v4", moe_intermediate_size=32)  # (hidden 64, experts of 32: FP4 groups of 32)
    q_dir, ref_dir = (tmp_path_factory.mktemp(f"v4-{variant}-{k}") for k in ("q", "ref"))
    released = variant == "released"
    quant, ref = {}, {}
    for f in src.glob("*.safetensors"):
        for name, t in load_file(f).items():
            out = released_name(name) if released else name
            scale_name = out.removesuffix(".weight") + ".scale" if released else out + "_scale_inv"
            if FP8_LINEAR.search(name):
                codes, byte, ref[name] = quantize_fp8(t)
                quant[out], quant[scale_name] = codes, byte.view(torch.float8_e8m0fnu) if released else byte
            elif ROUTED.search(name):
                packed, scale, ref[name] = quantize_fp4(t, ue8m0=released)
                quant[out], quant[scale_name] = packed, scale.view(torch.float8_e8m0fnu) if released else scale
            else:
                quant[out] = ref[name] = t
    save_file(quant, q_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(ref, ref_dir / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, q_dir / f.name)
            shutil.copy(f, ref_dir / f.name)
    raw = json.loads((src / "config.json").read_text())
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
          "scale_fmt": "ue8m0"}
    raw.update({"quantization_config": qc, "expert_dtype": "fp4"} if released else
               {"quantization_config": {**qc, "expert_dtype": "fp4"}})
    (q_dir / "config.json").write_text(json.dumps(raw))
    _MADE[variant] = q_dir, ref_dir
    return q_dir, ref_dir


@pytest.mark.parametrize("variant", ["released", "float_experts"])
def test_quantised_logits_equal_the_dequantised_checkpoints(make_checkpoint, tmp_path_factory, variant):
    q_dir, ref_dir = quantised(make_checkpoint, tmp_path_factory, variant)
    cfg = ModelConfig.from_pretrained(q_dir)
    assert cfg.fp8_block == BLOCK and cfg.fp8_scale_fmt == "ue8m0" and cfg.fp4_experts
    ours, ref = our_logits(load_model(q_dir), PROMPTS), our_logits(load_model(ref_dir), PROMPTS)
    assert torch.equal(ours, ref)  # the same float32 weights, bit for bit
    theirs = hf_model(ref_dir)
    start = 0
    with torch.no_grad():
        for p in PROMPTS:
            expected = theirs(torch.tensor([p])).logits[0].float()
            diff = (ours[start:start + len(p)] - expected).abs().max().item()
            assert diff <= 1e-5 * expected.abs().max().item(), f"prompt {p}: {diff}"
            start += len(p)
    # an expert worker's share: the same dequantised experts
    layer = next(i for i, moe in enumerate(cfg.moe_layers) if moe)
    got = load_experts(q_dir, {layer: [4, 1]}, cfg)[layer]
    plain = load_experts(ref_dir, {layer: [4, 1]})[layer]
    assert torch.equal(got.w13, plain.w13) and torch.equal(got.w2, plain.w2)


def test_keep_fp8_keeps_the_dense_codes_with_decoded_scales(make_checkpoint, tmp_path_factory):
    """keep_fp8: the FP8 linears' codes go to their modules with the UE8M0 scales decoded to float32;
    the FP4 experts have no FP8 codes to keep (they are served from their dequantised values)."""
    q_dir, _ = quantised(make_checkpoint, tmp_path_factory, "released")
    model = load_model(q_dir, keep_fp8=True)
    kept = {n: m.fp8_checkpoint for n, m in model.named_modules() if hasattr(m, "fp8_checkpoint")}
    codes, scale, block = kept["model.layers.1.self_attn.q_a_proj"]
    raw = load_file(q_dir / "model.safetensors")
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and block == BLOCK
    assert torch.equal(scale, raw["layers.1.attn.wq_a.scale"].float())
    assert not any(".experts" in n and "shared" not in n for n in kept)


def _broken_copy(q_dir: Path, tmp_path: Path, config=None, tensors=None) -> Path:
    d = tmp_path / "broken"
    shutil.copytree(q_dir, d)
    if config is not None:
        raw = json.loads((d / "config.json").read_text())
        config(raw)
        (d / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        t = load_file(d / "model.safetensors")
        tensors(t)
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _scale_rows_dropped(t: dict) -> None:
    t["layers.1.ffn.experts.2.w3.scale"] = t["layers.1.ffn.experts.2.w3.scale"][:, :1].contiguous()


def _uint8_scales(t: dict) -> None:
    t["layers.1.attn.wkv.scale"] = t["layers.1.attn.wkv.scale"].view(torch.uint8)


@pytest.mark.parametrize("config,tensors,match", [
    (lambda raw: raw.pop("expert_dtype"), None, r"'layers\.\d\.ffn\.experts\.\d\.w\d\.weight' is int8.*expert_dtype 'fp4'"),
    (None, _scale_rows_dropped, r"'layers\.1\.ffn\.experts\.2\.w3\.scale' has shape \[32, 1\], expected \[32, 2\] "
                                r"for packed FP4 \[32, 32\]"),
    (lambda raw: raw["quantization_config"].pop("scale_fmt"), _uint8_scales,
     r"'layers\.1\.attn\.wkv\.scale' is torch\.uint8.*scale_fmt 'ue8m0'"),
])
def test_bad_quantised_tensors_name_the_file_and_tensor(make_checkpoint, tmp_path_factory, tmp_path, config, tensors,
                                                        match):
    q_dir, _ = quantised(make_checkpoint, tmp_path_factory, "released")
    d = _broken_copy(q_dir, tmp_path, config, tensors)
    with pytest.raises(CheckpointError, match=match) as e:
        load_model(d)
    assert str(d / "model.safetensors") in str(e.value)


def test_quantization_config_fields():
    v4 = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 4, "vocab_size": 512}
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    c = ModelConfig.from_dict({**v4, "quantization_config": qc})
    assert (c.fp8_scale_fmt, c.fp4_experts) == ("float", False)
    c = ModelConfig.from_dict({**v4, "quantization_config": {**qc, "scale_fmt": "ue8m0", "expert_dtype": "fp4"}})
    assert (c.fp8_scale_fmt, c.fp4_experts) == ("ue8m0", True)
    assert not ModelConfig.from_dict({**v4, "expert_dtype": "fp4"}).fp4_experts  # (no quantization_config)
    with pytest.raises(ConfigError, match=r"quantization_config\.scale_fmt='e5m2'"):
        ModelConfig.from_dict({**v4, "quantization_config": {**qc, "scale_fmt": "e5m2"}})
    with pytest.raises(ConfigError, match=r"quantization_config\.expert_dtype='int4'"):
        ModelConfig.from_dict({**v4, "quantization_config": {**qc, "expert_dtype": "int4"}})
    with pytest.raises(ConfigError, match=r"config\.json: expert_dtype='mxfp4'"):
        ModelConfig.from_dict({**v4, "expert_dtype": "mxfp4", "quantization_config": qc})
    v3 = {**hf_config("deepseek_v3").to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    assert not ModelConfig.from_dict({**v3, "expert_dtype": "fp4", "quantization_config": qc}).fp4_experts
    with pytest.raises(ConfigError, match=r"expert_dtype='fp4'.*DeepSeek-V4 checkpoints only"):
        ModelConfig.from_dict({**v3, "quantization_config": {**qc, "expert_dtype": "fp4"}})
