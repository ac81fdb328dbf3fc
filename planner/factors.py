"""How the simulator applies the factors planner/calibrate.py solves on a profile's served runs to a
deployment: the workers' compute where both pools compute at once on a shared host (served_slowdown,
call_slowdown) and the front's CPU beside steps that take every core (front_scale).
"""
import numpy as np


def served_slowdown(perf, dep: "Deployment", batch: float | None = None) -> float:
    """How much slower the workers compute on a shared host than the profile's fits, where both
    pools compute at once (m >= 2): the profile's served factor, or, where it has served runs at two
    batch sizes (planner.calibrate.served_factors), the factor interpolated in 1 / (batch per
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
    between the runs' points (planner.calibrate.served_factors) and held at the nearer point outside
    them. So a decode micro-batch of 8 sequences gets the batch-16 run's factor and a prefill chunk of
    hundreds of tokens the batch-64 one: sharing the memory bandwidth slows the small calls most.
    None elsewhere (served_slowdown's one factor applies)."""
    points = getattr(perf, "served_factors", [])
    if not dep.cores or dep.colocated or dep.micro_batches < 2 or len(points) < 2:
        return None
    return lambda tokens: _factor_at(points, tokens)


def front_scale(perf, dep: "Deployment", spec: "Speculation | None" = None) -> float | None:
    """The factor on the front's and the load generator's CPU beside a deployment whose steps take
    every core of a shared host, solved on a served run of its kind (planner.calibrate.front_scales): a
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
