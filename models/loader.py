"""Load Hugging Face safetensors checkpoints into MoEForCausalLM.

Only the tensors the built model asks for are read (an attention worker skips the experts), every
tensor is checked before any is read, and each problem names the file and the tensor.
The checkpoint formats and names are models/checkpoint.py's; here the model (or an expert worker's
share) is built on the meta device, its tensors read and copied in, and quantised ones handed over.
"""
import atexit
import ctypes
import ctypes.util
import gc
import logging
from collections import defaultdict
from pathlib import Path
from typing import Iterable

import torch

from kernels.cpu_linear import gemm_is_emulated
from kernels.ops import select_ops
from models.checkpoint import (IGNORED, LAYER, STACKED_EXPERTS, CheckpointError, CheckpointReader, Target,
                               apply_layout, checkpoint_targets, expected_names, is_mtp_tensor, numel, target_shape)
from models.config import ModelConfig
from models.moe_decoder import Experts, MoEForCausalLM

log = logging.getLogger("shuttle")


def auto_dtype(checkpoint: torch.dtype, devices: Iterable[str]) -> tuple[torch.dtype, str | None]:
    """The serving dtype for `--dtype auto` and why it differs from the checkpoint's (None: it does not).

    The checkpoint's dtype, except where every device that computes (`devices`: the attention and
    expert pools') is a CPU whose GEMMs in that dtype are emulated (kernels.cpu_linear.gemm_is_emulated):
    there a bf16/fp16 checkpoint is upcast once at load and served in float32 (weights, activations
    and KV cache), since its GEMMs run about 100x faster and read only twice the bytes. A GPU, or a
    CPU with native bf16 (AVX-512 BF16/AMX), keeps the checkpoint's dtype; so does a deployment that
    mixes a GPU with a CPU (its hidden states cross between them in one dtype)."""
    devices = list(devices)
    if (checkpoint not in (torch.bfloat16, torch.float16) or not devices
            or any(torch.device(d).type != "cpu" for d in devices) or not gemm_is_emulated(checkpoint)):
        return checkpoint, None
    name = str(checkpoint).removeprefix("torch.")
    return torch.float32, (f"this CPU has no native {name} GEMMs (no AVX-512 BF16/FP16 or AMX), so --dtype auto "
                           f"serves the {name} checkpoint in float32, upcast at load (--dtype {name} keeps {name})")


