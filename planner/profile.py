"""`shuttle profile`: measure the real workers' costs on this host and fit the planner's models.

    profile = run_profile(ProfileOptions(model="models/builtin", threads=(1, 2), transports=("shm", "tcp")))

What is timed, with the real code (each point the fastest of `repeats` runs after a warm-up: the
undisturbed cost; what disturbs a served run, the front and load generator sharing the cores, is
measured on its own and added by the simulator, and on a shared or oversubscribed host a two-thread
OpenMP op whose second thread is descheduled measured up to 100x its undisturbed time, which a
median of three does not reject):
- attention side, per layer and micro-batch: ModelRunner.execute of a scheduled batch on a model
  built without experts, its dispatcher replaced by one that returns zeros and stamps the time of
  every dispatch (so the gaps between stamps are one layer's attention, norms, router and dense MLP).
  Decode batches of b sequences reading c tokens of context each, and prefill chunks of n tokens.
  Fit: T_a = k1 tokens + k2 + kc kv_reads + kp prefill_tokens + kq kv_prefill (kv_reads: context
  tokens read, summed over query tokens; prefill_tokens and kv_prefill: the same counted over the
  sequences with more than one new token, whose attention is the flash kernel's, not the decode
  kernel's).
- outside the layers, per step: embedding, final norm and LM head on the sampled rows (timed on
  their own), and what a real LLMEngine.step spends outside its forward (input preparation,
  sampling, scheduling, each sequence's bookkeeping) plus encoding the step's Deltas.
  Fits: head = h1 rows + h2 tokens + h0; step = s1 seqs + s0 + sp prefill_tokens.
- expert side, per layer and micro-batch: run_local_experts (what an expert worker runs between
  recv and reply) through every MoE layer's experts in turn, packed as the worker packs them, for
  R gathered tokens routed uniformly at random over a chosen number of experts.
  Fit: T_e = k3 pairs + k4 + k5 active_experts (pairs: (token, expert) pairs).
- speculative method mtp (checkpoints with MTP layers; planner.profile_mtp): ModelRunner.mtp_draft,
  timed call by call in a real colocated LLMEngine drafting k = 1 and 3 for b random prompts. Fit: T = d1 rows + d2 passes
  + dp prefill_tokens (rows: one-token rows over all passes, passes: the layer's runs, prefill_tokens:
  prompt-chunk rows). The per-position acceptance of those runs is kept as the default for planning.
- cold weights: where the model's weights are more than the last-level cache, every timed part
  begins with the caches evicted (CacheEvictor, untimed), as a served step finds them; whole
  colocated steps run as served instead, batches of other tokens in turn (measure_colocated).
- M2N, per backend: planner.profile_m2n (a real M2NSender / M2NReceiver pair in two processes).
- the front and the load generator, CPU seconds per output token: planner.front (a real 1 + 1
  `shuttle serve` driven by `shuttle bench serve`'s client; skipped with front=False).
Each thread count is measured in this process with torch.set_num_threads. With quantization="int8"
every runner, engine, expert sample and served run holds its experts as serving does
(EngineConfig.quantization, expert_nodes.worker.pack_for_cpu), and with quantize_linears its other
linears too; the profile records both: a profile is used only for the quantization it was measured
with (planner.cli.load_profile), and a host plan serves its linears as measured.
"""
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from attention_nodes.block_manager import blocks_for
from attention_nodes.config import CacheConfig, EngineConfig, SchedulerConfig
from attention_nodes.engine import LLMEngine
from attention_nodes.messages import Deltas, encode, encode_delta
from attention_nodes.model_runner import PROMPT_ROWS_KEY_READS, ModelRunner, key_reads
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import ScheduledBatch
from kernels import choice
from m2n_comm.m2n import ExpertBatch, run_local_experts
from models.config import ModelConfig
from models.loader import load_experts
from planner.calibrate import front_scales, served_factor, served_factors
from planner.fit import Fit, fit_linear
from planner.perf import expected_active
from planner.hardware import describe_host
from planner.profile_mtp import MTP_DRAFTS, measure_mtp  # noqa: F401 (MTP_DRAFTS: the profile's API)
from planner.shapes import shape_from
from planner.timing import (SERVED_VARIANTS, CacheEvictor, StampingDispatcher, best_time, served_time,
                             synthetic_batch)

