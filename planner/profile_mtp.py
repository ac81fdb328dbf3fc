"""`shuttle profile`'s measurement of speculative method mtp (planner/profile.py): the MTP layer's
drafting timed call by call in a real colocated engine, and its acceptance per draft position."""
import itertools
import logging
import time

import torch

from attention_nodes.block_manager import blocks_for
from attention_nodes.config import CacheConfig, EngineConfig, SchedulerConfig
from attention_nodes.engine import LLMEngine
from attention_nodes.model_runner import is_prompt_chunk, kept_positions
from attention_nodes.sampling_params import SamplingParams
from models.config import ModelConfig

log = logging.getLogger("shuttle.profile")

MTP_DRAFTS = (1, 3)  # the k measure_mtp runs: one pass a step, and chained ones
MTP_MAX_BATCH = 64  # speculation pays at small batches (disable_by_batch_size defaults to 4)


def measure_mtp(opts: "ProfileOptions", cfg: ModelConfig) -> tuple[list[dict], list[dict], list[float] | None]:
    """Speculative method mtp's drafting as a colocated engine runs it: a real LLMEngine with the
    checkpoint's MTP layer drafting k (MTP_DRAFTS) for b random 32-token prompts (opts.batches up to
    MTP_MAX_BATCH), greedy, 24 new tokens each; every ModelRunner.mtp_draft call timed with its
    features: rows (the first pass's one-token rows, a verification's kept 1 + accepted or a decode's
    one, plus the chained passes' rows), passes (the layer's runs) and prefill_tokens (prompt-chunk
    rows). Also each step that verifies drafts (and computes no prompt): its wall time less its forward
    and its MTP passes, the step's own work as measure_step's samples, with seqs and verify_rows (the
    verified sequences' rows): sampling every row and taking the accepted ones costs more than a plain
    step's one row a sequence (0.26 against 0.14 ms at 4 sequences, k = 2, on the built-in model).
    Returns (samples, step samples, acceptance): acceptance[j] is, of the draft sets at the largest k
    that had a draft j, the share whose draft j was accepted (simulate.Speculation's meaning: a set cut
    short at a block's end or near max_tokens counts only at the positions it has), on these random
    prompts; the first call of each engine is a warm-up, not a sample. ([], [], None) for a
    checkpoint without MTP layers, or one the engine does not speculate on (its reason logged)."""
    if not cfg.num_mtp_layers:
        return [], [], None
    from attention_nodes.config import SpeculativeConfig

    batches = sorted({b for b in opts.batches if b <= MTP_MAX_BATCH} or {1})
    prompt, new = 32, 24
    rng, samples, steps, acceptance = torch.Generator().manual_seed(0), [], [], None
    for k in MTP_DRAFTS:
        B = max(batches)
        try:
            engine = LLMEngine(EngineConfig(
                opts.model, dtype=opts.dtype, quantization=opts.quantization, quantize_linears=opts.quantize_linears,
                scheduler=SchedulerConfig(max_num_seqs=B, max_num_batched_tokens=max(2048, 8 * B)),
                cache=CacheConfig(16, B * blocks_for(prompt + new + k + 2, 16) + 4, enable_prefix_caching=False),
                speculative=SpeculativeConfig("mtp", k, disable_by_batch_size=10 ** 6)))
        except ValueError as e:  # (e.g. a model whose per-sequence state cannot take back rejected drafts)
            log.info("no MTP drafting samples: %s", e)
            return [], [], None
        runner, draft, count = engine.runner, engine.runner.mtp_draft, engine.spec_stats.count
        forward, execute = runner._forward, runner.execute
        threads_now, calls, reached = [1], [0], [0] * k
        spent = {"forward": 0.0, "mtp": 0.0, "verify": 0, "prompt": 0}  # (the step's, for its sample)

        def timed_forward(*a, **kw):
            t0 = time.perf_counter()
            try:
                return forward(*a, **kw)
            finally:
                spent["forward"] += time.perf_counter() - t0

        def composed(batch):  # (the drafts are dropped once verified: counted here)
            spent["verify"] = sum(n for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_draft_tokens)
            spent["prompt"] = sum(n for s, n in zip(batch.seqs, batch.num_new_tokens) if is_prompt_chunk(s, n))
            return execute(batch)

        def counted(drafted: int, accepted: int) -> None:
            for j in range(drafted):
                reached[j] += 1
            count(drafted, accepted)

        def timed(batch, starts, num_drafts, *sampling):
            t0 = time.perf_counter()
            out = draft(batch, starts, num_drafts, *sampling)
            dt = time.perf_counter() - t0
            spent["mtp"] += dt
            calls[0] += 1
            if calls[0] == 1:  # (first calls: buffers, kernel choices)
                return out
            rows = prefill = 0
            for seq, c, n, want in zip(batch.seqs, starts, batch.num_new_tokens, num_drafts):
                kept = kept_positions(seq, c, n)
                if want < 0 or kept <= 0:
                    continue
                if kept <= runner.mtp_decode_rows:
                    rows += kept
                else:
                    prefill += kept
            chained = [max(0, len(d) - 1) for d in out[0]]
            if rows or prefill:
                samples.append({"threads": threads_now[0], "k": k, "seqs": len(batch.seqs), "rows": rows + sum(chained),
                                "passes": 1 + max(chained, default=0), "prefill_tokens": prefill, "mtp_s": dt})
            return out

        runner.mtp_draft, engine.spec_stats.count = timed, counted
        runner._forward, runner.execute = timed_forward, composed
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        for threads in opts.threads:
            torch.set_num_threads(threads)
            threads_now[0] = threads
            for b in batches:
                for i in range(b):
                    engine.add_request(f"{k}-{threads}-{b}-{i}",
                                       torch.randint(2, cfg.vocab_size, (prompt,), generator=rng).tolist(), params)
                while engine.has_unfinished_requests():
                    spent.update(forward=0.0, mtp=0.0, verify=0, prompt=0)
                    t0 = time.perf_counter()
                    engine.step()
                    wall = time.perf_counter() - t0
                    if spent["verify"] and not spent["prompt"] and calls[0] > 1:
                        steps.append({"threads": threads, "k": k, "seqs": len(engine.last_batch.seqs),
                                      "verify_rows": spent["verify"],
                                      "step_s": max(wall - spent["forward"] - spent["mtp"], 1e-6)})
        stats = engine.spec_stats
        if k == max(MTP_DRAFTS) and stats.num_drafts:
            rates = [a / n if n else 0.0 for a, n in zip(stats.accepted_per_pos, reached)]
            acceptance = list(itertools.accumulate(rates, min))  # (non-increasing, as Speculation draws them)
    return samples, steps, acceptance
