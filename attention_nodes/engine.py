"""LLMEngine: continuous batching over a paged KV cache, token ids in, token ids out; and Engine,
the interface the fronts (LLM, AsyncLLM, the HTTP and gRPC servers) use of it and of the pool
front (pools/engine.py: PoolEngine).

    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for delta in engine.step():          # schedule -> execute -> update
            ...                              # new tokens of one sequence, and why it finished

Every step the scheduler admits and retires sequences, so requests join and leave at any step.
Stop conditions on token ids (eos, stop_token_ids, max_tokens, the context length) end sequences
here; stop strings are text, so the server checks them and calls `stop_sequence`.
"""
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from attention_nodes.block_manager import BlockManager
from attention_nodes.config import EngineConfig
from attention_nodes.model_runner import ModelRunner, PromptLogits, row_spans
from attention_nodes.sampler import Sampler, SamplerOutput, SamplingRow, peek_uniforms, skip_draws
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import ScheduledBatch, Scheduler
from attention_nodes.sequence import Sequence, SequenceStatus
from attention_nodes.speculative import SpecStats, after_verify, propose_ngram
from attention_nodes.structured import GrammarCache
from kernels.sampling import compute_logprobs
from models.config import ModelConfig
from models.dispatcher import Dispatcher

log = logging.getLogger("shuttle")


@dataclass
class TokenLogprobs:
    """The chosen token's log-probability (from the raw logits), its rank (1 = most likely) and the
    `logprobs` most likely alternatives as (token id, log-probability), best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SequenceDelta:
    """What one sequence produced in one step (only what changed)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose prefill the prefix cache skipped
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.. (params.prompt_logprobs), once


class Engine(Protocol):
    """What a front drives: requests in (validated by the front: validate_request), deltas out.
    LLMEngine runs the model in this process; PoolEngine drives attention and expert worker pools.
    Only the thread that calls `step` calls the others, except `wake` and `ready` (any thread)."""

    cfg: EngineConfig
    model_cfg: ModelConfig
    eos_token_ids: set[int]

    @property
    def ready(self) -> bool:
        """A step can run now (pools: every worker is up)."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def abort_request(self, request_id: str) -> list[SequenceDelta]:
        """Retire the request; returns its finish deltas, or [] when they come through `step`."""

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        """End one sequence because the front found a stop string in its text."""

    def set_eos_token_ids(self, ids: set[int]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[SequenceDelta]:
        """Advance the requests: the deltas of the sequences that produced tokens."""

    def step_summary(self) -> dict:
        """What the last step ran, for a trace's step span."""

    def wake(self) -> None:
        """End a `step` that waits for workers: the caller has requests or aborts to hand over."""

    def check_health(self) -> None:
        """Notice a failed worker also while no request runs (and recover, or raise)."""

    def stats(self) -> dict:
        """Counters for /metrics and the logs (running, waiting, KV blocks, steps, tokens, ...)."""

    def shutdown(self) -> None: ...


