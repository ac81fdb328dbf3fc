"""Triton GEMMs and fused MoE that read quantised weights as shipped and dequantise inside the tile loop
(after vLLM's fused_moe with block-scaled `w1_scale`/`w2_scale` and its MXFP4 path), never forming a
float copy of a weight. kernels/quant.py holds the formats and the torch references.

Formats (legend: T rows of x, O output features, I input features; y = x W^T):
- FP8 blocks (DeepSeek-V3/R1, Kimi K2, Qwen3 FP8): codes (O, I) float8_e4m3fn (or float8_e5m2, or
  uint8 holding e4m3fn bits) and float32 scale_inv (ceil(O / bo), ceil(I / bi)) per bo x bi block
  (128 x 128 in those checkpoints; edge blocks partial): W = code * scale of its block.
- MXFP4 (gpt-oss): blocks (O, I / 2) or (O, I / 32, 16) uint8, two E2M1 codes a byte (input 2j in the
  low nibble of byte j), and scales (O, I / 32) uint8 E8M0: W = FP4 value * 2^(e - 127); I a multiple
  of 32.

Tiling: one program computes a BLOCK_M x BLOCK_N tile of y, looping over K-tiles of BLOCK_K inputs
that never straddle a scale block along the input dim: FP8 takes BLOCK_K dividing bi, MXFP4 takes
BLOCK_K = 32 (one scale group, 16 bytes a row). Each K-tile's codes are converted to the dot dtype
(exact: every E4M3/E5M2/E2M1 value is representable in bf16, fp16 and float32), multiplied by the x
tile with float32 accumulation, and the partial product is scaled per output column (the scale of
the column's block for this K-tile, so any BLOCK_N works) before it joins the float32 accumulator:
acc += (x_tile . codes_tile) * scale_N. MXFP4 tiles are not interleaved: the even inputs of the
x tile meet the low nibbles and the odd inputs the high nibbles, two dots of K = 16 per group. E2M1
codes decode by arithmetic on their bits; E8M0 scales by moving the byte into float32's exponent.

The MoE kernels are kernels/moe_triton.py's (its alignment, block order and row-block helpers are
imported): align -> grouped GEMM w13 + SwiGLU (biases and kernels.moe.SwiGLU's clamped variant in the
float32 epilogue) -> grouped GEMM w2 x router weight -> sum over K, with w13 (E, 2I, D) and w2
(E, D, I) in either format. FP8 w13's scales are (E, ceil(2I / bo), ceil(D / bi)) for w13 quantised as
one matrix, or (E, 2 ceil(I / bo), ...) for w1 and w3 quantised apart and concatenated (the same rows
when bo divides I; the same shape, read differently, when I mod bo > bo / 2: the caller says which). MXFP4 weights are in w13's row order (gate rows, then up rows), not
gpt-oss's interleaved one. MoEConfig's BLOCK_K is an upper bound (FP8) or ignored (MXFP4, 32).

The dot runs in x's dtype (float32: IEEE, not TF32) except under the Triton interpreter, where bf16
dots are wrong (bf16 values held as uint16 are multiplied as integers) and bf16 x dots in float32
instead, which gives the same products (exact) and float32 sums. FP8 conversion in compiled code needs
a GPU with FP8 support (sm_89 or newer).
"""
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.moe import SILU, SwiGLU
from kernels.moe_triton import (MoEConfig, _block_of, _row_block, _store_down, _store_swiglu, default_config,
                                moe_align_block_size)
from kernels.quant import FP8_DTYPES, MXFP4_BLOCK, fp8_block_scale_shape

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's own test, at decoration time