def freeze_loaded_heap() -> None:
    """For a serving process once it has loaded what it keeps (model, tokenizer, web app): collect,
    then move every object left into the garbage collector's permanent generation, so that later
    full collections scan only what serving allocates. Without it a full collection walked the
    loaded heap and stopped the process for 100-180 ms (the GIL held), in the middle of a burst of
    requests (measured in a colocated `shuttle serve`: an engine step of 210 ms wall, 10 ms CPU).
    vLLM's engine core does the same after start-up. Thawed at exit, so that the interpreter's
    last collection still finalizes them (else Triton's bindings report leaked objects). Then the
    heap's free pages go back to the system (glibc's malloc_trim): the float copies that packing or
    quantising replaced were freed into the heap, where they stayed resident."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def load_model(model_dir: str | Path, cfg: ModelConfig | None = None, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", with_experts: bool = True,
               kernels: str | None = None, keep_fp8: bool = False, keep_mxfp4: bool = False) -> MoEForCausalLM:
    """Build MoEForCausalLM from a checkpoint directory, in `dtype` (default: the checkpoint's).

    kernels: "torch" or "triton" to override the device's default ops (see kernels.ops).
    keep_fp8: each FP8 weight's codes and scales as shipped also go to its module (keep_fp8_on).
    keep_mxfp4: the MXFP4 experts' blocks and scales go to their Experts as shipped instead of being
    dequantised (keep_mxfp4_on): for kernels/mxfp4_weights.py, which alone can then run them.
    """
    cfg = cfg or ModelConfig.from_pretrained(model_dir)
    dtype = dtype or cfg.dtype
    ops = select_ops(device, kernels)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg, with_experts=with_experts, ops=ops).to(dtype)
        full = dict((model if with_experts else MoEForCausalLM(cfg, with_experts=True, ops=ops)).named_parameters())
    params = dict(model.named_parameters(remove_duplicate=False))
    reader = CheckpointReader.of(model_dir, cfg)
    for weight, f in reader.scales.items():
        if weight not in reader.files:
            raise CheckpointError(f"{f}: unexpected tensor '{reader.scale_names[weight]}' (no FP8 weight '{weight}')")
    wanted: dict[str, list[Target]] = {}
    covered: dict[str, int] = defaultdict(int)  # param -> number of elements assigned
    mtp = []
    for name, f in reader.files.items():
        targets = checkpoint_targets(name, cfg)
        if (IGNORED.search(name) and cfg.family != "deepseek_v4") or (cfg.tie_word_embeddings
                                                                         and name == "lm_head.weight"):
            continue
        if is_mtp_tensor(name, cfg):
            mtp.append(name)
            continue
        if ".shared_expert" in name and not cfg.shared_expert_intermediate_size and reader.is_empty(name):
            continue  # n_shared_experts=0: transformers' zero-width shared MLP adds nothing
        if targets is None or any(t.param not in full for t in targets):
            raise CheckpointError(f"{f}: unexpected tensor '{name}' (no such parameter in {cfg.architecture} "
                                  f"with this config.json)")
        targets = [t for t in targets if t.param in params]  # skipped: parts this model was built without
        if targets:
            wanted[name] = targets
            for t in targets:
                covered[t.param] += numel(target_shape(t, params[t.param].shape))
    for pname, p in params.items():
        if pname == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if covered[pname] > p.numel():
            raise CheckpointError(f"{reader.dir}: parameter {pname} is filled by more than one tensor "
                                  f"(both per-expert and fused expert tensors?)")
        if covered[pname] < p.numel():
            expected = expected_names(pname, cfg)
            missing = [n for n in expected if n not in reader.files]
            raise CheckpointError(f"{reader.dir}: missing tensor '{missing[0] if missing else pname}' "
                                  f"for parameter {pname}" + (f" ({len(missing)} missing)" if len(missing) > 1 else ""))
    if mtp:
        log.info("%s: skipped %d tensors of %d multi-token-prediction layer(s) (num_nextn_predict_layers; used "
                 "only as speculative method mtp's drafter, models/mtp.py)", reader.dir, len(mtp), cfg.num_mtp_layers)
    model_shape = {t: target_shape(t, params[t.param].shape) for ts in wanted.values() for t in ts}
    kept, mx = {} if keep_fp8 else None, {} if keep_mxfp4 else None
    unfilled, codes_only = served_from_codes(wanted, reader, cfg, keep_fp8, keep_mxfp4)
    tensors = reader.read(wanted, model_shape, kept, mx, codes_only)
    to_empty_but(model.get_submodule, [model], unfilled, device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    fill_params(params, {n: ts for n, ts in wanted.items() if n in tensors}, tensors)
    if kept is not None:
        keep_fp8_on(model.get_submodule, wanted, kept, cfg.fp8_block)
    if mx:
        keep_mxfp4_on(model.get_submodule, wanted, mx)
    offset_norms(model, cfg.norm_offset)
    return model.eval()


def fill_params(params: dict[str, torch.Tensor], wanted: dict[str, list[Target]],
                tensors: dict[str, torch.Tensor]) -> None:
    """Copy each read checkpoint tensor into its targets: a parameter, one expert's slice of it, or a
    range of its rows, rearranged by the target's layout."""
    with torch.no_grad():
        for name, targets in wanted.items():
            for t in targets:
                dst = params[t.param]
                if t.expert is not None:
                    dst = dst[t.expert]
                if t.rows is not None:
                    dst = dst[t.rows[0]:t.rows[1]]
                dst.copy_(apply_layout(tensors[name], t.layout))


def offset_norms(model: torch.nn.Module, offset: float) -> None:
    """Add `offset` to every RMSNorm's weight: Qwen3-Next's norms scale by 1 + weight and its
    checkpoints store weight (ModelConfig.norm_offset); training/checkpoint.py takes it off again."""
    if offset:
        from models.norm import RMSNorm

        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, RMSNorm):
                    m.weight.add_(offset)


def keep_fp8_on(module_of, wanted: dict[str, list[Target]], kept: dict[str, tuple[torch.Tensor, torch.Tensor]],
                block: tuple[int, int]) -> None:
    """Hand FP8 codes and scales as shipped (CheckpointReader.read with kept) to the modules that hold
    their weights (module_of: a module's name -> the module): a Linear's `fp8_checkpoint` =
    (codes (O, I), scale_inv, block); per-expert tensors go to their Experts' `fp8_checkpoint`, a dict
    {("w1" | "w3" | "w2", local expert): (codes, scale_inv)} plus "block". Fused expert tensors are
    left out (they are served dequantised). Experts none of whose tensors the checkpoint stores in FP8
    (its modules_to_not_convert) get `unquantised_in_checkpoint` = True: served as shipped, unquantised
    (models/cpu_inference.PackedExperts, models/triton_quant.quantized_experts)."""
    expert_owners = {t.param.rpartition(".")[0] for ts in wanted.values() for t in ts if STACKED_EXPERTS.match(t.param)}
    fp8_owners = {t.param.rpartition(".")[0] for name in kept for t in wanted[name] if STACKED_EXPERTS.match(t.param)}
    for owner in expert_owners - fp8_owners:
        module_of(owner).unquantised_in_checkpoint = True
    for name, (codes, scale) in kept.items():
        for t in wanted[name]:
            owner, _, leaf = t.param.rpartition(".")
            if STACKED_EXPERTS.match(t.param) and t.expert is not None and not t.layout:
                kind = "w2" if leaf == "w2" else "w1" if t.rows[0] == 0 else "w3"
                d = module_of(owner).__dict__.setdefault("fp8_checkpoint", {"block": block})
                d[(kind, t.expert)] = (codes, scale)
            elif leaf == "weight" and t.expert is None and t.rows is None and not t.layout:
                module_of(owner).fp8_checkpoint = (codes, scale, block)


