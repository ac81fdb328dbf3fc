"""Prepare a loaded model for CPU inference: every linear layer and every expert gets its weights
pre-packed for oneDNN (kernels/cpu_linear.py), and the unpacked copies are released.

The model's code does not change: modules are swapped once, after loading (the choice is made at
construction, never inside forward). Training and the GPU path never call this.
"""
import torch
from torch import nn

from kernels.cpu_linear import PackedLinear, pack_weight, packing_available
from kernels.moe import fused_moe_packed
from models.moe_decoder import Experts, MoEForCausalLM


class PackedExperts(nn.Module):
    """Experts with per-expert packed w13 (2I, D) and w2 (D, I)."""

    def __init__(self, experts: Experts | None = None):
        super().__init__()
        self.w13_packed = [] if experts is None else [pack_weight(w) for w in experts.w13.detach()]
        self.w2_packed = [] if experts is None else [pack_weight(w) for w in experts.w2.detach()]

    @classmethod
    def from_packed(cls, w13_packed: list, w2_packed: list) -> "PackedExperts":
        """Experts made of already packed per-expert weights (shared, not copied)."""
        out = cls()
        out.w13_packed, out.w2_packed = list(w13_packed), list(w2_packed)
        return out

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        return fused_moe_packed(x_TD, self.w13_packed, self.w2_packed, topk_weights_TK, topk_ids_TK)


def pack_for_cpu_inference(model: MoEForCausalLM) -> bool:
    """Swap linears and experts for packed ones in place. Returns False (and changes nothing) where
    the weights are not on the CPU or oneDNN cannot pack their dtype here (see packing_available)."""
    w = model.lm_head.weight
    if w.device.type != "cpu" or not packing_available(w.dtype):
        return False
    tied = model.cfg.tie_word_embeddings
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Experts):
                setattr(parent, name, PackedExperts(child))
            elif isinstance(child, nn.Linear) and not (tied and child is model.lm_head):
                setattr(parent, name, PackedLinear(child))
    return True
