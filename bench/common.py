"""Helpers shared by the benchmarks: timing, tables, JSON results, the noise of a median."""
import json
import math
import platform
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

RESULTS = Path(__file__).parent / "results"


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Fastest wall time of `repeats` runs (after one warm-up), in seconds."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")


def save(name: str, payload: dict, device: str = "cpu") -> Path:
    """Write bench/results/NAME.json: the machine (CPU model and the ISA flags that pick kernels, torch,
    threads, the device named) plus payload."""
    from kernels.native import cpu_flags, cpu_model

    RESULTS.mkdir(parents=True, exist_ok=True)
    if device != "cpu" and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    isa = sorted(f for f in cpu_flags() if f in ISA_FLAGS)
    payload = {"machine": {"cpu": cpu_model() or platform.processor() or platform.machine(), "isa": isa,
                           "torch": torch.__version__, "threads": torch.get_num_threads(), "device": device},
               **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def median_noise(values: list[float], size: int | None = None, draws: int = 20000, seed: int = 0) -> float:
    """How far the median of `values` (measurements of one quantity, e.g. a deployment's throughput
    in each round) moves by noise alone: the standard deviation of log(median) over bootstrap
    resamples of `size` values (default: as many as given). 0 for fewer than two values."""
    logs = np.log(np.asarray(values, dtype=float))
    if len(logs) < 2:
        return 0.0
    picks = np.random.default_rng(seed).choice(logs, (draws, size or len(logs)))
    return float(np.median(picks, axis=1).std())


def within_by_noise(sd: float, band: float) -> float:
    """The chance that a prediction without bias lands within `band` (0.10: 10%) of a measurement
    when their log ratio is normal with standard deviation `sd` (1.0 for sd 0)."""
    if sd <= 0:
        return 1.0
    phi = lambda z: 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))  # noqa: E731
    return phi(math.log1p(band) / sd) - phi(math.log1p(-band) / sd)