class LLMEngine:
    """The Engine that runs the model (its attention; its experts too unless `dispatcher` sends
    them to expert workers) in this process."""

    def __init__(self, cfg: EngineConfig, eos_token_ids: set[int] | None = None, dispatcher: Dispatcher | None = None):
        """dispatcher: the experts' transport (None: the experts run in this process)."""
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_pretrained(cfg.model)
        prefix_caching = cfg.cache.enable_prefix_caching
        if self.model_cfg.has_sequence_state:  # (Qwen3-Next, DeepSeek-V4) a sequence's state is not in its blocks
            what = ("linear-attention layers' state" if self.model_cfg.v4 is None
                    else "sliding window and compressors' pending rows")
            if cfg.speculative is not None:
                raise ValueError(f"speculative decoding is not supported for {self.model_cfg.architecture}: its "
                                 f"{what} would take in the rejected drafts")
            if prefix_caching:
                log.info("prefix caching off: the %s per sequence is not kept per block", what)
                prefix_caching = False
        self.runner = ModelRunner(cfg, self.model_cfg, dispatcher, cfg.parallel.micro_batches)
        self.blocks = BlockManager(self.runner.num_blocks, cfg.cache.block_size, prefix_caching,
                                   self.runner.state_slots)
        if not cfg.scheduler.enable_chunked_prefill and cfg.scheduler.max_num_batched_tokens < self.model_cfg.max_model_len:
            raise ValueError(f"without chunked prefill, scheduler.max_num_batched_tokens "
                             f"({cfg.scheduler.max_num_batched_tokens}) must be at least the context length "
                             f"({self.model_cfg.max_model_len}), or a long (or recomputed) sequence could never run")
        self.scheduler = Scheduler(cfg.scheduler, self.blocks)
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else default_eos_ids(cfg.model, self.model_cfg))
        self.sampler = Sampler(self.model_cfg.vocab_size, self.eos_token_ids)
        self._grammars: GrammarCache | None = None  # made with the first structured request
        self.requests: dict[str, list[Sequence]] = {}
        # Samples 1..n-1 of a request wait here until sample 0 has computed (and the prefix cache
        # registered) the prompt's blocks, so they share those blocks instead of each prefilling them.
        self._held: dict[str, list[Sequence]] = {}
        self._arrival = itertools.count()
        self.num_steps = self.num_prefill_tokens = self.num_generated_tokens = 0
        self.spec = cfg.speculative  # speculative decoding (attention_nodes/speculative.py), or None
        self.spec_stats = SpecStats(self.spec.num_speculative_tokens) if self.spec else None
        self._spec_on = True  # whether the last step drafted (disable_by_batch_size)
        # (mtp) drafts proposed after the last step: (num_tokens then, drafts, their q rows or None)
        self._mtp_drafts: dict[tuple[str, int], tuple[int, list[int], torch.Tensor | None]] = {}
        self._mtp_pending: tuple[ScheduledBatch, list[int]] | None = None  # (mtp) the last step's, for _mtp_propose
        self.last_batch: ScheduledBatch | None = None  # what the last step scheduled (step_summary)

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    resume: list[list[int] | None] | None = None) -> None:
        """Queue a request: params.n sequences sharing the prompt (and, through the prefix cache, its
        full blocks: samples after the first are scheduled once the first has computed them).
        resume: for a request that was running elsewhere when that worker failed, per sample the
        output token ids already delivered (None: that sample finished). Each sample goes on from
        there: prompt + those tokens are recomputed (the preemption path), its grammar has accepted
        them and its seeded generator is moved past the draws they took, so it continues exactly as
        it would have. The front validated the prompt and params (validate_request: once, where the
        request entered); raises ValueError for an id in use or a request that could never fit the
        KV cache."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        if resume is not None and len(resume) != params.n:
            raise ValueError(f"resume lists {len(resume)} samples, the request has n={params.n}")
        max_tokens = max_new_tokens(params, ids, self.model_cfg)
        seqs = [self._sequence(request_id, i, ids, params, max_tokens, [] if resume is None else resume[i])
                for i in range(params.n)]
        if resume is not None:
            for seq in seqs:
                if not seq.is_finished:
                    self.scheduler.add(seq)
            self.requests[request_id] = seqs
            self._forget_if_done(request_id)
            return
        self.scheduler.add(seqs[0])  # checks the cache can ever hold it (the others are the same size)
        if len(seqs) > 1 and self.blocks.enable_prefix_caching and len(ids) > self.blocks.block_size:
            self._held[request_id] = seqs[1:]
        else:
            for seq in seqs[1:]:
                self.scheduler.add(seq)
        self.requests[request_id] = seqs

    def _sequence(self, request_id: str, index: int, ids: list[int], params: SamplingParams, max_tokens: int,
                  done: list[int] | None) -> Sequence:
        """Sample `index` of a request; done: output tokens it already produced ([] for a new one; None: finished)."""
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.runner.device).manual_seed((params.seed + index) % 2 ** 64)
        if done is None:  # finished before the failure: kept only so indices line up
            seq = Sequence(request_id, index, list(ids), len(ids), params, max_tokens, next(self._arrival), gen)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"
            return seq
        grammar = self._matcher(params)
        if done:
            bad = [t for t in done if not isinstance(t, int) or not 0 <= t < self.model_cfg.vocab_size]
            if bad or len(done) >= max_tokens:
                raise ValueError(f"resume of sample {index}: {len(done)} tokens (ids outside the vocabulary: "
                                 f"{bad[:5]}) for max_tokens={max_tokens}")
            if gen is not None and params.temperature > 0:
                skip_draws(gen, len(done))
            for tok in done if grammar is not None else ():
                grammar.accept_token(tok)
        seq = Sequence(request_id, index, list(ids) + list(done), len(ids), params, max_tokens, next(self._arrival),
                       gen, grammar=grammar)
        if done and params.prompt_logprobs is not None:
            seq.num_prompt_logprobs = len(ids)  # sent with the first token already
        return seq

    def _matcher(self, params: SamplingParams):
        """A grammar matcher for a structured request (None otherwise); ValueError for a bad spec."""
        if params.structured_outputs is None:
            return None
        if self._grammars is None:
            from transformers import AutoTokenizer
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(self.cfg.model), local_files_only=True)
            except (OSError, ValueError) as e:
                raise ValueError(f"structured_outputs need the checkpoint's tokenizer: {e}") from None
            self._grammars = GrammarCache(tokenizer, self.model_cfg.vocab_size, self.eos_token_ids)
        return self._grammars.matcher(params.structured_outputs)

    def abort_request(self, request_id: str) -> list[SequenceDelta]:
        """Retire every unfinished sequence of the request now; their blocks are free on return."""
        self._release_held(request_id)  # so the scheduler can retire them too
        return [self._finish(seq, "abort") for seq in self.requests.pop(request_id, []) if not seq.is_finished]

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        """End one sequence because the server found a stop string in its text."""
        seqs = self.requests.get(request_id)
        if seqs and not seqs[index].is_finished:
            self._finish(seqs[index], "stop", stop_reason)
            self._forget_if_done(request_id)

    def set_eos_token_ids(self, ids: set[int]) -> None:
        """Replace the end-of-sequence ids (stop conditions and min_tokens bans)."""
        self.eos_token_ids = set(ids)
        self.sampler = Sampler(self.model_cfg.vocab_size, self.eos_token_ids)
        self._grammars = None  # a finished grammar allows the end-of-sequence ids

    def wake(self) -> None:
        """Interface of the pool front (pools/engine.py): end a waiting `step`. This engine's steps
        never wait."""

    def check_health(self) -> None:
        """Interface of the pool front: raise if a worker died. This engine has no workers."""

    @property
    def ready(self) -> bool:
        return True

    def shutdown(self) -> None:
        """Nothing to stop: the engine lives in this process."""

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[SequenceDelta]:
        """schedule -> execute -> update. Returns the deltas of the sequences that sampled a token. With MTP
        a step's passes (_mtp_propose) run as the next begins: its tokens go out before the drafting."""
        for rid in [rid for rid in self._held if self._prompt_computed(rid)]:
            self._release_held(rid)
        if (pending := self._mtp_pending) is not None:
            self._mtp_pending = None
            self._mtp_propose(*pending)
        if self.spec is not None:
            self._draft()
        batch = self.last_batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.has_work():  # an invariant broke: fail loudly rather than spin for ever
                raise RuntimeError(f"the scheduler can run none of {len(self.scheduler.waiting)} waiting sequences "
                                   f"({self.blocks.num_free_blocks} free KV blocks)")
            return []
        starts = [seq.num_computed_tokens for seq in batch.seqs]  # (mtp: the positions this step computes)
        logits_RV, prompt_logits = self.runner.execute(batch)
        if prompt_logits:
            self._prompt_logprobs(batch, prompt_logits)
        self.scheduler.finish_computed(batch)  # all but the sequences with drafts (_sample)
        sampled = [seq for seq, s in zip(batch.seqs, batch.sample) if s]
        self.num_steps += 1
        self.num_prefill_tokens += sum(n for n, s in zip(batch.num_new_tokens, batch.seqs) if n > 1 and
                                       not s.num_draft_tokens)
        new = self._sample(logits_RV, sampled)
        if self.runner.mtp is not None:
            self._mtp_pending = (batch, starts)
        deltas = []
        for seq, (toks, lps, reason, stop_reason) in zip(sampled, new):
            self.num_generated_tokens += len(toks)
            prompt_lps, seq.pending_prompt_logprobs = seq.pending_prompt_logprobs or None, []
            deltas.append(SequenceDelta(seq.request_id, seq.index, toks, lps, reason, stop_reason,
                                        seq.num_cached_prompt_tokens, prompt_lps))
            self._forget_if_done(seq.request_id)
        return deltas

    def _sample(self, logits_RV: torch.Tensor, sampled: list[Sequence]) -> list[tuple]:
        """The tokens of the sampled sequences, as (token ids, logprobs or None, finish reason, stop
        reason) each. logits_RV: each sequence's d + 1 rows, in order. Each sequence takes its
        tokens in order, checks each for a stop, and goes on to position j + 1 while its token equals
        its draft j (attention_nodes/speculative.py: drafts with a distribution are rejection-sampled
        by the sampler). Rows whose pick does not depend on the tokens emitted before them in this
        step are sampled in one sampler call: every row of a sequence without drafts, and of a greedy
        one without a grammar (its row j, used only where drafts 0..j-1 were accepted, sees those as
        outputs: an argmax draws nothing), and of a sampled one whose drafts are point masses (MTP drafts
        of a seeded request, n-gram drafts) without a grammar: its row j draws from p_j as a decode step
        would, and a seeded one's generator is then set back and moved past the draws of the tokens it
        emitted only (its row j took its j-th draw, so it draws what plain decoding draws). Unseeded
        sampled sequences whose drafts were drawn from q (MTP, draft models), with no grammar or
        logprobs, verify all their positions in one call (Sampler.verify_chains). The others (drafts
        from q with a grammar or logprobs; sequences whose grammar takes each token) sample position j
        of every sequence still verifying in turn, one call per position."""
        qs = [seq.draft_probs for seq in sampled]
        drafts = [seq.drop_drafts() for seq in sampled]
        starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
        toks: list[list[int]] = [[] for _ in sampled]
        lps = [None if seq.params.logprobs is None else [] for seq in sampled]
        stops: list[tuple[str | None, int | None]] = [(None, None)] * len(sampled)

        def emit(i: int, j: int, out, r: int) -> bool:
            """Row r of `out` as sequence i's token at position j; whether position j + 1 follows."""
            seq, tok = sampled[i], out.token_ids[r]
            seq.token_ids.append(tok)
            toks[i].append(tok)
            if lps[i] is not None and out.logprobs is not None:
                lps[i].append(TokenLogprobs(tok, out.logprobs[r], out.ranks[r], out.top_logprobs[r]))
            stops[i] = self._stop_reason(seq, tok)
            return stops[i][0] is None and j < len(drafts[i]) and tok == drafts[i][j]

        # (point-mass drafts: a greedy request's, or a sampled one's argmax or n-gram drafts)
        at_once = [i for i, (s, d) in enumerate(zip(sampled, drafts))
                   if not d or s.grammar is None and (s.params.temperature == 0 or qs[i] is None)]
        chains = [i for i, (s, d) in enumerate(zip(sampled, drafts)) if d and qs[i] is not None and i not in at_once
                  and s.grammar is None and s.params.logprobs is None and s.generator is None]
        if chains:  # (drafts drawn from q: every position of a sequence verified in one go)
            rows = logits_RV[row_spans([starts[i] for i in chains], [len(drafts[i]) + 1 for i in chains]).to(
                logits_RV.device)]
            got = self.sampler.verify_chains(rows, [r for i in chains for r in self._rows_at_once(sampled[i], drafts[i])],
                                             [drafts[i] for i in chains], [qs[i] for i in chains])
            for i, chain in zip(chains, got):
                out = SamplerOutput(chain)
                for j in range(len(chain)):
                    if not emit(i, j, out, j):
                        break
        if at_once:
            rows = logits_RV if len(at_once) == len(sampled) else logits_RV[row_spans(
                [starts[i] for i in at_once], [len(drafts[i]) + 1 for i in at_once]).to(logits_RV.device)]
            # A seeded sampled sequence's rows draw one uniform each from its generator, in position order;
            # it then keeps the draws of the tokens it emits only, as plain decoding would have taken them.
            rewind = {i: sampled[i].generator.get_state() for i in at_once if drafts[i]
                      and sampled[i].generator is not None and sampled[i].params.temperature > 0}
            out = self.sampler(rows, [row for i in at_once for row in self._rows_at_once(sampled[i], drafts[i])])
            r = 0
            for i in at_once:
                j = 0
                while emit(i, j, out, r + j):
                    j += 1
                r += len(drafts[i]) + 1
                if i in rewind:
                    sampled[i].generator.set_state(rewind[i])
                    skip_draws(sampled[i].generator, j + 1)
        active, j = sorted(set(range(len(sampled))).difference(at_once, chains)), 0
        while active:
            rows = [SamplingRow(sampled[i].params, self._prompt_if_needed(sampled[i]), sampled[i].output_token_ids,
                                sampled[i].generator, sampled[i].grammar,
                                *((drafts[i][j], qs[i][j]) if qs[i] is not None and j < len(drafts[i]) else ()))
                    for i in active]
            out = self.sampler(logits_RV[torch.tensor([starts[i] + j for i in active], device=logits_RV.device)], rows)
            active, j = [i for r, i in enumerate(active) if emit(i, j, out, r)], j + 1
        for seq, d, got, (reason, stop_reason) in zip(sampled, drafts, toks, stops):
            if d:
                accepted = next((a for a, (t, x) in enumerate(zip(got, d)) if t != x), min(len(got), len(d)))
                self.spec_stats.count(len(d), accepted)
                seq.spec_misses, seq.spec_skip = after_verify(seq.spec_misses, accepted, self.spec.method)
                self.scheduler.computed(seq, 1 + accepted)  # the token before the drafts, and those accepted
            if reason:
                self.scheduler.finish(seq, reason, stop_reason)
        return [(got, lp or None, *stop) for got, lp, stop in zip(toks, lps, stops)]

    def _rows_at_once(self, seq: Sequence, drafts: list[int]) -> list[SamplingRow]:
        """The sampler rows of seq's positions 0..len(drafts) in one call: at position j its outputs
        so far and drafts 0..j-1 (copied only where penalties or min_tokens read them)."""
        p, prompt, outputs = seq.params, self._prompt_if_needed(seq), seq.output_token_ids
        if drafts and (p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
                       or len(outputs) < p.min_tokens):
            so_far = list(outputs)
            return [SamplingRow(p, prompt, so_far + drafts[:j], seq.generator, seq.grammar)
                    for j in range(len(drafts) + 1)]
        return [SamplingRow(p, prompt, outputs, seq.generator, seq.grammar)] * (len(drafts) + 1)

    def _draft(self) -> None:
        """Propose drafts for the running sequences that decode (speculative decoding), unless more
        than disable_by_batch_size of them run (logged when that changes)."""
        spec, running = self.spec, self.scheduler.running
        on = len(running) <= spec.disable_by_batch_size
        if on != self._spec_on:
            self._spec_on = on
            log.info("speculative decoding %s: %d sequences running (disable_by_batch_size %d)",
                     "on again" if on else "off", len(running), spec.disable_by_batch_size)
        if not on:
            return
        todo = []
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1 or seq.grammar is not None and seq.grammar.is_terminated():
                continue
            if seq.spec_skip:  # its last drafts were rejected whole (speculative.backoff)
                seq.spec_skip -= 1
                continue
            todo.append((seq, min(spec.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1)))
        if spec.method == "draft_model":  # one batched pass of the draft model per draft position
            proposed = self.runner.drafter.propose([seq for seq, _ in todo], [room for _, room in todo])
        for i, (seq, room) in enumerate(todo):
            if spec.method == "draft_model":
                drafts = proposed[i]
            elif spec.method == "mtp":  # proposed after the last step (_mtp_propose), for this very state
                num_tokens, drafts, q = self._mtp_drafts.get((seq.request_id, seq.index), (-1, [], None))
                drafts = drafts[:room] if num_tokens == seq.num_tokens else []
                if drafts and q is not None:  # (drawn from q: verified by rejection sampling)
                    seq.draft_probs = q[:len(drafts)]
            else:
                drafts = propose_ngram(seq.token_ids, room, spec.prompt_lookup_min, spec.prompt_lookup_max)
            if drafts:
                seq.token_ids.extend(drafts)
                seq.num_draft_tokens = len(drafts)

    def _mtp_propose(self, batch: ScheduledBatch, starts: list[int]) -> None:
        """Speculative method mtp, after a step (as the next begins, step): the MTP layer takes in the positions
        the step computed and kept (every sequence still running, so its drafts see the whole context later) and
        proposes drafts for the sequences the next step may draft for; `_draft` appends them. Greedy
        requests get the layer's argmax; sampled ones draws from q = softmax(logits / temperature):
        an unseeded one's q rows go with them for rejection sampling (attention_nodes/speculative.py);
        a seeded one's drafts are point masses drawn with the uniforms its generator gives its next
        tokens (read ahead, not taken), so that where q is near p the draft is the very token that
        position's draw from p gives: verified as point masses, the tokens are plain decoding's."""
        spec, self._mtp_drafts = self.spec, {}
        on = len(self.scheduler.running) <= spec.disable_by_batch_size
        if not on:  # speculation is off: the layer does not run, so a big batch pays nothing for it; the
            return  # positions computed meanwhile stay out of its cache (later drafts see stale rows there)
        wanted = []
        for seq in batch.seqs:
            decoding = seq.num_computed_tokens == seq.num_tokens - 1 and not seq.spec_skip and on and not (
                seq.grammar is not None and seq.grammar.is_terminated())
            wanted.append(-1 if seq.is_finished else 0 if not decoding else
                          max(0, min(spec.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1)))
        temperatures = [s.params.temperature if s.params.temperature > 0 else None for s in batch.seqs]
        ahead = [None if t is None or seq.generator is None or w <= 0 else peek_uniforms(seq.generator, w)
                 for seq, t, w in zip(batch.seqs, temperatures, wanted)]
        drafts, probs = self.runner.mtp_draft(batch, starts, wanted, temperatures, ahead)
        for seq, d, q, u in zip(batch.seqs, drafts, probs, ahead):
            if d:
                self._mtp_drafts[(seq.request_id, seq.index)] = (seq.num_tokens, d, None if u is not None else q)

    def step_summary(self) -> dict:
        """What the last step ran, for a trace's step span: its sequences, those with one new token
        (decoding, or a one-token prompt) and the new tokens of the others (prompt chunks)."""
        n = self.last_batch.num_new_tokens if self.last_batch is not None else []
        return {"seqs": len(n), "decode": sum(1 for q in n if q == 1), "prompt_tokens": sum(q for q in n if q > 1)}

    def _prompt_logprobs(self, batch, spans: list[PromptLogits]) -> None:
        """Logprobs of the prompt tokens whose preceding position this step computed (one
        log-softmax over all spans' rows); kept on the sequence until its next delta."""
        targets, k = [], 0
        for span in spans:
            seq = batch.seqs[span.seq_index]
            targets += seq.token_ids[span.start + 1:span.start + 1 + span.count]
            k = max(k, seq.params.prompt_logprobs)
        logits_NV = torch.cat([span.logits_NV for span in spans])[:, :self.model_cfg.vocab_size]
        chosen, rank, top_lps, top_ids = (t.tolist() for t in compute_logprobs(
            logits_NV, torch.tensor(targets, device=logits_NV.device), k))
        row = 0
        for span in spans:
            seq = batch.seqs[span.seq_index]
            kk = seq.params.prompt_logprobs
            for r in range(row, row + span.count):
                seq.pending_prompt_logprobs.append(
                    TokenLogprobs(targets[r], chosen[r], rank[r], list(zip(top_ids[r][:kk], top_lps[r][:kk]))))
            seq.num_prompt_logprobs = span.start + span.count
            row += span.count

    def _stop_reason(self, seq: Sequence, tok: int) -> tuple[str | None, int | None]:
        p = seq.params
        if seq.grammar is not None:
            seq.grammar.accept_token(tok)
            if seq.grammar.is_terminated():  # the grammar is complete and took its end token
                return "stop", None
        if seq.num_output_tokens > p.min_tokens:  # the sampler banned these ids before that
            if tok in self.eos_token_ids and not p.ignore_eos:
                return "stop", None
            if tok in p.stop_token_ids:
                return "stop", tok
        if seq.num_output_tokens >= seq.max_tokens:
            return "length", None
        return None, None

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> SequenceDelta:
        self.scheduler.finish(seq, reason, stop_reason)
        return SequenceDelta(seq.request_id, seq.index, [], None, reason, stop_reason)

    @staticmethod
    def _prompt_if_needed(seq: Sequence) -> list[int]:
        """The prompt, for the repetition penalty only (no copy per step otherwise)."""
        return seq.token_ids[:seq.num_prompt_tokens] if seq.params.repetition_penalty != 1 else []

    def _prompt_computed(self, request_id: str) -> bool:
        first = self.requests[request_id][0]
        return first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens

    def _release_held(self, request_id: str) -> None:
        for seq in self._held.pop(request_id, []):
            self.scheduler.add(seq)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[request_id]

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> dict:
        b = self.blocks
        waiting = len(self.scheduler.waiting) + sum(map(len, list(self._held.values())))  # may run off-thread
        return {"running": len(self.scheduler.running), "waiting": waiting,
                "num_blocks": b.num_blocks, "free_blocks": b.num_free_blocks,
                "kv_cache_tokens": b.num_blocks * b.block_size,  # capacity (MLA's latent cache holds more per byte)
                "state_slots": b.num_state_slots,  # linear-attention layers' per-sequence states (0: none)
                "kv_cache_usage": 1 - b.num_free_blocks / b.num_blocks, "prefix_cache_queries": b.prefix_queries,
                "prefix_cache_hits": b.prefix_hits, "preemptions": self.scheduler.num_preemptions,
                "steps": self.num_steps, "generated_tokens": self.num_generated_tokens,
                "expert_tokens": self._expert_tokens(), "weight_bytes": dict(self.runner.resident_bytes),
                **({"spec_decode": self.spec_stats.to_dict()} if self.spec_stats else {})}

    def _expert_tokens(self) -> dict[int, int]:
        """Tokens routed to each expert so far (colocated: counted here; else the expert workers count)."""
        counts = getattr(self.runner.model.dispatcher, "expert_tokens_E", None)
        return {} if counts is None else dict(enumerate(counts.tolist()))


