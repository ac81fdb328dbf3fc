"""RMSNorm (optionally with the residual add fused), computed in float32 as Hugging Face's reference does.

Legend: T tokens, D hidden (the normalised dimension, last axis).
"""
import torch


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * x / sqrt(mean(x^2) + eps), normalised over the last axis.

    x_TD: any leading shape, dtype bf16/fp16/fp32; the statistics are taken in float32 and the
    normalised value is cast back to x's dtype before the weight multiplies it (as transformers does,
    so bf16 results round at the same place).
    """
    x32 = x_TD.float()
    var = x32.pow(2).mean(-1, keepdim=True)
    return weight_D * (x32 * torch.rsqrt(var + eps)).to(x_TD.dtype)


def fused_add_rms_norm(x_TD: torch.Tensor, residual_TD: torch.Tensor, weight_D: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm decoder step: r = x + residual (in x's dtype, as the model adds), y = rms_norm(r).

    Returns (y_TD, r_TD); r is the residual stream the next layer adds to.
    """
    r_TD = x_TD + residual_TD
    return rms_norm(r_TD, weight_D, eps), r_TD