log = logging.getLogger("shuttle.profile")
PROFILE_VERSION = 1
# One line for decode and prefill rows under-predicted every prefill sample (-5% to -22%: the 2,048-
# token chunk of 16 prompts the most) and over-predicted the decode ones (+5% to +15%), so served
# TTFT came out 10-25% short and TPOT 10-30% long; prefill's own terms split them.
# A step with a prompt chunk runs eagerly, layer by layer (a decode step runs in the native call), and
# one that also has decode rows splits its attention in two: fitted without those steps' own terms, the
# built-in model's colocated steps of one 64-token prompt beside 3 decode rows came out 1.36x the fit
# and 16 prompt tokens beside 3 2.16x (Zen 5 EPYC, 2 threads), where the speculative engine's prompts
# join running verifications one at a time; with `eager` and `mixed` every such step was within 6%.
ATTN_TERMS = ("tokens", "const", "kv_reads", "prefill_tokens", "kv_prefill", "eager", "mixed")
HEAD_TERMS = ("rows", "tokens", "const")
STEP_TERMS = ("seqs", "const", "prefill_tokens")
EXPERT_TERMS = ("pairs", "const", "active")
NATIVE_DECODE_TERMS = ("tokens", "const")
COLOCATED_TERMS = ("tokens", "const", "kv_reads", "prefill_tokens", "kv_prefill", "active", "eager", "mixed")
MTP_TERMS = ("rows", "passes", "prefill_tokens")
SPEC_STEP_TERMS = ("seqs", "const", "verify_rows")  # a step that verifies drafts, outside its forward and drafting


@dataclass(frozen=True)
class ProfileOptions:
    model: str
    dtype: torch.dtype | None = None
    threads: tuple[int, ...] = (1, 2)
    transports: tuple[str, ...] = ("shm",)
    repeats: int = 3
    quick: bool = False
    # (4: a step of a few rows, as a speculative step verifies at batch 1, between 1 and 16)
    batches: tuple[int, ...] = (1, 4, 16, 64, 256)
    contexts: tuple[int, ...] = (16, 256, 1024)
    prefill: tuple[int, ...] = (32, 128, 512)
    # Multi-sequence prefill chunks (sequences, tokens each) at the scheduler's default token budget
    # (2,048): what a served step of many new prompts is. Without them the fits extrapolated 4-8x past
    # their largest sample and predicted such steps 15-35% too fast (a 1 + 1 pool on the AVX-512 EPYC).
    prefill_chunks: tuple[tuple[int, int], ...] = ((16, 128),)
    # Mixed steps (prompt tokens, decode rows beside them, at the largest context): a served step that
    # admits a prompt while others decode (the `mixed` term).
    mixed: tuple[tuple[int, int], ...] = ((32, 4), (128, 16))
    expert_tokens: tuple[int, ...] = (1, 8, 64, 256, 1024, 2048)
    max_kv_reads: int = 32768
    front: bool = True
    quantization: str | None = None  # the experts' (EngineConfig.quantization): None or "int8"
    quantize_linears: bool = False  # EngineConfig.quantize_linears: the other linears in `quantization` too

    @classmethod
    def quick_options(cls, **kw) -> "ProfileOptions":
        """A smaller grid (about a third of the points) and fewer repeats, for a smoke run."""
        return cls(repeats=3, quick=True, batches=(1, 4, 16, 64, 256), contexts=(16, 512), prefill=(32, 128, 256),
                   expert_tokens=(1, 16, 64, 256, 2048), max_kv_reads=16384, **kw)


_GRID = ("repeats", "quick", "batches", "contexts", "prefill", "prefill_chunks", "mixed", "expert_tokens",
         "max_kv_reads")


def _kv_reads(q_lens: list[int], ctx_lens: list[int]) -> int:
    """Context tokens read by all query tokens (model_runner.key_reads)."""
    return sum(key_reads(q, c) for q, c in zip(q_lens, ctx_lens))


def prefill_features(q_lens: list[int], ctx_lens: list[int], as_rows: bool = False) -> dict[str, int]:
    """prefill_tokens, kv_prefill, eager and mixed (ATTN_TERMS) of a batch: the new tokens of its
    sequences with more than one and the context they read; 1 where there are such tokens (the step
    runs eagerly), and 1 where one-token rows are beside them (its attention runs in two parts). All 0
    where its prompt chunks run as one-token rows (as_rows: ModelRunner.prompts_as_rows), a decode step."""
    pre = [] if as_rows else [(q, c) for q, c in zip(q_lens, ctx_lens) if q > 1]
    return {"prefill_tokens": sum(q for q, _ in pre), "kv_prefill": _kv_reads(*zip(*pre)) if pre else 0,
            "eager": int(bool(pre)), "mixed": int(bool(pre) and len(pre) < len(q_lens))}


