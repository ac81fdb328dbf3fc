"""Router scoring and top-k in one Triton kernel. Same signature as kernels/routing.py::topk_route.

Legend: T tokens, E experts, K experts chosen per token, G expert groups.
One program handles BLOCK_T tokens with all E scores in registers (E padded to a power of two):
softmax, sigmoid or sqrt(softplus) in float32, the correction bias added for the choice only, the group scores and
the eligible groups (G rounds of a masked max, then topk_groups rounds of "take the best group"),
then K rounds of "take the maximum, mask it out". Ties go to the lower expert (and group) id
(torch.topk leaves the order of ties unspecified).
"""
import torch
import triton
import triton.language as tl

from kernels.routing import GROUP_SCORES, SCORINGS, check_route_args

NEG_INF = tl.constexpr(float("-inf"))  # a constexpr: compiled kernels read no other globals


@triton.jit
def _group_mask(choice, cols, valid_E, group_size, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                TOP2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):
    """(BLOCK_T, BLOCK_E) mask of the experts in each token's TOPK_GROUPS best groups."""
    group = cols // group_size
    gcols = tl.arange(0, BLOCK_G)
    gscore = tl.full((BLOCK_T, BLOCK_G), NEG_INF, dtype=tl.float32)
    for g in tl.static_range(NUM_GROUPS):
        c = tl.where((group == g)[None, :] & valid_E[None, :], choice, NEG_INF)
        s = tl.max(c, axis=1)
        if TOP2:
            first = tl.min(tl.where(c == s[:, None], cols[None, :], BLOCK_E), axis=1)
            s = s + tl.max(tl.where(cols[None, :] == first[:, None], NEG_INF, c), axis=1)
        gscore = tl.where(gcols[None, :] == g, s[:, None], gscore)
    keep = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    for j in tl.static_range(TOPK_GROUPS):
        best = tl.max(gscore, axis=1)
        arg = tl.min(tl.where(gscore == best[:, None], gcols[None, :], BLOCK_G), axis=1)
        keep = keep | (group[None, :] == arg[:, None])
        gscore = tl.where(gcols[None, :] == arg[:, None], NEG_INF, gscore)
    return keep


@triton.jit
def _topk_route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, E, stride_l, group_size, scaling,
                       SCORING: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOP2: tl.constexpr,
                       TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    valid_E = cols < E
    valid = row_ok[:, None] & valid_E[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_l + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    if SCORING == 0:
        x = tl.where(valid_E[None, :], x, NEG_INF)  # rows past T stay finite: no NaN
        num = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = num / tl.sum(num, axis=1)[:, None]
    elif SCORING == 1:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:  # sqrtsoftplus: sqrt(log(1 + e^x)), written so that large x does not overflow
        scores = tl.sqrt(tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=valid_E, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(valid_E[None, :], choice, NEG_INF)  # padding never wins
    if NUM_GROUPS > 1:
        keep = _group_mask(choice, cols, valid_E, group_size, NUM_GROUPS, TOPK_GROUPS, TOP2, BLOCK_T, BLOCK_E,
                           BLOCK_G)
        choice = tl.where(keep, choice, NEG_INF)
    kcols = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    taken = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    for k in tl.static_range(TOP_K):
        c = tl.where(taken, NEG_INF, choice)
        best = tl.max(c, axis=1)
        # lowest expert id among the maxima, never one already taken
        arg = tl.min(tl.where((c == best[:, None]) & ~taken, cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == arg[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        top_w = tl.where(kcols[None, :] == k, w[:, None], top_w)
        top_i = tl.where(kcols[None, :] == k, arg[:, None].to(tl.int64), top_i)
        taken = taken | hit
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    top_w = top_w * scaling
    out_mask = row_ok[:, None] & (kcols[None, :] < TOP_K)
    offs = rows[:, None] * TOP_K + kcols[None, :]
    tl.store(w_ptr + offs, top_w, mask=out_mask)
    tl.store(ids_ptr + offs, top_i, mask=out_mask)


def topk_route(logits_TE: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False, *,
               correction_bias_E: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
               group_score: str = "max", scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick K experts per token: returns (topk_weights_TK float32, topk_ids_TK int64).

    logits_TE: router logits (any float dtype, last dim contiguous). The other arguments are those
    of kernels.routing.topk_route (see RouterConfig).
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"topk_route: logits must be (T, E), got shape {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    check_route_args(E, top_k, scoring, num_groups, topk_groups, group_score)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits_TE.device)
    if T == 0:
        return weights, ids
    logits_TE = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
    bias = logits_TE if correction_bias_E is None else correction_bias_E.contiguous()
    BLOCK_E = triton.next_power_of_2(E)
    BLOCK_T = max(1, min(16, 4096 // BLOCK_E, triton.next_power_of_2(T)))
    _topk_route_kernel[(triton.cdiv(T, BLOCK_T),)](
        logits_TE, bias, weights, ids, T, E, logits_TE.stride(0), E // num_groups, float(scaling),
        SCORING=SCORINGS.index(scoring), RENORMALIZE=renormalize, HAS_BIAS=correction_bias_E is not None,
        NUM_GROUPS=num_groups, TOPK_GROUPS=topk_groups, TOP2=group_score == GROUP_SCORES[1], TOP_K=top_k,
        BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_G=triton.next_power_of_2(num_groups))
    return weights, ids
