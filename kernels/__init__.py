"""Compute ops of Shuttle. Each op has a torch reference here; Triton kernels with the same
signatures are chosen once, at construction, from the device (never inside `forward`).
"""
from kernels.attention import cached_attention, paged_decode_attention
from kernels.moe import fused_moe, moe_gather_einsum, permute, grouped_swiglu, unpermute, Permutation
from kernels.rmsnorm import fused_add_rms_norm, rms_norm
from kernels.rotary import RopeConfig, RotaryEmbedding, apply_rotary, apply_rotary_, inv_freq_and_scale, ROPE_TYPES
from kernels.routing import topk_route
from kernels.ops import KernelOps, select_ops
from kernels.sampling import sample

__all__ = [
    "cached_attention", "paged_decode_attention", "fused_add_rms_norm", "apply_rotary_", "fused_moe", "moe_gather_einsum", "permute", "grouped_swiglu", "unpermute",
    "Permutation", "rms_norm", "RopeConfig", "RotaryEmbedding", "apply_rotary", "inv_freq_and_scale",
    "ROPE_TYPES", "topk_route", "sample", "KernelOps", "select_ops",
]
