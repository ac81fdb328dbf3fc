"""RMSNorm in Triton, with the residual add optionally fused. Same signatures as kernels/rmsnorm.py.

Legend: T rows (tokens, or tokens x heads for per-head q/k norm), D the normalised dimension.
One program normalises BLOCK_T rows; D is padded to a power of two and masked. Rounding follows
the reference: the residual sum is rounded to x's dtype before the statistics are taken, and the
normalised value is rounded before the weight multiplies it.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, r_out_ptr, T, D, stride_x, stride_r, stride_y, stride_ro, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < T) & (cols[None, :] < D)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(r_out_ptr.dtype.element_ty)
        tl.store(r_out_ptr + rows[:, None] * stride_ro + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    normed = (x * inv_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], normed * w[None, :], mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({D},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} differs from x's {tuple(x.shape)}")
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)  # as weight * normed
    r_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if T == 0:
        return y, r_out
    r2 = residual.reshape(-1, D).contiguous() if residual is not None else x2
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_T = max(1, min(16, 4096 // BLOCK_D, triton.next_power_of_2(T)))
    y2, ro2 = y.view(-1, D), (r_out.view(-1, D) if r_out is not None else y.view(-1, D))
    _rms_norm_kernel[(triton.cdiv(T, BLOCK_T),)](
        x2, r2, weight, y2, ro2, T, D, x2.stride(0), r2.stride(0), y2.stride(0), ro2.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)
    return y, r_out


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * x / sqrt(mean(x^2) + eps) over the last axis; any leading shape; x's dtype."""
    return _launch(x_TD, None, weight_D, eps)[0]


def fused_add_rms_norm(x_TD: torch.Tensor, residual_TD: torch.Tensor, weight_D: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + residual (rounded to x's dtype), y = rms_norm(r): returns (y_TD, r_TD) in one pass."""
    y, r = _launch(x_TD, residual_TD, weight_D, eps)
    return y, r
