"""Safetensors checkpoints as this model names them: which tensors fill which parameters (checkpoint_targets,
Target, the families' name maps), and CheckpointReader, which checks each tensor against its target
before any is read and reads FP8 / FP4 / MXFP4 ones as shipped or dequantised (models/loader.py loads them).

Checkpoint experts are per-expert matrices (`experts.{e}.gate_proj|up_proj|down_proj` or Mixtral's
`block_sparse_moe.experts.{e}.w1|w3|w2`); fused `experts.gate_up_proj` / `experts.down_proj` tensors
are accepted too. In the model they are stacked: w13 (E, 2I, D) and w2 (E, D, I).
FP8 block-quantised weights (quantization_config quant_method fp8) are dequantised to the model's
dtype as they are read, each with its `weight_scale_inv`; with keep_fp8 their E4M3 codes and scales
are also handed to the modules as shipped (`fp8_checkpoint`, for kernels/fp8_weights.py and
models/triton_quant.py), and per-expert ones of SiLU experts only that: their stacked parameters are
never filled nor given memory (models/loader.py: served_from_codes). DeepSeek-V4's released
files name each scale `X.scale` (beside `X.weight`), store scales as UE8M0 bytes (scale_fmt ue8m0) and, with
expert_dtype fp4, routed experts as packed FP4 (int8 (O, I/2), a scale per row per 32 inputs): dequantised on
read too (keep_fp8 keeps no FP4 codes: those experts are served, or requantised, from their dequantised values).
gpt-oss stores its experts fused and
transposed (`experts.gate_up_proj` (E, D, 2I) with gate and up interleaved, `down_proj` (E, I, D),
biases `gate_up_proj_bias` / `down_proj_bias`) and its router as `mlp.router`; MXFP4 checkpoints hold
each expert matrix as `X_blocks` + `X_scales` (out-major (E, O, D/32, 16) uint8 nibbles and E8M0
scales), dequantised on read into the same (E, D, 2I) / (E, I, D) tensors, or with keep_mxfp4 kept as
shipped instead (`mxfp4_checkpoint`, for kernels/mxfp4_weights.py; never dequantised). A Target's
layout says how a tensor is rearranged into the model's stacked form. Multi-token-prediction layers (DeepSeek's
num_nextn_predict_layers, stored as the layers past num_hidden_layers) are skipped with one log line
(speculative method mtp reads the first of them apart: models/mtp.load_mtp).
Llama 4 names its MLP `feed_forward` (router `router`, ungated `shared_expert`) and fuses its experts
transposed (`gate_up_proj` (E, D, 2I) gate then up, `down_proj` (E, I, D)); a multimodal checkpoint
keeps its language model under `language_model.` and its vision tower, which is skipped, beside it.
MiMo-V2-Flash names its sinks `attention_sink_bias` and keeps its MTP layers under `model.mtp.` (skipped).
A Qwen3_5MoeForConditionalGeneration checkpoint keeps its language model under `model.language_model.`
and its vision tower under `model.visual.` (skipped); Qwen3-Next's and Qwen3.5's MTP layers (`mtp.`) are skipped.
RENAMES holds each family's (checkpoint, model) name pieces; training/checkpoint.py writes them back.
"""
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.quant import (E8M0, FP8_DTYPES, decode_scales, dequantize_fp4_packed, dequantize_fp8_blocks,
                           dequantize_mxfp4, fp4_scale_shape, fp8_block_scale_shape, has_nan_e8m0, mxfp4_shape)
from models.config import ModelConfig

