"""Training losses: next-token cross entropy, the MoE load-balancing loss (Switch / Mixtral, as
transformers' `load_balancing_loss_func` computes it), the router z-loss (ST-MoE) and DeepSeek-V3's
multi-token-prediction loss (mtp_loss).

Legend: T tokens, E experts, K experts per token, V vocabulary.
"""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

IGNORE = -100  # label of a position that is not scored


@dataclass
class Losses:
    """One forward's losses (0-dim float32 tensors); `total` is what backward runs on."""

    total: torch.Tensor
    lm: torch.Tensor
    aux: torch.Tensor | None = None
    z: torch.Tensor | None = None
    mtp: torch.Tensor | None = None  # the MTP layer's cross entropy (unweighted)
    mtp_distill: torch.Tensor | None = None  # its cross entropy against the model's own prediction (--mtp-distill)


def lm_loss(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the positions whose label is not IGNORE (labels are already the next
    tokens: the caller shifts)."""
    return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE)


def mtp_targets(labels_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's multi-token prediction (depth 1; models/mtp.py): at position t the MTP module
    takes the target's hidden state h_t and the token x_{t+1} and predicts x_{t+2}. From the shifted
    labels (labels[t] = x_{t+1}) of B rows of L: (its input tokens (B, L - 1), IGNORE ones as 0, and
    its labels (B, L - 1): labels[t + 1], IGNORE where either token is unknown). Rows lose their last
    position: nothing follows it twice."""
    inputs_BL1 = labels_BL[:, :-1]
    targets_BL1 = labels_BL[:, 1:].masked_fill(inputs_BL1 == IGNORE, IGNORE)
    return inputs_BL1.clamp(min=0), targets_BL1


def mtp_loss(mtp_logits_TV: torch.Tensor, targets_T: torch.Tensor, coef: float) -> torch.Tensor:
    """coef (DeepSeek's lambda: 0.3, then 0.1 late in V3's training) times the mean cross entropy of
    the MTP module's predictions of x_{t+2} (targets from mtp_targets, flattened)."""
    return coef * F.cross_entropy(mtp_logits_TV.float(), targets_T, ignore_index=IGNORE)


def mtp_distill_loss(mtp_logits_TV: torch.Tensor, next_logits_TV: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of the MTP module's predictions of x_{t+2} against the target model's own
    distribution for that token (its logits at position t+1, detached), over the positions targets_T
    scores: self-distillation. Speculative decoding accepts a draft when the model itself would have
    produced it, so a drafter that learns the model's distribution, not the data's, is accepted more."""
    keep_T = targets_T != IGNORE
    teacher_TV = torch.softmax(next_logits_TV[keep_T].detach().float(), dim=-1)
    return -(teacher_TV * torch.log_softmax(mtp_logits_TV[keep_T].float(), dim=-1)).sum(-1).mean()


def mtp_agreement(mtp_logits_TV: torch.Tensor, next_logits_TV: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    """The share of scored positions where the MTP module's top token is the target model's own top
    token for x_{t+2}: a greedy draft's acceptance with the model's prefix (teacher forced)."""
    keep_T = targets_T != IGNORE
    return (mtp_logits_TV[keep_T].argmax(-1) == next_logits_TV[keep_T].argmax(-1)).float().mean()


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int,
                        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """E * sum_e f_e * P_e over the rows of every MoE layer taken together, where f_e is the number
    of top-k picks of expert e per row and P_e the mean router probability of e (transformers'
    load_balancing_loss_func with no attention mask).

    all_reduce_sum: sums a tensor over the data-parallel ranks. Given, f is the whole global batch's
    (it has no gradient) while P stays this rank's, so the mean over ranks of this value equals the
    loss of the global batch computed in one place (ranks hold equal numbers of rows).
    """
    counts_E = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_sum_E = torch.zeros_like(counts_E)
    rows = 0
    for logits_TE in router_logits:
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        ids_TK = torch.topk(probs_TE, top_k, dim=-1).indices
        counts_E = counts_E + torch.bincount(ids_TK.reshape(-1), minlength=num_experts).float()
        prob_sum_E = prob_sum_E + probs_TE.sum(dim=0)
        rows += logits_TE.shape[0]
    local_rows = torch.tensor([float(rows)], device=counts_E.device)
    if all_reduce_sum is not None:
        reduced = all_reduce_sum(torch.cat([counts_E, local_rows]))
        f_E = reduced[:-1] / reduced[-1]
    else:
        f_E = counts_E / local_rows
    return num_experts * (f_E * (prob_sum_E / local_rows)).sum()


def router_z_loss(router_logits: list[torch.Tensor]) -> torch.Tensor:
    """Mean over the rows of every MoE layer of logsumexp(router logits)^2 (ST-MoE, eq. 5)."""
    z_T = torch.cat([torch.logsumexp(logits_TE.float(), dim=-1) for logits_TE in router_logits])
    return z_T.pow(2).mean()