def keep_mxfp4_on(module_of, wanted: dict[str, list[Target]], kept: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  experts_of=None) -> None:
    """Hand MXFP4 blocks and scales as shipped (CheckpointReader.read with mxfp4_kept) to the Experts that
    hold their weights (module_of: a module's name -> the module): its `mxfp4_checkpoint` {"w13" | "w2":
    (blocks (E, O, G, 16), scales (E, O, G))}, rows in the parameter's order (gpt-oss's interleaved
    gate/up rows split into gate then up, as the layout "i" splits them), the experts experts_of(owner)
    lists (an expert worker's share; None: all). The parameter, never filled, becomes zeros of its shape
    that hold no memory: only the kept bytes are served (kernels/mxfp4_weights.py)."""
    for name, (blocks, scales) in kept.items():
        for t in wanted[name]:
            owner, _, leaf = t.param.rpartition(".")
            module = module_of(owner)
            ids = None if experts_of is None else torch.tensor(experts_of(owner))
            b, s = (blocks, scales) if ids is None else (blocks.index_select(0, ids), scales.index_select(0, ids))
            if "i" in t.layout:
                order = torch.cat((torch.arange(0, b.shape[1], 2), torch.arange(1, b.shape[1], 2)))
                b, s = b.index_select(1, order), s.index_select(1, order)
            module.__dict__.setdefault("mxfp4_checkpoint", {})[leaf] = (b, s)
            p = getattr(module, leaf)
            setattr(module, leaf, torch.nn.Parameter(torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape),
                                                     requires_grad=False))


def load_experts(model_dir: str | Path, expert_ids: list[int] | dict[int, list[int]], cfg: ModelConfig | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                 kernels: str | None = None, keep_fp8: bool = False, keep_mxfp4: bool = False) -> dict[int, Experts]:
    """An expert worker's share: for every MoE layer, an Experts module holding the global experts
    `expert_ids` in that order (local index i is expert expert_ids[i]); a dict {layer: ids} gives
    each listed MoE layer its own experts (other layers are not loaded). Reads only their tensors
    (a fused checkpoint tensor is read whole, then sliced). Returns {layer: Experts}. keep_fp8: their
    FP8 codes and scales as shipped also go to each Experts (keep_fp8_on); keep_mxfp4: their MXFP4
    blocks and scales as shipped instead of dequantised ones (keep_mxfp4_on)."""
    cfg = cfg or ModelConfig.from_pretrained(model_dir)
    dtype, ops = dtype or cfg.dtype, select_ops(device, kernels)
    moe = [i for i, is_moe in enumerate(cfg.moe_layers) if is_moe]
    by_layer = dict(expert_ids) if isinstance(expert_ids, dict) else {i: list(expert_ids) for i in moe}
    for layer, ids in by_layer.items():
        if layer not in moe:
            raise ValueError(f"layer {layer} is not a MoE layer (MoE layers: {moe})")
        if not ids or len(set(ids)) != len(ids) or not all(0 <= e < cfg.num_experts for e in ids):
            raise ValueError(f"layer {layer}: expert ids {ids} must be distinct and in [0, {cfg.num_experts})")
    local = {layer: {e: i for i, e in enumerate(ids)} for layer, ids in by_layer.items()}
    with torch.device("meta"):
        experts = {i: Experts.of(cfg, len(ids), ops).to(dtype) for i, ids in by_layer.items()}
    params = _expert_params(experts)
    full_shape = {n: (cfg.num_experts,) + tuple(p.shape[1:]) for n, p in params.items()}
    reader = CheckpointReader.of(model_dir, cfg)
    wanted: dict[str, list[Target]] = {}
    model_shape: dict[Target, tuple[int, ...]] = {}
    covered: dict[str, int] = defaultdict(int)
    for name in reader.files:
        for t in checkpoint_targets(name, cfg) or []:
            if t.param not in params:
                continue
            mine = local[int(LAYER.match(t.param).group(1))]
            if t.expert is not None and t.expert not in mine:
                continue
            t = Target(t.param, None if t.expert is None else mine[t.expert], t.rows, t.layout)
            wanted.setdefault(name, []).append(t)
            model_shape[t] = target_shape(t, full_shape[t.param] if t.expert is None else params[t.param].shape)
            covered[t.param] += params[t.param].numel() if t.expert is None else numel(model_shape[t])
    for pname, p in params.items():
        if covered[pname] != p.numel():
            missing = [n for n in expected_names(pname, cfg) if n not in reader.files]
            raise CheckpointError(f"{reader.dir}: missing tensor '{missing[0] if missing else pname}' for "
                                  f"parameter {pname} (experts {by_layer[int(LAYER.match(pname).group(1))]})")
    kept, mx = {} if keep_fp8 else None, {} if keep_mxfp4 else None
    unfilled, codes_only = served_from_codes(wanted, reader, cfg, keep_fp8, keep_mxfp4)
    tensors = reader.read(wanted, model_shape, kept, mx, codes_only)
    to_empty_but(lambda owner: experts[int(LAYER.match(owner + ".").group(1))], experts.values(), unfilled, device)
    params = _expert_params(experts)
    with torch.no_grad():
        for name, targets in wanted.items():
            for t in targets if name in tensors else ():
                dst = params[t.param]
                src = apply_layout(tensors[name], t.layout)
                if t.expert is not None:
                    dst = dst[t.expert]
                else:  # a fused tensor of every expert: this layer's experts, in order
                    src = src.index_select(0, torch.tensor(by_layer[int(LAYER.match(t.param).group(1))]))
                if t.rows is not None:
                    dst = dst[t.rows[0]:t.rows[1]]
                dst.copy_(src)
    if kept is not None:
        keep_fp8_on(lambda owner: experts[int(LAYER.match(owner + ".").group(1))], wanted, kept, cfg.fp8_block)
    if mx:
        layer_of = lambda owner: int(LAYER.match(owner + ".").group(1))  # noqa: E731
        keep_mxfp4_on(lambda owner: experts[layer_of(owner)], wanted, mx, lambda owner: by_layer[layer_of(owner)])
    return {i: m.eval() for i, m in experts.items()}


