"""Helpers shared by the benchmarks: timing, tables, JSON results."""
import json
import platform
import time
from pathlib import Path
from typing import Callable

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


def save(name: str, payload: dict, device: str = "cpu") -> Path:
    """Write bench/results/NAME.json: the machine (CPU, torch, threads, the device named) plus payload."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    if device != "cpu" and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    payload = {"machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "device": device}, **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
