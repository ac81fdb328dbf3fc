"""FP8 (float8 e4m3fn) rows with one scale each: what M2N sends with --m2n-dtype fp8.

    q, scale = quantize_fp8(x_TD)       # x ~= q * scale; scale (T, 1) in x's dtype
    x_TD = dequantize_fp8(q, scale)     # in scale's dtype

A row's scale is its largest magnitude / 448 (e4m3's largest value), at least float32's smallest
normal (so that 1 / scale is finite), rounded to x's dtype; q = e4m3(x * (1 / scale)), rounded to
nearest even.
Two implementations with the same bits: torch's ops (`*_torch`, the reference) and the native
library's loops (kernels/csrc/fp8.c: AVX-512 where the CPU has it, else AVX2; the rows over torch's
threads once a call is large enough); torch converts from float8 one value at a time on the CPU.
Which one runs is measured once per process and dtype on a 64 x 2048 row block (the faster of the two;
torch where the library or its dtype is missing).
"""
import functools
import logging
import time

import torch

from kernels import native

log = logging.getLogger("shuttle")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def quantize_fp8(x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (T, D) float8_e4m3fn, scale (T, 1) in x's dtype) with x ~= q * scale."""
    if _native_for(x_TD):
        return native.fp8_quantize(x_TD)
    return quantize_fp8_torch(x_TD)


def dequantize_fp8(q_TD: torch.Tensor, scale_T1: torch.Tensor) -> torch.Tensor:
    """q * scale in scale's dtype."""
    if _native_for(scale_T1):
        return native.fp8_dequantize(q_TD, scale_T1)
    return dequantize_fp8_torch(q_TD, scale_T1)


def quantize_fp8_torch(x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x_TD.abs().amax(dim=1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny).to(x_TD.dtype)
    return (x_TD.float() * (1.0 / scale.float())).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8_torch(q_TD: torch.Tensor, scale_T1: torch.Tensor) -> torch.Tensor:
    return q_TD.to(scale_T1.dtype) * scale_T1


def _native_for(t: torch.Tensor) -> bool:
    """Whether the native loops run this call: a CPU tensor of bf16 or float32 rows, and the native
    loops measured faster on this machine (for that dtype)."""
    if t.device.type != "cpu" or t.dtype not in (torch.bfloat16, torch.float32) or not native.available():
        return False
    return _native_faster(t.dtype)


@functools.cache
def _native_faster(dtype: torch.dtype, rows: int = 64, width: int = 2048) -> bool:
    """Time both implementations on (rows, width) of `dtype`, quantize then dequantize, best of 3
    alternating rounds; logged once."""
    x = torch.randn(rows, width).to(dtype)
    best = {"torch": float("inf"), "native": float("inf")}
    impls = {"torch": (quantize_fp8_torch, dequantize_fp8_torch),
             "native": (native.fp8_quantize, native.fp8_dequantize)}
    for _ in range(3):
        for name, (quantize, dequantize) in impls.items():
            t0 = time.perf_counter()
            dequantize(*quantize(x))
            best[name] = min(best[name], time.perf_counter() - t0)
    faster = best["native"] < best["torch"]
    log.info("fp8 rows (%s, %d x %d): native %.0f us, torch %.0f us: %s", str(dtype).removeprefix("torch."), rows,
             width, best["native"] * 1e6, best["torch"] * 1e6, "native" if faster else "torch")
    return faster
