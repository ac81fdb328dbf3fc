"""Expert placement control on the front: apply a new placement live, and EPLB (re-place the
experts from their measured load every --eplb-interval steps).

Applying version v (`PlacementControl.apply`, the one entry point for EPLB and for failover):
1. the front publishes v in the store (SESSION/placement/v, ExpertPlacement JSON);
2. each expert worker's watcher thread builds its modules for v while the worker keeps serving,
   reading only the new copies from the checkpoint, and says SESSION/placement/v/loaded/eN;
3. once every expert worker holds v, the front sends SetPlacement(v) to every attention worker;
4. attention workers advertise v in their M2N headers; in the first step where all of them do, every
   expert worker's answers confirm it, and from the next step every attention worker routes with v
   (the same step everywhere; an expert worker accepts a step only for a version it holds);
5. each expert worker frees the older versions and says SESSION/placement/active/eN = v.
Nothing waits: `poll` (called from PoolEngine.step) advances the steps above; no request is paused.

`greedy_placement`: MegaScale-Infer's greedy for one layer from its token counts: give the R
extra copies one at a time to the expert with the most tokens per copy, then place the copies,
heaviest first, each on the worker that would finish its share soonest among those with a free slot
and no copy of it yet (m2n_comm/placement.py: the tables and each worker's slots).

Slow expert workers: every worker has a speed (1.0; pools/stragglers.py lowers it for a worker its
peers persistently wait on). Loads are compared as time (tokens / speed), so a slow worker gets the
lightest experts, and a replicated expert's tokens are split over its copies in proportion to their
workers' speeds (Placement.shares). A change of speeds starts a re-placement at once (EPLB on),
without waiting for the interval.

Legend: L MoE layers, E experts, R redundant copies per layer, W expert workers.
"""
import json
import logging
import math
import time
from typing import Callable

import numpy as np

from m2n_comm.placement import MAX_SHARE, ExpertPlacement, Placement, check_redundancy, worker_slots

log = logging.getLogger("shuttle")
POLL_EVERY_S = 0.02  # the store is asked at most this often while a re-placement is under way
MIN_GAIN = 0.05  # EPLB re-places only when the busiest worker's predicted load drops by this share


