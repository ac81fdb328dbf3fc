"""`shuttle plan`: MegaScale-Infer's deployment search (its Algorithm 1), vectorised.

For every pair of hardware kinds (attention pool, expert pool), every n_a attention and n_e expert
devices with n_a + n_e <= max_devices, m in 1..4 micro-batches and every per-worker batch B:
    b = B / m tokens per micro-batch on an attention worker, reading `context` tokens each,
    T_a = attention(b, b x context)                per layer (profile fit or roofline)
    T_e = experts(n_a b K / n_e pairs, active)     per layer, gathered from all attention workers
    T_c = transfer(the larger of what one attention device sends and one expert device receives)
    one MoE layer  P = max(m T_a, m T_e, m T_c, T_a + T_e + 2 T_c)   (pipelined, or one round trip)
    TBT = L_moe P + L_dense m T_a + min(T_a, T_e) + 2 T_c + m head + step   (= MegaScale-Infer's
          (T_a + T_e + 2 T_c) + max(T_a, T_e)(mL - 1) when the pipeline is full and every layer is MoE;
          dense layers have no expert stage, as in the simulator)
    throughput = n_a B / TBT decode tokens per second;  cost = n_a price_a + n_e price_e per hour
subject to memory (attention: non-expert weights + KV of B sequences at full context; experts:
ceil(E / n_e) experts of every MoE layer, or one with n_e / E replicas when n_e is a multiple of
E, in the plan's quantization: ModelConfig.expert_bytes) and TBT <= the SLO; plans are ranked by
throughput per cost. Expert parallelism only: no tensor parallelism within a pool (a stated
simplification). The host kind (a measured profile) is ranked by the discrete-event simulator
instead (planner.host_plan), where cores are shared.
"""
from dataclasses import dataclass

import numpy as np

from planner.hardware import HardwareKind
from planner.perf import expected_active
from planner.shapes import ModelShape

BATCHES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
MEMORY_USABLE = 0.9  # of a device's memory: the rest for activations, buffers, the runtime


@dataclass(frozen=True)
class Candidate:
    attention_hw: str
    expert_hw: str
    attention_workers: int
    expert_workers: int
    micro_batches: int
    batch: int  # sequences per attention worker
    tbt_s: float
    throughput: float  # decode tokens/s
    cost_per_hour: float
    t_a: float
    t_e: float
    t_c: float
    attention_util: float
    expert_util: float
    estimated: bool

    @property
    def devices(self) -> int:
        return self.attention_workers + self.expert_workers

    @property
    def per_cost(self) -> float:
        return self.throughput / self.cost_per_hour

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(devices=self.devices, throughput_per_cost=self.per_cost, throughput_per_device=self.throughput /
                 self.devices, tbt_ms=self.tbt_s * 1e3)
        return d


def expert_counts(E: int, max_devices: int) -> np.ndarray:
    """n_e values: 1..E, then multiples of E (every expert replicated n_e / E times)."""
    return np.array(sorted({*range(1, min(E, max_devices) + 1), *range(2 * E, max_devices + 1, E)}))


def evaluate(perf, shape: ModelShape, hw_a: HardwareKind, hw_e: HardwareKind, max_devices: int,
             context: float, max_context: int, batches=BATCHES, transport: str = "rdma",
             quantization: str | None = None) -> dict[str, np.ndarray]:
    """Every (n_e, n_a, m, B) of one hardware pair as flat arrays (the closed form above);
    quantization: the experts' (EngineConfig.quantization), for their memory."""
    c = shape.config
    E, K, L, L_moe = c.num_experts, c.top_k, c.num_layers, c.num_moe_layers
    n_e1 = expert_counts(E, max_devices - 1)
    n_a1 = np.arange(1, max_devices)
    m1, B1 = np.arange(1, 5), np.asarray(batches, dtype=float)
    n_e, n_a, m, B = (x.ravel() for x in np.meshgrid(n_e1, n_a1, m1, B1, indexing="ij"))
    keep = (n_a + n_e <= max_devices) & (B >= m)
    n_e, n_a, m, B = n_e[keep], n_a[keep], m[keep], B[keep]
    b = B / m
    t_a = perf.attention(b, b * context)
    gathered = n_a * b  # tokens of one micro-batch over all attention workers
    local = np.maximum(E / n_e, 1.0)
    pairs = gathered * K / n_e
    t_e = perf.experts(pairs, expected_active(gathered * np.minimum(1.0, E / n_e), local, E, K))
    row = c.hidden_size * c.dtype.itemsize
    sent_rows = b * np.minimum(K, n_e) * (row + 8 * K)  # one attention device, to all expert devices
    recv_rows = pairs * row  # one expert device, from all attention devices (upper bound: a row per pair)
    t_c = perf.transfer(np.maximum(sent_rows, recv_rows), transport)
    period = np.maximum.reduce([m * t_a, m * t_e, m * t_c, t_a + t_e + 2 * t_c])
    tbt = L_moe * period + (L - L_moe) * m * t_a + np.minimum(t_a, t_e) + 2 * t_c + m * perf.head(b, b) + perf.step(B)
    mem_a = (c.non_expert_bytes(c.dtype) + B * max_context * c.kv_bytes_per_token(c.dtype)
             + B * c.state_bytes_per_sequence(c.dtype))
    experts_held = np.where(n_e <= E, np.ceil(E / n_e), 1.0)
    mem_e = experts_held * L_moe * c.expert_bytes(c.dtype, quantization)
    fits = (mem_a <= hw_a.memory_bytes * MEMORY_USABLE) & (mem_e <= hw_e.memory_bytes * MEMORY_USABLE)
    fits &= (n_e <= E) | (n_e % E == 0)
    return {"n_a": n_a, "n_e": n_e, "m": m, "B": B, "t_a": t_a, "t_e": t_e, "t_c": t_c, "tbt": tbt,
            "throughput": n_a * B / tbt, "cost": n_a * hw_a.price_per_hour + n_e * hw_e.price_per_hour,
            "fits": fits, "util_a": L * m * t_a / tbt, "util_e": L_moe * m * t_e / tbt}


