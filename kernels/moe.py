"""Mixture-of-experts computation: permute tokens by expert, grouped SwiGLU GEMM, weighted combine.

Legend: T tokens, D hidden, K experts per token, E experts, I expert intermediate size,
N = T*K token-expert pairs (rows after permutation).
Weights: w13_EID2 is stored as (E, 2I, D): rows [0, I) are the gate projection (w1 / gate_proj),
rows [I, 2I) the up projection (w3 / up_proj); w2_EDI is (E, D, I), the down projection.
Optional biases (gpt-oss): b13_EI2 (E, 2I) in w13's row order, b2_ED (E, D), added to each projection
before the activation / before the router weight. The activation is a SwiGLU (see SwiGLU): plain
silu(gate) * up by default, gpt-oss's clamped variant with its alpha, limit and up + 1.

On a CPU without oneDNN's bf16/fp16 path (AVX2 only) torch emulates reduced-precision GEMMs at a
few GFLOP/s, while float32 runs near the machine's rate: there an expert with at least
UPCAST_MIN_ROWS rows copies its weights to float32 for the call (a memory-bound copy that the
faster GEMM repays from about that many rows on: bench/kernels_cpu.py) and computes in float32,
rounding once at the end. Smaller groups (decode at small batch) keep the bf16 GEMM, which reads
half the bytes.
"""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kernels.cpu_linear import gemm_is_emulated as _gemm_is_emulated  # tests monkeypatch this name

UPCAST_MIN_ROWS = 16  # rows of one expert from which emulated bf16/fp16 weights are upcast (see above)


@dataclass(frozen=True)
class SwiGLU:
    """The expert activation h = g * sigmoid(alpha * g) * (u + up_offset), where g = min(gate, limit)
    and u = clamp(up, -limit, limit) when limit is set. The default (alpha 1, no limit, offset 0)
    is silu(gate) * up (Mixtral, Qwen, DeepSeek, ...); gpt-oss uses alpha 1.702, limit 7, offset 1."""

    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0

    @property
    def is_silu(self) -> bool:
        return self.alpha == 1.0 and self.limit is None and self.up_offset == 0.0

    @property
    def is_clamped_silu(self) -> bool:
        """silu(min(gate, limit)) * clamp(up, -limit, limit), or plain SiLU-mul (DeepSeek-V4's experts)."""
        return self.alpha == 1.0 and self.up_offset == 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.is_silu:
            return F.silu(gate) * up
        if self.is_clamped_silu:  # (rounded as transformers' DeepSeek-V4: F.silu, then the product)
            return F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + self.up_offset)


SILU = SwiGLU()


@dataclass(frozen=True)
class Permutation:
    """How token-expert pairs were sorted by expert; `unpermute` consumes it.

    token_idx_N: source token of each sorted row. pair_idx_N: index into the flattened (T*K)
    top-k arrays. counts_E: rows per expert (CPU list, so slicing needs no device sync later).
    """

    token_idx_N: torch.Tensor
    pair_idx_N: torch.Tensor
    counts_E: list[int]
    num_tokens: int


def permute(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, Permutation]:
    """Copy each token once per chosen expert, grouped by expert id (stable within an expert).

    Returns x_ND, whose rows for expert e are the contiguous slice
    [sum(counts[:e]), sum(counts[:e+1])), and the Permutation to undo it.
    """
    T, K = topk_ids_TK.shape
    flat_ids_N = topk_ids_TK.reshape(-1)
    pair_idx_N = torch.argsort(flat_ids_N, stable=True)
    token_idx_N = torch.div(pair_idx_N, K, rounding_mode="floor")
    counts_E = torch.bincount(flat_ids_N, minlength=num_experts).tolist()
    return x_TD.index_select(0, token_idx_N), Permutation(token_idx_N, pair_idx_N, counts_E, T)