class PlacementControl:
    """The front's side of live re-placement (see the module docstring). send_all(msg) sends a
    control message to every attention worker. policy(load_LE, current) -> ExpertPlacement | None:
    EPLB's choice (default `eplb_policy`), called every `interval` steps when interval > 0."""

    def __init__(self, store, session: str, placement: ExpertPlacement, send_all: Callable[[object], None],
                 interval: int = 0, num_redundant: int = 0):
        self.store, self.session, self.send_all = store, session, send_all
        self.current = placement                      # the placement every worker routes with
        self.pending: ExpertPlacement | None = None   # being applied
        self._phase, self._next_poll = "", 0.0
        self.interval, self.num_redundant = interval, num_redundant
        self.policy: Callable = lambda load, cur, speed: eplb_policy(load, cur, self.num_redundant, speed,
                                                                     also=placement.layers)
        self.speeds: Callable[[], list[float]] = lambda: [1.0] * placement.num_workers  # per expert worker
        self.applied = 0                               # re-placements completed
        self._window_start: tuple[int, np.ndarray | None] = (0, None)  # (steps, counts) when the window began
        self._speeds_used = [1.0] * placement.num_workers  # the speeds of the last policy decision

    def apply(self, placement: ExpertPlacement) -> None:
        """Start applying `placement` (its version must be the current one + 1); poll() finishes it."""
        if self.pending is not None:
            raise RuntimeError(f"placement version {self.pending.version} is still being applied")
        if placement.version != self.current.version + 1:
            raise ValueError(f"placement version {placement.version}: the next one is {self.current.version + 1}")
        if (placement.moe_layers, placement.num_experts, placement.num_workers) != \
                (self.current.moe_layers, self.current.num_experts, self.current.num_workers):
            raise ValueError("a new placement must cover the same MoE layers, experts and expert workers")
        self.pending, self._phase = placement, "loading"
        self.store.set(self._key(), placement.to_json())
        log.info("placement version %d: loading on the expert workers", placement.version)

    def _key(self) -> str:
        return f"{self.session}/placement/{self.pending.version}"

    def poll(self, steps: int, load_LE: Callable[[], np.ndarray | None]) -> None:
        """Advance a re-placement under way, or start one when EPLB's interval has passed.
        steps: the deployment's step count; load_LE(): tokens per (MoE layer, expert) so far."""
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + POLL_EVERY_S
        if self.pending is not None:
            self._advance()
        elif not self.interval or self.current.down:
            return
        elif (interval_passed := steps - self._window_start[0] >= self.interval) or self.speeds() != self._speeds_used:
            counts = load_LE()
            if counts is None:
                return
            start = self._window_start[1]
            # A change of speeds cannot wait for a window's counts: the loads so far stand in.
            window = counts if start is None or not interval_passed else counts - start
            self._window_start, self._speeds_used = (steps, counts), self.speeds()
            chosen = self.policy(window.tolist(), self.current, self._speeds_used)
            if chosen is not None:
                self.apply(chosen)

    def _advance(self) -> None:
        W, key = self.current.num_workers, self._key()
        failed = [f"{key}/failed/e{w}" for w in range(W) if self.store.check([f"{key}/failed/e{w}"])]
        if failed:
            why = self.store.get(failed[0]).decode()
            log.error("placement version %d abandoned: %s: %s", self.pending.version, failed[0].rsplit("/", 1)[1], why)
            # The version number is spent (some workers may hold it): the next attempt uses the one after.
            self.current = ExpertPlacement(self.current.moe_layers, self.current.layers, self.pending.version)
            self.pending, self._phase = None, ""
            return
        if self._phase == "loading":
            if self.store.check([f"{key}/loaded/e{w}" for w in range(W)]):
                self.send_all(self.pending)
                self._phase = "switching"
        elif self._phase == "switching":
            keys = [f"{self.session}/placement/active/e{w}" for w in range(W)]
            if self.store.check(keys) and all(int(self.store.get(k)) >= self.pending.version for k in keys):
                log.info("placement version %d active", self.pending.version)
                self.current, self.pending, self._phase = self.pending, None, ""
                self.applied += 1

    def next_version(self) -> int:
        """The number a new placement version takes (versions given up included)."""
        return max(self.current.version, self.pending.version if self.pending else 0) + 1

    def set_current(self, placement: ExpertPlacement) -> None:
        """The front put `placement` in use by opening a data-plane epoch with it (failover, a worker
        added back, a restart after a failover). EPLB waits while workers are down; its window's
        counts start again (a restarted worker counts from zero)."""
        self.current, self._window_start = placement, (self._window_start[0], None)

    def moved(self) -> bool:
        """True once a re-placement was applied or is under way (workers may hold other versions)."""
        return self.current.version > 0 or self.pending is not None

    def restarted(self) -> None:
        """The front restarted every worker with `current` (after a failure): a re-placement under
        way is given up (its version number is spent) and EPLB's window starts again, since step
        and token counts restart from zero in new workers."""
        if self.pending is not None:
            log.warning("placement version %d abandoned: the workers were restarted", self.pending.version)
            self.current = ExpertPlacement(self.current.moe_layers, self.current.layers, self.pending.version)
            self.pending, self._phase = None, ""
        self._window_start = (0, None)

    def stats(self) -> dict:
        return {"placement_version": self.current.version, "placement_changes": self.applied,
                "placement_pending": self.pending is not None}


