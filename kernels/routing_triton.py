"""Router scoring and top-k in one Triton kernel. Same signature as kernels/routing.py::topk_route.

Legend: T tokens, E experts, K experts chosen per token.
One program handles BLOCK_T tokens with all E scores in registers (E padded to a power of two):
softmax or sigmoid in float32, then K rounds of "take the maximum, mask it out". Ties go to the
lower expert id (torch.topk leaves the order of ties unspecified).
"""
import torch
import triton
import triton.language as tl

_SCORING = {"softmax": 0, "sigmoid": 1}


@triton.jit
def _topk_route_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_l, SCORING: tl.constexpr, RENORMALIZE: tl.constexpr,
                       TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    valid = row_ok[:, None] & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None] * stride_l + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    if SCORING == 0:
        x = tl.where(cols[None, :] < E, x, float("-inf"))  # rows past T stay finite: no NaN
        num = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = num / tl.sum(num, axis=1)[:, None]
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    scores = tl.where(cols[None, :] < E, scores, -1.0)  # padding never wins (real scores are >= 0)
    kcols = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(scores, axis=1)
        # lowest expert id among the maxima
        arg = tl.min(tl.where(scores == best[:, None], cols[None, :], BLOCK_E), axis=1)
        top_w = tl.where(kcols[None, :] == k, best[:, None], top_w)
        top_i = tl.where(kcols[None, :] == k, arg[:, None].to(tl.int64), top_i)
        scores = tl.where(cols[None, :] == arg[:, None], -2.0, scores)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out_mask = row_ok[:, None] & (kcols[None, :] < TOP_K)
    offs = rows[:, None] * TOP_K + kcols[None, :]
    tl.store(w_ptr + offs, top_w, mask=out_mask)
    tl.store(ids_ptr + offs, top_i, mask=out_mask)


def topk_route(logits_TE: torch.Tensor, top_k: int, scoring: str = "softmax",
               renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick K experts per token: returns (topk_weights_TK float32, topk_ids_TK int64).

    logits_TE: router logits (any float dtype, last dim contiguous). scoring: "softmax" or "sigmoid".
    renormalize: divide the chosen K scores by their sum.
    """
    if scoring not in _SCORING:
        raise ValueError(f"unknown router scoring {scoring!r}; expected 'softmax' or 'sigmoid'")
    if logits_TE.dim() != 2:
        raise ValueError(f"topk_route: logits must be (T, E), got shape {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"topk_route: top_k={top_k} must be in [1, {E}]")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits_TE.device)
    if T == 0:
        return weights, ids
    logits_TE = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
    BLOCK_E = triton.next_power_of_2(E)
    BLOCK_T = max(1, min(16, 4096 // BLOCK_E, triton.next_power_of_2(T)))
    _topk_route_kernel[(triton.cdiv(T, BLOCK_T),)](
        logits_TE, weights, ids, T, E, logits_TE.stride(0), SCORING=_SCORING[scoring], RENORMALIZE=renormalize,
        TOP_K=top_k, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=triton.next_power_of_2(top_k))
    return weights, ids
