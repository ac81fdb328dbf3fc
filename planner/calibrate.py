"""The simulator's calibration on served runs (planner/front.py's): the factors with which
`planner.simulate` gives a profile's own served runs their measured wall times.

- served_factor / served_factors: the workers' compute where both pools compute at once (1 + 1 at
  m = 2, batch 64 and 16), what sharing the L3 and memory bandwidth costs;
- front_scales: the front's and the load generator's CPU beside steps that take every core (a
  colocated engine per thread count, 1 + 1 at m = 1).

run_profile stores them in the profile; bench/planner.py solves them again on --replay. How the simulator
applies them to a deployment: served_slowdown / call_slowdown (the workers' compute) and front_scale (the
front's CPU), below.
"""
import numpy as np


def served_factor(profile: dict) -> float:
    """How much slower the workers computed in the front's served run (planner/front.py: a real
    1 + 1 pool, m=2, one thread each, its front and load generator on the same host) than the fits
    above say: the factor on their compute with which the simulator gives that run's wall time, at
    least 1 (_served_over_simulated). What the parts measured one at a time miss when they share a
    host: the L3 cache and memory bandwidth (a memory-streaming process on the other core made an
    8-token expert call 2-3.5x slower, a 128-token one 1.2-1.3x). The simulator multiplies by it the
    compute of pools that compute at once (m >= 2) on a shared host (served_slowdown, below). 1.0
    without a front measurement."""
    run = (profile.get("front") or {}).get("run")
    return _served_over_simulated(profile, run) if run else 1.0


def served_factors(profile: dict) -> list[list[float]]:
    """[[sequences per micro-batch, factor], ...] of the front's served runs at both batch sizes (64
    and 16 at m = 2: 32 and 8), smallest first; [] without them. Where both pools compute at once
    (m >= 2), sharing the host slows the small calls more: an expert call of 8 tokens was 2-3.5x
    slower beside a memory-streaming process, one of 128 1.2-1.3x. The simulator scales each call by
    the factor at its tokens, interpolated between these points and held at the nearer one outside
    them (call_slowdown, below): a run's decode micro-batches get the point of their size,
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
    (front_scale, below) with which the simulator gives the run's wall time, in [0, 2]
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


def served_slowdown(perf, dep: "Deployment", batch: float | None = None) -> float:
    """How much slower the workers compute on a shared host than the profile's fits, where both
    pools compute at once (m >= 2): the profile's served factor, or, where it has served runs at two
    batch sizes (served_factors), the factor interpolated in 1 / (batch per
    micro-batch) between them (the nearest one's outside). 1.0 elsewhere: where each process has its
    own device; pools at m = 1, which compute one at a time (with the factor their TPOT came out
    9-30% long in 6 of 8 planner rows, without it 2-17%; their throughput error moved from -4% to +5%
    on average); and a colocated engine, whose attention and experts run in turn in one process, not
    beside each other (the factor is solved on two pools sharing the cache and memory bandwidth).
    batch: the sequences an attention worker runs at once (None: its max_num_seqs)."""
    if not dep.cores or dep.colocated or dep.micro_batches < 2:
        return 1.0
    points = getattr(perf, "served_factors", [])
    if len(points) < 2:
        return float(getattr(perf, "served_factor", 1.0))
    return float(_factor_at(points, (dep.max_num_seqs if batch is None else batch) / dep.micro_batches))


def _factor_at(points, tokens):
    """The served factor at `tokens` per call (at least 1): linear in 1 / tokens between the
    [[tokens, factor], ...] points, the nearer point's outside them."""
    x, f = zip(*sorted((1.0 / t, f) for t, f in points))
    return np.interp(1.0 / np.maximum(np.asarray(tokens, dtype=float), 1.0), x, f)


def call_slowdown(perf, dep: "Deployment"):
    """Where both pools compute at once on a shared host (m >= 2, cores set) and the profile has
    served runs at two batch sizes: the factor on one call's compute as a function of its tokens (an
    attention worker's micro-batch, or the tokens an expert call gathers), interpolated in 1 / tokens
    between the runs' points (served_factors) and held at the nearer point outside
    them. So a decode micro-batch of 8 sequences gets the batch-16 run's factor and a prefill chunk of
    hundreds of tokens the batch-64 one: sharing the memory bandwidth slows the small calls most.
    None elsewhere (served_slowdown's one factor applies)."""
    points = getattr(perf, "served_factors", [])
    if not dep.cores or dep.colocated or dep.micro_batches < 2 or len(points) < 2:
        return None
    return lambda tokens: _factor_at(points, tokens)


def front_scale(perf, dep: "Deployment", spec: "Speculation | None" = None) -> float | None:
    """The factor on the front's and the load generator's CPU beside a deployment whose steps take
    every core of a shared host, solved on a served run of its kind (front_scales): a
    colocated engine (the nearest profiled thread count), or pools at m = 1 whose computing pool takes
    every core; where the thread count was served at two batch sizes (the colocated engine at 64 and
    256), interpolated between them by the deployment's max_num_seqs. None elsewhere, and for profiles
    without such runs (then the front's CPU as measured beside 1 + 1 pools at m = 2, planner.front,
    applies as it is).
    There the rule (_held: the whole of the front's work on the step, and its CPU in the cores'
    bound) put the colocated and m = 1 rows of the AVX-512 EPYC's planner run 6-25% slow, and
    without the front's CPU they came out 25-55% fast: part of it runs in cycles the step leaves
    (a spinning OpenMP thread's, a pool's wait), and the colocated engine's front is one process
    with it (no delta messages to read).
    A deployment that speculates at every step (spec, at most disable_by_batch_size sequences), where
    the profile served its kind speculating (planner.front.SPEC_SCALE_BATCH): its plain factor times
    the speculating run's over the plain factor at that run's batch (the plain factor moves 2.6x from
    batch 1 to 64; one speculating run's factor held at every batch put batch 1 28% slow)."""
    scales = getattr(perf, "front_scales", [])
    if not dep.cores:
        return None
    plain_runs = [r for r in scales if not r.get("speculative")]
    plain = _scale_at(plain_runs, dep, dep.max_num_seqs)
    if spec is None or dep.max_num_seqs > spec.disable_by_batch_size:
        return plain
    runs = _runs_of([r for r in scales if r.get("speculative")], dep)
    if not runs:
        return plain
    at = runs[0].get("concurrency") or dep.max_num_seqs
    speculating, base = _scale_at(runs, dep, at), _scale_at(plain_runs, dep, at)
    return speculating if plain is None or not base else plain * speculating / base


def _runs_of(scales: list[dict], dep: "Deployment") -> list[dict] | None:
    """front_scale's runs of the deployment's kind, the nearest thread count's first (None: no kind)."""
    if dep.colocated:
        return sorted((r for r in scales if r["kind"] == "colocated"),
                      key=lambda r: (abs(r["threads"] - dep.threads), -r["threads"]))
    if dep.micro_batches == 1 and not dep.oversubscribed and max(dep.pool_threads) >= dep.cores:
        return [r for r in scales if r["kind"] == "m1"]
    return None


def _scale_at(scales: list[dict], dep: "Deployment", batch: int) -> float | None:
    """The factor of the deployment's kind among `scales` at `batch` sequences: that thread count's runs
    at one or two batch sizes (older profiles name none), linear in 1 / batch between them."""
    runs = _runs_of(scales, dep)
    if not runs:
        return None
    points = [[r.get("concurrency") or batch, r["scale"]] for r in runs if r["threads"] == runs[0]["threads"]]
    return float(_factor_at(points, batch))
