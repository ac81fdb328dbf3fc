"""Speculative decoding: drafts proposed for running sequences, verified by the target model in
one forward pass per step (attention_nodes/engine.py), and counted as vLLM counts them.

    drafts = propose_ngram(seq.token_ids, k, lo, hi)   # prompt lookup: [] where nothing matches

A step with drafts appends them to their sequences' tokens, so the scheduler computes 1 + d tokens
for a sequence with d drafts (fewer drafts where the step's token budget or the free KV blocks
are short: a draft never preempts anything; attention_nodes/scheduler.py) and the runner returns
the logits of all of those positions. The engine then samples position j of each verifying sequence
with the sampler as a decode step would (penalties, logit bias, grammar masks, the request's
generator), and keeps going while the token emitted equals draft j + 1: every position of a
sequence in one sampler call where no grammar follows the tokens taken (LLMEngine._sample), else one
position at a time. What the sampler emits at a draft position depends on what the draft is:

- A draft that is one token (n-gram: a point mass q), and any draft of a greedy request: the
  sampler draws from the target p (the argmax, for greedy) as a decode step would. For a point
  mass "accept the draft when the sample equals it, else emit the sample" gives each token with
  probability p exactly (the rejection rule below comes to the same law), and each emitted token
  is one draw, so a seeded request draws what it would without speculation and its output is the
  same (verified at once, its generator is set back past the draws of the tokens it kept); greedy
  output is the same as without speculation whatever the drafts. A seeded request's MTP drafts are
  such point masses, drawn from the head's q with the very uniforms its next tokens will take, so
  that where q is near p a draft is the token the target's draw gives (accepted 50% of the time at
  k = 1 on the built-in model at temperature 0.8, against 38% for the argmax).
- A draft x drawn from a distribution q (an MTP head's or a draft model's: Sequence.draft_probs)
  for a request that samples: speculative sampling (Leviathan et al. 2023, Chen et al. 2023;
  vLLM's rejection sampler), `rejection_sample`. x is accepted with probability
  min(1, p(x)/q(x)); otherwise the token is drawn from the residual (p - q)+ renormalised, which
  never holds x. p is the distribution the sampler draws from there (Sampler.probs: after
  min_tokens bans, logit bias, penalties, grammar masks, temperature and top-k / min-p / top-p),
  so every emitted token has the law a plain decode step gives it, whatever q. Unseeded sequences
  without a grammar or logprobs verify all their positions in one call (Sampler.verify_chains:
  K + 1 uniforms of the global generator); otherwise a verified position takes two uniforms from the
  request's generator, so a seeded request with the same drafts gives the same tokens (not those it
  gives without speculation, and not on a resume after a failure: sampler.skip_draws counts one
  uniform a token).

After the last accepted draft the next position is sampled from p as usual (the bonus token). The
KV entries of rejected drafts stay in the blocks past num_computed_tokens, overwritten when those
positions are computed; only verified tokens are entered in the prefix cache.

A draft costs its verification whether it is accepted or not: at batch 1 a step of 1 + k tokens
took 5-10% longer than a step of one, all of it lost where nothing is accepted. So a sequence whose
drafts were rejected whole r times in a row is not drafted for the next backoff(r) steps (1, 3,
7, then 15), and one accepted draft token resets r: which steps verify drafts changes, not the
output's law (nor greedy output, nor the tokens of n-gram drafts). MTP drafts tolerate one whole
rejection (TOLERATED_MISSES: backoff from the second in a row, 0, 1, 3, ...): a trained head's
drafts are rejected whole about as often as its first draft is (41% of the built-in model's) but
rarely twice in a row, so backing off after each cost that model more steps for the same tokens
(bench/spec_decode.py, 64 greedy tokens, k = 1..3: at batch 1 on its plain workload 43, 39 and 32
steps against 36, 29 and 25; at batch 16 4-22% more), and fewer only where rejections come in runs
(its copy workload at batch 1: 1-2 steps fewer).
"""
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.sampling import _inverse_cdf