STACKED_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(w13|w2)$")  # the model's stacked tensors
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
# (a Llama4ForConditionalGeneration's vision tower and projector, a Qwen3_5MoeForConditionalGeneration's
# vision tower: only the language model is served; the multi-token-prediction layers of MiMo-V2-Flash and
# of Qwen3-Next / Qwen3.5, which transformers skips too)
IGNORED = re.compile(r"(rotary_emb\.inv_freq$)|^(vision_model|multi_modal_projector|model\.visual|model\.mtp|mtp)\.")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv` scales the FP8 `X.weight`
RELEASED_SCALE = ".scale"  # DeepSeek-V4's released files name it `X.scale` (beside `X.weight`)
# a routed expert's weight (checkpoint name), which DeepSeek-V4 ships as packed FP4 (expert_dtype fp4)
_ROUTED_EXPERT_WEIGHT = re.compile(r"(^|\.)experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
MXFP4_SUFFIXES = ("_blocks", "_scales")  # `X_blocks` + `X_scales` hold the MXFP4 tensor `X`


class CheckpointError(ValueError):
    """A checkpoint that does not fit its config; the message names the file and the tensor."""


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, optionally one expert row and a row range.
    layout: "" as stored; "T": the last two dims transposed (gpt-oss's down_proj (E, I, D) -> w2);
    "iT": transposed, then the interleaved gate/up rows (0, 2, ... then 1, 3, ...) split into gate
    then up (gate_up_proj (E, D, 2I) -> w13); "i": the last dim de-interleaved (gate_up_proj_bias)."""

    param: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    layout: str = ""


class CheckpointReader:
    """Index of the tensors of a checkpoint directory: name -> safetensors file."""

    def __init__(self, model_dir: str | Path, fp8_block: tuple[int, int] | None = None, scale_fmt: str = "float",
                 fp4_experts: bool = False):
        """fp8_block, scale_fmt, fp4_experts: the config's quantization (ModelConfig.fp8_block,
        fp8_scale_fmt, fp4_experts; CheckpointReader.of reads them from a ModelConfig)."""
        self.dir, self.fp8_block = Path(model_dir), fp8_block
        self.scale_fmt, self.fp4_experts = scale_fmt, fp4_experts
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            self.files = {name: self.dir / f for name, f in weight_map.items()}
            for f in sorted(set(self.files.values())):
                if not f.is_file():
                    raise CheckpointError(f"{f}: file listed in {index.name} does not exist")
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                extra = " (only .bin weights found: convert them to safetensors)" if list(self.dir.glob("*.bin")) else ""
                raise CheckpointError(f"{self.dir}: no *.safetensors files{extra}")
            self.files = {}
            for f in shards:
                with safe_open(f, framework="pt") as h:
                    for name in h.keys():
                        self.files[name] = f
        # FP8 (and FP4) scales are read with their weights, never as tensors of their own: `X.weight_scale_inv`,
        # or `X.scale` where `X.weight` is in the checkpoint (DeepSeek-V4's released files)
        self.scale_names = {n[:-len(SCALE_SUFFIX)]: n for n in self.files if n.endswith(SCALE_SUFFIX)}
        for n in [n for n in self.files if n.endswith(RELEASED_SCALE)]:
            weight = n[:-len(RELEASED_SCALE)] + ".weight"
            if weight not in self.files:
                continue
            if weight in self.scale_names:
                raise CheckpointError(f"{self.files[n]}: tensor '{weight}' has two scales, '{n}' and "
                                      f"'{self.scale_names[weight]}'")
            self.scale_names[weight] = n
        self.scales = {w: self.files.pop(n) for w, n in self.scale_names.items()}
        self.mxfp4 = self._pair_mxfp4()

    @classmethod
    def of(cls, model_dir: str | Path, cfg: ModelConfig) -> "CheckpointReader":
        """A reader of model_dir with cfg's quantization (fp8_block, fp8_scale_fmt, fp4_experts)."""
        return cls(model_dir, cfg.fp8_block, cfg.fp8_scale_fmt, cfg.fp4_experts)

    def _pair_mxfp4(self) -> dict[str, tuple[Path, Path]]:
        """MXFP4 tensors `X` stored as `X_blocks` + `X_scales` (experts of gpt-oss): each pair becomes
        one entry `X` of self.files (the blocks' file) and of the returned {X: (blocks file, scales file)}."""
        pairs: dict[str, tuple[Path, Path]] = {}
        for name, f in list(self.files.items()):
            if not name.endswith("_blocks") or ".experts." not in name:
                continue
            base = name[:-len("_blocks")]
            if base + "_scales" not in self.files:
                raise CheckpointError(f"{f}: MXFP4 tensor '{name}' has no '{base}_scales' in the checkpoint")
            pairs[base] = (f, self.files.pop(base + "_scales"))
            del self.files[name]
            self.files[base] = f
        return pairs

    def shape(self, h, name: str) -> tuple[int, ...]:
        """A tensor's shape as the model sees it (an MXFP4 pair: dequantised and transposed to the
        (E, D, O) layout of gpt-oss's float checkpoints)."""
        if name in self.mxfp4:
            e, o, *rest = mxfp4_shape(tuple(h.get_slice(name + "_blocks").get_shape()))
            return (e, *rest, o)
        shape = tuple(h.get_slice(name).get_shape())
        if self._is_fp4(h, name):  # packed FP4 (O, I / 2): (O, I) unpacked
            return (*shape[:-1], 2 * shape[-1])
        return shape

    def fp8_names(self, names: list[str]) -> set[str]:
        """Those of `names` stored as FP8 with a scale (from the files' headers, each file opened once)."""
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            if name in self.scales and name in self.files:
                by_file[self.files[name]].append(name)
        out = set()
        for f, group in by_file.items():
            with safe_open(f, framework="pt") as h:
                out.update(n for n in group if h.get_slice(n).get_dtype() in ("F8_E4M3", "F8_E5M2"))
        return out

    def _is_fp4(self, h, name: str) -> bool:
        """Whether tensor `name` is a packed FP4 routed-expert weight (int8, expert_dtype fp4); an int8
        expert weight without expert_dtype fp4 in the config is a CheckpointError."""
        if h.get_slice(name).get_dtype() != "I8" or not _ROUTED_EXPERT_WEIGHT.search(name):
            return False
        if not self.fp4_experts:
            raise CheckpointError(f"{self.files[name]}: expert tensor '{name}' is int8 (packed FP4?) but config.json "
                                  f"does not declare expert_dtype 'fp4' (with quant_method fp8)")
        return True

    def is_empty(self, name: str) -> bool:
        """Whether tensor `name` has no elements (transformers saves n_shared_experts=0 as (0, D) MLPs)."""
        with safe_open(self.files[name], framework="pt") as h:
            return 0 in self.shape(h, name)

    def read(self, wanted: dict[str, list[Target]], model_shape: dict[Target, tuple[int, ...]],
             kept: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
             mxfp4_kept: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
             codes_only: frozenset[str] | set[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Check then read the `wanted` tensors, one file at a time. kept: filled with the FP8 ones'
        (codes, scale_inv) as shipped (read_fp8), beside their dequantised values, or instead of them
        for the names in codes_only (absent from the result then). mxfp4_kept: filled with the MXFP4
        ones' (blocks (E, O, G, 16), scales (E, O, G)) as shipped, instead of their dequantised values
        (they are then absent from the result)."""
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in wanted:
            by_file[self.files[name]].append(name)
        out = {}
        for f, names in by_file.items():
            with safe_open(f, framework="pt") as h:
                present = set(h.keys())
                for name in names:
                    if (name + "_blocks" if name in self.mxfp4 else name) not in present:
                        raise CheckpointError(f"{f}: tensor '{name}' is listed in the index but not in the file")
                    got = self.shape(h, name)
                    for t in wanted[name]:
                        if got != model_shape[t]:
                            packed = (f" (unpacked from packed FP4 {list(h.get_slice(name).get_shape())})"
                                      if self._is_fp4(h, name) else "")
                            raise CheckpointError(f"{f}: tensor '{name}' has shape {list(got)}{packed}, expected "
                                                  f"{list(model_shape[t])} for {t.param}")
                for name in names:
                    if name in self.mxfp4:
                        blocks, scales = self._checked_mxfp4(f, name, h.get_tensor(name + "_blocks"))
                        if mxfp4_kept is not None:
                            mxfp4_kept[name] = blocks, scales
                        else:
                            out[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2)
                        continue
                    out[name] = h.get_tensor(name)
                    if out[name].dtype == torch.int8 and (name in self.scales or _ROUTED_EXPERT_WEIGHT.search(name)):
                        # (packed FP4 routed experts; no FP8 codes to keep: served from the dequantised values)
                        if not self._is_fp4(h, name):
                            raise CheckpointError(f"{f}: tensor '{name}' is int8 with a scale; packed FP4 is read "
                                                  f"only for routed experts' weights (expert_dtype fp4)")
                        out[name] = self._dequantize_fp4(f, name, out[name])
                        continue
                    if out[name].dtype in FP8_DTYPES:
                        if kept is not None:
                            kept[name] = self._checked_fp8(f, name, out[name])
                            if name in codes_only:
                                del out[name]
                                continue
                        out[name] = self._dequantize(f, name, out[name])
        return out

    def read_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 block-quantised weight as shipped: (codes float8_e4m3fn (O, I), scale_inv float32
        (ceil(O / bo), ceil(I / bi))), checked: E4M3, 2-D, its scale present and of that shape, no NaN
        codes (0x7F / 0xFF). CheckpointError naming the file and the tensor otherwise."""
        if name not in self.files:
            raise CheckpointError(f"{self.dir}: no tensor '{name}' in the checkpoint")
        with safe_open(self.files[name], framework="pt") as h:
            return self._checked_fp8(self.files[name], name, h.get_tensor(name))

    def _checked_fp8(self, f: Path, name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if w.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{f}: tensor '{name}' is {w.dtype}; FP8 weights are kept as shipped only as "
                                  f"float8_e4m3fn (serve with --quantization none to dequantise them)")
        scale = self._scale(f, name, w)
        for o0 in range(0, w.shape[0], 4096):  # E4M3's NaN codes, a row chunk at a time
            if (w[o0:o0 + 4096].view(torch.uint8) & 0x7F).eq(0x7F).any():
                raise CheckpointError(f"{f}: FP8 tensor '{name}' holds NaN codes (0x7F / 0xFF)")
        return w, decode_scales(scale)

    def _checked_mxfp4(self, f: Path, name: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`name`_blocks (E, O, G, 16) uint8, `name`_scales (E, O, G) uint8), their shapes and dtypes
        checked (dequantised: float32 (E, G * 32, O))."""
        scale_file = self.mxfp4[name][1]
        if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16:
            raise CheckpointError(f"{f}: MXFP4 tensor '{name}_blocks' must be uint8 (E, O, G, 16), got "
                                  f"{blocks.dtype} {list(blocks.shape)}")
        with safe_open(scale_file, framework="pt") as h:
            scales = h.get_tensor(name + "_scales")
        if tuple(scales.shape) != tuple(blocks.shape[:-1]) or scales.dtype != torch.uint8:
            raise CheckpointError(f"{scale_file}: tensor '{name}_scales' has shape {list(scales.shape)} "
                                  f"{scales.dtype}, expected uint8 {list(blocks.shape[:-1])} for '{name}_blocks'")
        return blocks, scales

    def _dequantize(self, f: Path, name: str, w: torch.Tensor) -> torch.Tensor:
        """An FP8 weight times its per-block weight_scale_inv, as float32."""
        return dequantize_fp8_blocks(w, decode_scales(self._scale(f, name, w)), self.fp8_block)

    def _dequantize_fp4(self, f: Path, name: str, w: torch.Tensor) -> torch.Tensor:
        """A packed FP4 expert weight (O, I / 2) times its scale per row per 32 inputs, as float32 (O, I)."""
        return dequantize_fp4_packed(w, self._scale(f, name, w, fp4=True))

    def _scale(self, f: Path, name: str, w: torch.Tensor, fp4: bool = False) -> torch.Tensor:
        """Quantised weight `name`'s scale (weight_scale_inv or .scale) as stored, its shape and dtype checked:
        FP8 (O, I): one per fp8_block block; packed FP4 (O, I / 2): one per row per 32 inputs."""
        kind = "packed FP4" if fp4 else "FP8"
        if self.fp8_block is None:
            raise CheckpointError(f"{f}: tensor '{name}' is {w.dtype} but config.json has no FP8 quantization_config "
                                  f"(quant_method fp8 with weight_block_size)")
        if name not in self.scales:
            raise CheckpointError(f"{f}: {kind} tensor '{name}' has no '{name}{SCALE_SUFFIX}' (or "
                                  f"'{name.removesuffix('.weight')}{RELEASED_SCALE}') in the checkpoint")
        scale_name = self.scale_names[name]
        if w.dim() != 2:
            raise CheckpointError(f"{f}: {kind} tensor '{name}' has shape {list(w.shape)}; only 2-D quantised "
                                  f"weights are supported")
        with safe_open(self.scales[name], framework="pt") as h:
            scale = h.get_tensor(scale_name)
        want = fp4_scale_shape(tuple(w.shape)) if fp4 else fp8_block_scale_shape(tuple(w.shape), self.fp8_block)
        if tuple(scale.shape) != want:
            grid = "one per row per 32 inputs" if fp4 else f"blocks of {list(self.fp8_block)}"
            raise CheckpointError(f"{self.scales[name]}: tensor '{scale_name}' has shape {list(scale.shape)}, expected "
                                  f"{list(want)} for {kind} {list(w.shape)} ({grid})")
        ue8m0 = scale.dtype == torch.uint8 or (E8M0 is not None and scale.dtype == E8M0)
        if not (scale.is_floating_point() or ue8m0) or (scale.dtype == torch.uint8 and self.scale_fmt != "ue8m0"):
            raise CheckpointError(f"{self.scales[name]}: tensor '{scale_name}' is {scale.dtype}; scales are float, "
                                  f"or float8_e8m0fnu / uint8 exponents (uint8 only with quantization_config "
                                  f"scale_fmt 'ue8m0')")
        if ue8m0 and has_nan_e8m0(scale):
            raise CheckpointError(f"{self.scales[name]}: tensor '{scale_name}' holds NaN scales (UE8M0 byte 0xFF)")
        return scale


# family -> (checkpoint piece, model piece) of tensor names, applied in order
RENAMES = {"gpt_oss": ((".mlp.router.", ".mlp.gate."),),
           "llama4": ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.shared_expert.", ".mlp.shared_experts."),
                      (".feed_forward.", ".mlp.")),
           "mimo_v2_flash": ((".self_attn.attention_sink_bias", ".self_attn.sinks"),)}
FUSED_TRANSPOSED = ("gpt_oss", "llama4")  # experts stored (E, D, 2I) / (E, I, D)
# DeepSeek-V4's released names (embed, head, layers.N.attn.wq_a, ffn.experts.E.w1, hc_attn_fn, ...; with or
# without "model."; transformers' save_pretrained writes them back so) -> transformers' module names, in order
V4_RENAMES = ((r"^model\.hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"), (r"\.attn\.", ".self_attn."),
              (r"\.ffn\.", ".mlp."), (r"\.self_attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
              (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
              (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
              (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
              (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"), (r"\.attn_sink$", ".sinks"),
              (r"(\.self_attn\.(?:.*\.)?)norm\.", r"\1kv_norm."), (r"\.ape$", ".position_bias"),
              (r"\.wq_a\.", ".q_a_proj."), (r"\.wq_b\.", ".q_b_proj."), (r"\.wkv\.", ".kv_proj."),
              (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
              (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
              (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
              (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
              (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."))


V4_NAMES_BACK = ((r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
                 (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
                 (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."), (r"\.self_attn\.", ".attn."),
                 (r"\.mlp\.", ".ffn."), (r"\.input_layernorm\.", ".attn_norm."),
                 (r"\.post_attention_layernorm\.", ".ffn_norm."), (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
                 (r"\.sinks$", ".attn_sink"), (r"\.kv_norm\.", ".norm."), (r"\.position_bias$", ".ape"),
                 (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
                 (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
                 (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."), (r"\.q_a_proj\.", ".wq_a."),
                 (r"\.q_b_proj\.", ".wq_b."), (r"\.kv_proj\.", ".wkv."), (r"\.gate_proj\.", ".wgate."),
                 (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."), (r"\.q_a_norm\.", ".q_norm."),
                 (r"\.gate\.e_score_correction_bias$", ".gate.bias"))


def v4_checkpoint_name(name: str) -> str:
    """A DeepSeek-V4 model parameter's name as transformers' save_pretrained writes it (the released
    names under "model.", head.weight); v4_model_name reads it back."""
    if name == "lm_head.weight":
        return "head.weight"
    if not name.startswith("model.layers."):
        return name
    for pattern, repl in V4_NAMES_BACK:
        name = re.sub(pattern, repl, name)
    return name


def v4_model_name(name: str) -> str:
    """A DeepSeek-V4 checkpoint tensor's name in the model (V4_RENAMES; names already in transformers'
    form pass unchanged)."""
    if name in ("head.weight", "lm_head.weight"):
        return "lm_head.weight"
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    name = name if name.startswith("model.") else "model." + name
    for pattern, repl in V4_RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def checkpoint_targets(name: str, cfg: ModelConfig) -> list[Target] | None:
    """Map a checkpoint tensor name to its model targets; None when the name belongs to no parameter."""
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's (and MiniMax-M2's) module name on disk
    if name.endswith(".mlp.e_score_correction_bias"):  # MiniMax-M2 keeps it beside the gate
        name = name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
    if cfg.family == "deepseek_v4":
        name = v4_model_name(name)
    elif cfg.family == "llama4":
        name = name.removeprefix("language_model.")
    elif cfg.family == "qwen3_5_moe" and name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    for theirs, ours in RENAMES.get(cfg.family, ()):
        name = name.replace(theirs, ours)
    I = cfg.moe_intermediate_size
    if m := _EXPERT.match(name):
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        if e >= cfg.num_experts:
            return None
        if kind in ("gate_proj", "w1"):
            return [Target(f"{prefix}.mlp.experts.w13", e, (0, I))]
        if kind in ("up_proj", "w3"):
            return [Target(f"{prefix}.mlp.experts.w13", e, (I, 2 * I))]
        return [Target(f"{prefix}.mlp.experts.w2", e)]
    if m := _FUSED.match(name):
        gate_up, bias = m.group(2) == "gate_up_proj", m.group(3) is not None
        param = f"{m.group(1)}.mlp.experts.{('b' if bias else 'w') + ('13' if gate_up else '2')}"
        if cfg.family == "llama4":  # transposed, gate then up
            return [Target(param, layout="T")]
        if cfg.family != "gpt_oss":  # transformers 5's in-memory layout: (E, 2I, D) gate then up, (E, D, I)
            return [Target(param)]
        return [Target(param, layout=("i" if gate_up else "") if bias else ("iT" if gate_up else "T"))]
    return [Target(name)]


def apply_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A checkpoint tensor rearranged into the model's form (see Target.layout)."""
    if "T" in layout:
        t = t.transpose(-1, -2)
    if "i" in layout:
        dim = -2 if "T" in layout else -1
        order = torch.cat((torch.arange(0, t.shape[dim], 2), torch.arange(1, t.shape[dim], 2)))
        t = t.index_select(dim, order.to(t.device))
    return t


def target_shape(t: Target, param_shape: torch.Size) -> tuple[int, ...]:
    """The shape the checkpoint tensor must have to fill target t of a parameter of param_shape."""
    shape = tuple(param_shape)
    if t.expert is not None:
        shape = shape[1:]
    if t.rows is not None:
        shape = (t.rows[1] - t.rows[0],) + shape[1:]
    if "T" in t.layout:
        shape = (*shape[:-2], shape[-1], shape[-2])
    return shape


def is_mtp_tensor(name: str, cfg: ModelConfig) -> bool:
    """Whether a checkpoint tensor belongs to a multi-token-prediction layer (layer index in
    [num_layers, num_layers + num_mtp_layers)), which the target model does not use (models/mtp.py
    loads the first as speculative method mtp's drafter)."""
    if cfg.family == "deepseek_v4":  # (its MTP layers are mtp.N.*)
        return name.startswith(("mtp.", "model.mtp."))
    m = LAYER.match(name)
    return m is not None and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.num_mtp_layers


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def expert_checkpoint_names(family: str) -> tuple[str, tuple[str, str, str]]:
    """(module, (gate, up, down)) of a family's per-expert checkpoint tensors, as in
    `model.layers.{i}.{module}.experts.{e}.{gate}.weight`."""
    if family in ("mixtral", "minimax_m2"):
        return "block_sparse_moe", ("w1", "w3", "w2")
    if family == "deepseek_v4":  # (as the model names it; training/checkpoint.py writes its released names)
        return "mlp", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def expected_names(param: str, cfg: ModelConfig) -> list[str]:
    """Checkpoint names that would fill `param` (for error messages)."""
    m = STACKED_EXPERTS.match(param)
    if not m:
        return [param]
    mod, (gate, up, down) = expert_checkpoint_names(cfg.family)
    names = (gate, up) if m.group(2) == "w13" else (down,)
    prefix = m.group(1)
    if cfg.family in FUSED_TRANSPOSED:  # fused on disk
        module = "feed_forward" if cfg.family == "llama4" else "mlp"
        return [f"{prefix}.{module}.experts.{'gate_up_proj' if m.group(2) == 'w13' else 'down_proj'}"]
    return [f"{prefix}.{mod}.experts.{e}.{n}.weight" for e in range(cfg.num_experts) for n in names]
