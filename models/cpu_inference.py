"""Prepare a loaded model for CPU inference: every linear layer and every expert gets its weights
pre-packed for oneDNN (kernels/cpu_linear.py), and the unpacked copies are released.

Modules are swapped once, after loading (the choice is made then, never inside forward); the one
hook in the model's code is Attention.qkv_proj, the fused q/k/v GEMM (fuse_qkv). Training and the
GPU path never call this.
"""
import torch
from torch import nn

from kernels import choice, native
from kernels.cpu_linear import (SKINNY_MAX_ROWS, CpuWeight, ExpertPanels, PackedLinear, compile_packed,  # noqa: F401 (re-exported)
                                packing_available)
from kernels.fp8_weights import Fp8ExpertPanels, Fp8Experts, Fp8Weight, fused_moe_fp8
from kernels.int8 import Int8Experts, Int8ExpertPanels, Int8Weight, fused_moe_int8, quantize_int8
from kernels.mxfp4_weights import Mxfp4Experts, Mxfp4Weight, fused_moe_mxfp4
from kernels.moe import SILU, SwiGLU, fused_moe_packed
from kernels.quant import FP8_BLOCK
from models.moe_decoder import Attention, DecoderLayer, Experts, MoEForCausalLM, Router, SparseMoE
from models.norm import RMSNorm


def fused_native_experts(experts: Experts) -> bool:
    """Whether these experts run as one native call per layer (kernels/native.fused_moe_bf16): bf16
    SiLU experts (clamped or not: DeepSeek-V4) without biases, an even hidden size, on a CPU with
    AVX-512 BF16."""
    return (experts.w13.dtype == torch.bfloat16 and experts.act.is_clamped_silu and experts.b13 is None
            and experts.w13.shape[2] % 2 == 0 and native.avx512_bf16())


def fused_int8_experts(experts: Experts) -> bool:
    """Whether int8 experts run as one call per layer (kernels/int8.fused_moe_int8; its torch
    reference where the native library cannot run): SiLU experts without biases."""
    return experts.act.is_silu and experts.b13 is None and experts.b2 is None


