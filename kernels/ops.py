"""One table of compute ops per device, chosen once at construction (never inside `forward`).

On CUDA the Triton kernels are used; everywhere else the torch references. The environment variable
SHUTTLE_KERNELS ("torch" or "triton") overrides the choice for tests and benchmarks; this module is
the only place that reads it. Triton modules are imported only when chosen, because Triton decides
at import (decoration) time whether to compile or to interpret (TRITON_INTERPRET=1).

Every entry has the signature of its torch reference:
  rms_norm(x_TD, w_D, eps) -> y_TD
  fused_add_rms_norm(x_TD, residual_TD, w_D, eps) -> (y_TD, new_residual_TD)   new_residual = x + residual
  apply_rotary_(q_TNH, k_TKH, cos_TH, sin_TH) -> (q_TNH, k_TKH), rotated in place
  topk_route(logits_TE, top_k, scoring, renormalize) -> (weights_TK float32, ids_TK int64)
  fused_moe(x_TD, w13_EID2, w2_EDI, weights_TK, ids_TK, *, b13_EI2=None, b2_ED=None, act=SILU) -> y_TD
      (expert biases and the SwiGLU variant of kernels.moe.SwiGLU: gpt-oss)
  paged_decode_attention(q_BNH, k_cache_PSKH, v_cache_PSKV, block_table_BM, seq_lens_B, scale, window,
                         sinks_N=None, start_B=None) -> o_BNV   (sinks: one extra softmax logit per query
      head, gpt-oss; start_B: each sequence's first visible key, Llama 4's chunks; V <= H: MiMo-V2-Flash)
  paged_latent_decode_attention(q_BNW, cache_PSW, block_table_BM, seq_lens_B, scale, latent_dim) -> o_BNC  (MLA)
  causal_conv1d(x_BLC, lens_B, state_BCW, weight_CK) -> (y_BLC, new_state_BCW)   (Qwen3-Next's linear
      attention: depthwise causal convolution + SiLU after each sequence's state; kernels/delta_rule.py)
  gated_delta_rule_recurrent(q_BHK, k_BHK, v_BHV, g_BH, beta_BH, state_BHKV) -> (o_BHV, new_state_BHKV)
  gated_delta_rule_chunked(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, state_BHKV) -> (o_BLHV, new_state_BHKV)
  compressed_decode_attention(q_BNH, ring_SWH, slot_B, lens_B, pages_PEH, table_BM, idx_BK, rate, block_size,
                              sinks_N, scale) -> o_BNH   (DeepSeek-V4: one shared key=value head over the
      sliding window's ring plus the chosen compressed entries, with sinks; kernels/compressed_attention.py)
"""
import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch

BACKENDS = ("torch", "triton")
ENV_VAR = "SHUTTLE_KERNELS"


@dataclass(frozen=True)
class KernelOps:
    backend: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    apply_rotary_: Callable
    topk_route: Callable
    fused_moe: Callable
    paged_decode_attention: Callable
    paged_latent_decode_attention: Callable
    causal_conv1d: Callable
    gated_delta_rule_recurrent: Callable
    gated_delta_rule_chunked: Callable
    compressed_decode_attention: Callable


def choose_backend(device: torch.device | str, backend: str | None = None) -> str:
    """The backend for `device`: an explicit `backend`, else $SHUTTLE_KERNELS, else triton on CUDA."""
    backend = backend or os.environ.get(ENV_VAR) or None
    if backend is None:
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r} (from {ENV_VAR} or the caller); "
                         f"expected one of {', '.join(BACKENDS)}")
    return backend


@functools.cache  # one table per process: compiled code (models/stages.py) guards on its identity
def torch_ops() -> KernelOps:
    from kernels.attention import paged_decode_attention, paged_latent_decode_attention
    from kernels.compressed_attention import compressed_decode_attention
    from kernels.delta_rule import causal_conv1d, gated_delta_rule_chunked, gated_delta_rule_recurrent
    from kernels.moe import fused_moe
    from kernels.rmsnorm import fused_add_rms_norm, rms_norm
    from kernels.rotary import apply_rotary_
    from kernels.routing import topk_route

    return KernelOps("torch", rms_norm, fused_add_rms_norm, apply_rotary_, topk_route, fused_moe,
                     paged_decode_attention, paged_latent_decode_attention, causal_conv1d, gated_delta_rule_recurrent,
                     gated_delta_rule_chunked, compressed_decode_attention)


@functools.cache
def triton_ops() -> KernelOps:
    from kernels.attention_triton import paged_decode_attention
    from kernels.compressed_attention_triton import compressed_decode_attention
    from kernels.delta_rule_triton import causal_conv1d, gated_delta_rule_chunked, gated_delta_rule_recurrent
    from kernels.mla_triton import paged_latent_decode_attention
    from kernels.moe_triton import fused_moe
    from kernels.rmsnorm_triton import fused_add_rms_norm, rms_norm
    from kernels.rotary_triton import apply_rotary_
    from kernels.routing_triton import topk_route

    return KernelOps("triton", rms_norm, fused_add_rms_norm, apply_rotary_, topk_route, fused_moe,
                     paged_decode_attention, paged_latent_decode_attention, causal_conv1d, gated_delta_rule_recurrent,
                     gated_delta_rule_chunked, compressed_decode_attention)


def select_ops(device: torch.device | str, backend: str | None = None) -> KernelOps:
    """The op table for `device` (see choose_backend)."""
    return triton_ops() if choose_backend(device, backend) == "triton" else torch_ops()