def served_from_codes(wanted: dict[str, list[Target]], reader: "CheckpointReader", cfg: ModelConfig, keep_fp8: bool,
                      keep_mxfp4: bool) -> tuple[set[str], set[str]]:
    """(params, names): the stacked expert parameters that the quantised kernels serve from the codes
    kept as shipped alone, so that they are never filled (nor given memory: to_empty_but), and the
    FP8 tensors read as codes only (CheckpointReader.read's codes_only). keep_fp8: parameters filled
    only by per-expert FP8 tensors, of SiLU experts without biases (the CPU's fused FP8 block and
    Triton's take every expert's codes; models/cpu_inference._fp8_experts); keep_mxfp4: those filled
    by MXFP4 tensors (keep_mxfp4_on)."""
    fp8_ok = keep_fp8 and cfg.expert_act.is_silu and not cfg.expert_bias
    by_param: dict[str, list[tuple[str, Target]]] = defaultdict(list)
    for name, targets in wanted.items():
        for t in targets:
            if STACKED_EXPERTS.match(t.param):
                by_param[t.param].append((name, t))
    fp8 = reader.fp8_names([n for filled in by_param.values() for n, _ in filled]) if fp8_ok else set()
    params, names = set(), set()
    for pname, filled in by_param.items():
        if keep_mxfp4 and all(n in reader.mxfp4 for n, _ in filled):
            params.add(pname)
        elif fp8_ok and all(t.expert is not None and not t.layout and n in fp8 for n, t in filled):
            params.add(pname)
            names.update(n for n, _ in filled)
    return params, names


def to_empty_but(module_of, roots, unfilled: set[str], device: torch.device | str) -> None:
    """to_empty each of roots on `device`, except the parameters named in unfilled (module_of: a module's
    name -> the module), which become zeros of their shape that hold no memory (a zero-stride view)."""
    held = []
    for pname in unfilled:
        owner, _, leaf = pname.rpartition(".")
        module = module_of(owner)
        held.append((module, leaf, module._parameters.pop(leaf)))
    for root in roots:
        root.to_empty(device=device)
    for module, leaf, p in held:
        module.register_parameter(leaf, torch.nn.Parameter(
            torch.zeros((), dtype=p.dtype, device=device).expand(p.shape), requires_grad=False))


def _expert_params(experts: dict[int, Experts]) -> dict[str, torch.nn.Parameter]:
    return {f"model.layers.{i}.mlp.experts.{n}": p for i, m in experts.items() for n, p in m.named_parameters()}
