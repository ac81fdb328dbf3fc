"""A sequence: one output stream of a request (a request with n samples has n sequences), as the
scheduler and the block manager see it. Token ids only; text belongs to the server.
"""
import enum
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from attention_nodes.sampling_params import SamplingParams


class TokenSpan(SequenceABC):
    """token_ids[start:] as a read-only view, without the copy. The sampler gets every running
    sequence's outputs each step (for min_tokens and penalties); a slice copied all of them, so a
    step cost grew with the output length (8.6 us a sequence at ~320 outputs, 2.2 ms a step at
    batch 256: more than the rest of the step's bookkeeping)."""

    __slots__ = ("_ids", "_start")

    def __init__(self, ids: list[int], start: int):
        self._ids, self._start = ids, start

    def __len__(self) -> int:
        return len(self._ids) - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._ids[self._start:][i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("token index out of range")
        return self._ids[self._start + (i if i >= 0 else i + n)]

    def __iter__(self):
        return iter(self._ids[self._start:])  # islice would step through the whole prompt first

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, TokenSpan)) else NotImplemented

    def __repr__(self) -> str:
        return f"TokenSpan({list(self)})"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """token_ids holds the prompt then the generated tokens (then, during a speculative step, the
    last num_draft_tokens are drafts). The first num_computed_tokens of them have their keys and
    values in the cache blocks of block_table; the rest are computed by the next steps (a prompt or
    its remaining chunk, the newest sampled token and its drafts, or everything after a preemption)."""

    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int  # params.max_tokens capped by the context length
    arrival: int  # admission order (lower is older)
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading full blocks registered in the prefix cache
    last_block_hash: int | None = None
    num_cached_prompt_tokens: int = 0  # prefill tokens skipped thanks to the prefix cache
    num_admissions: int = 0  # times scheduled from waiting (more than one after a preemption)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    grammar: object | None = None  # xgrammar GrammarMatcher of params.structured_outputs
    num_prompt_logprobs: int = 0  # prompt positions whose next token's logprob was computed
    pending_prompt_logprobs: list = field(default_factory=list)  # engine.TokenLogprobs, sent with the next delta
    num_draft_tokens: int = 0  # speculative drafts at the end of token_ids, not yet verified
    # (num_draft_tokens, >= V) float: the distribution each draft was drawn from (an MTP head's or a
    # draft model's), verified by speculative.rejection_sample; None: point masses (n-gram drafts)
    draft_probs: torch.Tensor | None = None
    state_slot: int | None = None  # linear-attention models: its state's slot while running (BlockManager)
    spec_misses: int = 0  # speculative drafts rejected whole in a row (speculative.backoff)
    spec_skip: int = 0  # decode steps left before it is drafted for again
    draft_pos: int = 0  # (draft_model) positions the draft model's cache holds of its own tokens

    def drop_drafts(self, count: int | None = None) -> list[int]:
        """Remove the last `count` drafts (None: all) from token_ids; returns them."""
        count = self.num_draft_tokens if count is None else count
        if count <= 0:
            return []
        dropped = self.token_ids[-count:]
        del self.token_ids[-count:]
        self.num_draft_tokens -= count
        if self.draft_probs is not None:
            self.draft_probs = self.draft_probs[:self.num_draft_tokens] if self.num_draft_tokens else None
        return dropped

    @property
    def needs_prompt_logprobs(self) -> bool:
        """The first sample computes the prompt's logprobs (the others would read the same ones),
        until every prompt token after the first has one; until then no prefix-cache hit."""
        return self.params.prompt_logprobs is not None and self.index == 0 and \
            self.num_prompt_logprobs < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> TokenSpan:
        """The generated tokens: a view (TokenSpan), not a copy."""
        return TokenSpan(self.token_ids, self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