class PackedExperts(nn.Module):
    """Experts with per-expert w13 (2I, D) and w2 (D, I), their biases (if any) and activation. Each
    weight is a CpuWeight (packed for oneDNN, plus a bf16 copy for few rows where it applies) that
    kernels.moe.fused_moe_packed runs, or, where fused_native_experts says so, an ExpertPanels that
    the whole block's native kernel runs (then the oneDNN copies are never made). quantization="int8":
    each weight as int8 codes and per-channel scales, whatever the dtype and CPU: Int8ExpertPanels
    that kernels/int8.fused_moe_int8 runs as one block where fused_int8_experts says so, else
    CpuWeight.quantized for fused_moe_packed (biases, other activations). quantization="fp8": FP8
    codes with 128 x 128 block scales (kernels/fp8_weights.py), the checkpoint's own where the loader
    kept them (keep_fp8), else quantised from the float weights, except experts an FP8 checkpoint stores
    unquantised (Experts.unquantised_in_checkpoint: served as without quantization); Fp8ExpertPanels run by
    fused_moe_fp8 for SiLU experts without biases, else CpuWeight.quantized(Fp8Weight).
    quantization="mxfp4": MXFP4 codes and E8M0 scales (kernels/mxfp4_weights.py), the checkpoint's
    blocks as shipped where the loader kept them (keep_mxfp4), else quantised from the float weights;
    CpuWeight.quantized(Mxfp4Weight) per expert, run as one block by fused_moe_mxfp4 whatever the
    activation and biases (Mxfp4Experts). quantization="w8a8_int8": int8's
    Int8ExpertPanels, run with their activations quantised per token (Int8Experts.act_int8); SiLU
    experts without biases only (the fused block), else ValueError."""

    def __init__(self, experts: Experts | None = None, quantization: str | None = None):
        super().__init__()
        if quantization == "fp8" and getattr(experts, "unquantised_in_checkpoint", False):
            quantization = None  # an FP8 checkpoint's experts that it stores unquantised: served as shipped
        self.w13_packed, self.w2_packed = [], []
        self.act_int8 = quantization == "w8a8_int8"
        if self.act_int8 and experts is not None and not fused_int8_experts(experts):
            raise ValueError("quantization w8a8_int8 runs SiLU experts without biases (the fused int8 block); "
                             f"these experts have {'biases' if experts.b13 is not None else 'another activation'}:"
                             " use int8 (weight-only) for them")
        if experts is not None and quantization == "fp8":
            self.w13_packed, self.w2_packed = _fp8_experts(experts)
        elif experts is not None and quantization == "mxfp4":
            self.w13_packed, self.w2_packed = _mxfp4_experts(experts)
        elif experts is not None and quantization in ("int8", "w8a8_int8") and fused_int8_experts(experts):
            inter = experts.w2.shape[2]
            self.w13_packed = [Int8ExpertPanels(w, True, inter) for w in experts.w13.detach()]
            self.w2_packed = [Int8ExpertPanels(w, False, inter) for w in experts.w2.detach()]
        elif experts is not None and quantization is not None:
            self.w13_packed = [CpuWeight.quantized(quantize_int8(w)) for w in experts.w13.detach()]
            self.w2_packed = [CpuWeight.quantized(quantize_int8(w)) for w in experts.w2.detach()]
        elif experts is not None and fused_native_experts(experts):
            inter = experts.w2.shape[2]
            self.w13_packed = [ExpertPanels(w, True, inter) for w in experts.w13.detach()]
            self.w2_packed = [ExpertPanels(w, False, inter) for w in experts.w2.detach()]
        elif experts is not None:
            self.w13_packed = [CpuWeight(w) for w in experts.w13.detach()]
            self.w2_packed = [CpuWeight(w) for w in experts.w2.detach()]
        self.b13 = None if experts is None or experts.b13 is None else experts.b13.detach()
        self.b2 = None if experts is None or experts.b2 is None else experts.b2.detach()
        self.act = SILU if experts is None else experts.act
        self._index_native()

    def _index_native(self) -> None:
        """The data pointers the native kernel takes (its weights stay owned by the lists); int8: the
        fused int8 block's table (Int8Experts)."""
        self.native = self.int8 = self.fp8 = self.mxfp4 = None
        if self.w13_packed and isinstance(getattr(self.w13_packed[0], "int8", None), Mxfp4Weight):
            self.mxfp4 = Mxfp4Experts([w.int8 for w in self.w13_packed], [w.int8 for w in self.w2_packed], self.b13,
                                      self.b2, self.act)
        elif self.w13_packed and isinstance(self.w13_packed[0], Fp8ExpertPanels):
            self.fp8 = Fp8Experts(self.w13_packed, self.w2_packed)
        elif self.w13_packed and isinstance(self.w13_packed[0], Int8ExpertPanels):
            self.int8 = Int8Experts(self.w13_packed, self.w2_packed, self.act_int8)
        elif self.w13_packed and isinstance(self.w13_packed[0], ExpertPanels):
            self.native = (torch.tensor([w.panels.data_ptr() for w in self.w13_packed], dtype=torch.int64),
                           torch.tensor([w.panels.data_ptr() for w in self.w2_packed], dtype=torch.int64),
                           self.w13_packed[0].inter_padded)

    @classmethod
    def from_packed(cls, w13_packed: list, w2_packed: list, b13_EI2: torch.Tensor | None = None,
                    b2_ED: torch.Tensor | None = None, act: SwiGLU = SILU, act_int8: bool = False) -> "PackedExperts":
        """Experts made of already packed per-expert weights (shared, not copied), with their biases
        (rows in the same order) and activation; act_int8: w8a8 int8 panels."""
        out = cls()
        out.w13_packed, out.w2_packed, out.act_int8 = list(w13_packed), list(w2_packed), act_int8
        out.b13, out.b2, out.act = b13_EI2, b2_ED, act
        out._index_native()
        return out

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return native.fused_moe_bf16(x_TD, topk_ids_TK, topk_weights_TK, *self.native, self.act.limit)
        if self.int8 is not None:
            return fused_moe_int8(x_TD, topk_ids_TK, topk_weights_TK, self.int8)
        if self.fp8 is not None:
            return fused_moe_fp8(x_TD, topk_ids_TK, topk_weights_TK, self.fp8)
        if self.mxfp4 is not None:
            return fused_moe_mxfp4(x_TD, topk_ids_TK, topk_weights_TK, self.mxfp4)
        return fused_moe_packed(x_TD, self.w13_packed, self.w2_packed, topk_weights_TK, topk_ids_TK,
                                b13_EI2=self.b13, b2_ED=self.b2, act=self.act)


