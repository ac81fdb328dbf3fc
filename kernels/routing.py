"""Router scoring and top-k expert selection.

Legend: T tokens, E experts, K experts chosen per token.
"""
import torch


def topk_route(
    logits_TE: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick K experts per token.

    logits_TE: router logits, any float dtype. scoring: "softmax" (probabilities over all E experts)
    or "sigmoid" (independent scores). renormalize: divide the chosen K scores by their sum.
    Returns (topk_weights_TK float32, topk_ids_TK int64). Among exactly tied scores torch.topk's
    choice is unspecified (the Triton kernel takes the lowest ids).
    """
    if scoring == "softmax":
        scores_TE = torch.softmax(logits_TE.float(), dim=-1)
    elif scoring == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE.float())
    else:
        raise ValueError(f"unknown router scoring {scoring!r}; expected 'softmax' or 'sigmoid'")
    topk_weights_TK, topk_ids_TK = torch.topk(scores_TE, top_k, dim=-1)
    if renormalize:
        topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(dim=-1, keepdim=True)
    return topk_weights_TK, topk_ids_TK
