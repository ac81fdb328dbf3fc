"""FP8 block and MXFP4 weights served as they are stored, on the Triton op table (kernels/quant_triton.py):
the GPU's counterpart of the CPU's quantised modules (models/cpu_inference.py).

`pack_for_triton` swaps, in place, under --quantization fp8 or mxfp4 with kernels "triton":
- every layer's Experts for `Fp8TritonExperts` (fused_moe_fp8) or `Mxfp4TritonExperts`
  (fused_moe_mxfp4): the codes and scales the loader kept as shipped (keep_fp8 / keep_mxfp4), else
  the float weights quantised at load (FP8 in FP8_BLOCK blocks, gate and up apart as checkpoints store
  them; MXFP4 in groups of 32 inputs);
- (fp8) every nn.Linear the loader kept FP8 for `Fp8TritonLinear` (fp8_block_linear), and with
  quantize_linears every other one too, but the LM head (the routers are not nn.Linear).
The kernels convert each K-tile of codes to the dot's dtype inside the tile loop, so no float copy of
a weight is ever formed; the float tensors the loader filled go with the swapped modules (an FP8
checkpoint's per-expert weights it never fills: models/loader.served_from_codes). Codes and scales are
buffers: resident_weight_bytes counts them."""
import torch
from torch import nn

from kernels.quant import FP8_BLOCK, TRITON_QUANTIZATIONS, quantize_fp8_blocks, quantize_mxfp4, triton_fp8_supported
from kernels.quant_triton import fp8_block_linear, fused_moe_fp8, fused_moe_mxfp4
from models.moe_decoder import Experts