def _fp8_experts(experts: Experts) -> tuple[list, list]:
    """(w13, w2) per expert as FP8 (PackedExperts' quantization "fp8"): the codes the loader kept
    (Experts.fp8_checkpoint) where it kept every one, else quantised in FP8_BLOCK blocks."""
    kept, inter, E = getattr(experts, "fp8_checkpoint", None), experts.w2.shape[2], experts.w13.shape[0]
    if not fused_int8_experts(experts):  # biases or another activation: per-expert linears
        w13 = [Fp8Weight.quantize(w, FP8_BLOCK) for w in experts.w13.detach()]
        w2 = [Fp8Weight.quantize(w, FP8_BLOCK) for w in experts.w2.detach()]
        return [CpuWeight.quantized(w) for w in w13], [CpuWeight.quantized(w) for w in w2]
    if kept is not None and all((k, e) in kept for k in ("w1", "w3", "w2") for e in range(E)):
        b = kept["block"]
        return ([Fp8ExpertPanels.gate_up(*kept["w1", e], *kept["w3", e], b) for e in range(E)],
                [Fp8ExpertPanels.down(*kept["w2", e], b) for e in range(E)])
    return ([Fp8ExpertPanels.quantize(w, True, inter, FP8_BLOCK) for w in experts.w13.detach()],
            [Fp8ExpertPanels.quantize(w, False, inter, FP8_BLOCK) for w in experts.w2.detach()])


def _mxfp4_experts(experts: Experts) -> tuple[list, list]:
    """(w13, w2) per expert as CpuWeight.quantized(Mxfp4Weight) (PackedExperts' quantization "mxfp4"):
    the blocks and scales the loader kept as shipped (Experts.mxfp4_checkpoint: {"w13": (blocks
    (E, 2I, G, 16), scales (E, 2I, G)) with w13's rows, "w2": likewise (E, D, G', 16), (E, D, G')}),
    else quantised from the float weights (ValueError naming the shape where an input count is not a
    multiple of 32)."""
    kept = getattr(experts, "mxfp4_checkpoint", None)
    out = []
    for key in ("w13", "w2"):
        if kept is not None and key in kept:
            blocks, scales = kept[key]
            ws = [Mxfp4Weight.from_checkpoint(b, s) for b, s in zip(blocks, scales)]
        else:
            ws = [Mxfp4Weight.quantize(w) for w in getattr(experts, key).detach()]
        out.append([CpuWeight.quantized(w) for w in ws])
    return out[0], out[1]


def quantized_linear_weight(w_OI: torch.Tensor, quantization: str) -> CpuWeight:
    """A float linear weight quantised at load (quantize_linears): "int8" per-output-channel codes
    (kernels/int8.quantize_int8), "fp8" FP8 E4M3 in FP8_BLOCK blocks (kernels/fp8_weights.Fp8Weight)."""
    if quantization == "int8":
        return CpuWeight.quantized(quantize_int8(w_OI.detach()))
    if quantization == "fp8":
        return CpuWeight.quantized(Fp8Weight.quantize(w_OI.detach(), FP8_BLOCK))
    raise ValueError(f"quantize_linears takes quantization int8 or fp8 (attention_nodes.config.LINEAR_QUANTIZATIONS), "
                     f"got {quantization!r}")


