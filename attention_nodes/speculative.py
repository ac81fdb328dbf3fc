"""Speculative decoding: drafts proposed for running sequences, verified by the target model in
one forward pass per step (attention_nodes/engine.py), and counted as vLLM counts them.

    drafts = propose_ngram(seq.token_ids, k, lo, hi)   # prompt lookup: [] where nothing matches

A step with drafts appends them to their sequences' tokens, so the scheduler computes 1 + d tokens
for a sequence with d drafts (fewer drafts where the step's token budget or the free KV blocks
are short: a draft never preempts anything; attention_nodes/scheduler.py) and the runner returns
the logits of all of those positions. The engine then samples position j of every sequence still
verifying, in turn, each with the sampler as a decode step would (penalties, logit bias, grammar
masks, the request's generator), and keeps going while the token sampled equals draft j + 1. A
draft is one token, not a distribution (a point mass q), and for such a q "sample from the target
p, accept the draft when the sample equals it, else emit the sample" gives each position's token
with probability p exactly: the rejection rule min(1, p/q) then the residual (p - q)+ come to the
same law. Each emitted token is one draw, so a seeded request draws what it would without
speculation and its output is the same. The KV entries of rejected drafts stay in the blocks past
num_computed_tokens, overwritten when those positions are computed; only verified tokens are
entered in the prefix cache.

A draft costs its verification whether it is accepted or not: at batch 1 a step of 1 + k tokens
took 5-10% longer than a step of one, all of it lost where nothing is accepted. So a sequence whose
drafts were rejected whole r times in a row is not drafted for the next backoff(r) steps (1, 3,
7, then 15), and one accepted draft token resets r: output tokens do not change, only which steps
verify drafts.
"""
from dataclasses import dataclass, field

import numpy as np


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


MAX_BACKOFF = 15  # the most decode steps a sequence goes without drafts after rejected ones


def backoff(misses: int) -> int:
    """Steps without drafts after `misses` drafts in a row were rejected whole: 2^misses - 1, at most
    MAX_BACKOFF."""
    return min(2 ** misses - 1, MAX_BACKOFF)


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
