"""RMSNorm with the residual add fused, shared by the decoder and MLA (models/mla.py)."""
import torch
from torch import nn

from kernels.ops import KernelOps
from models.stages import EAGER, DecodeStages


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: KernelOps):
        super().__init__()
        self.weight, self.eps, self.ops = nn.Parameter(torch.ones(dim)), eps, ops
        self.stages: DecodeStages = EAGER  # models/stages.py: compile_stages swaps in compiled ones

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the first layer has no residual yet."""
        if residual is None:  # once per step: not worth a compiled graph of its own
            return self(x), x
        return self.stages.add_rms_norm(x, residual, self.weight, self.eps, self.ops)