def _upcast_from(x_ND: torch.Tensor, w: object, linear: Callable, upcast_min_rows: int | None) -> int | None:
    """The row count from which grouped_swiglu upcasts an expert (None: never) for these inputs."""
    if (upcast_min_rows is None or linear is not F.linear or not isinstance(w, torch.Tensor)
            or x_ND.device.type != "cpu" or not _gemm_is_emulated(x_ND.dtype)):
        return None
    return upcast_min_rows


def grouped_swiglu(x_ND: torch.Tensor, counts_E: list[int], w13_EID2: torch.Tensor, w2_EDI: torch.Tensor,
                   linear: Callable = F.linear, b13_EI2: torch.Tensor | None = None,
                   b2_ED: torch.Tensor | None = None, act: SwiGLU = SILU,
                   upcast_min_rows: int | None = UPCAST_MIN_ROWS) -> torch.Tensor:
    """For each expert e, y = act(x W1^T + b1, x W3^T + b3) W2^T + b2 over its contiguous slice of rows
    (no biases and act = SILU: (silu(x W1^T) * (x W3^T)) W2^T).

    One matmul pair per active expert; experts with no rows cost nothing. Returns y_ND in x's dtype.
    w13_EID2 / w2_EDI may also be per-expert sequences of any weight `linear` accepts (e.g. the
    oneDNN-packed weights of kernels/cpu_linear.py with linear=packed_linear).
    upcast_min_rows: on a CPU whose bf16/fp16 GEMMs are emulated, experts with at least this many
    rows compute in float32 (module docstring); None keeps every GEMM in x's dtype.
    """
    y_ND = torch.empty_like(x_ND)
    upcast_from = _upcast_from(x_ND, w13_EID2, linear, upcast_min_rows)
    start = 0
    for e, n in enumerate(counts_E):  # (a loop over experts, not tokens)
        if n == 0:
            continue
        rows = slice(start, start + n)
        x, w13, w2 = x_ND[rows], w13_EID2[e], w2_EDI[e]
        b13, b2 = None if b13_EI2 is None else b13_EI2[e], None if b2_ED is None else b2_ED[e]
        if upcast_from is not None and n >= upcast_from:
            x, w13, w2 = x.float(), w13.float(), w2.float()
            b13, b2 = None if b13 is None else b13.float(), None if b2 is None else b2.float()
        gate, up = linear(x, w13, b13).chunk(2, dim=-1)
        y_ND[rows] = linear(act(gate, up), w2, b2)
        start += n
    return y_ND