def _ways(runner: ModelRunner, batch: ScheduledBatch) -> list[bool]:
    """How a runner may compute a step's prompt chunks (as_rows, for prefill_features): as one-token
    rows where it takes them so (ModelRunner.prompts_as_rows), and as chunks, eagerly, in any case
    (served prompts that read more keys); a decode step: [False]. The runner is left taking rows."""
    runner.prompt_rows_key_reads = PROMPT_ROWS_KEY_READS
    return [True, False] if runner.prompts_as_rows(batch) else [False]


def _as_rows(runner: ModelRunner, on: bool) -> None:
    runner.prompt_rows_key_reads = PROMPT_ROWS_KEY_READS if on else 0


def step_shapes(opts: "ProfileOptions", cfg: ModelConfig) -> tuple[list[tuple[list[int], list[int]]], int]:
    """The (q_lens, ctx_lens) batches measure_attention and measure_colocated time: decode batches at
    each context (at most max_kv_reads context tokens read), single prompts, chunks of prompts and
    mixed steps (a prompt beside decode rows at the largest context); and the KV blocks (of 16
    tokens) they need."""
    contexts = [c for c in opts.contexts if c < cfg.max_model_len]
    max_ctx = max(contexts) if contexts else 16
    pre = [n for n in opts.prefill if n < cfg.max_model_len]
    chunks = [(b, n) for b, n in opts.prefill_chunks if n < cfg.max_model_len]
    mixed = [(n, b) for n, b in opts.mixed if n < cfg.max_model_len]
    shapes = [([1] * b, [c] * b) for b in opts.batches for c in contexts if b * c <= opts.max_kv_reads]
    shapes += [([n], [0]) for n in pre] + [([n] * b, [0] * b) for b, n in chunks]
    shapes += [([n] + [1] * b, [0] + [max_ctx] * b) for n, b in mixed]
    return shapes, blocks_for(max(max_ctx + 1, *pre, *(n for _, n in chunks), *(n for n, _ in mixed), 1), 16) + 1


def measure_attention(opts: ProfileOptions, cfg: ModelConfig) -> list[dict]:
    """Attention-side samples: per-layer time and head time of decode and prefill
    batches, for every thread count."""
    shapes, num_blocks = step_shapes(opts, cfg)
    block_size = 16
    evict = CacheEvictor(opts.model)
    disp = StampingDispatcher(evict)
    runner = ModelRunner(EngineConfig(opts.model, dtype=opts.dtype, cache=CacheConfig(block_size, num_blocks),
                                      quantization=opts.quantization,
                                      quantize_linears=opts.quantize_linears), cfg, disp, 1)
    # (Large batches at long context cost seconds per point, the CPU's paged attention reading every
    # token: bounded by max_kv_reads, which still spans the fit's range.)
    samples = []
    for threads in opts.threads:
        torch.set_num_threads(threads)
        for q_lens, ctx_lens in shapes:
            for as_rows in _ways(runner, synthetic_batch(q_lens, ctx_lens, block_size, num_blocks)):
                layer_times = []

                def run():
                    runner.execute(synthetic_batch(q_lens, ctx_lens, block_size, num_blocks))
                    gaps, s = disp.layer_times(), disp.stamps
                    layer_times.append(statistics.median(gaps) if gaps else (s[-2] - s[0]))

                _as_rows(runner, as_rows)
                best_time(run, opts.repeats)
                head = _head_time(runner, q_lens, opts.repeats, evict)
                samples.append({"threads": threads, "tokens": sum(q_lens), "seqs": len(q_lens), "rows": len(q_lens),
                                "kv_reads": _kv_reads(q_lens, ctx_lens), **prefill_features(q_lens, ctx_lens, as_rows),
                                "layer_s": min(layer_times[1:]), "head_s": head})
    return samples