def _packed_linear(linear: nn.Linear, quantization: str | None, quantize: bool = False) -> PackedLinear:
    """PackedLinear of `linear`; with quantization "fp8", an FP8 weight the loader kept as shipped
    (fp8_checkpoint) stays FP8 (kernels/fp8_weights.Fp8Weight); quantize: a float weight is quantised
    in `quantization` (quantized_linear_weight)."""
    kept = getattr(linear, "fp8_checkpoint", None)
    if quantization == "fp8" and kept is not None:
        return PackedLinear(linear, CpuWeight.quantized(Fp8Weight.from_checkpoint(*kept)))
    return PackedLinear(linear, quantized_linear_weight(linear.weight, quantization) if quantize else None)


def pack_for_cpu_inference(model: MoEForCausalLM, quantization: str | None = None,
                           quantize_linears: bool = False) -> bool:
    """Swap linears and experts for packed ones in place; quantization="int8": the experts' weights
    as int8 (PackedExperts; "w8a8_int8" their activations too); "fp8": the experts as FP8, and the
    linears the loader kept FP8 as shipped (keep_fp8) too; "mxfp4": the experts as MXFP4.
    quantize_linears (quantization int8 or fp8): every other linear layer quantised in the same format
    too (attention projections, dense and shared-expert MLPs), but the LM head and the routers.
    Returns False where the weights are not on the CPU or oneDNN cannot pack their dtype here (see
    packing_available): then only the experts are swapped, and only if quantised, and the linears if
    quantize_linears."""
    w = model.lm_head.weight
    if w.device.type != "cpu":
        return False
    if not packing_available(w.dtype):
        if quantization is not None:
            for parent in list(model.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, Experts):
                        setattr(parent, name, PackedExperts(child, quantization))
                    elif quantize_linears and isinstance(child, nn.Linear) and child is not model.lm_head:
                        setattr(parent, name, _packed_linear(child, quantization, quantize=True))
        choose_kernels(model)  # what needs no packing: int8 experts, attention, norms, routing
        return False
    pack_modules(model, quantization, keep=model.lm_head if model.cfg.tie_word_embeddings else None,
                 quantize_linears=quantize_linears)
    return True


def pack_modules(root: nn.Module, quantization: str | None = None, keep: nn.Module | None = None,
                 quantize_linears: bool = False) -> None:
    """pack_for_cpu_inference's swaps on any module tree whose weights oneDNN can pack (a model, or
    the MTP layer beside one: models/mtp.py): q/k/v fused, routers' CPU weights, experts and linears
    (but `keep`, a tied LM head) packed, the kernels chosen and the expert GEMMs compiled;
    quantize_linears: the linears quantised in `quantization` (all but the root's lm_head)."""
    head = getattr(root, "lm_head", None)
    for attn in [m for m in root.modules() if isinstance(m, Attention)]:
        fuse_qkv(attn, quantization, quantize_linears)
    for router in [m for m in root.modules() if isinstance(m, Router)]:
        w = router.weight.detach()
        router.cpu_weight = CpuWeight(w.float() if router.logits_fp32 else w)
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Experts):
                setattr(parent, name, PackedExperts(child, quantization))
            elif isinstance(child, nn.Linear) and child is not keep:
                setattr(parent, name, _packed_linear(child, quantization, quantize_linears and child is not head))
    choose_kernels(root)
    compile_expert_gemms(root)


def compile_expert_gemms(module: nn.Module) -> int:
    """Compile the oneDNN GEMMs of every expert weight shape in `module` at every row count now
    (kernels/cpu_linear.compile_packed; experts packed for oneDNN only: float32, or bf16 without our
    panels). An expert's rows are whatever its share of a step is, so under serving load the counts
    keep arriving for a long time (a resumed batch's re-prefill reaches new ones); compiled at start,
    the worker's RSS stays flat. About 0.5 ms a GEMM to compile, 96 a shape pair. Returns the GEMMs run."""
    done, run = set(), 0
    for m in module.modules():
        if not isinstance(m, PackedExperts) or not m.w13_packed or not isinstance(m.w13_packed[0], CpuWeight):
            continue
        for ws, bias in ((m.w13_packed, m.b13), (m.w2_packed, m.b2)):
            w = ws[0]
            key = (None if w.packed is None else tuple(w.packed.shape), w.packed is not None and w.packed.dtype,
                   bias is not None)
            if w.packed is not None and key not in done:
                done.add(key)
                run += compile_packed(w, None if bias is None else bias[0])
    return run