def unpermute(y_ND: torch.Tensor, perm: Permutation, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """Weight each row by its router weight and sum the K rows of each token: returns y_TD.

    The product is taken in float32 when the weights are float32 (as Mixtral's reference does) and
    the result is cast back to y's dtype.
    """
    w_N = topk_weights_TK.reshape(-1).index_select(0, perm.pair_idx_N)
    weighted_ND = (y_ND * w_N[:, None]).to(y_ND.dtype)
    out_TD = torch.zeros(perm.num_tokens, y_ND.shape[1], dtype=y_ND.dtype, device=y_ND.device)
    return out_TD.index_add_(0, perm.token_idx_N, weighted_ND)


def fused_moe(
    x_TD: torch.Tensor,
    w13_EID2: torch.Tensor,
    w2_EDI: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    b13_EI2: torch.Tensor | None = None,
    b2_ED: torch.Tensor | None = None,
    act: SwiGLU = SILU,
    upcast_min_rows: int | None = UPCAST_MIN_ROWS,
) -> torch.Tensor:
    """Reference MoE: permute -> grouped SwiGLU GEMM -> weighted combine. Returns y_TD (x's dtype).

    x_TD: activations; topk_ids_TK int64 in [0, E); topk_weights_TK float32 or x's dtype.
    b13_EI2 (E, 2I) / b2_ED (E, D): optional biases in the weights' dtype; act: the SwiGLU variant.
    upcast_min_rows: see grouped_swiglu (None: every GEMM in x's dtype, as before the upcast existed).
    """
    x_ND, perm = permute(x_TD, topk_ids_TK, w13_EID2.shape[0])
    y_ND = grouped_swiglu(x_ND, perm.counts_E, w13_EID2, w2_EDI, b13_EI2=b13_EI2, b2_ED=b2_ED, act=act,
                          upcast_min_rows=upcast_min_rows)
    return unpermute(y_ND, perm, topk_weights_TK)


def moe_gather_einsum(
    x_TD: torch.Tensor,
    w13_EID2: torch.Tensor,
    w2_EDI: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
) -> torch.Tensor:
    """The naive formulation (gpt-fast's ConditionalFeedForward): gather every chosen expert's
    weights per token and contract with einsum. Kept as a second oracle and as the baseline of
    bench/moe_cpu.py; it copies K full expert matrices per token, so it is slow for large T.
    """
    w13_TKID2 = w13_EID2[topk_ids_TK]
    w2_TKDI = w2_EDI[topk_ids_TK]
    gate_up_TKI2 = torch.einsum("td,tkfd->tkf", x_TD, w13_TKID2)
    gate, up = gate_up_TKI2.chunk(2, dim=-1)
    y_TKD = torch.einsum("tki,tkdi->tkd", F.silu(gate) * up, w2_TKDI)
    return torch.einsum("tkd,tk->td", y_TKD.float(), topk_weights_TK.float()).to(x_TD.dtype)


def fused_moe_packed(
    x_TD: torch.Tensor,
    w13_packed_E: list[torch.Tensor],
    w2_packed_E: list[torch.Tensor],
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    b13_EI2: torch.Tensor | None = None,
    b2_ED: torch.Tensor | None = None,
    act: SwiGLU = SILU,
) -> torch.Tensor:
    """fused_moe with each expert's weights prepared for CPU inference (kernels/cpu_linear.CpuWeight:
    packed for oneDNN, with a bf16 copy for few rows where it applies): CPU inference only.
    w13_packed_E[e] holds w13[e] (2I, D); w2_packed_E[e] holds w2[e] (D, I); biases and act as in
    fused_moe."""
    from kernels.cpu_linear import cpu_linear

    if x_TD.shape[0] == 1:  # decode at batch 1: no sort, gather or scatter
        return _one_token_moe(x_TD, w13_packed_E, w2_packed_E, topk_weights_TK, topk_ids_TK, cpu_linear, b13_EI2,
                              b2_ED, act)
    x_ND, perm = permute(x_TD, topk_ids_TK, len(w13_packed_E))
    y_ND = grouped_swiglu(x_ND, perm.counts_E, w13_packed_E, w2_packed_E, linear=cpu_linear, b13_EI2=b13_EI2,
                          b2_ED=b2_ED, act=act)
    return unpermute(y_ND, perm, topk_weights_TK)


def _one_token_moe(x_1D: torch.Tensor, w13_E: list, w2_E: list, topk_weights_1K: torch.Tensor,
                   topk_ids_1K: torch.Tensor, linear: Callable, b13_EI2: torch.Tensor | None,
                   b2_ED: torch.Tensor | None, act: SwiGLU) -> torch.Tensor:
    """fused_moe_packed for one token: its K experts in ascending id order, each output weighted as
    unpermute weights it and summed in the order its index_add_ adds (the sorted order), so the
    result is bitwise the general path's. Saves the ~12 sort/gather/scatter ops of a 1-row step."""
    ids = topk_ids_1K[0].tolist()
    y_1D = torch.zeros_like(x_1D)
    for k in sorted(range(len(ids)), key=ids.__getitem__):
        e = ids[k]
        gate, up = linear(x_1D, w13_E[e], None if b13_EI2 is None else b13_EI2[e]).chunk(2, dim=-1)
        h_1D = linear(act(gate, up), w2_E[e], None if b2_ED is None else b2_ED[e])
        y_1D += (h_1D * topk_weights_1K[:, k:k + 1]).to(h_1D.dtype)
    return y_1D