def eplb_policy(load_LE: list[list[float]], current: ExpertPlacement, num_redundant: int,
                speed_W: list[float] | None = None, also: tuple[Placement, ...] | None = None) -> ExpertPlacement | None:
    """MegaScale-Infer's greedy per layer from the window's loads and the workers' speeds, or the
    layers `also` (the deployment's first placement) unless the greedy's costs MIN_GAIN less or the
    first sends tokens to more copies, if that lowers the predicted expert time of a step by at least MIN_GAIN; else None (no
    churn for nothing). A step's expert time is the sum over layers of the slowest worker's time
    (tokens / speed) in that layer: every layer waits for its slowest expert worker. (The first
    placement wins near-ties since at decode sizes each copy that gets tokens reads all its weights:
    after a slow worker recovers, even loads go back to it rather than to copies everywhere.)"""
    if not any(any(row) for row in load_LE):
        return None
    new = rebalance(load_LE, current, num_redundant, speed_W)
    if also is not None:
        first = ExpertPlacement(current.moe_layers, also, new.version)
        if (1 - MIN_GAIN) * step_cost(first, load_LE, speed_W) <= step_cost(new, load_LE, speed_W) and \
                active_copies(first) <= active_copies(new):
            new = first
    if step_cost(new, load_LE, speed_W) > (1 - MIN_GAIN) * step_cost(current, load_LE, speed_W):
        return None
    before, after = predicted_worker_load(current, load_LE), predicted_worker_load(new, load_LE)
    log.info("EPLB: expert-worker tokens %s -> %s (predicted shares%s)", _shares(before), _shares(after),
             "" if speed_W is None or len(set(speed_W)) == 1 else f"; speeds {[round(v, 3) for v in speed_W]}")
    return new


def _shares(load_W: list[float]) -> list[float]:
    total = sum(load_W) or 1.0
    return [round(x / total, 3) for x in load_W]


def step_cost(placement: ExpertPlacement, load_LE: list[list[float]], speed_W: list[float] | None = None) -> float:
    """Sum over MoE layers of the longest time (tokens / speed) any expert worker computes there."""
    speed = speed_W or [1.0] * placement.num_workers
    return sum(max(x / v for x, v in zip(p.worker_loads(load), speed)) for p, load in zip(placement.layers, load_LE))


def active_copies(placement: ExpertPlacement) -> int:
    """Copies that get tokens (a share above 0), summed over layers."""
    return sum(x > 0 for p in placement.layers for e in range(p.num_experts) for x in p.shares_of(e))


def predicted_worker_load(placement: ExpertPlacement, load_LE: list[list[float]]) -> list[float]:
    """Tokens each expert worker computes, summed over layers, if routing stays as in load_LE."""
    total = [0.0] * placement.num_workers
    for p, load in zip(placement.layers, load_LE):
        for w, x in enumerate(p.worker_loads(load)):
            total[w] += x
    return total


def read_expert_load(store, session: str, num_workers: int) -> tuple[np.ndarray | None, list[int]]:
    """From the expert workers' published stats: tokens per (MoE layer, global expert) summed over
    workers (L, E) int64, and (token, expert) pairs each worker computed; (None, []) before any."""
    total, per_worker = None, []
    for w in range(num_workers):
        key = f"{session}/stats/e{w}"
        if not store.check([f"{key}/tokens", key]):
            per_worker.append(0)
            continue
        meta = json.loads(store.get(key))
        counts = np.frombuffer(store.get(f"{key}/tokens"), dtype="<i8").reshape(len(meta["moe_layers"]), -1)
        total = counts.copy() if total is None else total + counts
        per_worker.append(int(counts.sum()))
    return total, per_worker