def choose_kernels(module: nn.Module) -> None:
    """Time the CPU kernels' candidates on the weight shapes of a packed module (a model, or an expert
    worker's blocks), and on a model's attention, norm and routing shapes, and install the fastest per
    op and row count for the process (kernels/choice.py; cached on disk, so a process pays the timing
    once per machine and shapes)."""
    gemm, moe, skinny, mxfp4 = set(), set(), set(), set()
    blocks = {"int8_moe": set(), "fp8_moe": set()}  # the quantised blocks' shapes, by codes
    linears = {"int8_moe": set(), "fp8_moe": set()}  # (quantize_linears: int8_linear / fp8_linear)
    for m in module.modules():
        if isinstance(m, PackedExperts) and (m.int8 is not None or m.fp8 is not None):
            block = m.int8 or m.fp8
            blocks["int8_moe" if m.int8 is not None else "fp8_moe"].add((block.hidden, block.inter))
            continue
        if isinstance(m, PackedExperts) and m.native is not None:
            moe.add((m.w2_packed[0].out_features, m.w2_packed[0].in_features))
            continue
        for w in cpu_weights(m):
            if isinstance(w.int8, Mxfp4Weight):
                mxfp4.add((w.out_features, w.int8.in_features))
            elif isinstance(w.int8, (Int8Weight, Fp8Weight)):
                linears["int8_moe" if isinstance(w.int8, Int8Weight) else "fp8_moe"].add(
                    (w.int8.in_features, max(1, w.out_features // 2)))
            elif w.panels is not None:
                gemm.add((w.out_features, w.panels.shape[1] * 2))
            elif w.half is not None:
                skinny.add(tuple(w.half.shape))
    for op, shapes in linears.items():  # an attention worker's quantised linears: the block's choice on their shape
        if shapes and not blocks[op]:
            blocks[op].add(max(shapes, key=lambda s: s[0] * s[1]))
    for op, shapes in (("gemm", gemm), ("moe", moe), ("skinny", skinny), *blocks.items(), ("mxfp4", mxfp4),
                       *step_op_shapes(module).items()):
        if shapes:
            choice.configure(op, sorted(shapes))


def step_op_shapes(module: nn.Module) -> dict[str, set]:
    """The shapes (kernels/choice.py) of the ops with a native kernel and a torch path that a model's
    decode layers run in bf16 or float32: per-head attention, every RMSNorm, softmax routing without
    groups or a correction bias (the others have no native kernel)."""
    out = {op: set() for op in native.NATIVE_OR_TORCH}
    for layer in (m for m in module.modules() if isinstance(m, DecoderLayer)):
        dtype = layer.input_layernorm.weight.dtype
        if dtype in (torch.bfloat16, torch.float32):
            out["rmsnorm"] |= {(m.weight.shape[0], dtype.itemsize) for m in layer.modules() if isinstance(m, RMSNorm)}
            if isinstance(layer.self_attn, Attention):
                c = layer.self_attn.cfg
                out["attention"].add((c.num_heads, c.num_kv_heads, c.head_dim, dtype.itemsize))
            if isinstance(layer.mlp, SparseMoE) and (r := layer.mlp.cfg.router).scoring == "softmax" \
                    and r.num_groups == 1 and not r.correction_bias:
                out["routing"].add((layer.mlp.cfg.num_experts, r.top_k, 4 if r.logits_fp32 else dtype.itemsize))
    return out


def decode_is_native(model: MoEForCausalLM) -> bool:
    """Whether a packed model's decode step does its heavy work in the native kernels alone: every
    packed linear on our bf16 panels or int8 / FP8 codes (quantize_linears), every router on bf16
    panels, every expert block a fused native one (bf16, int8, FP8 or MXFP4), attention the native
    paged kernel (MLA's latent attention is torch's). Then torch runs only small ops beside them
    (kernels.native.native_parallel_only). The LM head is left out: the runner widens it."""
    if not native.available() or model.cfg.mla is not None:
        return False
    for m in model.modules():
        if (isinstance(m, PackedLinear) and m.weight.panels is None and m is not model.lm_head
                and not isinstance(m.weight.int8, (Int8Weight, Fp8Weight))):
            return False
        if (isinstance(m, PackedExperts) and m.w13_packed and m.native is None and m.int8 is None and m.fp8 is None
                and m.mxfp4 is None):
            return False
        if isinstance(m, Router) and getattr(m, "cpu_weight", None) is not None and m.cpu_weight.panels is None:
            return False  # a float32 router (logits_fp32: GLM, DeepSeek) runs oneDNN's GEMM, torch's threads
    return True


def fuse_qkv(attn: Attention, quantization: str | None = None, quantize_linears: bool = False) -> None:
    """Replace q_proj, k_proj and v_proj by one packed GEMM of their stacked weights (Q + 2C, D):
    one oneDNN call instead of three, and a larger one, which streams its weights closer to the
    memory's rate at decode sizes (the k/v matrices alone are 256 KB-1 MB). quantization "fp8" with
    all three kept FP8 as shipped: their codes stacked (each a whole number of 16-row panels), else
    the float weights, quantised in `quantization` with quantize_linears."""
    projs = [attn.q_proj, attn.k_proj, attn.v_proj]
    kept = [getattr(p, "fp8_checkpoint", None) for p in projs]
    weight = None  # the fused weight's, where not the float weights packed
    if quantization == "fp8" and all(k is not None for k in kept):
        try:
            weight = CpuWeight.quantized(Fp8Weight.stack([Fp8Weight.from_checkpoint(*k) for k in kept]))
        except ValueError:  # a projection's rows are not whole panels: its scales would straddle one
            weight = None
    fused = nn.Linear(projs[0].in_features, sum(p.out_features for p in projs), bias=projs[0].bias is not None,
                      device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in projs]), requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in projs]), requires_grad=False)
    if weight is None and quantize_linears:
        weight = quantized_linear_weight(fused.weight, quantization)
    attn.qkv_proj = PackedLinear(fused, weight)
    del attn.q_proj, attn.k_proj, attn.v_proj


