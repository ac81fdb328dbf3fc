"""AdamW with decoupled weight decay on matrices only, and the warmup-then-cosine learning rate."""
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class CosineSchedule:
    """lr(step), step counted from 0: linear warmup from lr/warmup_steps to lr over warmup_steps
    steps, then a cosine from lr down to min_lr at total_steps (and min_lr after)."""

    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def state_dict(self) -> dict:
        return asdict(self)


def build_optimizer(named_params: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float,
                    betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW; matrices (ndim >= 2: linear, embedding, expert weights) decay, norms and biases do not.
    Parameter order is the model's, so optimiser state saved by one run loads into the next."""
    decay = [p for _, p in named_params if p.ndim >= 2]
    no_decay = [p for _, p in named_params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate of every parameter group (the schedule sets it before each step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