def _head_time(runner: ModelRunner, q_lens: list[int], repeats: int, evict: CacheEvictor) -> float:
    """Embedding of the step's tokens, final norm and LM head of its sampled rows (one per sequence),
    on the threads the runner gives them (ModelRunner.decode_threads, ModelRunner.logits)."""
    model = runner.model
    ids = torch.ones(sum(q_lens), dtype=torch.long)
    rows = torch.tensor(q_lens).cumsum(0) - 1

    @torch.inference_mode()
    def head():
        with runner.decode_threads(q_lens):
            runner.logits(model.model.norm(model.model.embed_tokens(ids)[rows]))

    return best_time(head, repeats, before=evict)


def measure_step(opts: ProfileOptions, cfg: ModelConfig) -> list[dict]:
    """Per-step costs outside the forward, on a real LLMEngine built as an attention worker's (the
    experts stamped, not run) decoding b sequences: the step's wall time less its forward
    (begin_step..end_step: embedding, layers, final norm, LM head) is the input preparation,
    sampling, scheduling and every sequence's bookkeeping; plus encoding the step's Deltas (what an
    attention worker sends the front). The median of 12 steps per point. (Timing the scheduler,
    sampler and encoding on their own missed about half of it: 0.3 against 1.0 ms at batch 64.) The
    steps that compute the b prompts (32 tokens each) are samples too, one each, with their
    prefill_tokens: admitting and hashing prompts costs per token (a colocated 1-thread step of
    2,048 prompt tokens spent ~10 ms outside its forward, the decode steps' fit said 0.9)."""
    B, steps, prompt = max(opts.batches), 12, 32
    disp = StampingDispatcher()
    num_blocks = B * blocks_for(prompt + steps + 2, 16) + 4
    engine = LLMEngine(EngineConfig(opts.model, dtype=opts.dtype,
                                    scheduler=SchedulerConfig(max_num_seqs=B, max_num_batched_tokens=max(2048, 8 * B)),
                                    cache=CacheConfig(16, num_blocks, enable_prefix_caching=False),
                                    quantization=opts.quantization, quantize_linears=opts.quantize_linears),
                       set(), dispatcher=disp)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    rng, samples = torch.Generator().manual_seed(0), []
    for threads in opts.threads:
        torch.set_num_threads(threads)
        for b in opts.batches:
            for i in range(b):
                engine.add_request(f"{threads}-{b}-{i}",
                                   torch.randint(2, cfg.vocab_size, (prompt,), generator=rng).tolist(), params)
            while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                                  for s in engine.scheduler.running):  # the prompts
                t0 = time.perf_counter()
                deltas = engine.step()
                encode(Deltas([encode_delta(d) for d in deltas]))
                batch = engine.last_batch
                samples.append({"threads": threads, "seqs": len(batch.seqs),
                                "prefill_tokens": sum(n for n in batch.num_new_tokens if n > 1),
                                "step_s": time.perf_counter() - t0 - (disp.stamps[-1] - disp.stamps[0])})
            outside = []
            for _ in range(steps):
                t0 = time.perf_counter()
                deltas = engine.step()
                encode(Deltas([encode_delta(d) for d in deltas]))
                outside.append(time.perf_counter() - t0 - (disp.stamps[-1] - disp.stamps[0]))
            while engine.has_unfinished_requests():
                engine.step()
            samples.append({"threads": threads, "seqs": b, "prefill_tokens": 0, "step_s": statistics.median(outside)})
    return samples


def measure_experts(opts: ProfileOptions, cfg: ModelConfig) -> list[dict]:
    """Expert-side samples: run_local_experts over gathered token counts and numbers of experts
    receiving tokens, through every MoE layer in turn as an expert worker's step does (per layer:
    the total over the layers / their count). One layer on its own kept its experts in the cache and
    came out up to a third faster than a step that streams all layers' experts from memory. Under
    passive waits torch's own ops stay on one thread as in the worker (expert_nodes.worker.narrows),
    which the worker's steps do since the narrowing; the native block's own region still wakes its
    second thread once a layer (the passive fit's constant: 33-44 us a layer against 16-22
    spinning, before and after)."""
    from expert_nodes.worker import pack_for_cpu, narrows
    from kernels import native

    layers = [i for i, moe in enumerate(cfg.moe_layers) if moe]
    evict = CacheEvictor(opts.model)
    experts = pack_for_cpu(load_experts(opts.model, list(range(cfg.num_experts)), cfg, opts.dtype), opts.quantization)
    dtype = opts.dtype or cfg.dtype
    E, K, g = cfg.num_experts, cfg.top_k, torch.Generator().manual_seed(0)
    samples = []
    for threads in opts.threads:
        torch.set_num_threads(threads)
        for R in opts.expert_tokens:
            for active in sorted({min(E, max(K, R * K)), K}):
                ids_RK = torch.stack([torch.randperm(active, generator=g)[:K] for _ in range(R)])
                x = torch.randn(R, cfg.hidden_size, generator=g).to(dtype)
                w = torch.full((R, K), 1.0 / K)
                batches = [(experts[l], ExpertBatch(0, l, 0, x, ids_RK, w, [R])) for l in layers]

                def step():
                    for held, batch in batches:
                        run_local_experts(held, batch)

                with native.native_parallel_only(narrows(experts.values())):  # as the worker steps
                    t = best_time(step, opts.repeats, before=evict) / len(layers)
                samples.append({"threads": threads, "tokens": R, "pairs": R * K,
                                "active": int(ids_RK.unique().numel()), "expert_s": t})
    return samples