@triton.jit
def _e2m1_to_float(code):
    """E2M1 codes (int32, 0..15: sign, 2 exponent bits, 1 mantissa bit) -> float32 FP4 values."""
    e = (code >> 1) & 3
    m = code & 1
    mag = tl.where(e == 0, 2 * m, (2 + m) << e).to(tl.float32) * 0.25  # 0, .5 | (1 + m/2) 2^(e-1)
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def _x_tiles(x_rows, row_ok, k0, K, stride_xk, MXFP4: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT_DTYPE: tl.constexpr):
    """The K-tile [k0, k0 + BLOCK_K) of the rows x_rows (pointers to their input 0), in DOT_DTYPE: for
    MXFP4 its even and its odd inputs (K a multiple of 32: no column mask), else the tile twice."""
    if MXFP4:
        offs = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        a0 = tl.load(x_rows[:, None] + offs[None, :] * stride_xk, mask=row_ok[:, None], other=0.0)
        a1 = tl.load(x_rows[:, None] + (offs + 1)[None, :] * stride_xk, mask=row_ok[:, None], other=0.0)
    else:
        offs = k0 + tl.arange(0, BLOCK_K)
        a0 = tl.load(x_rows[:, None] + offs[None, :] * stride_xk, mask=row_ok[:, None] & (offs < K)[None, :],
                     other=0.0)
        a1 = a0
    return a0.to(DOT_DTYPE), a1.to(DOT_DTYPE)


