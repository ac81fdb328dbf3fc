"""`shuttle simulate`: a discrete-event simulation of a deployment serving a workload.

    sim = Simulator(perf, SimModel.from_profile(profile), Deployment(attention_workers=1, expert_workers=1,
                    micro_batches=2, cores=2))
    metrics = sim.run(Workload(num_prompts=64, input_len=64, output_len=32, max_concurrency=32))

Scheduling is the real code: each attention worker's Scheduler and BlockManager on a simulated
clock, requests to the worker with the fewest queued tokens, steps split by split_micro_batches.
A step's time is a per-layer event recurrence (`_pipeline`): attention, M2N transfers and expert
workers that gather every attention worker's micro-batch, each cost from a performance model
(planner.perf: a measured profile or a roofline); colocated, attention and experts run in turn.
On one host (`cores` set) the front's and the load generator's CPU share the cores with the
workers (`_share_cores`, `_delivered`, `_hold_in_front`), and sharing the host slows the workers'
compute by the profile's served factors (planner.factors' `call_slowdown`). docs/architecture.md has
the details.
"""
import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from attention_nodes.block_manager import BlockManager, blocks_for
from attention_nodes.config import ParallelConfig, SchedulerConfig, worker_threads
from attention_nodes.model_runner import (PROMPT_ROWS_KEY_READS, is_prompt_chunk, key_reads, prompt_key_reads,
                                          split_micro_batches)
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import ScheduledBatch, Scheduler
from attention_nodes.sequence import Sequence
from attention_nodes.speculative import after_verify
from planner.factors import call_slowdown, front_scale, served_slowdown
from planner.perf import expected_active
from planner.speculation import Speculation, SpeculativeSteps  # noqa: F401 (Speculation: simulate's API)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The front's CPU never counts as less than this share of a core (_share_cores): a guard against
# dividing by a host the workers fill, not a fit (0.02 and 0.1 replay the stored planner runs alike).
MIN_SPARE_CORES = 0.1


@dataclass(frozen=True)
class SimModel:
    """What the simulator needs of the model."""

    num_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    dtype_bytes: int

    @classmethod
    def from_profile(cls, p: dict) -> "SimModel":
        """From a profile's "model" entry (ModelConfig's numbers, written by planner.profile.run_profile)."""
        m = p["model"]
        return cls(m["num_layers"], m["num_moe_layers"], m["num_experts"], m["top_k"], m["hidden_size"],
                   DTYPE_BYTES[m["dtype"]])

    @classmethod
    def from_config(cls, cfg, dtype=None) -> "SimModel":
        """From a models.config.ModelConfig, in `dtype` (default: the checkpoint's)."""
        return cls(cfg.num_layers, cfg.num_moe_layers, cfg.num_experts, cfg.top_k, cfg.hidden_size,
                   (dtype or cfg.dtype).itemsize)