def fit_samples(samples: dict[str, list[dict]], threads: int) -> dict[str, Fit]:
    """The per-thread-count fits of the attention, head, step and expert samples (and of the
    native decode, colocated and MTP ones where measured)."""
    def pick(kind: str) -> list[dict]:
        return [s for s in samples[kind] if s["threads"] == threads]

    a, s, e = pick("attention"), pick("step"), pick("experts")
    fits = {"attention": fit_linear(a, [r["layer_s"] for r in a], ATTN_TERMS),
            "head": fit_linear(a, [r["head_s"] for r in a], HEAD_TERMS),
            "step": fit_linear(s, [r["step_s"] for r in s], STEP_TERMS),
            "experts": fit_linear(e, [r["expert_s"] for r in e], EXPERT_TERMS)}
    if samples.get("native_decode"):
        n = pick("native_decode")
        fits["native_decode"] = fit_linear(n, [r["saving_s"] for r in n], NATIVE_DECODE_TERMS)
    if samples.get("colocated"):
        c = pick("colocated")
        fits["colocated"] = fit_linear(c, [r["step_s"] for r in c], COLOCATED_TERMS)
    d = pick("mtp") if samples.get("mtp") else []
    if len(d) >= len(MTP_TERMS):
        fits["mtp"] = fit_linear(d, [r["mtp_s"] for r in d], MTP_TERMS)
    v = pick("mtp_step") if samples.get("mtp_step") else []
    if len(v) >= len(SPEC_STEP_TERMS):
        fits["spec_step"] = fit_linear(v, [r["step_s"] for r in v], SPEC_STEP_TERMS)
    return fits


def measure_colocated(opts: ProfileOptions, cfg: ModelConfig) -> list[dict]:
    """Whole colocated steps as a colocated engine computes them: ModelRunner.execute with the
    experts in this process (the native decode step where the model takes it), random tokens, over
    measure_attention's grid (step_shapes), per thread count: the median of
    opts.repeats rounds of SERVED_VARIANTS batches of the shape with other tokens (so other experts)
    in turn, without evicting the caches: each step finds them as the one before left it, as served
    steps do. (Evicted first, a step of one sequence of the built-in model took 0.84 ms against 0.43
    served; of 64, 2.27 against 2.09 repeated.) Fit: T = k1 tokens + k0 + kc kv_reads + kp
    prefill_tokens + kq kv_prefill + ke active + kg eager + km mixed (COLOCATED_TERMS; active: the
    experts the tokens are expected to reach), which the simulator takes for a colocated step's compute.
    The parts measured one at a time (attention with the experts stubbed, the experts through an expert
    worker's call, the head) added up to less than such a step: on the 2-core AMX Xeon a 1-thread step
    of 2,048 prompt tokens took 1.55x their sum and decode steps 1.25-1.3x, so served colocated runs
    came out 22-39% slower than predicted from them."""
    shapes, num_blocks = step_shapes(opts, cfg)
    block_size = 16
    runner = ModelRunner(EngineConfig(opts.model, dtype=opts.dtype, cache=CacheConfig(block_size, num_blocks),
                                      quantization=opts.quantization,
                                      quantize_linears=opts.quantize_linears), cfg)
    E, K = cfg.num_experts, cfg.top_k
    samples = []
    for threads in opts.threads:
        torch.set_num_threads(threads)
        for q_lens, ctx_lens in shapes:
            batches = [synthetic_batch(q_lens, ctx_lens, block_size, num_blocks, cfg.vocab_size, v)
                       for v in range(SERVED_VARIANTS)]
            for as_rows in _ways(runner, batches[0]):
                _as_rows(runner, as_rows)
                t = served_time([lambda b=b: runner.execute(b) for b in batches], opts.repeats)
                tokens = sum(q_lens)
                samples.append({"threads": threads, "tokens": tokens, "seqs": len(q_lens),
                                "kv_reads": _kv_reads(q_lens, ctx_lens), **prefill_features(q_lens, ctx_lens, as_rows),
                                "active": float(expected_active(tokens, E, E, K)), "step_s": t})
    return samples