@triton.jit
def _scaled_dot(acc, a0, a1, w_cols, col_ok, s_cols, k0, K, stride_wk, stride_sk, MXFP4: tl.constexpr,
                SCALE_K: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """acc + (x tile . W[cols, k0:k0 + BLOCK_K]^T): w_cols point to the columns' weight rows (code 0
    or byte 0), s_cols to their scale rows; the K-tile lies in one scale block (SCALE_K inputs), so the
    partial product is scaled per column in float32."""
    s_ptrs = s_cols + (k0 // SCALE_K) * stride_sk
    if MXFP4:
        e = tl.load(s_ptrs, mask=col_ok, other=127).to(tl.int32)
        s = tl.where(e == 0, 0x400000, e << 23).to(tl.float32, bitcast=True)  # 2^(e - 127), 2^-127 subnormal
        offs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        codes = tl.load(w_cols[None, :] + offs[:, None] * stride_wk, mask=col_ok[None, :], other=0).to(tl.int32)
        part = tl.dot(a0, _e2m1_to_float(codes & 15).to(DOT_DTYPE), input_precision=DOT_PRECISION)
        part = tl.dot(a1, _e2m1_to_float(codes >> 4).to(DOT_DTYPE), part, input_precision=DOT_PRECISION)
    else:
        s = tl.load(s_ptrs, mask=col_ok, other=0.0)
        offs = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_cols[None, :] + offs[:, None] * stride_wk, mask=(offs < K)[:, None] & col_ok[None, :],
                    other=0.0)
        part = tl.dot(a0, w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return acc + part * s[None, :]


@triton.jit
def _linear_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, T, O, I, stride_xt, stride_xi, stride_wo, stride_wk,
                   stride_so, stride_sk, stride_yt, stride_yo, MXFP4: tl.constexpr, SCALE_N: tl.constexpr,
                   SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   HAS_BIAS: tl.constexpr):
    """y[t, o] = x[t] . W[o] (+ b[o]); column o's scales are row o // SCALE_N of s."""
    pid_m, pid_n = _block_of(tl.program_id(0), T, O, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = offs_m < T, offs_n < O
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xt
    w_cols = w_ptr + offs_n.to(tl.int64) * stride_wo
    s_cols = s_ptr + (offs_n // SCALE_N) * stride_so
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a0, a1 = _x_tiles(x_rows, row_ok, k0, I, stride_xi, MXFP4, BLOCK_K, DOT_DTYPE)
        acc = _scaled_dot(acc, a0, a1, w_cols, col_ok, s_cols, k0, I, stride_wk, stride_sk, MXFP4, SCALE_K, BLOCK_K,
                          DOT_DTYPE, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_yt + offs_n[None, :] * stride_yo
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, b_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
                    num_pairs, num_rows, D, I, up_scale_off, stride_xt, stride_xd, stride_we, stride_wi, stride_wk,
                    stride_se, stride_si, stride_sk, stride_be, stride_bi, stride_hn, stride_hi, alpha, limit,
                    up_offset, TOP_K: tl.constexpr, MXFP4: tl.constexpr, SCALE_N: tl.constexpr,
                    SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr):
    """moe_triton's _gate_up_kernel over quantised w13: gate row n's scales are row n // SCALE_N of the
    expert's scales, up row I + n's are row (up_scale_off + n) // SCALE_N."""
    pid_m, pid_n = _block_of(tl.program_id(0), num_rows, I, BLOCK_M, BLOCK_N, GROUP_M)
    expert, pair_M, row_ok = _row_block(sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, pid_m, num_pairs,
                                        BLOCK_M)
    if expert == -1:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < I
    x_rows = x_ptr + (pair_M // TOP_K) * stride_xt
    gate_cols = w_ptr + expert * stride_we + offs_n * stride_wi
    up_cols = gate_cols + I * stride_wi
    gate_scales = s_ptr + expert * stride_se + (offs_n // SCALE_N) * stride_si
    up_scales = s_ptr + expert * stride_se + ((up_scale_off + offs_n) // SCALE_N) * stride_si
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        a0, a1 = _x_tiles(x_rows, row_ok, k0, D, stride_xd, MXFP4, BLOCK_K, DOT_DTYPE)
        acc_gate = _scaled_dot(acc_gate, a0, a1, gate_cols, col_ok, gate_scales, k0, D, stride_wk, stride_sk, MXFP4,
                               SCALE_K, BLOCK_K, DOT_DTYPE, DOT_PRECISION)
        acc_up = _scaled_dot(acc_up, a0, a1, up_cols, col_ok, up_scales, k0, D, stride_wk, stride_sk, MXFP4, SCALE_K,
                             BLOCK_K, DOT_DTYPE, DOT_PRECISION)
    _store_swiglu(acc_gate, acc_up, b_ptr, h_ptr, expert, pair_M, row_ok, offs_n, col_ok, I, stride_be, stride_bi,
                  stride_hn, stride_hi, alpha, limit, up_offset, HAS_BIAS, CLAMP)


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, b_ptr, y_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                 num_post_padded_ptr, num_pairs, num_rows, I, D, stride_hn, stride_hi, stride_we, stride_wd,
                 stride_wk, stride_se, stride_sd, stride_sk, stride_be, stride_bd, stride_yn, stride_yd,
                 MXFP4: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    """moe_triton's _down_kernel over quantised w2: y[p, d] = weight[p] * (h[p] . w2[e, d] (+ b2[e, d]))."""
    pid_m, pid_n = _block_of(tl.program_id(0), num_rows, D, BLOCK_M, BLOCK_N, GROUP_M)
    expert, pair_M, row_ok = _row_block(sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, pid_m, num_pairs,
                                        BLOCK_M)
    if expert == -1:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < D
    h_rows = h_ptr + pair_M * stride_hn
    w_cols = w_ptr + expert * stride_we + offs_n * stride_wd
    s_cols = s_ptr + expert * stride_se + (offs_n // SCALE_N) * stride_sd
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a0, a1 = _x_tiles(h_rows, row_ok, k0, I, stride_hi, MXFP4, BLOCK_K, DOT_DTYPE)
        acc = _scaled_dot(acc, a0, a1, w_cols, col_ok, s_cols, k0, I, stride_wk, stride_sk, MXFP4, SCALE_K, BLOCK_K,
                          DOT_DTYPE, DOT_PRECISION)
    _store_down(acc, b_ptr, weights_ptr, y_ptr, expert, pair_M, row_ok, offs_n, col_ok, stride_be, stride_bd,
                stride_yn, stride_yd, HAS_BIAS, True)


@dataclass(frozen=True)
class _Format:
    """How the kernels read one quantised weight: MXFP4 or FP8 codes, the scale block (SCALE_N rows x
    SCALE_K inputs) and the K-tile."""

    mxfp4: bool
    scale_n: int
    scale_k: int
    block_k: int


def _dot_args(dtype: torch.dtype) -> dict:
    """DOT_DTYPE / DOT_PRECISION for x's dtype (module docstring: bf16 under the interpreter)."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and _INTERPRETED):
        return dict(DOT_DTYPE=tl.float32, DOT_PRECISION="ieee")
    return dict(DOT_DTYPE=_TL_DTYPES[dtype], DOT_PRECISION=None)  # None: the default for 16-bit


def _launch_args(cfg: MoEConfig, fmt: _Format, dtype: torch.dtype) -> dict:
    return dict(MXFP4=fmt.mxfp4, SCALE_N=fmt.scale_n, SCALE_K=fmt.scale_k, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                BLOCK_K=fmt.block_k, GROUP_M=cfg.GROUP_M, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **_dot_args(dtype))


def _fp8_format(block: tuple[int, int], cfg: MoEConfig, name: str) -> _Format:
    """BLOCK_K: the largest power of two dividing the scale block's input size, at most cfg.BLOCK_K."""
    bo, bi = block
    if bo < 1 or bi < 1:
        raise ValueError(f"{name}: block {block} must be positive")
    block_k = min(cfg.BLOCK_K, bi & -bi)
    if block_k < 16:
        raise ValueError(f"{name}: the block's input size {bi} must be a multiple of 16 (tl.dot's minimum K)")
    return _Format(False, bo, bi, block_k)


_MXFP4 = _Format(True, 1, MXFP4_BLOCK, MXFP4_BLOCK)


def _fp8_codes(w: torch.Tensor, name: str) -> torch.Tensor:
    """FP8 codes as an FP8 tensor: uint8 bits are viewed as float8_e4m3fn (no copy)."""
    if w.dtype == torch.uint8:
        return w.view(FP8_DTYPES[0])
    if w.dtype not in FP8_DTYPES:
        raise ValueError(f"{name}: weight must be {' or '.join(map(str, FP8_DTYPES))} or uint8, got {w.dtype}")
    return w


def _packed(blocks: torch.Tensor, dims: int, name: str) -> torch.Tensor:
    """MXFP4 blocks as (..., I / 2) uint8: (..., I / 32, 16) is flattened (a view when contiguous)."""
    if blocks.dtype != torch.uint8:
        raise ValueError(f"{name}: blocks must be uint8, got {blocks.dtype}")
    if blocks.dim() == dims + 1 and blocks.shape[-1] == MXFP4_BLOCK // 2:
        return blocks.flatten(-2)
    if blocks.dim() != dims:
        raise ValueError(f"{name}: blocks must be {dims}-D (..., I / 2) or {dims + 1}-D (..., I / 32, 16), "
                         f"got {tuple(blocks.shape)}")
    return blocks


def _check_x(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"{name}: x must be 2-D float32/float16/bfloat16, got {tuple(x.shape)} {x.dtype}")


def _check_same_device(name: str, *tensors: torch.Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {devices}")


def _linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None, fmt: _Format,
            cfg: MoEConfig) -> torch.Tensor:
    (T, I), O = x.shape, w.shape[0]
    y = torch.empty((T, O), dtype=x.dtype, device=x.device)
    if T == 0 or O == 0:
        return y
    grid = (triton.cdiv(T, cfg.BLOCK_M) * triton.cdiv(O, cfg.BLOCK_N),)
    _linear_kernel[grid](x, w, s, w if bias is None else bias, y, T, O, I, *x.stride(), *w.stride(), *s.stride(),
                         *y.stride(), HAS_BIAS=bias is not None, **_launch_args(cfg, fmt, x.dtype))
    return y


def _check_bias(bias: torch.Tensor | None, O: int, name: str) -> None:
    if bias is not None and (tuple(bias.shape) != (O,) or not bias.is_floating_point()):
        raise ValueError(f"{name}: bias must be a float ({O},), got {tuple(bias.shape)} {bias.dtype}")


def fp8_block_linear(x_TI: torch.Tensor, w_OI: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int] = (128, 128), bias: torch.Tensor | None = None,
                     config: MoEConfig | None = None) -> torch.Tensor:
    """y_TO = x W^T (+ bias), W = code * scale_inv of its block, in x's dtype (float32 accumulation).

    x_TI float32/float16/bfloat16 (any strides); w_OI FP8 codes (float8_e4m3fn, float8_e5m2, or uint8
    holding e4m3fn bits); scale_inv (ceil(O / bo), ceil(I / bi)) float; block (bo, bi), bi a multiple of
    16; bias (O,) float or None. config: tiles (default_config's for T rows). Raises ValueError on
    mismatched arguments.
    """
    _check_x(x_TI, "fp8_block_linear")
    w = _fp8_codes(w_OI, "fp8_block_linear")
    if w.dim() != 2 or w.shape[1] != x_TI.shape[1]:
        raise ValueError(f"fp8_block_linear: weight must be (O, I={x_TI.shape[1]}), got {tuple(w.shape)}")
    if tuple(scale_inv.shape) != fp8_block_scale_shape(w.shape, block):
        raise ValueError(f"fp8_block_linear: scale_inv must be {fp8_block_scale_shape(w.shape, block)} for block "
                         f"{block}, got {tuple(scale_inv.shape)}")
    _check_bias(bias, w.shape[0], "fp8_block_linear")
    _check_same_device("fp8_block_linear", x_TI, w, scale_inv, bias)
    (T, I), O = x_TI.shape, w.shape[0]
    cfg = config or default_config(T, 1, 1, I, O, x_TI.dtype)
    return _linear(x_TI, w, scale_inv.float(), bias, _fp8_format(block, cfg, "fp8_block_linear"), cfg)


def mxfp4_linear_triton(x_TI: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None = None, config: MoEConfig | None = None) -> torch.Tensor:
    """y_TO = x W^T (+ bias), W = FP4 value * 2^(e - 127), in x's dtype (float32 accumulation).

    x_TI float32/float16/bfloat16 (any strides), I a multiple of 32; blocks (O, I / 2) or (O, I / 32, 16)
    uint8; scales (O, I / 32) uint8 (E8M0); bias (O,) float or None. config: tiles (BLOCK_K is 32).
    Raises ValueError on mismatched arguments.
    """
    _check_x(x_TI, "mxfp4_linear_triton")
    w = _packed(blocks, 2, "mxfp4_linear_triton")
    (T, I), O = x_TI.shape, w.shape[0]
    if I % MXFP4_BLOCK or w.shape[1] * 2 != I:
        raise ValueError(f"mxfp4_linear_triton: x's I={I} must be a multiple of {MXFP4_BLOCK} and twice the "
                         f"blocks' bytes per row, got blocks {tuple(blocks.shape)}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (O, I // MXFP4_BLOCK):
        raise ValueError(f"mxfp4_linear_triton: scales must be uint8 {(O, I // MXFP4_BLOCK)}, got "
                         f"{tuple(scales.shape)} {scales.dtype}")
    _check_bias(bias, O, "mxfp4_linear_triton")
    _check_same_device("mxfp4_linear_triton", x_TI, w, scales, bias)
    return _linear(x_TI, w, scales, bias, _MXFP4, config or default_config(T, 1, 1, I, O, x_TI.dtype))


def _check_moe(name: str, x_TD: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, inputs_per_code: int,
               topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor, b13_EI2: torch.Tensor | None,
               b2_ED: torch.Tensor | None) -> tuple[int, int]:
    """(D, I) of code tensors w13 (E, 2I, D / inputs_per_code) and w2 (E, D, I / inputs_per_code) (1 for
    FP8, 2 for packed MXFP4); ValueError unless they, x, the router and the biases fit together."""
    _check_x(x_TD, name)
    T, D = x_TD.shape
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] * inputs_per_code != D:
        raise ValueError(f"{name}: w13 must be (E, 2I, D={D}) weights, got codes {tuple(w13.shape)}")
    E, I = w13.shape[0], w13.shape[1] // 2
    if w2.dim() != 3 or tuple(w2.shape[:2]) != (E, D) or w2.shape[2] * inputs_per_code != I:
        raise ValueError(f"{name}: w2 must be (E={E}, D={D}, I={I}) weights, got codes {tuple(w2.shape)}")
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T or topk_ids_TK.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: topk_ids must be (T={T}, K) int64/int32, got {tuple(topk_ids_TK.shape)} "
                         f"{topk_ids_TK.dtype}")
    if topk_weights_TK.shape != topk_ids_TK.shape or topk_weights_TK.dtype not in (torch.float32, x_TD.dtype):
        raise ValueError(f"{name}: topk_weights must be {tuple(topk_ids_TK.shape)} float32 or {x_TD.dtype}, got "
                         f"{tuple(topk_weights_TK.shape)} {topk_weights_TK.dtype}")
    if (b13_EI2 is None) != (b2_ED is None):
        raise ValueError(f"{name}: give both biases (b13 and b2) or neither")
    if b13_EI2 is not None and (tuple(b13_EI2.shape) != (E, 2 * I) or tuple(b2_ED.shape) != (E, D)):
        raise ValueError(f"{name}: biases must be b13 {(E, 2 * I)} and b2 {(E, D)}, got {tuple(b13_EI2.shape)}, "
                         f"{tuple(b2_ED.shape)}")
    _check_same_device(name, x_TD, w13, w2, topk_weights_TK, topk_ids_TK, b13_EI2, b2_ED)
    return D, I


def _moe(x_TD: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, I: int,
         up_scale_off: int, topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor, b13_EI2: torch.Tensor | None,
         b2_ED: torch.Tensor | None, act: SwiGLU, fmt13: _Format, fmt2: _Format, cfg: MoEConfig) -> torch.Tensor:
    """moe_triton.fused_moe's launches over checked, quantised weights (w13 (E, 2I, ·), w2 (E, D, ·))."""
    (T, D), K = x_TD.shape, topk_ids_TK.shape[1]
    N, dev, dtype = T * K, x_TD.device, x_TD.dtype
    if N == 0:
        return torch.zeros((T, D), dtype=dtype, device=dev)  # T == 0 (empty) or K == 0 (nothing routed)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids_TK, cfg.BLOCK_M, w13.shape[0])
    num_rows = sorted_ids.shape[0]
    has_bias = b13_EI2 is not None
    b13, b2 = (b13_EI2, b2_ED) if has_bias else (s13, s2)  # (never read without HAS_BIAS)
    h_NI = torch.empty((N, I), dtype=dtype, device=dev)
    grid = (triton.cdiv(num_rows, cfg.BLOCK_M) * triton.cdiv(I, cfg.BLOCK_N),)
    _gate_up_kernel[grid](x_TD, w13, s13, b13, h_NI, sorted_ids, expert_ids, num_post_padded, N, num_rows, D, I,
                          up_scale_off, *x_TD.stride(), *w13.stride(), *s13.stride(), *b13.stride()[:2],
                          *h_NI.stride(), float(act.alpha), float(act.limit or 0.0), float(act.up_offset), TOP_K=K,
                          HAS_BIAS=has_bias, CLAMP=act.limit is not None, **_launch_args(cfg, fmt13, dtype))
    y_ND = torch.empty((N, D), dtype=dtype, device=dev)
    weights_N = topk_weights_TK.reshape(-1).contiguous()  # indexed by pair id in the kernel
    grid = (triton.cdiv(num_rows, cfg.BLOCK_M) * triton.cdiv(D, cfg.BLOCK_N),)
    _down_kernel[grid](h_NI, w2, s2, b2, y_ND, weights_N, sorted_ids, expert_ids, num_post_padded, N, num_rows, I, D,
                       *h_NI.stride(), *w2.stride(), *s2.stride(), *b2.stride()[:2], *y_ND.stride(),
                       HAS_BIAS=has_bias, **_launch_args(cfg, fmt2, dtype))
    return y_ND.view(T, K, D).sum(dim=1)  # rows of token t are pairs t*K .. t*K+K-1, adjacent


def fused_moe_fp8(x_TD: torch.Tensor, w13_EID2: torch.Tensor, w13_scale: torch.Tensor, w2_EDI: torch.Tensor,
                  w2_scale: torch.Tensor, topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor, *,
                  block: tuple[int, int] = (128, 128), b13_EI2: torch.Tensor | None = None,
                  b2_ED: torch.Tensor | None = None, act: SwiGLU = SILU, gate_up_apart: bool | None = None,
                  config: MoEConfig | None = None) -> torch.Tensor:
    """moe_triton.fused_moe with FP8 block-quantised experts: w13_EID2 (E, 2I, D) and w2_EDI (E, D, I)
    codes (float8_e4m3fn, float8_e5m2 or uint8 e4m3fn bits); w13_scale (E, ceil(2I / bo), ceil(D / bi))
    or, gate_up_apart, (E, 2 ceil(I / bo), ceil(D / bi)) (w1 and w3 quantised apart); w2_scale
    (E, ceil(D / bo), ceil(I / bi)), float. gate_up_apart None: told by w13_scale's shape, a ValueError
    where both layouts have it and read it differently (I mod bo > bo / 2). x, router, biases, act and
    result as there; config's BLOCK_K is capped by the largest power of two dividing bi."""
    w13, w2 = _fp8_codes(w13_EID2, "fused_moe_fp8"), _fp8_codes(w2_EDI, "fused_moe_fp8")
    D, I = _check_moe("fused_moe_fp8", x_TD, w13, w2, 1, topk_weights_TK, topk_ids_TK, b13_EI2, b2_ED)
    E, (bo, bi) = w13.shape[0], block
    joint, apart = (E, *fp8_block_scale_shape((2 * I, D), block)), (E, 2 * -(-I // bo), -(-D // bi))
    if gate_up_apart is None:
        if joint == apart and I % bo:
            raise ValueError(f"fused_moe_fp8: w13_scale {tuple(w13_scale.shape)} fits both w13 quantised as one "
                             f"matrix and w1 / w3 quantised apart (I={I}, bo={bo}); say which with gate_up_apart")
        gate_up_apart = tuple(w13_scale.shape) == apart and apart != joint
    want = apart if gate_up_apart else joint
    if tuple(w13_scale.shape) != want:
        raise ValueError(f"fused_moe_fp8: w13_scale must be {want} ({'w1 and w3 apart' if gate_up_apart else 'w13 as one'}"
                         f"), got {tuple(w13_scale.shape)}")
    if tuple(w2_scale.shape) != (E, *fp8_block_scale_shape((D, I), block)):
        raise ValueError(f"fused_moe_fp8: w2_scale must be {(E, *fp8_block_scale_shape((D, I), block))}, got "
                         f"{tuple(w2_scale.shape)}")
    _check_same_device("fused_moe_fp8", x_TD, w13_scale, w2_scale)
    cfg = config or default_config(x_TD.shape[0], topk_ids_TK.shape[1], E, D, I, x_TD.dtype)
    fmt = _fp8_format(block, cfg, "fused_moe_fp8")
    up_scale_off = -(-I // bo) * bo if gate_up_apart else I
    return _moe(x_TD, w13, w13_scale.float(), w2, w2_scale.float(), I, up_scale_off, topk_weights_TK, topk_ids_TK,
                b13_EI2, b2_ED, act, fmt, fmt, cfg)


def fused_moe_mxfp4(x_TD: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor,
                    w2_scales: torch.Tensor, topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor, *,
                    b13_EI2: torch.Tensor | None = None, b2_ED: torch.Tensor | None = None, act: SwiGLU = SILU,
                    config: MoEConfig | None = None) -> torch.Tensor:
    """moe_triton.fused_moe with MXFP4 experts (gpt-oss): w13_blocks (E, 2I, D / 2) or (E, 2I, D / 32, 16)
    uint8 in w13's row order (gate rows, then up rows), w13_scales (E, 2I, D / 32) uint8; w2_blocks
    (E, D, I / 2) or (E, D, I / 32, 16), w2_scales (E, D, I / 32); D and I multiples of 32. x, router,
    biases (gpt-oss's, in w13's row order), act (gpt-oss's clamped SwiGLU) and result as there; config's
    BLOCK_K is ignored (32)."""
    w13, w2 = _packed(w13_blocks, 3, "fused_moe_mxfp4"), _packed(w2_blocks, 3, "fused_moe_mxfp4")
    D, I = _check_moe("fused_moe_mxfp4", x_TD, w13, w2, 2, topk_weights_TK, topk_ids_TK, b13_EI2, b2_ED)
    E = w13.shape[0]
    if D % MXFP4_BLOCK or I % MXFP4_BLOCK:
        raise ValueError(f"fused_moe_mxfp4: D={D} and I={I} must be multiples of {MXFP4_BLOCK}")
    for name, s, shape in (("w13_scales", w13_scales, (E, 2 * I, D // MXFP4_BLOCK)),
                           ("w2_scales", w2_scales, (E, D, I // MXFP4_BLOCK))):
        if s.dtype != torch.uint8 or tuple(s.shape) != shape:
            raise ValueError(f"fused_moe_mxfp4: {name} must be uint8 {shape}, got {tuple(s.shape)} {s.dtype}")
    _check_same_device("fused_moe_mxfp4", x_TD, w13_scales, w2_scales)
    cfg = config or default_config(x_TD.shape[0], topk_ids_TK.shape[1], E, D, I, x_TD.dtype)
    return _moe(x_TD, w13, w13_scales, w2, w2_scales, I, I, topk_weights_TK, topk_ids_TK, b13_EI2, b2_ED, act,
                _MXFP4, _MXFP4, cfg)