@dataclass(frozen=True)
class Deployment:
    """colocated, or attention_workers + expert_workers exchanging micro_batches over `transport`.
    torch_threads per process (None: like shuttle serve, `pool_threads`; colocated: every core). cores: the host's cores shared by all processes (None: each process has its own
    device). expert_share: the share of (token, expert) pairs each expert worker receives and
    local_experts: how many experts each holds (None: an even placement)."""

    colocated: bool = False
    attention_workers: int = 1
    expert_workers: int = 1
    micro_batches: int = 1
    torch_threads: int | None = None
    cores: int | None = None
    transport: str = "shm"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int | None = None
    expert_share: tuple[float, ...] | None = None
    local_experts: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("attention_workers", "expert_workers", "micro_batches", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.micro_batches > 4:
            raise ValueError(f"micro_batches must be 1 to 4, got {self.micro_batches}")
        if self.colocated and self.attention_workers != 1:
            raise ValueError("a colocated deployment has one engine (attention_workers=1)")

    @property
    def processes(self) -> int:
        return 1 if self.colocated else self.attention_workers + self.expert_workers

    @property
    def pool_threads(self) -> tuple[int, int]:
        """Torch threads of each attention worker and each expert worker (colocated: the engine's,
        twice): torch_threads, else shuttle serve's rule on one host (attention_nodes.config.
        worker_threads: at m = 1 the pools take turns and each gets the cores), else 1."""
        if self.torch_threads:
            return self.torch_threads, self.torch_threads
        if self.cores is None:
            return 1, 1
        if self.colocated:
            return self.cores, self.cores
        return worker_threads(ParallelConfig(colocated=False, attention_workers=self.attention_workers,
                                             expert_workers=self.expert_workers,
                                             micro_batches=self.micro_batches), self.cores)

    @property
    def threads(self) -> int:
        """The attention workers' (or the colocated engine's) torch threads."""
        return self.pool_threads[0]

    @property
    def computing_threads(self) -> int:
        """Threads that compute at once: the colocated engine's; at m = 1 a pool's at a time (the
        pools take turns); else both pools' together."""
        th_a, th_e = self.pool_threads
        if self.colocated:
            return th_a
        attn, expert = self.attention_workers * th_a, self.expert_workers * th_e
        return max(attn, expert) if self.micro_batches == 1 else attn + expert

    @property
    def oversubscribed(self) -> bool:
        """More threads compute at once than the host has cores."""
        return self.cores is not None and self.computing_threads > self.cores


@dataclass(frozen=True)
class Workload:
    """Like shuttle bench serve's random dataset: fixed lengths, EOS ignored; all requests at once
    unless request_rate (per second, Poisson) is given; at most max_concurrency in flight."""

    num_prompts: int
    input_len: int
    output_len: int
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    seed: int = 0


class _Worker:
    def __init__(self, dep: Deployment, num_blocks: int):
        self.blocks = BlockManager(num_blocks, dep.block_size, True)
        self.sched = Scheduler(SchedulerConfig(dep.max_num_seqs, dep.max_num_batched_tokens), self.blocks)
        self.queued_tokens = 0


class Simulator(SpeculativeSteps):
    def __init__(self, perf, model: SimModel, dep: Deployment, trace_steps: int = 0, spec: Speculation | None = None):
        # Worker pools wait passively between OpenMP regions (ProfilePerf.for_pools); colocated spins.
        if not dep.colocated and hasattr(perf, "for_pools"):
            perf = perf.for_pools()
        scale = front_scale(perf, dep, spec)
        if scale is not None:
            perf = perf.with_front_scale(scale)
        self.perf, self.model, self.dep, self.spec = perf, model, dep, spec
        self._accept: dict[int, int] = {}  # id(seq) -> drafts its verify step accepts (drawn when drafted)
        # On a shared host the workers compute slower than their parts measured alone: the profile's
        # calibration against served runs (served_slowdown; `run` sets it for its workload's batch).
        self.slow = served_slowdown(perf, dep)
        self.call_slow = call_slowdown(perf, dep)  # by each call's tokens where both pools compute at once
        E, n_e = model.num_experts, dep.expert_workers
        local = np.array(dep.local_experts if dep.local_experts else [E / n_e] * n_e, dtype=float)
        self.local_e = local
        self.share_e = np.array(dep.expert_share if dep.expert_share else local / local.sum(), dtype=float)
        # Chance that a token has at least one of its K experts on worker e (it is sent there).
        self.p_send_e = 1.0 - (1.0 - np.minimum(self.share_e, 1.0)) ** model.top_k if n_e > 1 else np.ones(1)
        self.trace_steps, self.events = trace_steps, []
        self.busy = {"attention": 0.0, "experts": 0.0}
        self._front_backlog = 0.0  # per-request front CPU not yet charged to a step (run)
        self._deltas_cpu = 0.0  # the front's and load generator's CPU for the last step's deltas
        self._spare = 1.0  # the cores the workers left free during the last step (_share_cores), 0.1 to 1
        self._delivering = 0.0  # when the front is through with the deltas of the steps so far

    # -- one step -------------------------------------------------------------------------------
    def _shape(self, batches: list[ScheduledBatch]) -> tuple[np.ndarray, ...]:
        """Per worker and micro-batch: tokens, context tokens read, sampled rows, the tokens it emits
        (a verified sequence: 1 + its accepted drafts), and the tokens and reads of its prefilling
        sequences (more than one new token, not a verification's decode rows; none where the worker
        computes them as one-token rows: ModelRunner.prompts_as_rows); per worker: seqs, prompt tokens and
        verified rows."""
        W, m = len(batches), self.dep.micro_batches
        tok, kv, rows, out, ptok, pkv = (np.zeros((W, m)) for _ in range(6))
        seqs, prompt, verify = np.zeros(W), np.zeros(W), np.zeros(W)
        as_rows = self.perf.prompts_as_rows()
        for w, b in enumerate(batches):
            seqs[w] = len(b.seqs)
            prompt[w] = sum(n for n, s in zip(b.num_new_tokens, b.seqs) if is_prompt_chunk(s, n))
            chunks = not (as_rows and prompt_key_reads(b.seqs, b.num_new_tokens) <= PROMPT_ROWS_KEY_READS)
            for i, g in enumerate(split_micro_batches(b.num_new_tokens, m)):
                for j in g:
                    seq = b.seqs[j]
                    q, c = b.num_new_tokens[j], seq.num_computed_tokens
                    reads = key_reads(q, c)
                    tok[w, i] += q
                    kv[w, i] += reads
                    if seq.num_draft_tokens:  # verified: every row sampled
                        rows[w, i] += q
                        verify[w] += q
                        out[w, i] += 1 + self._accepted(seq)
                        continue
                    rows[w, i] += b.sample[j]
                    out[w, i] += b.sample[j]
                    if q > 1 and chunks:
                        ptok[w, i] += q
                        pkv[w, i] += reads
        return tok, kv, rows, out, seqs, ptok, pkv, prompt, verify

    def step_time(self, t0: float, batches: list[ScheduledBatch], step: int = 0) -> float:
        """Simulated end time of a step that starts at t0 with these batches (one per attention worker)."""
        tok, kv, rows, out, seqs, ptok, pkv, prompt, verify = self._shape(batches)
        (th, th_e), mod, dep = self.dep.pool_threads, self.model, self.dep
        slow = self._slow_at(tok)
        # A worker's step with prompt tokens runs every micro-batch eagerly (NativeDecode.mode), and a
        # micro-batch with decode rows beside them splits its attention (planner.profile.prefill_features)
        eager = ((ptok.sum(1, keepdims=True) > 0) & (tok > 0)).astype(float)
        mixed = ((ptok > 0) & (tok > ptok)).astype(float)
        A = self.perf.attention(tok, kv, th, prefill_tokens=ptok, kv_prefill=pkv, eager=eager, mixed=mixed) * slow
        H = self.perf.head(rows, tok, th) * slow
        S = self.perf.step(seqs, th, prefill_tokens=prompt, verify_rows=verify) * self.slow
        trace = step < self.trace_steps
        if dep.colocated:
            X = self.perf.experts(tok * mod.top_k, expected_active(tok, mod.num_experts, mod.num_experts, mod.top_k),
                                  th) * self.slow
            n = tok.sum(1)
            whole = self.perf.colocated(n, kv.sum(1), th, prefill_tokens=ptok.sum(1), kv_prefill=pkv.sum(1),
                                        active=expected_active(n, mod.num_experts, mod.num_experts, mod.top_k),
                                        eager=eager.max(1), mixed=mixed.max(1))
            if whole is not None and dep.micro_batches == 1:  # whole steps as measured
                work = S + whole * self.slow
            else:  # the parts (and the native decode step's saving, measured on its own)
                work = S + (mod.num_layers * A + mod.num_moe_layers * X + H).sum(1)
                if not ptok.any() and dep.micro_batches == 1:  # a decode-only step runs its layers in one native call where the model takes it
                    work = work - np.where(n > 0, self.perf.native_decode_saving(n, th), 0.0) * self.slow
            self.busy["attention"] += float(work.sum())
            if trace:
                self.events.append(("step", "attention", "a0", t0, t0 + float(work[0])))
            return t0 + self._share_cores(float(work.max()), float(work.sum()) * th, out)
        end, busy_a, busy_e = self._pipeline(t0, tok, A, H, S, trace)
        self.busy["attention"] += busy_a
        self.busy["experts"] += busy_e
        return t0 + self._share_cores(end - t0, busy_a * th + busy_e * th_e, out)

    def _slow_at(self, tokens):
        """The factor on calls of `tokens` tokens: by their size where both pools compute at once
        (call_slowdown), else the deployment's one (served_slowdown)."""
        return self.slow if self.call_slow is None else self.call_slow(tokens)

    def _share_cores(self, wall: float, cpu: float, rows: np.ndarray) -> float:
        """A step's duration on a host of `dep.cores` cores shared by its workers (`cpu`: their busy
        thread-seconds, `wall`: the step without sharing) and the front and load generator (their
        CPU for the step's output tokens (`rows`: sampled, per worker and micro-batch), for the
        delta message of each worker that sampled, and for the requests admitted since the last
        step, from the profile). That CPU lands on a core the worker on the step's critical path
        holds with probability `_held` and then delays the step by as much, or, where that is
        under 1 (a pool's worker holds part of the cores), by at most the step's own length: a
        front busy for the whole step shares that core half and half at most, and the rest of its
        work runs past the step's end (served 1 + 1 m=2 at batch 256 on a host half as fast: decode
        steps of 256 sequences 43-44 ms apart at the client, 51.6 ms simulated with all 41 ms of the
        front's CPU at 1/2, 46.7 with the bound; batch 64, where the front's 11 ms fit in the 12 ms
        step, unchanged at 17.8 against 16-18). Where `_held` is 1 the whole of it delays the
        step, longer than the step or not: a colocated engine runs the front's Python in turn with
        its own (the interpreter lock), and at m = 1 or oversubscribed the workers the step waits
        on hold every core (bounded there too, the stored planner runs' colocated and m = 1 rows
        came out 11-33% fast). No step beats all the CPU work over the cores.
        Without cores (each process on its own device) the front costs the workers nothing."""
        cores = self.dep.cores
        if not cores or wall <= 0:
            self._deltas_cpu = 0.0
            return wall
        self._deltas_cpu = float(self.perf.front(rows.sum(), (rows.sum(1) > 0).sum()))
        front = self._deltas_cpu + self._front_backlog
        self._front_backlog = 0.0
        held = self._held
        step = max(wall + (front if held >= 1 else min(front, wall)) * held, (cpu + front) / cores)
        self._spare = min(1.0, max(MIN_SPARE_CORES, cores - cpu / step))
        return step

    @property
    def _front_share(self) -> float:
        """The share of a core the front and the load generator get for a request's work on a shared
        host: the cores over the threads that compute at once plus theirs (the scheduler's fair
        share), at most 1; 1 where the front has a host of its own. (A served 1 + 1 m=2 run, traced:
        a group of 21 requests finished at once and their replacements reached the engine over 19-60
        ms, 6 of them by the next prefill step, while at the measured 0.7 ms of CPU each the
        simulator had them all within one step and 13 in 16 ms. Replayed on six planner runs this
        took mean TPOT within 15% from 63 to 66 of 78 rows, the throughput error unchanged. The
        steps' deltas reach the client at this share too: `_delivered`.)"""
        dep = self.dep
        if not dep.cores:
            return 1.0
        return min(1.0, dep.cores / (dep.computing_threads + 2))

    def _delivered(self, end: float) -> float:
        """When the client has the tokens of a step that ended at `end` (and a request that finished
        in it has freed its concurrency slot): the front's and the load generator's CPU for the
        step's deltas at their fair share of a busy host (`_front_share`) after the step, a latency;
        or, where it is later, once the front has worked through these and the earlier steps' deltas
        in turn on the cores the workers left free during the steps (`_spare`), a queue.
        Measured on served 1 + 1 m=2 runs of the quick Mixtral shape (each request's times in the
        front, the attention worker and the client): from the worker's step to the client's chunk
        13.5 ms at batch 64 and ~32 ms at 256, where the deltas' CPU at the fair share is 11 and
        42 ms, and the server's own TPOT (at the front's event loop, /metrics) equals the client's,
        so at batch 64 the lag does not grow over a request's life: a latency. At batch 256 the
        decode-only steps (~20 ms, 256 tokens, ~21 ms of front and load-generator CPU) outran the
        front: the first wave's replacements reached the worker ~160 ms after their requests
        finished, the batch draining from 256 to 74 (the simulator, handling deltas at full speed,
        had them back in ~75 ms, the batch at 215), then waited for the token budget behind one
        another (TTFT 408-515 ms, TPOT 44-55): the queue. Replayed over fifteen stored planner runs
        (195 rows), this with the requests' wait (`_hold_in_front`) puts mean TPOT within 15% in 174
        rows and throughput within 10% in 172; a queue at full speed gives 154 and 171, the latency
        alone 166 in TPOT, a queue at the fair share alone 114 (it backs up where a step's deltas
        take nearly a step: colocated and m=1 at batch 64)."""
        latency = end + self._deltas_cpu / self._front_share
        self._delivering = max(end, self._delivering) + self._deltas_cpu / self._spare
        return max(latency, self._delivering)

    def _hold_in_front(self, end: float, front_free: float, inbox: list, send: np.ndarray, each: float) -> float:
        """Requests sent by the time a step ends at `end` whose handling is not through by then wait
        for the step's deltas (the front's and the load generator's CPU for them, on the cores the
        workers left free, `_spare`): both event loops run the deltas' callbacks, queued first,
        before a request's next part (written, read, tokenized, handed to the engine). The front
        takes requests one after another (`each` seconds each), so those sent later start after it
        is through with these and with the deltas, or at their send, whichever is later. Served
        1 + 1 m=2 at batch 256, a request took 31-57 ms from the client's send to the front's engine
        in three runs (7.6 ms at batch 64), where its share of the front's per-request CPU, one
        request after another, came to ~14 ms for a group of 20. Updates `inbox` ((time the engine
        may take it, request), a heap) in place, walking it in order only as far as times change (an
        open loop's later arrivals are left alone: 10,000 requests at 150 a second simulate in ~3 s);
        returns when the front is through with the last."""
        wait = self._deltas_cpu / self._spare
        if front_free <= end or wait <= 0:
            return front_free
        done, moved, free = [], [], end + wait
        while inbox and inbox[0][0] <= end:  # through before the step ended
            done.append(heapq.heappop(inbox))
        last = True  # every queued request moved: the last of them ends the front's work
        while inbox:  # the rest in the front's order, until one (and so every later one) keeps its time
            a, r = inbox[0]
            if send[r] <= end and a - each < end:  # on it when the step ended: the rest after the deltas
                new = a + wait
            else:
                new = max(free, send[r]) + each  # free >= end + wait: one sent by the step waits for it
            if new <= a:
                last = False
                break
            heapq.heappop(inbox)
            moved.append((new, r))
            free = new
        for item in done + moved:
            heapq.heappush(inbox, item)
        return free if last else front_free

    @property
    def _held(self) -> float:
        """The chance that the front's CPU delays the step (_share_cores): a colocated engine shares
        the front's interpreter lock, so the front's Python runs in turn with the engine's whatever
        the cores: 1. A pool worker holds its threads' cores while it computes and while it waits
        (the M2N waits poll for spin_s first); the front's work lands on one of the host's cores and
        holds back the step when that core is the critical worker's: its threads over the cores (at
        m = 1 the computing pool takes every core, 1; 1 + 1 at one thread each on two cores, 1/2).
        With more threads computing at once than cores (oversubscribed) every core is shared by
        workers the step waits on: 1 (1/2 had put 2 + 1 and 1 + 2 at m=2 26-47% fast in six planner
        runs replayed, 1 puts them within -4% to +12%, one run's 1 + 2 at +23% with its repeats
        spreading 37%).
        Not 1 for every pool (the share all the workers hold together): that predicts served 1 + 1
        m=2 decode steps of 64 sequences at 10.9 ms, 6.7 of them the front's and the load
        generator's, against 8.9 ms traced, the pools' own compute in it 1.6x the fits' (the served
        factor falls to its floor of 1; the batch-64 rows' TPOT 15-25% long)."""
        dep = self.dep
        if dep.colocated or dep.oversubscribed:
            return 1.0
        return min(1.0, max(dep.pool_threads) / dep.cores)

    def _pipeline(self, t0: float, tok: np.ndarray, A: np.ndarray, H: np.ndarray, S: np.ndarray,
                  trace: bool) -> tuple[float, float, float]:
        """The per-layer event recurrence of one disaggregated step: on every attention worker, for
        each layer and micro-batch i, attention starts when the worker is free and micro-batch i's
        previous MoE output is back; its tokens reach each expert worker one transfer later; an
        expert worker runs slot (layer, i) once the chunks of all attention workers have arrived
        (gathering: lock-step) and its previous slot is done; the answers come back one transfer
        later. Dense layers have no expert stage. Then each micro-batch's LM head. A worker whose
        wait outlasted the transport's polling (spin_s) has blocked and pays a wake-up (wake_s);
        sending keeps the sender busy for its own CPU per message (`send`).
        Returns (end time, attention busy seconds, expert busy seconds)."""
        mod, dep, th = self.model, self.dep, self.dep.pool_threads[1]
        W, m = tok.shape
        T_i = tok.sum(0)
        pairs = self.share_e[:, None] * T_i[None, :] * mod.top_k
        X = self.perf.experts(pairs, expected_active(T_i[None, :], self.local_e[:, None], mod.num_experts, mod.top_k),
                              th) * self._slow_at(T_i)
        sent_WEm = tok[:, None, :] * self.p_send_e[None, :, None]
        row = mod.hidden_size * mod.dtype_bytes
        c_out = self.perf.transfer(sent_WEm * (row + 8 * mod.top_k), dep.transport)
        c_back = self.perf.transfer(sent_WEm * row, dep.transport)
        # The senders' own CPU (packing, copying into the slots): arrivals already include it (c_*
        # is half a measured round), but it keeps the sending worker busy.
        send_a = self.perf.send(sent_WEm * (row + 8 * mod.top_k), dep.transport).sum(1)  # (W, m)
        send_e = self.perf.send(sent_WEm * row, dep.transport).sum(0)  # (E, m)
        wake, spin = self.perf.wake(dep.transport)

        def woken(free: np.ndarray, arrive: np.ndarray) -> np.ndarray:
            """When a worker free at `free` starts on a message arriving at `arrive`: a wait longer
            than the transport's polling has blocked and pays a wake-up."""
            return np.maximum(free, arrive) + np.where(arrive - free > spin, wake, 0.0)

        free_a = t0 + S
        free_e = np.full(dep.expert_workers, t0)
        ready = np.repeat(free_a[:, None], m, axis=1)
        first_moe = mod.num_layers - mod.num_moe_layers
        for layer in range(mod.num_layers):
            for i in range(m):
                start = woken(free_a, ready[:, i])
                free_a = start + A[:, i]
                if trace:
                    self._trace_spans("attention", f"attn L{layer} mb{i}", "a", start, free_a)
                if layer < first_moe:
                    ready[:, i] = free_a
                    continue
                start_e = woken(free_e, (free_a[:, None] + c_out[:, :, i]).max(0))
                free_a = free_a + send_a[:, i]
                free_e = start_e + X[:, i]
                if trace:
                    self._trace_spans("expert", f"experts L{layer} mb{i}", "e", start_e, free_e)
                ready[:, i] = (free_e[None, :] + c_back[:, :, i]).max(1)
                free_e = free_e + send_e[:, i]
        for i in range(m):
            free_a = woken(free_a, ready[:, i]) + H[:, i]
        busy_a = float((mod.num_layers * A.sum(1) + H.sum(1) + S).sum() + mod.num_moe_layers * send_a.sum())
        return float(free_a.max()), busy_a, float(mod.num_moe_layers * (X.sum() + send_e.sum()))

    def _trace_spans(self, cat: str, name: str, prefix: str, start: np.ndarray, end: np.ndarray) -> None:
        for k, (s, e) in enumerate(zip(start, end)):
            if e > s:
                self.events.append((name, cat, f"{prefix}{k}", float(s), float(e)))

    def chrome_trace(self) -> list[dict]:
        """Recorded spans in the format of the workers' --trace files (microseconds)."""
        return [{"name": n, "cat": c, "ph": "X", "ts": s * 1e6, "dur": (e - s) * 1e6, "pid": p, "tid": c}
                for n, c, p, s, e in self.events]

    # -- a whole workload ------------------------------------------------------------------------
    def run(self, wl: Workload) -> dict:
        """Serve the workload; returns shuttle bench serve's metrics plus each pool's busy fraction."""
        from planner.metrics import summarize

        dep, rng = self.dep, np.random.default_rng(wl.seed)
        draws = np.random.default_rng([wl.seed, 1])  # speculation's acceptance
        if np.isfinite(wl.request_rate):
            arrivals = np.cumsum(rng.exponential(1.0 / wl.request_rate, wl.num_prompts))
        else:
            arrivals = np.zeros(wl.num_prompts)
        per_seq = blocks_for(wl.input_len + wl.output_len, dep.block_size)
        blocks = dep.num_blocks or dep.max_num_seqs * per_seq + 1
        workers = [_Worker(dep, blocks) for _ in range(dep.attention_workers)]
        cap = wl.max_concurrency or wl.num_prompts
        # what each attention worker runs at once: the load's concurrency over the workers, at most
        # max_num_seqs (an open-loop load: max_num_seqs)
        self.slow = served_slowdown(self.perf, dep, min(dep.max_num_seqs, -(-cap // dep.attention_workers)))
        free_slots = [0.0] * cap  # a heap of the times concurrency slots free up
        pending = deque(range(wl.num_prompts))
        send, times = np.zeros(wl.num_prompts), [[] for _ in range(wl.num_prompts)]
        owner: dict[int, tuple[int, int]] = {}  # id(seq) -> (request, worker)
        inbox: list[tuple[float, int]] = []  # (send time, request) not yet seen by the engine
        params = SamplingParams(max_tokens=wl.output_len, temperature=0.0, ignore_eos=True)
        t, step, done = 0.0, 0, 0
        per_request, front_free = self.perf.front_request(), 0.0
        # one simulator may run more than one workload
        self._front_backlog, self._delivering, self.events, self._accept = 0.0, 0.0, [], {}
        # speculation's counters as the engine's SpecStats: draft sets, then accepted drafts per position
        drafted = [0] * (1 + (self.spec.num_speculative_tokens if self.spec else 0))
        self.busy = {"attention": 0.0, "experts": 0.0}
        while done < wl.num_prompts:
            while pending and free_slots:  # a free slot goes to the next request, from its arrival
                r = pending.popleft()
                send[r] = max(arrivals[r], heapq.heappop(free_slots))
                # The front takes requests one at a time, on its share of a busy host: the engine sees
                # this one when the front is through with it (and the ones before it); its CPU lands
                # on the next step.
                front_free = max(send[r], front_free) + per_request / self._front_share
                self._front_backlog += per_request
                heapq.heappush(inbox, (front_free, r))
            while inbox and inbox[0][0] <= t:
                _, r = heapq.heappop(inbox)
                ids = rng.integers(2, 1 << 30, wl.input_len).tolist()
                w = min(range(len(workers)), key=lambda k: workers[k].queued_tokens)
                seq = Sequence(str(r), 0, ids, len(ids), params, wl.output_len, r)
                workers[w].sched.add(seq)
                workers[w].queued_tokens += wl.input_len + wl.output_len
                owner[id(seq)] = (r, w)
            if not any(wk.sched.has_work() for wk in workers):
                t = max(t, inbox[0][0])
                continue
            if self.spec is not None:
                for wk in workers:
                    self._draft(wk, draws)
            batches = [wk.sched.schedule() for wk in workers]
            t = self.step_time(t, batches, step)
            drafting = self._drafting(workers, batches) if self.spec is not None else 0.0  # (after the tokens go out)
            step += 1
            seen = self._delivered(t)
            front_free = self._hold_in_front(t, front_free, inbox, send, per_request / self._front_share)
            for wk, b in zip(workers, batches):
                wk.sched.finish_computed(b)
                for seq, sampled in zip(b.seqs, b.sample):
                    if not sampled:
                        continue
                    r, w = owner[id(seq)]
                    if seq.num_draft_tokens:  # verified: the token before the drafts and those accepted
                        emit = 1 + self._accepted(seq)
                        drafted[0] += 1
                        for j in range(emit - 1):
                            drafted[1 + j] += 1
                        del self._accept[id(seq)]
                        seq.drop_drafts()
                        seq.token_ids.extend([1] * emit)  # (then cached, as the engine's _sample)
                        wk.sched.computed(seq, emit)
                        seq.spec_misses, seq.spec_skip = after_verify(seq.spec_misses, emit - 1, "mtp")
                    else:
                        emit = 1
                        seq.token_ids.append(1)
                    times[r].extend([seen] * emit)
                    if seq.num_output_tokens >= seq.max_tokens:
                        wk.sched.finish(seq, "length")
                        wk.queued_tokens -= wl.input_len + wl.output_len
                        heapq.heappush(free_slots, seen)
                        done += 1
            t += drafting
        out = summarize(send, times, wl.input_len)
        out.update(attention_busy=self.busy["attention"] / max(out["duration"], 1e-12) / dep.attention_workers,
                   expert_busy=(self.busy["experts"] / max(out["duration"], 1e-12) / dep.expert_workers
                                if not dep.colocated else None),
                   steps=step, estimated=bool(getattr(self.perf, "estimated", False)))
        if self.spec is not None:  # vLLM's per-position acceptance (accepted_per_pos[j] / num_drafts)
            out["spec_decode_per_position_acceptance_rates"] = [a / max(drafted[0], 1) for a in drafted[1:]]
        return out
