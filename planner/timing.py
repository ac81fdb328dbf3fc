"""How the profile times the real code: the fastest of repeated calls (best_time) or the median of steps
that follow one another as served (served_time), the last-level cache evicted before a timed step
where the weights are more than it (CacheEvictor), a dispatcher that stamps each layer's dispatch in
place of the experts (StampingDispatcher), and the scheduled batches the timed steps run
(synthetic_batch). Used by planner/profile.py and bench/prompt_rows.py."""
import os
import statistics
import time
from pathlib import Path

import torch

from attention_nodes.block_manager import blocks_for
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import ScheduledBatch
from attention_nodes.sequence import Sequence


def best_time(fn, repeats: int, before=None) -> float:
    """Fastest wall time of `repeats` calls after one warm-up call, in seconds; `before` (untimed)
    runs ahead of each."""
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def llc_bytes(cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The size of this host's last-level cache (Linux sysfs), 32 MiB where it cannot be read."""
    sizes = {}
    for index in Path(cache_dir).glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
            sizes[level] = int(size[:-1]) << {"K": 10, "M": 20}[size[-1]] if size[-1] in "KM" else int(size)
        except (OSError, ValueError, IndexError, KeyError):
            continue
    return sizes[max(sizes)] if sizes else 32 << 20


class CacheEvictor:
    """Evicts the caches before each timed step, where the model's weights are more than the host's
    last-level cache: served, the weights a layer reads were pushed out since the step before (a
    colocated step streams the whole model through the cache, and in the pools the other worker's
    weights stream through it too), while a profile repeating one step finds them cached. Once per
    step, not per layer: what a step touches at every layer (the interpreter's own objects) stays
    cached when served. Reading twice the cache's size of another buffer evicts it (not timed).
    Measured (bench/planner.py --quick, 25M models, 32 MB L3): a 1 + 1 m=2 at batch 16 was predicted
    19% fast without it (its 8-token expert calls ran from the cache), and the served run computed
    1.13x what the fits said; with it +2% to +23% over nine runs and 1.02-1.14x."""

    def __init__(self, model_dir: str | os.PathLike):
        weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
        llc = llc_bytes()
        self.on = weights > llc
        self.buffer = torch.ones(2 * llc // 4) if self.on else None

    def __call__(self) -> None:
        if self.on:
            self.buffer.sum()


class StampingDispatcher:
    """Stands in for the experts: returns zeros, and records when each layer's dispatch came. With
    `evict`, each step begins by evicting the caches (before its first stamp), so that every layer
    reads its weights from memory as in a served step."""

    def __init__(self, evict=None):
        self.stamps: list[float] = []
        self.evict = evict

    def dispatch(self, layer, experts, x_TD, topk_ids_TK, topk_weights_TK, mb=0):
        self.stamps.append(time.perf_counter())
        return torch.zeros_like(x_TD)

    def layer_times(self) -> list[float]:
        """The layers after the first (which adds the embedding): the gaps between dispatches."""
        s = self.stamps
        return [b - a for a, b in zip(s[1:-2], s[2:-1])]

    def combine(self, handle):
        return handle

    def begin_step(self) -> None:
        if self.evict is not None:
            self.evict()
        self.stamps = [time.perf_counter()]

    def end_step(self) -> None:
        self.stamps.append(time.perf_counter())


SERVED_VARIANTS = 4  # (measure_colocated) batches of other random tokens a shape's steps take in turn


def served_time(fns: list, repeats: int) -> float:
    """The median wall time of `repeats` rounds of calling each of fns in turn (one warm-up round
    first, untimed), in seconds: steps that follow one another as served ones do, each finding the
    caches as the step before left them."""
    for fn in fns:
        fn()
    times = []
    for _ in range(repeats):
        for fn in fns:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def synthetic_batch(q_lens: list[int], ctx_lens: list[int], block_size: int, num_blocks: int,
           vocab: int | None = None, seed: int = 0) -> ScheduledBatch:
    """Sequences computing q_lens[b] tokens after ctx_lens[b] cached ones. Every sequence reads the
    same blocks (the values do not matter for timing), so a large batch needs no large cache. The
    tokens are all 1, or with `vocab` drawn at random below it (seeded by the batch size and `seed`):
    where the experts run, one token everywhere would route every row to the same top-k experts."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    seqs, g = [], torch.Generator().manual_seed(len(q_lens) + 7919 * seed)
    for i, (q, c) in enumerate(zip(q_lens, ctx_lens)):
        ids = [1] * (q + c) if vocab is None else torch.randint(2, vocab, (q + c,), generator=g).tolist()
        seq = Sequence(str(i), 0, ids, q + c, params, 1, i)
        seq.num_computed_tokens = c
        seq.block_table = [b % num_blocks for b in range(blocks_for(q + c, block_size))]
        seqs.append(seq)
    return ScheduledBatch(seqs, list(q_lens), [True] * len(seqs))