def cpu_weights(m: nn.Module) -> list:
    """The weights prepared for the CPU that module `m` itself holds (CpuWeight, ExpertPanels or
    Int8ExpertPanels): a PackedLinear's, a Router's copy, every expert's of PackedExperts."""
    if isinstance(m, PackedLinear):
        return [m.weight]
    if isinstance(m, Router):
        return [] if getattr(m, "cpu_weight", None) is None else [m.cpu_weight]
    return [*m.w13_packed, *m.w2_packed] if isinstance(m, PackedExperts) else []


def half_copy_bytes(module: nn.Module) -> int:
    """Bytes of the bf16 copies that cpu_linear streams for few rows (kernels/cpu_linear.CpuWeight) in
    linears and experts."""
    return sum(w.half.numel() * 2 for m in module.modules() if not isinstance(m, Router)
               for w in cpu_weights(m) if w.half is not None)


def resident_weight_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes the weights of a model (or an expert worker's blocks) hold now, after packing or
    quantising, as {"embedding", "experts", "other"}: parameters and buffers, each once, plus the
    packed, panel, bf16-copy and int8 forms (kernels/cpu_linear.py) the CPU modules keep."""
    out, seen = {"embedding": 0, "experts": 0, "other": 0}, set()

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out[kind] += t.numel() * t.element_size()

    for name, m in module.named_modules():
        kind = ("experts" if isinstance(m, (Experts, PackedExperts)) or getattr(m, "stacked_experts", False)
                or ".experts" in f".{name}"
                else "embedding" if "embed_tokens" in name else "other")
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            add(kind, t)
        for w in cpu_weights(m):
            for t in (getattr(w, "packed", None), w.half, w.panels):
                add(kind, t)
            for q in (w.int8, getattr(w, "fp8", None)):  # int8, FP8 or MXFP4 codes and their scales
                if q is not None:
                    add(kind, q.panels)
                    add(kind, q.scales)
        for t in (getattr(m, "bias", None), getattr(m, "b13", None), getattr(m, "b2", None)):
            if isinstance(t, torch.Tensor):
                add(kind, t)
    return out