def default_eos_ids(model_dir: str | Path, model_cfg: ModelConfig) -> set[int]:
    """End-of-sequence ids as transformers' generate uses them: generation_config.json, else config.json."""
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            return set(eos if isinstance(eos, list) else [eos])
    return set(model_cfg.eos_token_ids)


def check_params(params: SamplingParams, model_cfg: ModelConfig) -> None:
    """ValueError naming the field if params name token ids outside the model's vocabulary."""
    vocab = model_cfg.vocab_size
    bad = [t for t in (params.logit_bias or {}) if t >= vocab]
    if bad:
        raise ValueError(f"logit_bias has token ids {bad[:5]} outside the vocabulary [0, {vocab})")


def max_new_tokens(params: SamplingParams, ids: list[int], model_cfg: ModelConfig) -> int:
    """params.max_tokens, at most what the model's context leaves after the prompt."""
    return min(params.max_tokens, model_cfg.max_model_len - len(ids))


def validate_request(prompt_token_ids: list[int], params: SamplingParams, model_cfg: ModelConfig) -> list[int]:
    """The checks a request passes once, where it enters (LLM, AsyncLLM, the HTTP front); engines
    and workers trust their front. Returns the prompt as a list; ValueError says what is wrong."""
    ids = check_prompt(prompt_token_ids, model_cfg)
    check_params(params, model_cfg)
    return ids


def check_prompt(prompt_token_ids: list[int], model_cfg: ModelConfig) -> list[int]:
    """The prompt as a list; ValueError if it is empty, has ids outside the vocabulary, or leaves no
    room to generate in the model's context."""
    ids = list(prompt_token_ids)
    vocab, max_len = model_cfg.vocab_size, model_cfg.max_model_len
    if not ids:
        raise ValueError("prompt is empty")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if len(ids) >= max_len:
        raise ValueError(f"prompt of {len(ids)} tokens leaves no room in the context of {max_len} tokens")
    return ids

