"""Linear layers for CPU inference with weights pre-packed for oneDNN.

torch's F.linear on the CPU re-lays out the weight on every call; at decode sizes (a few rows per
matmul) that halves the rate at which weights stream from memory. Packing once into oneDNN's
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's CPU freezing does)
measured 1.6-1.8x faster for bf16 and 2-3.7x for float32 at 1-16 rows on our 2-core machines
(bench/results/engine.json). Inference only: packed weights have no autograd.

Legend: T rows, I input features, O output features, E experts.
"""
import functools
import os

# oneDNN keeps one compiled primitive (with its scratch buffers, ~0.2-0.5 MiB) per weight and row
# count; serving sees every row count from 1 to the token budget, so its default 1,024 entries grew
# a float32 worker's RSS by ~100 MiB within minutes of varied load (tests/test_soak.py: +11.6%).
# 512 still holds two row counts for every weight of a 425M-parameter model. Read at first use.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")

import torch  # noqa: E402
from torch import nn  # noqa: E402

BATCH_HINT = 16  # rows oneDNN picks its blocking for; any row count works


@functools.cache
def gemm_is_emulated(dtype: torch.dtype) -> bool:
    """Whether CPU GEMMs in `dtype` lack a native path here: bf16 without AVX-512 BF16/AMX (or
    AVX-NE-CONVERT), fp16 without AVX-512 FP16/AMX-FP16. There torch converts element by element
    (about 1 GFLOP/s on a 2-core AVX2 EPYC, against 130-160 GFLOP/s in float32). The one place that
    decides it: the MoE upcast (kernels/moe.py), packing (below) and `--dtype auto`
    (models/loader.auto_dtype) all ask here."""
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported()


def packing_available(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` can be packed on this CPU: float32 wherever oneDNN is built in;
    bfloat16 only where its GEMMs are native (gemm_is_emulated), which e.g. an AVX2-only EPYC
    lacks: there the reorder raises, and plain F.linear is the fallback."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and not gemm_is_emulated(dtype)


def pack_weight(w_OI: torch.Tensor) -> torch.Tensor:
    """w_OI (float32 or bfloat16, CPU) in oneDNN's blocked layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w_OI.detach().contiguous(), BATCH_HINT)


def packed_linear(x_TI: torch.Tensor, packed: torch.Tensor, bias_O: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for 2-D x with the weight from pack_weight."""
    return torch.ops.mkldnn._linear_pointwise(x_TI, packed, bias_O, "none", [], "")


class PackedLinear(nn.Module):
    """Drop-in for an nn.Linear at inference: any leading shape, same result up to summation order."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.packed = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = packed_linear(x.reshape(-1, self.in_features), self.packed, self.bias)
        return y.view(*x.shape[:-1], self.out_features)
