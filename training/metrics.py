"""Throughput accounting (model FLOPs per token with only the active experts, the device's measured
peak, MFU), per-rank heartbeats and straggler detection, and the run's JSON-lines log.
"""
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from models.config import ModelConfig


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward multiplies by: attention, routers, the top_k chosen experts
    (not all E), shared experts, dense MLPs and the LM head; the embedding lookup is no matmul."""
    D = cfg.hidden_size
    total = cfg.vocab_size * D
    for i, moe in enumerate(cfg.moe_layers):
        total += cfg.attention_weights(i)  # (per layer: MiMo-V2-Flash's kv heads differ)
        if moe:
            total += D * cfg.num_experts + cfg.top_k * 3 * D * cfg.moe_intermediate_size
            if cfg.shared_expert_intermediate_size:
                total += 3 * D * cfg.shared_expert_intermediate_size + D
        else:
            total += 3 * D * cfg.intermediate_size
    return total


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward plus backward FLOPs per token (PaLM, appendix B): 6 * active parameters, plus
    12 * layers * query width * seq_len for the attention scores and their use."""
    return 6.0 * active_params(cfg) + 12.0 * cfg.num_layers * cfg.q_size * seq_len


def measure_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """FLOP/s of a square matmul on this device in `dtype` (the CPU's achievable peak with this
    process's threads): the best of repeated 1024^3 (CPU) or 8192^3 (GPU) products."""
    n = 8192 if device.type == "cuda" else 1024
    gen = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG (resumed runs) alone
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    best, deadline = float("inf"), time.perf_counter() + seconds
    torch.matmul(a, b)  # warm-up
    while time.perf_counter() < deadline or best == float("inf"):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def find_stragglers(step_seconds: list[float], factor: float) -> list[int]:
    """Ranks whose step time exceeds factor times the median over all ranks."""
    median = statistics.median(step_seconds)
    return [r for r, t in enumerate(step_seconds) if median > 0 and t > factor * median]


class Heartbeat:
    """OUT/heartbeat/rank-N.json: this rank's pid, step, wall time and last step time, replaced
    atomically after every step, so a watcher (or a test) sees which rank is slow or gone."""

    def __init__(self, out: Path, rank: int):
        self.dir, self.rank = out / "heartbeat", rank
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank-{rank}.json"

    def beat(self, step: int, step_seconds: float) -> None:
        """Record a finished step (replaces the rank's file atomically)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": self.rank, "pid": os.getpid(), "step": step, "time": time.time(),
                                   "step_seconds": step_seconds}))
        os.replace(tmp, self.path)


class JsonlLog:
    """Appends one JSON object per line to OUT/train_log.jsonl (rank 0 only); a restarted run keeps
    appending, so the log holds the whole history, repeated steps included."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, **record: Any) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def read_log(path: Path, event: str = "step") -> list[dict]:
    """The records of one event, later ones replacing earlier ones of the same step (a resumed run
    repeats the steps after its checkpoint), ordered by step."""
    by_step: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == event:
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]