def measure_native_decode(opts: ProfileOptions, cfg: ModelConfig) -> list[dict]:
    """What running a colocated decode step whole in one native call saves over running it as the
    attention and expert samples time it (models/native_decode.py): each layer's attention side
    natively, as an attention worker does (the stamping runner of measure_attention), and the
    experts through their Python call (measure_experts). Per batch and thread count: the colocated
    step both ways, alternated, the fastest of opts.repeats each, at the middle context. The
    simulator takes it off colocated decode-only steps. [] where the model does not take the native
    decode (then a colocated engine serves it as the samples do). A saving lost in the noise counts
    as 1 us."""
    contexts = sorted(c for c in opts.contexts if c < cfg.max_model_len)
    ctx = contexts[len(contexts) // 2] if contexts else 16
    block_size = 16
    num_blocks = blocks_for(ctx + 1, block_size) + 1
    runner = ModelRunner(EngineConfig(opts.model, dtype=opts.dtype, cache=CacheConfig(block_size, num_blocks),
                                      quantization=opts.quantization,
                                      quantize_linears=opts.quantize_linears), cfg)
    nd = runner.model.native_decode
    if nd is None:
        return []
    samples = []
    for threads in opts.threads:
        torch.set_num_threads(threads)
        for b in opts.batches:
            batch = synthetic_batch([1] * b, [ctx] * b, block_size, num_blocks)
            times = {True: [], False: []}
            for r in range(opts.repeats + 1):  # the first round warms both up (buffers, caches)
                for on in ((True, False) if r % 2 else (False, True)):
                    nd.layer_by_layer = not on
                    t0 = time.perf_counter()
                    runner.execute(batch)
                    if r:
                        times[on].append(time.perf_counter() - t0)
            samples.append({"threads": threads, "tokens": b, "step_s": min(times[True]), "layers_s": min(times[False]),
                            "saving_s": max(min(times[False]) - min(times[True]), 1e-6)})
    nd.layer_by_layer = False
    return samples


def measure_workers(opts: ProfileOptions, cfg: ModelConfig) -> dict[str, list[dict]]:
    """The attention, step, expert and (with an MTP layer) MTP drafting samples at every thread count of
    opts, in this process; "mtp_acceptance" is measure_mtp's acceptance (None without an MTP layer)."""
    old_threads = torch.get_num_threads()
    try:
        mtp, mtp_steps, acceptance = measure_mtp(opts, cfg)
        return {"attention": measure_attention(opts, cfg), "step": measure_step(opts, cfg),
                "experts": measure_experts(opts, cfg), "mtp": mtp, "mtp_step": mtp_steps,
                "mtp_acceptance": acceptance}
    finally:
        torch.set_num_threads(old_threads)


def measure_passive(opts: ProfileOptions) -> dict[str, list[dict]] | None:
    """The same samples at the thread counts of 2 and more, with OpenMP's passive waits: the worker
    pools run so on one host (pools/launchers.py), where an op's second thread sleeps between
    parallel regions and every op wakes it. OpenMP reads its wait policy once, at start, so they are
    measured in a child process. (On the AVX-512 host, 25M model, batch 64: a decode step's layers
    took 2x the spinning threads' time, and more than one thread's.) None without such counts."""
    threads = [t for t in opts.threads if t >= 2]
    if not threads:
        return None
    spec = {**{k: getattr(opts, k) for k in _GRID}, "model": str(opts.model), "threads": threads,
            "dtype": None if opts.dtype is None else str(opts.dtype).removeprefix("torch."),
            "quantization": opts.quantization, "quantize_linears": opts.quantize_linears}
    out = subprocess.run([sys.executable, "-c", "from planner.profile import _passive_child; _passive_child()"],
                         input=json.dumps(spec), capture_output=True, text=True,
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    if out.returncode != 0:
        raise RuntimeError(f"profiling with passive OpenMP waits failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _passive_child() -> None:
    """measure_passive's child: reads its spec as JSON on stdin, prints the samples as one JSON line."""
    spec = json.loads(sys.stdin.read())
    grid = {k: tuple(map(tuple, v)) if k == "prefill_chunks" else tuple(v) if isinstance(v, list) else v
            for k, v in spec.items() if k in _GRID}
    opts = ProfileOptions(spec["model"], getattr(torch, spec["dtype"]) if spec["dtype"] else None,
                          tuple(spec["threads"]), transports=(), front=False, quantization=spec["quantization"],
                          quantize_linears=spec["quantize_linears"], **grid)
    samples = measure_workers(opts, ModelConfig.from_pretrained(opts.model))
    print(json.dumps(samples))


def run_profile(opts: ProfileOptions) -> dict:
    """Measure everything and return the profile (JSON-ready)."""
    from planner.profile_m2n import measure_transfer

    cfg = ModelConfig.from_pretrained(opts.model)
    shape = shape_from(opts.model)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    samples = measure_workers(opts, cfg)
    mtp_acceptance = samples.pop("mtp_acceptance", None)
    old_threads = torch.get_num_threads()
    try:  # colocated engines only (spinning threads): not in the passive samples
        samples["native_decode"] = measure_native_decode(opts, cfg)
        samples["colocated"] = measure_colocated(opts, cfg)
    finally:
        torch.set_num_threads(old_threads)
    fits = {str(t): {k: f.to_dict() for k, f in fit_samples(samples, t).items()} for t in opts.threads}
    passive = measure_passive(opts)
    fits_passive = {} if passive is None else {
        str(t): {k: f.to_dict() for k, f in fit_samples(passive, t).items()} for t in opts.threads if t >= 2}
    if passive is not None:
        passive.pop("mtp_acceptance", None)
        samples["passive"] = passive
    dtype = opts.dtype or cfg.dtype
    front = None
    if opts.front:
        from planner.front import measure_front, measure_scale_runs

        served_dtype = str(dtype).replace("torch.", "") if opts.dtype else None
        served = dict(quantization=opts.quantization, quantize_linears=opts.quantize_linears)
        front = measure_front(opts.model, served_dtype, **served)
        front["scale_runs"] = measure_scale_runs(opts.model, opts.threads, served_dtype, **served,
                                                 speculative=bool(samples.get("mtp") and mtp_acceptance))
    transfer = {}
    for backend in opts.transports:
        tsamples, wake = measure_transfer(opts.model, backend, dtype, quick=opts.quick)
        samples[f"transfer_{backend}"] = tsamples
        transfer[backend] = {**fit_linear(tsamples, [s["oneway_s"] for s in tsamples], ("bytes", "const")).to_dict(),
                             **wake, "send": fit_linear(tsamples, [s["send_s"] for s in tsamples],
                                                        ("bytes", "const")).to_dict()}
    profile = {"version": PROFILE_VERSION, "kind": "measured", "model": {
                "path": str(opts.model), "name": shape.name, "config_hash": shape.config_hash,
                "dtype": str(dtype).replace("torch.", ""), "quantization": opts.quantization,
                "quantize_linears": opts.quantize_linears,
                "num_layers": cfg.num_layers,
                "num_moe_layers": cfg.num_moe_layers, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
                "hidden_size": cfg.hidden_size},
            "host": describe_host(), "threads": list(opts.threads), "fits": fits, "fits_passive": fits_passive,
            "transfer": transfer, "front": front,
            # speculative method mtp's per-position acceptance on measure_mtp's random prompts (None:
            # no MTP layer): the simulator's default, for a workload of that kind
            "mtp_acceptance": mtp_acceptance,
            # the CPU kernels the measured runners took, per op and row count (kernels/choice.py): the
            # fits above hold for these
            "kernels": {op: {k: t[k] for k in ("runs", "picks", "source")} for op, t in choice.chosen().items()},
            "samples": samples, "seconds": round(time.monotonic() - t0, 1),
            # the 1-minute load average before and after (this process's own work included): a host
            # busy with other jobs makes every time above slower and noisier (format_profile warns)
            "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    profile["served_factor"] = served_factor(profile)
    profile["served_factors"] = served_factors(profile)
    profile["front_scales"] = front_scales(profile)
    return profile