class Fp8TritonLinear(nn.Module):
    """An nn.Linear whose weight is FP8 codes (O, I) with float32 scale_inv per block: y = x W^T (+ bias)
    in x's dtype, any leading shape."""

    def __init__(self, linear: nn.Linear, codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
        super().__init__()
        device = linear.weight.device
        self.in_features, self.out_features, self.block = linear.in_features, linear.out_features, tuple(block)
        self.register_buffer("codes", codes.to(device))
        self.register_buffer("scale_inv", scale_inv.to(device, torch.float32))
        self.bias = None if linear.bias is None else linear.bias.detach()

    @classmethod
    def quantize(cls, linear: nn.Linear, block: tuple[int, int] = FP8_BLOCK) -> "Fp8TritonLinear":
        return cls(linear, *quantize_fp8_blocks(linear.weight.detach(), block), block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_block_linear(x.reshape(-1, self.in_features), self.codes, self.scale_inv, self.block, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class _StackedExperts(nn.Module):
    """Experts whose buffers stack one entry per expert along dim 0 (and biases b13 / b2, act, block)."""

    stacked_experts = True  # (resident_weight_bytes counts their bytes as the experts')

    @classmethod
    def regroup(cls, parts: list[tuple["_StackedExperts", int]]) -> "_StackedExperts":
        """One module of expert `i` of each (module, i), in order (expert_nodes/placement.regroup)."""
        first, out = parts[0][0], cls.__new__(cls)
        if any(getattr(m, "block", None) != getattr(first, "block", None) for m, _ in parts):
            raise ValueError(f"cannot regroup FP8 experts of different blocks: "
                             f"{sorted({str(getattr(m, 'block', None)) for m, _ in parts})}")
        nn.Module.__init__(out)
        for name, _ in first.named_buffers(recurse=False):
            out.register_buffer(name, torch.stack([getattr(m, name)[i] for m, i in parts]))
        for attr in ("b13", "b2"):
            setattr(out, attr, None if getattr(first, attr) is None else torch.stack([getattr(m, attr)[i] for m, i in parts]))
        out.act, out.block = first.act, getattr(first, "block", None)
        return out


class Fp8TritonExperts(_StackedExperts):
    """One layer's experts as FP8 blocks: w13 codes (E, 2I, D) (gate rows, then up rows) with scales
    (E, 2 ceil(I / bo), ceil(D / bi)) (gate and up quantised apart), w2 codes (E, D, I) with scales
    (E, ceil(D / bo), ceil(I / bi)); the biases and SwiGLU of the Experts they replace."""

    def __init__(self, experts: Experts):
        super().__init__()
        kept, (E, I2, D) = getattr(experts, "fp8_checkpoint", None), experts.w13.shape
        I, device = I2 // 2, experts.w13.device
        if kept is not None and all((k, e) in kept for k in ("w1", "w3", "w2") for e in range(E)):
            self.block = tuple(kept["block"])
            w1, w3, w2 = ([kept[k, e] for e in range(E)] for k in ("w1", "w3", "w2"))
        else:  # a float checkpoint (or an FP8 one's fused expert tensors, dequantised on read): quantised here
            self.block = FP8_BLOCK
            w = experts.w13.detach()
            w1 = [quantize_fp8_blocks(w[e, :I], self.block) for e in range(E)]
            w3 = [quantize_fp8_blocks(w[e, I:], self.block) for e in range(E)]
            w2 = [quantize_fp8_blocks(m, self.block) for m in experts.w2.detach()]
        stack = lambda parts, i: torch.stack([p[i] for p in parts]).to(device)  # noqa: E731
        self.register_buffer("w13", torch.cat((stack(w1, 0), stack(w3, 0)), dim=1))
        self.register_buffer("s13", torch.cat((stack(w1, 1), stack(w3, 1)), dim=1).float())
        self.register_buffer("w2", stack(w2, 0))
        self.register_buffer("s2", stack(w2, 1).float())
        self.b13 = None if experts.b13 is None else experts.b13.detach()
        self.b2 = None if experts.b2 is None else experts.b2.detach()
        self.act = experts.act

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        return fused_moe_fp8(x_TD, self.w13, self.s13, self.w2, self.s2, topk_weights_TK, topk_ids_TK,
                             block=self.block, b13_EI2=self.b13, b2_ED=self.b2, act=self.act, gate_up_apart=True)


class Mxfp4TritonExperts(_StackedExperts):
    """One layer's experts as MXFP4: w13 blocks (E, 2I, D / 32, 16) and E8M0 scales (E, 2I, D / 32) in
    w13's row order, w2 blocks (E, D, I / 32, 16) and scales (E, D, I / 32); the biases and SwiGLU of
    the Experts they replace (gpt-oss's clamped one)."""

    def __init__(self, experts: Experts):
        super().__init__()
        kept, device = getattr(experts, "mxfp4_checkpoint", None) or {}, experts.w13.device
        for key in ("w13", "w2"):
            if key in kept:
                blocks, scales = kept[key]
            else:
                w = getattr(experts, key).detach()
                if w.shape[-1] % 32:
                    raise ValueError(f"--quantization mxfp4 quantises expert weights in groups of 32 inputs; this "
                                     f"model's {key} is {tuple(w.shape)} (inputs {w.shape[-1]})")
                blocks, scales = quantize_mxfp4(w)
            self.register_buffer(f"{key}_blocks", blocks.to(device))
            self.register_buffer(f"{key}_scales", scales.to(device))
        self.b13 = None if experts.b13 is None else experts.b13.detach()
        self.b2 = None if experts.b2 is None else experts.b2.detach()
        self.act = experts.act

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        return fused_moe_mxfp4(x_TD, self.w13_blocks, self.w13_scales, self.w2_blocks, self.w2_scales,
                               topk_weights_TK, topk_ids_TK, b13_EI2=self.b13, b2_ED=self.b2, act=self.act)


def quantized_experts(experts: Experts, quantization: str) -> nn.Module:
    """experts as quantization ("fp8" or "mxfp4") serves them on the Triton op table; experts an FP8
    checkpoint stores unquantised (Experts.unquantised_in_checkpoint) stay as they are."""
    if quantization not in TRITON_QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} has no Triton kernels; choose from "
                         f"{', '.join(TRITON_QUANTIZATIONS)}")
    if quantization == "fp8" and getattr(experts, "unquantised_in_checkpoint", False):
        return experts
    if quantization == "fp8":
        check_fp8_runs(experts.w13.device)
    return Fp8TritonExperts(experts) if quantization == "fp8" else Mxfp4TritonExperts(experts)


def check_fp8_runs(device: torch.device) -> None:
    """ValueError unless the Triton kernels convert FP8 codes on `device` (kernels.quant.triton_fp8_supported)."""
    if not triton_fp8_supported(device):
        raise ValueError(f"quantization fp8 with Triton kernels converts FP8 codes in the kernels, which needs a GPU "
                         f"of sm_89 or newer, not {device} (serve with --quantization none to dequantise at load, "
                         f"or run the experts and linears on CPU workers)")


def pack_for_triton(root: nn.Module, quantization: str, quantize_linears: bool = False) -> None:
    """The swaps of this module's docstring, in place, on a model or an expert worker's blocks."""
    if quantization not in TRITON_QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} has no Triton kernels; choose from "
                         f"{', '.join(TRITON_QUANTIZATIONS)}")
    head = getattr(root, "lm_head", None)
    if quantization == "fp8":
        check_fp8_runs(next(root.parameters()).device)
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Experts):
                setattr(parent, name, quantized_experts(child, quantization))
            elif isinstance(child, nn.Linear) and child is not head and quantization == "fp8":
                kept = getattr(child, "fp8_checkpoint", None)
                if kept is not None:
                    setattr(parent, name, Fp8TritonLinear(child, *kept))
                elif quantize_linears:
                    setattr(parent, name, Fp8TritonLinear.quantize(child))
