"""RMSNorm (optionally with the residual add fused), computed in float32 as Hugging Face's reference does.

On the CPU, outside autograd and torch.compile, contiguous bf16/float32 inputs go to one native call
(kernels/native.add_rms_norm, kernels/csrc/rmsnorm.c) that rounds where these ops round, at the row
counts where kernels/choice.py measured it faster (op "rmsnorm"); the torch ops below stay the
reference and everything else's path.

Legend: T tokens, D hidden (the normalised dimension, last axis).
"""
import torch

from kernels import native


def _native(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    tensors = (x, weight) if residual is None else (x, weight, residual)
    # the table last: under torch.compile eager_cpu is False first, so no graph guards on it
    return (x.dtype in (torch.bfloat16, torch.float32)
            and all(t.dtype == x.dtype and t.is_contiguous() for t in tensors)
            and (residual is None or residual.shape == x.shape) and x.shape[-1] == weight.shape[0]
            and native.eager_cpu(*tensors) and native.runs_native("rmsnorm", x.numel() // max(x.shape[-1], 1)))


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * x / sqrt(mean(x^2) + eps), normalised over the last axis.

    x_TD: any leading shape, dtype bf16/fp16/fp32; the statistics are taken in float32 and the
    normalised value is cast back to x's dtype before the weight multiplies it (as transformers does,
    so bf16 results round at the same place).
    """
    if _native(x_TD, weight_D):
        return native.add_rms_norm(x_TD, None, weight_D, eps)[0]
    return rms_norm_torch(x_TD, weight_D, eps)


def rms_norm_torch(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm by torch ops alone (any device; autograd follows them)."""
    x32 = x_TD.float()
    var = x32.pow(2).mean(-1, keepdim=True)
    return weight_D * (x32 * torch.rsqrt(var + eps)).to(x_TD.dtype)


def fused_add_rms_norm(x_TD: torch.Tensor, residual_TD: torch.Tensor, weight_D: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm decoder step: r = x + residual (in x's dtype, as the model adds), y = rms_norm(r).

    Returns (y_TD, r_TD); r is the residual stream the next layer adds to.
    """
    if _native(x_TD, weight_D, residual_TD):
        return native.add_rms_norm(x_TD, residual_TD, weight_D, eps)
    r_TD = x_TD + residual_TD
    return rms_norm(r_TD, weight_D, eps), r_TD
