"""The scheduler: which sequences run in the next step, and how many of their tokens.

One step mixes decodes (one new token each) with prefill chunks of newly admitted or partly
prefilled sequences, within a token budget and a sequence cap. Running sequences go first, oldest
first; when the cache has no block left for one of them, the newest running sequence is preempted
(its blocks freed, its tokens recomputed later: prompt and output so far, through the prefix cache
where its blocks survived). Waiting sequences are admitted in arrival order while blocks and budget
last, and never in a step that had to preempt.
"""
from collections import deque
from dataclasses import dataclass

from attention_nodes.block_manager import BlockManager, blocks_for
from attention_nodes.config import SchedulerConfig
from attention_nodes.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """seqs[b] computes num_new_tokens[b] tokens, token_ids[b][num_computed:num_computed+n], this step.
    sample[b]: the chunk reaches the end of the sequence's tokens, so a next token is sampled."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    sample: list[bool]
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def check_fits(request_id: str, prompt_tokens: int, max_tokens: int, block_size: int, num_blocks: int) -> None:
    """ValueError for a sequence whose prompt plus max_tokens needs more KV blocks than the cache has
    (it could never be scheduled); the pools' front asks the same before it sends a request."""
    need = blocks_for(prompt_tokens + max_tokens, block_size)
    if need > num_blocks:
        raise ValueError(f"request {request_id}: {prompt_tokens} prompt tokens plus max_tokens {max_tokens} need "
                         f"{need} KV blocks, but the cache has {num_blocks}")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager):
        self.cfg, self.blocks = cfg, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        check_fits(seq.request_id, seq.num_prompt_tokens, seq.max_tokens, self.blocks.block_size,
                   self.blocks.num_blocks)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """The next step's sequences and token counts; grows their block tables to fit (preempting
        the newest running sequences when blocks run out) and admits waiting ones."""
        batch = ScheduledBatch([], [], [])
        budget = self.cfg.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_draft_tokens:  # drafts only whole and where they fit: never preempt for one
                keep = min(seq.num_draft_tokens, budget - 1)
                while keep and self.blocks.blocks_needed(seq, seq.num_computed_tokens + 1 + keep) > \
                        self.blocks.num_free_blocks:
                    keep -= 1
                seq.drop_drafts(seq.num_draft_tokens - keep)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while self.blocks.blocks_needed(seq, seq.num_computed_tokens + n) > self.blocks.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            self._add(batch, seq, n)
            budget -= n
            i += 1
        if not batch.num_preempted:
            budget = self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.blocks.match_prefix(seq)
            n = seq.num_tokens - len(prefix) * self.blocks.block_size
            if n > budget and not self.cfg.enable_chunked_prefill:
                break
            n = min(n, budget)
            total = len(prefix) * self.blocks.block_size + n
            if self.blocks.blocks_needed(seq, total, prefix) > self.blocks.num_free_blocks:
                break
            self.waiting.popleft()
            self.blocks.share_prefix(seq, prefix)
            self.blocks.grow(seq, total)
            self.blocks.take_state_slot(seq)
            if seq.num_admissions == 0:  # not a recomputation: count the prompt
                self.blocks.prefix_queries += seq.num_tokens
                self.blocks.prefix_hits += seq.num_computed_tokens
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            seq.num_admissions += 1
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(batch, seq, n)
            budget -= n
        return budget

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        batch.sample.append(seq.num_computed_tokens + n == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        seq.drop_drafts()
        self.blocks.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish_computed(self, batch: ScheduledBatch) -> None:
        """After the forward pass: the scheduled tokens now have their keys and values cached. A
        sequence with drafts is left to `computed` once they are verified."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if not seq.num_draft_tokens:
                self.computed(seq, n)

    def computed(self, seq: Sequence, n: int) -> None:
        """n more of seq's tokens have their keys and values cached (and its full blocks are entered
        in the prefix cache)."""
        seq.num_computed_tokens += n
        self.blocks.register_computed(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Retire a sequence (finished or aborted) wherever it is; its blocks are freed now."""
        if seq.is_finished:
            return
        seq.drop_drafts()
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
