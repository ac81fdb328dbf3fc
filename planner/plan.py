"""Plans: the search on catalogue kinds (planner.search) or on this host (simulated), the plan file
that `shuttle serve --plan` and `LLM(plan=...)` run, and the table `shuttle plan` prints.

Plan file (JSON):
    {"version": 1, "model": {"name", "path", "config_hash"},
     "hardware": {"attention": {kind...}, "expert": {kind...}},
     "deployment": {"colocated", "attention_workers", "expert_workers", "micro_batches", "max_num_seqs",
                    "torch_threads", "transport", "attention_device", "expert_device", "quantization",
                    "quantize_linears"},
     "predicted": {"throughput", "tbt_ms", "cost_per_hour", ...}, "estimated": bool, "slo": {...}, "workload": {...}}
"""
from dataclasses import dataclass
from pathlib import Path

from planner.hardware import HOST, HardwareKind
from planner.search import Candidate

PLAN_VERSION = 1
HOST_BATCHES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class HostSearch:
    """This host's plan search: every deployment that fits `cores` processes x threads (colocated
    at 1..cores threads; n_a + n_e <= cores workers of cores // (n_a + n_e) threads, m 1..4), each
    per-worker batch, simulated on the workload (max_concurrency = batch x n_a)."""

    cores: int
    input_len: int
    output_len: int
    transport: str = "shm"
    batches: tuple[int, ...] = HOST_BATCHES


def host_deployments(hs: HostSearch):
    from planner.simulate import Deployment

    for t in range(1, hs.cores + 1):
        for B in hs.batches:
            yield Deployment(colocated=True, torch_threads=t, cores=hs.cores, max_num_seqs=B), B
    for n_a in range(1, hs.cores):
        for n_e in range(1, hs.cores - n_a + 1):
            for m in range(1, 5):
                for B in hs.batches:
                    if B >= m:
                        yield Deployment(False, n_a, n_e, m, None, hs.cores, hs.transport, max_num_seqs=B), B


# Each host candidate serves this many batches of prompts in the simulator, and bench/planner.py
# measures every deployment with as many (at least): candidates of every batch size, and the pick
# against the measured rows, are compared in the same steady state. (The plan simulated two, and
# the rows were measured at two waves at batch 64 and one at 256; with four at 64 and still one at
# 256, the picks at 256 measured 0.79-0.96x of colocated at 64: a ramp against a steady state.)
HOST_WAVES = 4


def search_host(perf, model, hs: HostSearch, price: float, tbt_slo_s: float, top: int) -> tuple[list, dict]:
    """Simulated candidates on this host ranked by throughput (the host costs the same whichever
    deployment runs on it), and what bound the search (as planner.search.search)."""
    from planner.simulate import Simulator, Workload

    cands, fastest, n = [], None, 0
    for dep, B in host_deployments(hs):
        conc = B * dep.attention_workers
        r = Simulator(perf, model, dep).run(Workload(max(HOST_WAVES * conc, 32), hs.input_len, hs.output_len, conc))
        n += 1
        tbt = r["mean_tpot_ms"] / 1e3
        c = Candidate(HOST, HOST, 0 if dep.colocated else dep.attention_workers,
                      0 if dep.colocated else dep.expert_workers, dep.micro_batches, B, tbt,
                      r["output_throughput"], price, 0.0, 0.0, 0.0, r["attention_busy"], r["expert_busy"] or 0.0, False)
        c = _with_threads(c, dep)
        fastest = c if fastest is None or c.tbt_s < fastest.tbt_s else fastest
        if tbt <= tbt_slo_s:
            cands.append(c)
    cands.sort(key=lambda c: -c.throughput)
    return cands[:top], {"memory_ok": n, "feasible": len(cands), "fastest": fastest}


@dataclass(frozen=True)
class HostCandidate(Candidate):
    torch_threads: int = 1

    @property
    def devices(self) -> int:
        return self.torch_threads if self.attention_workers == 0 else self.attention_workers + self.expert_workers


def _with_threads(c: Candidate, dep) -> HostCandidate:
    # Pools keep torch_threads unset: shuttle serve then applies the rule the simulation used.
    return HostCandidate(**c.__dict__, torch_threads=dep.threads if dep.colocated else dep.torch_threads)


def plan_file(c: Candidate, hw: dict[str, HardwareKind], shape, model_path: str, slo_ms: float,
              workload: dict, quantization: str | None = None, quantize_linears: bool = False) -> dict:
    """The plan file of candidate `c`; quantization: the experts' (EngineConfig.quantization, None
    or "int8"), which the plan was searched for and is served with; quantize_linears: the other
    linears too (a host profile's, as it measured them)."""
    colocated = c.attention_workers == 0
    return {"version": PLAN_VERSION,
            "model": {"name": shape.name, "path": model_path, "config_hash": shape.config_hash},
            "hardware": {"attention": hw[c.attention_hw].__dict__, "expert": hw[c.expert_hw].__dict__},
            "deployment": {"colocated": colocated, "attention_workers": max(1, c.attention_workers),
                           "expert_workers": max(1, c.expert_workers), "micro_batches": c.micro_batches,
                           "max_num_seqs": c.batch, "torch_threads": getattr(c, "torch_threads", None),
                           "transport": "shm" if c.attention_hw == HOST else "tcp",
                           "attention_device": hw[c.attention_hw].device, "expert_device": hw[c.expert_hw].device,
                           "quantization": quantization, "quantize_linears": quantize_linears},
            "predicted": c.to_dict(), "estimated": c.estimated, "slo": {"tbt_ms": slo_ms}, "workload": workload}


