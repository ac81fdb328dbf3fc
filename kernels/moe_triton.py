"""Fused MoE in Triton (after vLLM's fused_moe): align -> grouped GEMM w13 + SiLU gate -> grouped
GEMM w2 x router weight -> sum over K. Same signature as kernels/moe.py::fused_moe.

Legend: T tokens, D hidden, K experts per token (top-k), E experts, I expert intermediate size,
N = T*K token-expert pairs ("pair" p = t*K + k indexes the flattened top-k arrays).
w13_EID2 is (E, 2I, D): rows [0, I) gate (w1), rows [I, 2I) up (w3); w2_EDI is (E, D, I).
Optional biases b13_EI2 (E, 2I) and b2_ED (E, D) and the SwiGLU variant (kernels.moe.SwiGLU: alpha,
clamp limit, up offset; gpt-oss) are applied in float32 on the accumulators.

Pairs are sorted by expert and each expert's slice is padded to a multiple of BLOCK_M, so every
BLOCK_M-row block of the sorted list belongs to one expert: one program multiplies one row block by
one column block of that expert's weight. Padding rows hold the sentinel N and are masked out.
Accumulation is float32; outputs and the (N, I) intermediate are stored in x's dtype.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.moe import SILU, SwiGLU

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes of both GEMM launches. BLOCK_* must be powers of two >= 16 (tl.dot's minimum);
    GROUP_M row blocks are visited together so their weight columns stay in L2."""

    BLOCK_M: int = 64
    BLOCK_N: int = 64
    BLOCK_K: int = 64
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoEConfig.{name}={v}: must be a power of two >= 16")
        if self.GROUP_M < 1 or self.num_stages < 1 or self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"MoEConfig: GROUP_M, num_stages >= 1 and num_warps a power of two, got {self}")


def default_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                   dtype: torch.dtype) -> MoEConfig:
    """Heuristic tiles (untuned): BLOCK_M follows the expected rows per expert, T*K/E, so decode
    batches (a few rows per expert) do not waste a 64-row tile on padding."""
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    fp32 = dtype == torch.float32
    if rows_per_expert <= 16:  # decode: memory bound, wide K tiles, no grouping needed
        m, n, k, group, warps, stages = 16, 64, 64 if fp32 else 128, 1, 4, 3
    elif rows_per_expert <= 128:
        m, n, k, group, warps, stages = 64, 64, 32 if fp32 else 64, 8, 4, 2 if fp32 else 3
    else:  # prefill; BLOCK_N stays 64 because the gate/up kernel holds two accumulators
        m, n, k, group, warps, stages = 128, 64, 32 if fp32 else 64, 8, 8, 2 if fp32 else 3
    if hidden % 16 or inter % 16:
        # Strides not divisible by 16 defeat vectorised loads; each element then needs its own 64-bit
        # pointer, and wide tiles spill registers (seen in sm_90 builds), so use narrow ones.
        n, k, warps = 32, 32, 4 if m == 16 else 8
    cap = max(16, triton.next_power_of_2(max(hidden, inter)))  # no tile wider than both dims
    return MoEConfig(m, min(n, cap), min(k, cap), group, warps, stages)