def propose_ngram(token_ids: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    token_ids of lo..hi tokens ([] where no such suffix occurred before)."""
    L = len(token_ids)
    if k < 1 or L < lo + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    # candidate ends of an earlier occurrence: positions before the last that hold the last token
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    ok = np.ones(ends.size, dtype=bool)
    best = None
    for n in range(1, min(hi, L - 1) + 1):  # grow the suffix: the matches of n + 1 are among those of n
        if n > 1:
            ok &= ends >= n - 1
            ok[ok] = arr[ends[ok] - (n - 1)] == arr[L - n]
        if not ok.any():
            break
        if n >= lo:
            best = int(ends[ok][-1])
    return [] if best is None else arr[best + 1:best + 1 + k].tolist()


def rejection_sample(
    target_probs_BKV: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
    draft_ids_BK: torch.Tensor,
    bonus_probs_BV: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of B rows of K drafts each. Returns (token_ids_BK1, num_accepted_B).

    target_probs_BKV: p at each draft position, the distribution the request samples from there
    (Sampler.probs: after penalties, grammar masks, temperature and filters), given the drafts
    before it. draft_probs_BKV: q, the distribution each draft was drawn from; None for point
    masses (each draft's q is 1 on itself). draft_ids_BK: the drafts (int). bonus_probs_BV: p at
    the position after the K drafts, or None to leave that token to the caller. generator: the
    uniforms' source: one generator for all rows, one per row (None in the list: the global one),
    or None (the global one). Each row takes K + 1 uniforms, in one call per generator. K may be 0
    (then bonus_probs_BV is needed): a plain draw.

    Draft j of a row is accepted, while all before it were, with probability min(1, p(x)/q(x))
    (uniform u_j: u_j q(x) < p(x)); at the first rejected position the row's next token is drawn
    from the residual (p - q)+ renormalised (from p less the draft where rounding left that empty:
    p = q), which is never the draft; with all K accepted it is drawn from bonus_probs_BV (uniform
    u_K either way). token_ids_BK1 row b: its num_accepted_B[b] accepted drafts, that next token,
    then -1 (and -1 for the next token when all K were accepted and bonus_probs_BV is None).
    Each emitted token then has the target's law, whatever q.
    """
    B, K = draft_ids_BK.shape
    device = target_probs_BKV.device
    u_BK1 = _uniforms(generator, B, K + 1, device)
    ids_BK = draft_ids_BK.to(device=device, dtype=torch.long)
    rows_B = torch.arange(B, device=device)
    if K:
        p_BK = target_probs_BKV.gather(2, ids_BK[..., None]).squeeze(2)
        q_BK = (torch.ones_like(p_BK) if draft_probs_BKV is None
                else draft_probs_BKV.gather(2, ids_BK[..., None]).squeeze(2))
        accept_BK = u_BK1[:, :K] * q_BK < p_BK
        num_accepted_B = accept_BK.long().cumprod(dim=1).sum(dim=1)
        # the first rejected position (or the last, unused, where all were accepted)
        pos_B = num_accepted_B.clamp(max=K - 1)
        p_BV, x_B = target_probs_BKV[rows_B, pos_B].float(), ids_BK[rows_B, pos_B]
        if draft_probs_BKV is None:
            q_BV = torch.zeros_like(p_BV).index_put_((rows_B, x_B), torch.ones(B, device=device))
        else:
            q_BV = draft_probs_BKV[rows_B, pos_B].float()
        weights_BV = (p_BV - q_BV).clamp_(min=0)
        empty_B1 = weights_BV.sum(dim=1, keepdim=True) <= 0
        if bool(empty_B1.any()):
            weights_BV = torch.where(empty_B1, p_BV.index_put((rows_B, x_B), torch.zeros(B, device=device)), weights_BV)
    else:
        num_accepted_B = torch.zeros(B, dtype=torch.long, device=device)
        weights_BV = bonus_probs_BV.float()
    rejected_B = num_accepted_B < K
    if bonus_probs_BV is not None and K:
        weights_BV = torch.where(rejected_B[:, None], weights_BV, bonus_probs_BV.float())
    next_B = _inverse_cdf(weights_BV.cumsum(dim=1), u_BK1[:, K])
    if bonus_probs_BV is None:
        next_B = torch.where(rejected_B, next_B, -1)
    cols_K1 = torch.arange(K + 1, device=device)
    out_BK1 = torch.where(cols_K1[None, :] < num_accepted_B[:, None],
                          torch.nn.functional.pad(ids_BK, (0, 1), value=-1), -1)
    out_BK1[rows_B, num_accepted_B] = next_B
    return out_BK1, num_accepted_B


def _uniforms(generator: torch.Generator | list[torch.Generator | None] | None, B: int, n: int,
              device: torch.device) -> torch.Tensor:
    """(B, n) U[0, 1) float32 values: from one generator (or the global one) in one call, or row b's
    from generator[b] (None: the global one)."""
    if not isinstance(generator, list):
        return torch.rand(B, n, generator=generator, device=device)
    u_Bn = torch.empty(B, n, device=device)
    unseeded = [b for b, g in enumerate(generator) if g is None]
    if unseeded:
        u_Bn[unseeded] = torch.rand(len(unseeded), n, device=device)
    for b, g in enumerate(generator):
        if g is not None:
            u_Bn[b] = torch.rand(n, generator=g, device=device)
    return u_Bn


MAX_BACKOFF = 15  # the most decode steps a sequence goes without drafts after rejected ones
TOLERATED_MISSES = {"ngram": 0, "mtp": 1, "draft_model": 0}  # whole rejections in a row drafting goes on after


def after_verify(misses: int, accepted: int, method: str) -> tuple[int, int]:
    """A sequence's (drafts rejected whole in a row, decode steps to skip drafting) after a verification
    that accepted `accepted` drafts, given `misses` before it (Sequence.spec_misses / spec_skip)."""
    misses = 0 if accepted else min(misses + 1, 8)
    return misses, backoff(misses, TOLERATED_MISSES[method])


def backoff(misses: int, tolerated: int = 0) -> int:
    """Steps without drafts after `misses` drafts in a row were rejected whole, the first `tolerated`
    of them free: 2^(misses - tolerated) - 1, at most MAX_BACKOFF."""
    return min(2 ** max(0, misses - tolerated) - 1, MAX_BACKOFF)


@dataclass
class SpecStats:
    """vLLM's counters (vllm:spec_decode_*): drafts (sequences a step drafted for), draft tokens,
    accepted draft tokens, and accepted tokens per draft position."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def count(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos)}
