"""Speculative decoding in `shuttle simulate` (planner/simulate.py): `Speculation`, what a deployment's
MTP drafting is (k, acceptance per position, disable_by_batch_size), and the Simulator's steps that
draft before a step and run the MTP layer after it, as the engine's _draft and _mtp_propose do.
"""
from dataclasses import dataclass

import numpy as np

from attention_nodes.scheduler import ScheduledBatch
from attention_nodes.sequence import Sequence
from attention_nodes.speculative import after_verify


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding with the checkpoint's MTP layer, as the engine runs it: while at most
    disable_by_batch_size sequences run on a worker, each decoding sequence gets k drafts (fewer
    near max_tokens), verified as 1 + k decode rows of the next step; after each step the MTP layer
    runs over the positions every sequence kept and chains k - 1 more one-row passes (perf.mtp).
    acceptance[j]: of the drafted steps that had a draft j, the share whose draft j was accepted
    (vLLM's per-position rate, accepted_per_pos[j] / num_drafts, where every draft set is whole; a
    set is cut short near max_tokens and at a block's end), non-increasing, drawn per step with the
    workload's seed; a draft rejected whole backs off as the engine does (speculative.backoff)."""

    num_speculative_tokens: int
    acceptance: tuple[float, ...]
    disable_by_batch_size: int

    def __post_init__(self) -> None:
        a = self.acceptance
        if len(a) < self.num_speculative_tokens:
            raise ValueError(f"speculative acceptance needs a rate for each of the {self.num_speculative_tokens} draft "
                             f"positions, got {len(a)}")
        if any(not 0.0 <= x <= 1.0 for x in a) or any(y > x for x, y in zip(a, a[1:])):
            raise ValueError(f"speculative acceptance per position must be in [0, 1] and non-increasing, got {list(a)}")

    @staticmethod
    def mtp_config(config):
        """A --speculative-config (a SpeculativeConfig, dict or JSON text) as a SpeculativeConfig of
        method mtp, the one the planner models; ValueError otherwise."""
        from attention_nodes.config import SpeculativeConfig

        cfg = SpeculativeConfig.parse(config)
        if cfg.method != "mtp":
            raise ValueError(f"the planner models speculative method mtp (the checkpoint's MTP layer, profiled by "
                             f"shuttle profile), not {cfg.method!r}")
        return cfg

    @classmethod
    def of(cls, config, acceptance) -> "Speculation":
        """From a --speculative-config (mtp_config) and the per-position acceptance (positions past
        those given take the last one's rate). ValueError for another method or no acceptance."""
        cfg = cls.mtp_config(config)
        if not acceptance:
            raise ValueError("speculative method mtp needs its acceptance per draft position (none measured or given)")
        k, a = cfg.num_speculative_tokens, tuple(acceptance)
        return cls(k, a + (a[-1],) * max(0, k - len(a)), cfg.disable_by_batch_size)

    def mean_accept_len(self) -> float:
        """Tokens a drafted sequence gains per verify step: 1 + the expected accepted drafts."""
        return 1.0 + sum(self.acceptance[:self.num_speculative_tokens])


class SpeculativeSteps:
    """The Simulator's speculative steps (planner/simulate.Simulator mixes them in): they read its spec,
    dep, perf, slow and busy, and keep each drafted sequence's accepted count in _accept."""

    def _draft(self, wk: "_Worker", draws: np.random.Generator) -> None:
        """Before a step, as the engine's _draft: drafts for wk's decoding sequences while speculation
        is on there, each with the number its verification will accept, drawn now."""
        spec = self.spec
        if len(wk.sched.running) > spec.disable_by_batch_size:
            return
        for seq in wk.sched.running:
            if seq.num_draft_tokens or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            if seq.spec_skip:
                seq.spec_skip -= 1
                continue
            room = self._room(seq, seq.num_output_tokens, seq.num_computed_tokens)
            if room > 0:
                u = draws.random()
                self._accept[id(seq)] = sum(u < a for a in spec.acceptance[:room])
                seq.token_ids.extend([1] * room)
                seq.num_draft_tokens = room

    def _room(self, seq: Sequence, outputs: int, computed: int) -> int:
        """The drafts a sequence with `outputs` output tokens and `computed` positions cached gets, as
        the engine's: k, fewer near max_tokens, and a chain stops at the end of its last block
        (ModelRunner.mtp_draft: draft j >= 1 runs at position computed - 1 + j, inside the blocks)."""
        blocks_end = len(seq.block_table) * self.dep.block_size
        return min(self.spec.num_speculative_tokens, seq.max_tokens - outputs - 1, blocks_end - computed + 1)

    def _accepted(self, seq: Sequence) -> int:
        """The drafts seq's verification accepts (of those the scheduler kept)."""
        return min(self._accept.get(id(seq), 0), seq.num_draft_tokens)

    def _drafting(self, workers: list["_Worker"], batches: list[ScheduledBatch]) -> float:
        """The MTP layer's passes after a step, as the engine's _mtp_propose runs them on each worker
        where speculation stays on: one over every position a sequence still running kept (a
        verification's 1 + accepted rows, a decode's one, a prompt chunk's whole), then k - 1 chained
        one-row passes over the sequences that draft next (not those backing off). Returns the slowest
        worker's time (they step together); every worker's counts as busy."""
        spec, th = self.spec, self.dep.pool_threads[0]
        worst = 0.0
        for wk, b in zip(workers, batches):
            rows = prefill = chained = longest = finished = 0
            for seq, n, sampled in zip(b.seqs, b.num_new_tokens, b.sample):
                emit = (1 + self._accepted(seq)) if seq.num_draft_tokens else int(sampled)
                outputs = seq.num_output_tokens - seq.num_draft_tokens + emit
                if outputs >= seq.max_tokens:
                    finished += 1
                    continue
                kept = emit if seq.num_draft_tokens else n
                if kept > 1 + spec.num_speculative_tokens:
                    prefill += kept
                else:
                    rows += kept
                skip = seq.spec_skip  # (a verification's outcome sets it first, as the engine's _sample)
                if seq.num_draft_tokens:
                    skip = after_verify(seq.spec_misses, emit - 1, "mtp")[1]
                if sampled and not skip:  # it drafts next: its drafts after the first come from chained passes
                    more = max(0, self._room(seq, outputs, seq.num_computed_tokens + kept) - 1)
                    chained, longest = chained + more, max(longest, more)
            if not (rows or prefill) or len(wk.sched.running) - finished > spec.disable_by_batch_size:
                continue
            t = float(self.perf.mtp(rows + chained, 1 + longest, prefill, th)) * self.slow
            self.busy["attention"] += t
            worst = max(worst, t)
        return worst