# -- placement policies ----------------------------------------------------------------------------
def greedy_placement(load_E: list[float], num_workers: int, num_redundant: int = 0,
                     slots_W: list[int] | None = None, speed_W: list[float] | None = None) -> Placement:
    """MegaScale-Infer's greedy for one layer (see the module docstring). load_E: tokens routed to
    each expert over the window (any non-negative numbers); speed_W: each worker's relative speed
    (None: all equal). Deterministic: ties go to the lower expert id, then to the lower worker id."""
    E, W = len(load_E), num_workers
    check_redundancy(E, W, num_redundant)
    slots = list(slots_W) if slots_W is not None else worker_slots(E, W, num_redundant)
    if len(slots) != W or sum(slots) != E + num_redundant:
        raise ValueError(f"worker slots {slots} must be {W} numbers adding up to {E + num_redundant}")
    speed = list(speed_W) if speed_W is not None else [1.0] * W
    if len(speed) != W or not all(v > 0 for v in speed):
        raise ValueError(f"worker speeds {speed} must be {W} positive numbers")
    count = [1] * E
    for _ in range(num_redundant):  # one more copy for the expert with the most tokens per copy
        e = max((e for e in range(E) if count[e] < W), key=lambda e: (load_E[e] / count[e], -e))
        count[e] += 1
    # Heaviest copies first; an expert's copies next to each other, replicated experts before single
    # ones of equal weight, so every copy still finds a worker without one.
    order = sorted(range(E), key=lambda e: (-load_E[e] / count[e], -count[e], e))
    load_W, free, held = [0.0] * W, slots, [set() for _ in range(W)]
    copies: list[list[int]] = [[] for _ in range(E)]
    for e in order:
        for _ in range(count[e]):
            options = [w for w in range(W) if free[w] > 0 and e not in held[w]]
            if not options:  # only workers that already hold e have room: trade with one that does not
                options = [_make_room(e, held, free, copies, load_W, load_E, count)]
            w = min(options, key=lambda w: ((load_W[w] + load_E[e] / count[e]) / speed[w], w))
            copies[e].append(w)
            held[w].add(e)
            free[w] -= 1
            load_W[w] += load_E[e] / count[e]
    copies = [sorted(ws) for ws in copies]
    return Placement(E, W, tuple(tuple(ws) for ws in copies), shares=_speed_shares(copies, speed))


def _speed_shares(copies: list[list[int]], speed_W: list[float]) -> tuple[tuple[int, ...], ...] | None:
    """Integer shares of each expert's copies in proportion to their workers' speeds (the fastest
    copy MAX_SHARE; one under 1/16 of its speed gets 0: held, but sent no tokens, since at decode
    sizes a copy's time is reading its weights however few tokens it gets); None when every
    expert's copies are equally fast."""
    shares = []
    for ws in copies:
        top = max(speed_W[w] for w in ws)
        s = [round(MAX_SHARE * speed_W[w] / top + 0.001) for w in ws]  # (a half rounds up)
        g = math.gcd(*s)
        shares.append(tuple(x // g for x in s))
    return None if all(set(s) == {1} for s in shares) else tuple(shares)


def _make_room(e: int, held: list[set], free: list[int], copies: list[list[int]], load_W: list[float],
               load_E: list[float], count: list[int]) -> int:
    """Every worker with a free slot already holds e: move a copy of some expert x from a full worker
    v without e to a worker u with room that lacks x, freeing a slot on v for e. With balanced slots
    such an x exists: held[v] within held[u] would need u to have 2 more slots than v."""
    for u in (w for w in range(len(free)) if free[w] > 0):
        for v in (w for w in range(len(free)) if free[w] == 0 and e not in held[w]):
            for x in sorted(held[v]):
                if x not in held[u]:
                    copies[x][copies[x].index(v)] = u
                    held[v].discard(x), held[u].add(x)
                    free[u], free[v] = free[u] - 1, free[v] + 1
                    share = load_E[x] / count[x]
                    load_W[u], load_W[v] = load_W[u] + share, load_W[v] - share
                    return v
    raise ValueError(f"worker slots {[len(h) + f for h, f in zip(held, free)]} leave no room for copy "
                     f"{len(copies[e]) + 1} of expert {e} on a worker without one")


def rebalance(load_LE: list[list[float]], current: ExpertPlacement, num_redundant: int,
              speed_W: list[float] | None = None) -> ExpertPlacement:
    """The greedy placement of every layer from its loads (load_LE[i]: MoE layer moe_layers[i]) and
    the workers' speeds, as version current.version + 1. Layers with no tokens keep their current
    placement."""
    layers = tuple(p if not any(load) else greedy_placement(load, current.num_workers, num_redundant, speed_W=speed_W)
                   for p, load in zip(current.layers, load_LE))
    return ExpertPlacement(current.moe_layers, layers, current.version + 1)


def imbalance(worker_load_W: list[float]) -> float:
    """max / mean of the workers' loads (1.0 when balanced or idle)."""
    mean = sum(worker_load_W) / max(len(worker_load_W), 1)
    return max(worker_load_W) / mean if mean > 0 else 1.0