def moe_align_block_size(topk_ids_TK: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the N = T*K pairs by expert (stable) and pad each expert's slice to a multiple of block_m.

    Returns int32 device tensors: sorted_ids (R,) pair ids with sentinel N in padding and past the
    end, R = cdiv(N + min(E, N) * (block_m - 1), block_m) * block_m (an upper bound known on the host);
    expert_ids (R // block_m,) expert of each block, -1 past the end; num_tokens_post_padded (1,).
    Experts without pairs get no blocks. No host synchronisation (CUDA-graph friendly); ids must lie
    in [0, E) (not checked, as that would need a sync).
    """
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"moe_align_block_size: block_m={block_m} and num_experts={num_experts} must be >= 1")
    device, N, E = topk_ids_TK.device, topk_ids_TK.numel(), num_experts
    ids_N = topk_ids_TK.reshape(-1).to(torch.int64)
    counts_E = torch.zeros(E, dtype=torch.int64, device=device).scatter_add_(0, ids_N, torch.ones_like(ids_N))
    padded_E = (counts_E + block_m - 1) // block_m * block_m
    padded_end_E = torch.cumsum(padded_E, 0)
    padded_start_E = padded_end_E - padded_E
    start_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_expert_N, order_N = torch.sort(ids_N, stable=True)
    # Row of the i-th sorted pair: its expert's padded start + its rank within the expert.
    rank_N = torch.arange(N, device=device) - start_E[sorted_expert_N]
    dest_N = padded_start_E[sorted_expert_N] + rank_N
    num_blocks = triton.cdiv(N + min(E, N) * (block_m - 1), block_m)
    sorted_ids = torch.full((num_blocks * block_m,), N, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest_N, order_N.to(torch.int32))
    block_start = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_end_E, block_start, right=True)  # first e with end > start
    expert_ids = torch.where(expert_ids < E, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end_E[-1:].to(torch.int32)


@triton.jit
def _block_of(pid, num_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program pid, GROUP_M row blocks at a time (L2 reuse)."""
    num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(n_cols, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _row_block(sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """Row block pid_m of the sorted pairs: (its expert, -1 for a block past the padded end; its
    BLOCK_M pair ids; which of them are real pairs rather than the sentinel)."""
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    expert = tl.where(pid_m * BLOCK_M >= tl.load(num_post_padded_ptr), -1, expert)
    pair_M = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, pair_M, pair_M < num_pairs


@triton.jit
def _store_swiglu(acc_gate, acc_up, b_ptr, h_ptr, expert, pair_M, row_ok, offs_n, col_ok, I, stride_be, stride_bi,
                  stride_hn, stride_hi, alpha, limit, up_offset, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr):
    """The gate/up GEMM's epilogue (also kernels/quant_triton.py's): float32 accumulators plus the expert's
    biases, clamped, act(gate, up) stored as h rows of the block's pairs."""
    if HAS_BIAS:
        b_ptrs = b_ptr + expert * stride_be + offs_n * stride_bi
        acc_gate += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_ptrs + I * stride_bi, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if CLAMP:
        acc_gate = tl.minimum(acc_gate, limit)
        acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
    h = acc_gate * tl.sigmoid(acc_gate * alpha) * (acc_up + up_offset)
    h_ptrs = h_ptr + pair_M[:, None] * stride_hn + offs_n[None, :] * stride_hi
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _store_down(acc, b_ptr, weights_ptr, y_ptr, expert, pair_M, row_ok, offs_n, col_ok, stride_be, stride_bd,
                stride_yn, stride_yd, HAS_BIAS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """The down GEMM's epilogue (also kernels/quant_triton.py's): plus the expert's bias, times each pair's
    router weight (float32), stored as y rows of the block's pairs."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + offs_n * stride_bd, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(weights_ptr + pair_M, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + pair_M[:, None] * stride_yn + offs_n[None, :] * stride_yd
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
                    num_pairs, num_rows, D, I, stride_xt, stride_xd, stride_we, stride_wi, stride_wd,
                    stride_be, stride_bi, stride_hn, stride_hi, alpha, limit, up_offset, TOP_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr):
    """h[p, n] = act(g, u) with g = x[p // K] . w13[e, n] (+ b13[e, n]), u = x[p // K] . w13[e, I + n]
    (+ b13[e, I + n]) for the block's pairs p; act(g, u) = g * sigmoid(alpha g) * (u + up_offset) after
    clamping g <= limit and |u| <= limit when CLAMP (alpha 1, offset 0: silu(g) * u)."""
    pid_m, pid_n = _block_of(tl.program_id(0), num_rows, I, BLOCK_M, BLOCK_N, GROUP_M)
    expert, pair_M, row_ok = _row_block(sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, pid_m, num_pairs,
                                        BLOCK_M)
    if expert == -1:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair_M // TOP_K)[:, None] * stride_xt + offs_k[None, :] * stride_xd
    gate_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wi + offs_k[:, None] * stride_wd
    up_ptrs = gate_ptrs + I * stride_wi
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = offs_k < D - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        acc_gate = tl.dot(a, tl.load(gate_ptrs, mask=b_mask, other=0.0), acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, tl.load(up_ptrs, mask=b_mask, other=0.0), acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xd
        gate_ptrs += BLOCK_K * stride_wd
        up_ptrs += BLOCK_K * stride_wd
    _store_swiglu(acc_gate, acc_up, b_ptr, h_ptr, expert, pair_M, row_ok, offs_n, col_ok, I, stride_be, stride_bi,
                  stride_hn, stride_hi, alpha, limit, up_offset, HAS_BIAS, CLAMP)


@triton.jit
def _down_kernel(h_ptr, w_ptr, b_ptr, y_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
                 num_pairs, num_rows, I, D, stride_hn, stride_hi, stride_we, stride_wd, stride_wi,
                 stride_be, stride_bd, stride_yn, stride_yd, MUL_ROUTED_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[p, d] = weight[p] * (h[p] . w2[e, d] (+ b2[e, d])) for the block's pairs p (weight product in
    float32)."""
    pid_m, pid_n = _block_of(tl.program_id(0), num_rows, D, BLOCK_M, BLOCK_N, GROUP_M)
    expert, pair_M, row_ok = _row_block(sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, pid_m, num_pairs,
                                        BLOCK_M)
    if expert == -1:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair_M[:, None] * stride_hn + offs_k[None, :] * stride_hi
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wd + offs_k[:, None] * stride_wi
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = offs_k < I - k0
        a = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K * stride_hi
        w_ptrs += BLOCK_K * stride_wi
    _store_down(acc, b_ptr, weights_ptr, y_ptr, expert, pair_M, row_ok, offs_n, col_ok, stride_be, stride_bd,
                stride_yn, stride_yd, HAS_BIAS, MUL_ROUTED_WEIGHT)


def _check_args(x_TD: torch.Tensor, w13_EID2: torch.Tensor, w2_EDI: torch.Tensor,
                topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor) -> None:
    """Raise ValueError unless the shapes, dtypes and devices fit together."""
    if x_TD.dim() != 2 or x_TD.dtype not in _DTYPES:
        raise ValueError(f"fused_moe: x must be 2-D (T, D) float32/float16/bfloat16, got "
                         f"{tuple(x_TD.shape)} {x_TD.dtype}")
    T, D = x_TD.shape
    if w13_EID2.dim() != 3 or w13_EID2.shape[1] % 2 or w13_EID2.shape[2] != D:
        raise ValueError(f"fused_moe: w13 must be (E, 2I, D={D}), got {tuple(w13_EID2.shape)}")
    E, I = w13_EID2.shape[0], w13_EID2.shape[1] // 2
    if tuple(w2_EDI.shape) != (E, D, I):
        raise ValueError(f"fused_moe: w2 must be (E, D, I) = {(E, D, I)}, got {tuple(w2_EDI.shape)}")
    if w13_EID2.dtype != x_TD.dtype or w2_EDI.dtype != x_TD.dtype:
        raise ValueError(f"fused_moe: weights must have x's dtype {x_TD.dtype}, got {w13_EID2.dtype}, {w2_EDI.dtype}")
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T or topk_ids_TK.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"fused_moe: topk_ids must be (T={T}, K) int64/int32, got "
                         f"{tuple(topk_ids_TK.shape)} {topk_ids_TK.dtype}")
    if topk_weights_TK.shape != topk_ids_TK.shape or topk_weights_TK.dtype not in (torch.float32, x_TD.dtype):
        raise ValueError(f"fused_moe: topk_weights must be {tuple(topk_ids_TK.shape)} float32 or {x_TD.dtype}, "
                         f"got {tuple(topk_weights_TK.shape)} {topk_weights_TK.dtype}")
    devices = {t.device for t in (x_TD, w13_EID2, w2_EDI, topk_weights_TK, topk_ids_TK)}
    if len(devices) != 1:
        raise ValueError(f"fused_moe: all tensors must be on one device, got {devices}")


def fused_moe(x_TD: torch.Tensor, w13_EID2: torch.Tensor, w2_EDI: torch.Tensor, topk_weights_TK: torch.Tensor,
              topk_ids_TK: torch.Tensor, *, b13_EI2: torch.Tensor | None = None, b2_ED: torch.Tensor | None = None,
              act: SwiGLU = SILU, config: MoEConfig | None = None) -> torch.Tensor:
    """y_TD = sum_k weight[t, k] * W2_e (silu(W1_e x_t) * (W3_e x_t)), e = ids[t, k]; x's dtype.
    With biases and act: sum_k weight[t, k] * (W2_e act(W1_e x_t + b1_e, W3_e x_t + b3_e) + b2_e).

    x_TD float32/float16/bfloat16 (any strides); w13_EID2 (E, 2I, D) and w2_EDI (E, D, I) in x's
    dtype; topk_weights_TK float32 or x's dtype; topk_ids_TK int64/int32 in [0, E). float32 inputs
    use IEEE (not TF32) dot products so results match the torch reference. T == 0 gives (0, D).
    config: tile sizes; default_config(...) when None. Raises ValueError on mismatched arguments.
    """
    _check_args(x_TD, w13_EID2, w2_EDI, topk_weights_TK, topk_ids_TK)
    if (b13_EI2 is None) != (b2_ED is None):
        raise ValueError("fused_moe: give both biases (b13 and b2) or neither")
    if b13_EI2 is not None and (tuple(b13_EI2.shape) != tuple(w13_EID2.shape[:2])
                                or tuple(b2_ED.shape) != (w2_EDI.shape[0], w2_EDI.shape[1])):
        raise ValueError(f"fused_moe: biases must be b13 (E, 2I) = {tuple(w13_EID2.shape[:2])} and b2 (E, D) = "
                         f"{tuple(w2_EDI.shape[:2])}, got {tuple(b13_EI2.shape)}, {tuple(b2_ED.shape)}")
    (T, D), (E, I2, _), K = x_TD.shape, w13_EID2.shape, topk_ids_TK.shape[1]
    I, N, dev, dtype = I2 // 2, T * K, x_TD.device, x_TD.dtype
    if N == 0:
        return torch.zeros((T, D), dtype=dtype, device=dev)  # T == 0 (empty) or K == 0 (nothing routed)
    cfg = config or default_config(T, K, E, D, I, dtype)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids_TK, cfg.BLOCK_M, E)
    num_rows = sorted_ids.shape[0]
    common = dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                  DOT_PRECISION="ieee" if dtype == torch.float32 else None,  # None: the default for 16-bit
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    h_NI = torch.empty((N, I), dtype=dtype, device=dev)
    grid = (triton.cdiv(num_rows, cfg.BLOCK_M) * triton.cdiv(I, cfg.BLOCK_N),)
    has_bias = b13_EI2 is not None
    b13, b2 = (b13_EI2, b2_ED) if has_bias else (w13_EID2, w2_EDI)  # (never read without HAS_BIAS)
    _gate_up_kernel[grid](x_TD, w13_EID2, b13, h_NI, sorted_ids, expert_ids, num_post_padded, N, num_rows, D, I,
                          *x_TD.stride(), *w13_EID2.stride(), *b13.stride()[:2], *h_NI.stride(), float(act.alpha),
                          float(act.limit or 0.0), float(act.up_offset), TOP_K=K, HAS_BIAS=has_bias,
                          CLAMP=act.limit is not None, **common)
    y_ND = torch.empty((N, D), dtype=dtype, device=dev)
    weights_N = topk_weights_TK.reshape(-1).contiguous()  # indexed by pair id in the kernel
    grid = (triton.cdiv(num_rows, cfg.BLOCK_M) * triton.cdiv(D, cfg.BLOCK_N),)
    _down_kernel[grid](h_NI, w2_EDI, b2, y_ND, weights_N, sorted_ids, expert_ids, num_post_padded, N, num_rows, I,
                       D, *h_NI.stride(), *w2_EDI.stride(), *b2.stride()[:2], *y_ND.stride(), MUL_ROUTED_WEIGHT=True,
                       HAS_BIAS=has_bias, **common)
    return y_ND.view(T, K, D).sum(dim=1)  # rows of token t are pairs t*K .. t*K+K-1, adjacent
