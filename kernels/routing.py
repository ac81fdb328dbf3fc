"""Router scoring and top-k expert selection: one configurable router for every family.

Legend: T tokens, E experts, K experts chosen per token, G expert groups.

What the families need (see RouterConfig): softmax (Mixtral, Qwen, OLMoE, DeepSeek-V2, gpt-oss) or
sigmoid scores (DeepSeek-V3, Kimi K2, GLM-4.5, MiniMax-M2) or sqrt(softplus) ones (DeepSeek-V4, whose
first layers take their experts from a token-id table instead: hash_route); a per-expert correction bias added only
to choose experts, never to weigh them (V3's, GLM's and MiniMax-M2's e_score_correction_bias); grouped top-k, where only the topk_groups best of G equal
groups of experts may be chosen, a group scored by its best expert (V2's group_limited_greedy) or
by the sum of its best two (V3, GLM); renormalisation of the chosen scores; a final scaling factor.
gpt-oss softmaxes its top-k logits only: that is softmax scoring with renormalisation (the same
ranking, and softmax(all)[chosen] / sum of those = softmax(chosen)); its logits have a bias
(RouterConfig.bias, a parameter of the model's router).

On the CPU, outside autograd and torch.compile, softmax routing without groups or a correction bias
runs in one native call (kernels/native.route_softmax_topk, the routing of the native decode step:
kernels/csrc/decode_step.c), a handful of torch ops fewer per layer, at the row counts where
kernels/choice.py measured it faster (op "routing": the call walks its rows on one thread, torch's
top-k is vectorised); its weights agree with the torch ops below up to the last bit of the
softmax's exp, the ids but for exact ties.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import native

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class RouterConfig:
    """How a MoE layer picks and weighs its experts (the arguments of topk_route, plus how the
    model computes the logits and applies the weights).

    top_k: experts per token. scoring: "softmax" or "sigmoid". renormalize: divide the chosen scores
    by their sum. num_groups / topk_groups: experts form num_groups equal groups and only the
    topk_groups best groups are eligible (1 / 1: no grouping). group_score: "max" or "top2_sum".
    scaling: multiplies the final weights (routed_scaling_factor). correction_bias: the router has a
    per-expert bias added to the scores for selection only. logits_fp32: the router matmul runs in
    float32 (DeepSeek). weights_fp32: expert outputs are weighed by float32 weights (Mixtral,
    DeepSeek); otherwise the weights are rounded to the activations' dtype first. bias: the router's
    linear layer has a bias, added to the logits (gpt-oss).
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    scaling: float = 1.0
    correction_bias: bool = False
    logits_fp32: bool = False
    weights_fp32: bool = False
    bias: bool = False

    def route_kwargs(self) -> dict:
        """The keyword arguments of topk_route past (logits, top_k, scoring, renormalize)."""
        return dict(num_groups=self.num_groups, topk_groups=self.topk_groups, group_score=self.group_score,
                    scaling=self.scaling)


def check_route_args(E: int, top_k: int, scoring: str, num_groups: int, topk_groups: int, group_score: str) -> None:
    """Raise ValueError naming the argument that cannot route E experts."""
    if scoring not in SCORINGS:
        raise ValueError(f"unknown router scoring {scoring!r}; expected one of {', '.join(SCORINGS)}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"unknown group_score {group_score!r}; expected one of {', '.join(GROUP_SCORES)}")
    if num_groups < 1 or E % num_groups:
        raise ValueError(f"topk_route: num_groups={num_groups} must divide the {E} experts")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_route: topk_groups={topk_groups} must be in [1, num_groups={num_groups}]")
    if not 1 <= top_k <= topk_groups * (E // num_groups):
        raise ValueError(f"topk_route: top_k={top_k} must be in [1, {topk_groups * (E // num_groups)}] "
                         f"(the experts of the {topk_groups} eligible groups of {E // num_groups})")


def _native(logits_TE: torch.Tensor) -> bool:
    return (logits_TE.dtype in (torch.bfloat16, torch.float32) and logits_TE.dim() == 2 and logits_TE.is_contiguous()
            and native.eager_cpu(logits_TE) and native.runs_native("routing", logits_TE.shape[0]))


def topk_route(
    logits_TE: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False, *,
    correction_bias_E: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
    group_score: str = "max", scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick K experts per token (see RouterConfig for the arguments).

    logits_TE: router logits, any float dtype. correction_bias_E: float32 bias added to the scores
    to choose experts (and groups); the weights are the unbiased scores. Returns
    (topk_weights_TK float32, topk_ids_TK int64). Among exactly tied scores torch.topk's choice is
    unspecified (the Triton kernel takes the lowest ids).
    """
    E = logits_TE.shape[-1]
    check_route_args(E, top_k, scoring, num_groups, topk_groups, group_score)
    if scoring == "softmax" and num_groups == 1 and correction_bias_E is None and _native(logits_TE):
        return native.route_softmax_topk(logits_TE, top_k, renormalize, scaling)
    return topk_route_torch(logits_TE, top_k, scoring, renormalize, correction_bias_E=correction_bias_E,
                            num_groups=num_groups, topk_groups=topk_groups, group_score=group_score, scaling=scaling)


def score(logits_TE: torch.Tensor, scoring: str) -> torch.Tensor:
    """float32 scores of the logits: softmax, sigmoid or sqrt(softplus) (DeepSeek-V4)."""
    logits = logits_TE.float()
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    return torch.sigmoid(logits) if scoring == "sigmoid" else F.softplus(logits).sqrt()


def hash_route(logits_TE: torch.Tensor, ids_TK: torch.Tensor, scoring: str, renormalize: bool,
               scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's hash-routed layers: the experts are given (ids_TK, from a token-id table) and
    weighed by their scores, renormalised (over the sum + 1e-20, as transformers) and scaled.
    Returns (weights_TK float32, ids_TK int64)."""
    weights_TK = score(logits_TE, scoring).gather(1, ids_TK)
    if renormalize:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_TK * scaling if scaling != 1.0 else weights_TK, ids_TK


def topk_route_torch(
    logits_TE: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False, *,
    correction_bias_E: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
    group_score: str = "max", scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_route by torch ops alone (any device), on arguments topk_route has checked."""
    E = logits_TE.shape[-1]
    scores_TE = score(logits_TE, scoring)
    choice_TE = scores_TE if correction_bias_E is None else scores_TE + correction_bias_E.float()
    if num_groups > 1:
        T = choice_TE.shape[0]
        grouped_TGS = choice_TE.view(T, num_groups, E // num_groups)
        if group_score == "max":
            group_TG = grouped_TGS.max(dim=-1).values
        else:
            group_TG = grouped_TGS.topk(min(2, E // num_groups), dim=-1).values.sum(dim=-1)
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
        keep_TG.scatter_(1, group_TG.topk(topk_groups, dim=-1).indices, True)
        choice_TE = choice_TE.masked_fill(~keep_TG.repeat_interleave(E // num_groups, dim=1), float("-inf"))
    topk_ids_TK = torch.topk(choice_TE, top_k, dim=-1).indices
    topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    if renormalize:
        topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        topk_weights_TK = topk_weights_TK * scaling
    return topk_weights_TK, topk_ids_TK
