"""The simulator's calibration on served runs (planner/front.py's): the factors with which
`planner.simulate` gives a profile's own served runs their measured wall times.

- served_factor / served_factors: the workers' compute where both pools compute at once (1 + 1 at
  m = 2, batch 64 and 16), what sharing the L3 and memory bandwidth costs;
- front_scales: the front's and the load generator's CPU beside steps that take every core (a
  colocated engine per thread count, 1 + 1 at m = 1).

run_profile stores them in the profile; bench/planner.py solves them again on --replay. How the simulator
applies them to a deployment: planner/factors.py.
"""


def served_factor(profile: dict) -> float:
    """How much slower the workers computed in the front's served run (planner/front.py: a real
    1 + 1 pool, m=2, one thread each, its front and load generator on the same host) than the fits
    above say: the factor on their compute with which the simulator gives that run's wall time, at
    least 1 (_served_over_simulated). What the parts measured one at a time miss when they share a
    host: the L3 cache and memory bandwidth (a memory-streaming process on the other core made an
    8-token expert call 2-3.5x slower, a 128-token one 1.2-1.3x). The simulator multiplies by it the
    compute of pools that compute at once (m >= 2) on a shared host (planner.factors.served_slowdown).
    1.0 without a front measurement."""
    run = (profile.get("front") or {}).get("run")
    return _served_over_simulated(profile, run) if run else 1.0


def served_factors(profile: dict) -> list[list[float]]:
    """[[sequences per micro-batch, factor], ...] of the front's served runs at both batch sizes (64
    and 16 at m = 2: 32 and 8), smallest first; [] without them. Where both pools compute at once
    (m >= 2), sharing the host slows the small calls more: an expert call of 8 tokens was 2-3.5x
    slower beside a memory-streaming process, one of 128 1.2-1.3x. The simulator scales each call by
    the factor at its tokens, interpolated between these points and held at the nearer one outside
    them (planner.factors.call_slowdown): a run's decode micro-batches get the point of their size,
    its prefill chunks the large-call one. The points are solved together so that the simulator
    gives both served runs their measured wall times (the batch-16 run's prefill chunks take the
    batch-64 point). With one factor per run, which scaled a run's prefill as its decode, batch 16
    was predicted 12-18% short in TPOT in every run."""
    fr = profile.get("front") or {}
    runs = sorted((r["concurrency"] / r["micro_batches"], r) for r in (fr.get("run_small"), fr.get("run")) if r)
    if len(runs) < 2 or runs[0][0] >= runs[-1][0]:
        return []
    (t_lo, lo), (t_hi, hi) = runs[0], runs[-1]
    f_lo, f_hi = _served_over_simulated(profile, lo), _served_over_simulated(profile, hi)
    for _ in range(6):  # each run moves its own point; the other's enters through its other calls
        old = (f_lo, f_hi)
        f_hi = _served_over_simulated(profile, hi, lambda f: {"served_factors": [[t_lo, f_lo], [t_hi, f]]}, f_hi)
        f_lo = _served_over_simulated(profile, lo, lambda f: {"served_factors": [[t_lo, f], [t_hi, f_hi]]}, f_lo)
        if max(abs(f_lo - old[0]), abs(f_hi - old[1])) < 2e-3:
            break
    return [[t_lo, f_lo], [t_hi, f_hi]]


def _served_over_simulated(profile: dict, run: dict, factors=None, start: float | None = None) -> float:
    """The factor on the workers' compute with which the simulator gives a served 1 + 1 run's wall
    time, at least 1. Only the compute scales (the front's and the transfers' times do not), so the
    plain ratio of the served to the unscaled simulated time under-corrects: on the AVX-512 host the
    calibrated simulator still gave the profile's own served runs 1-3% (batch 64) and 4-6% (batch
    16) too fast. Solved by secant steps on the simulated duration (nearly linear in the factor).
    factors(f): the profile keys that put f in place (default: the one served_factor); start: a
    first guess (default: the plain ratio)."""
    from planner.perf import ProfilePerf
    from planner.simulate import Deployment, SimModel, Simulator, Workload

    bare = {k: v for k, v in profile.items() if k not in ("served_factor", "served_factors")}
    dep = Deployment(False, 1, 1, run["micro_batches"], 1, profile["host"]["cores"], "shm",
                     max_num_seqs=run["concurrency"])
    model = SimModel.from_profile(bare)
    target = run["load_s"]
    factors = factors or (lambda f: {"served_factor": f})

    def duration(factor: float) -> float:
        perf = ProfilePerf({**bare, **factors(factor)})
        return Simulator(perf, model, dep).run(
            Workload(run["requests"], run["prompt_len"], run["output_len"], run["concurrency"]))["duration"]
    f0, d0 = 1.0, duration(1.0)
    if d0 >= target:
        return 1.0
    f1 = start if start is not None and start > 1.0 else target / d0
    for _ in range(6):
        d1 = duration(f1)
        if abs(d1 - target) <= 1e-3 * target or d1 == d0:
            break
        f0, d0, f1 = f1, d1, max(1.0, f1 + (target - d1) * (f1 - f0) / (d1 - d0))
    return round(f1, 3)


def front_scales(profile: dict) -> list[dict]:
    """[{"kind", "threads", "concurrency", "scale"}, ...]: for each served run of
    planner.front.measure_scale_runs (a colocated engine per thread count, at two batch sizes at the
    most threads; 1 + 1 pools at m = 1), the factor on the front's and the load generator's CPU
    (planner.factors.front_scale) with which the simulator gives the run's wall time, in [0, 2]
    (bisection: the simulated duration grows with it); a run that speculated is simulated so, at the
    profile's acceptance. [] without served runs."""
    from planner.perf import ProfilePerf
    from planner.simulate import Deployment, SimModel, Simulator, Speculation, Workload

    bare = {k: v for k, v in profile.items() if k != "front_scales"}
    model, cores = SimModel.from_profile(bare), profile["host"]["cores"]
    out = []
    for run in (profile.get("front") or {}).get("scale_runs") or []:
        dep = Deployment(run["kind"] == "colocated", 1, 1, 1, run["threads"], cores, "shm",
                         max_num_seqs=run["concurrency"])
        entry = {"kind": run["kind"], "threads": run["threads"] or max(dep.pool_threads),
                 "concurrency": run["concurrency"], **({"speculative": run["speculative"]} if run.get("speculative")
                                                       else {})}
        spec = Speculation.of(run["speculative"], profile.get("mtp_acceptance")) if run.get("speculative") else None
        work = Workload(run["requests"], run["prompt_len"], run["output_len"], run["concurrency"])

        def duration(scale: float) -> float:
            perf = ProfilePerf({**bare, "front_scales": [{**entry, "scale": scale}]})
            return Simulator(perf, model, dep, spec=spec).run(work)["duration"]
        lo, hi = 0.0, 2.0
        if duration(hi) <= run["load_s"]:
            lo = hi
        elif duration(lo) < run["load_s"]:
            for _ in range(12):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if duration(mid) < run["load_s"] else (lo, mid)
        out.append({**entry, "scale": round(lo, 3)})
    return out