def serving_pairs(pairs: list[tuple[HardwareKind, HardwareKind]], quantization: str | None
                  ) -> tuple[list[tuple[HardwareKind, HardwareKind]], list[str]]:
    """The hardware pairs that can serve experts in `quantization`, and the kinds left out as expert
    pools: int8 and FP8 experts run on CPU workers only (kernels/int8.py; EngineConfig refuses them on a
    CUDA device), so with it the expert pool must be a CPU kind (HardwareKind.device); the
    attention pool may be any."""
    if quantization is None:
        return list(pairs), []
    kept = [(a, e) for a, e in pairs if e.device == "cpu"]
    skipped = sorted({e.name for _, e in pairs if e.device != "cpu"})
    return kept, skipped


def search(perf_for, shape: ModelShape, pairs: list[tuple[HardwareKind, HardwareKind]], max_devices: int,
           tbt_slo_s: float, context: float, max_context: int, top: int = 5,
           quantization: str | None = None) -> tuple[list[Candidate], dict]:
    """Best `top` plans by throughput per cost over every hardware pair, and what bound the search:
    {"feasible": n, "memory_ok": n, "best_tbt_s": fastest TBT among those that fit in memory,
    "fastest": that Candidate}. perf_for(hw_a, hw_e) gives the pair's performance model;
    quantization: the experts' (their memory; the pairs are the caller's to choose)."""
    cands, fastest, n_mem, n_ok = [], None, 0, 0
    for hw_a, hw_e in pairs:
        perf = perf_for(hw_a, hw_e)
        r = evaluate(perf, shape, hw_a, hw_e, max_devices, context, max_context, quantization=quantization)
        ok = r["fits"] & (r["tbt"] <= tbt_slo_s)
        n_mem, n_ok = n_mem + int(r["fits"].sum()), n_ok + int(ok.sum())
        if r["fits"].any():
            i = int(np.argmin(np.where(r["fits"], r["tbt"], np.inf)))
            c = _candidate(r, i, hw_a, hw_e, perf)
            fastest = c if fastest is None or c.tbt_s < fastest.tbt_s else fastest
        score = np.where(ok, r["throughput"] / r["cost"], -np.inf)
        for i in np.lexsort((r["n_a"] + r["n_e"], -np.round(score, 6)))[:top]:
            if np.isfinite(score[i]):
                cands.append(_candidate(r, int(i), hw_a, hw_e, perf))
    # Equal throughput per cost (a deployment and its multiples): the smaller one, a unit to replicate.
    cands.sort(key=lambda c: (-round(c.per_cost, 6), c.devices))
    return cands[:top], {"memory_ok": n_mem, "feasible": n_ok, "fastest": fastest}


def _candidate(r: dict, i: int, hw_a: HardwareKind, hw_e: HardwareKind, perf) -> Candidate:
    return Candidate(hw_a.name, hw_e.name, int(r["n_a"][i]), int(r["n_e"][i]), int(r["m"][i]), int(r["B"][i]),
                     float(r["tbt"][i]), float(r["throughput"][i]), float(r["cost"][i]), float(r["t_a"][i]),
                     float(r["t_e"][i]), float(r["t_c"][i]), float(min(1.0, r["util_a"][i])),
                     float(min(1.0, r["util_e"][i])), bool(getattr(perf, "estimated", False)))