def format_plans(cands: list[Candidate]) -> str:
    cols = ["#", "attention", "experts", "n_a", "n_e", "m", "batch", "tok/s", "tok/s/dev", "TBT ms", "$/h",
            "tok/s per $/h", "attn util", "expert util"]
    rows = []
    for i, c in enumerate(cands, 1):
        est = "~" if c.estimated else ""
        colo = c.attention_workers == 0
        rows.append([str(i), c.attention_hw, c.expert_hw, "colocated" if colo else str(c.attention_workers),
                     f"{getattr(c, 'torch_threads', '')} thr" if colo else str(c.expert_workers), str(c.micro_batches),
                     str(c.batch), f"{est}{c.throughput:.1f}", f"{est}{c.throughput / c.devices:.1f}",
                     f"{est}{c.tbt_s * 1e3:.2f}", f"{c.cost_per_hour:.2f}", f"{est}{c.per_cost:.1f}",
                     f"{c.attention_util:.0%}", f"{c.expert_util:.0%}"])
    widths = [max(len(col), *(len(r[j]) for r in rows)) for j, col in enumerate(cols)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    if any(c.estimated for c in cands):
        lines.append("~ estimated: roofline models of catalogue devices (planner/hardware.json), not measurements")
    return "\n".join(lines)


ANY = object()  # plan_engine_kwargs: no quantization asked for (the plan's is taken)


def plan_engine_kwargs(path: str | Path, model: str | None = None, quantization=ANY, quantize_linears=ANY) -> dict:
    """LLM / engine_config keyword arguments that run the plan file's deployment on this host:
    model (the plan's unless given), device and expert_device, the pool layout, threads, batch and
    the experts' quantization (None for plans written before it was recorded) and quantize_linears.
    ValueError, naming what is wrong, for a file that is not a plan, a plan of another model or,
    where `quantization` is given (None or "int8"), of another quantization (or quantize_linears), or a
    plan this host cannot hold (more worker processes than cores, or CUDA devices it lacks)."""
    import json
    import os

    import torch

    from planner.shapes import quantization_of, shape_from

    try:
        plan = json.loads(Path(path).read_text())
        dep = plan["deployment"]
        keys = ("colocated", "attention_workers", "expert_workers", "micro_batches", "max_num_seqs", "transport")
        missing = [k for k in keys if k not in dep]
    except FileNotFoundError:
        raise ValueError(f"plan {path}: file not found") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"plan {path}: not a plan written by shuttle plan ({e})") from None
    if missing:
        raise ValueError(f"plan {path}: deployment lacks {', '.join(missing)}")
    model = model or plan["model"]["path"]
    if shape_from(model).config_hash != plan["model"]["config_hash"]:
        raise ValueError(f"plan {path} is for model {plan['model']['name']} (config {plan['model']['config_hash']}), "
                         f"not {model}")
    try:
        planned_q = quantization_of(dep.get("quantization"))
        asked_q = planned_q if quantization is ANY else quantization_of(quantization)
    except ValueError as e:
        raise ValueError(f"plan {path}: {e}") from None
    if asked_q != planned_q:
        raise ValueError(f"plan {path} was made for quantization {planned_q or 'none'} (its experts' memory and "
                         f"times), not {asked_q or 'none'}; plan again with shuttle plan --quantization "
                         f"{asked_q or 'none'}")
    planned_linears = bool(dep.get("quantize_linears", False))
    if quantize_linears is not ANY and bool(quantize_linears) != planned_linears:
        raise ValueError(f"plan {path} was made {'with' if planned_linears else 'without'} quantize_linears (its "
                         f"attention times), not {'with' if quantize_linears else 'without'}; plan again from a "
                         f"profile measured {'with' if quantize_linears else 'without'} --quantize-linears")
    devices = {dep.get("attention_device", "cpu"), dep.get("expert_device", "cpu")}
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        raise ValueError(f"plan {path} runs on {plan['hardware']['attention']['name']} / "
                         f"{plan['hardware']['expert']['name']} CUDA devices; this host has none")
    procs = 1 if dep["colocated"] else dep["attention_workers"] + dep["expert_workers"]
    threads = dep.get("torch_threads") or 1
    cores = len(os.sched_getaffinity(0))
    if "cpu" in devices and procs * (threads if dep["colocated"] else 1) > cores:
        raise ValueError(f"plan {path} needs {procs} worker process(es) x {threads} thread(s); this host has "
                         f"{cores} cores: it is bigger than this host")
    if any(d.startswith("cuda") for d in devices) and procs > torch.cuda.device_count():
        raise ValueError(f"plan {path} needs {procs} devices; this host has {torch.cuda.device_count()}")
    return {"model": model, "device": dep.get("attention_device", "cpu"), "expert_device": dep.get("expert_device"),
            "colocated": bool(dep["colocated"]), "attention_workers": int(dep["attention_workers"]),
            "expert_workers": int(dep["expert_workers"]), "micro_batches": int(dep["micro_batches"]),
            "transport": dep["transport"], "torch_threads": dep.get("torch_threads"),
            "max_num_seqs": int(dep["max_num_seqs"]), "quantization": planned_q,
            "quantize_linears": planned_linears}
