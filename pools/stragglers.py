"""Stragglers: which worker the others wait for.

Every step of a deployment waits for its slowest worker, so one throttled expert worker (a noisy
neighbour, a CPU quota, a stop/continue cycle, a slow link) slows every attention worker. The
workers of each pool charge the workers of the other pool for the time they waited on them
(m2n_comm/m2n.py, `waited_ns`: each peer the wait from the previous arrival to its own, so a peer
that is consistently late is charged what it alone caused). Over a sliding window each worker's
charge per second of wall time is its wait share; its straggler score is that share over the
median share of the other workers of its pool, both plus FLOOR so that near-zero waits compare as
equal (1.0: waited on like the others; a pool of one has no peer to compare with: 1.0). A
straggler can make a worker of the other pool late in turn (the one whose micro-batches it serves
last reaches the straggler's peers last), which may then score high in its own pool too. A worker
whose score is at or above `threshold` over at least half a window is logged once, named, and again
when it is back under.

Each expert worker also has a speed for EPLB (pools/eplb.py: loads compared as tokens / speed), 1.0 until
it is a straggler. A straggler's speed halves (down to MIN_SPEED), and halves again for every
window it stays one, so EPLB moves load off it step by step until its peers stop waiting on it;
unless it computed over CARRIES fair shares of its pool's work in the window: then it is waited on
for the work it carries (a hot expert, or the load moved off a slower worker), which EPLB's token
counts balance, and lowering its speed too would only swing the load back and forth.
Whether it is still slow then is only seen by giving load back: after it has been no straggler for
RECOVER_S its speed doubles, and each time it turns out slow again the wait before the next doubling
doubles (at most 16x), so a persistently slow worker settles at the load it can carry.

    s = Stragglers()
    s.sample(now, [("expert", "e0", busy_ns, waited_on_ns), ...])   # cumulative, about once a second
    s.table()                                                        # per worker: the window's numbers
    s.speeds(["e0", "e1"])                                           # EPLB's speeds
"""
import collections
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("shuttle")
WINDOW_S = 10.0   # the window scores are computed over
THRESHOLD = 3.0   # a score at or above this names the worker a straggler
FLOOR = 0.02      # added to every wait share: waits under ~2% of the time are noise, not a straggler
MIN_SPEED = 1 / 32  # the lowest speed a straggler gets: its copies of replicated experts get no tokens
RECOVER_S = 60.0   # a slowed worker's speed doubles after this long (times 2 per relapse) as no straggler
CARRIES = 1.5      # a straggler with over this many fair shares of its pool's work keeps its speed


@dataclass
class _Series:
    pool: str
    points: deque = field(default_factory=deque)  # (time, busy_ns, waited_on_ns), cumulative
    speed: float = 1.0      # for EPLB (module docstring)
    changed_at: float = float("-inf")  # when speed last changed
    relapses: int = 0       # times it was a straggler again after its speed was raised


class Stragglers:
    """Per-worker busy time and the time its peers waited on it over the last `window_s` seconds,
    and straggler scores (module docstring). Counters that go backwards (a restarted worker or
    peer) start that worker's window again."""

    def __init__(self, window_s: float = WINDOW_S, threshold: float = THRESHOLD):
        self.window_s, self.threshold = window_s, threshold
        self._series: dict[str, _Series] = {}
        self.flagged: set[str] = set()
        self._flagged_at: dict[str, float] = {}  # when each flagged worker was last named
        self._cleared_at: dict[str, float] = collections.defaultdict(lambda: float("-inf"))  # ... and back

    def sample(self, now: float, workers: list[tuple]) -> None:
        """Record each worker's cumulative (busy_ns, waited_on_ns) at `now`, then log changes of who
        is a straggler. workers: (pool, name, busy_ns, waited_on_ns[, work]) tuples; work: the
        units it computed so far (an expert worker's (token, expert) pairs)."""
        for pool, name, busy_ns, waited_ns, *work in workers:
            s = self._series.setdefault(name, _Series(pool))
            if s.points and (busy_ns < s.points[-1][1] or waited_ns < s.points[-1][2]):
                s.points.clear()  # restarted: counts begin again
            s.points.append((now, busy_ns, waited_ns, work[0] if work else None))
            while len(s.points) > 2 and now - s.points[1][0] >= self.window_s:
                s.points.popleft()
        rows = self.table()
        self._log(rows, now)
        self._adjust_speeds(now, rows)

    def speeds(self, names: list[str]) -> list[float]:
        """EPLB's speed of each named worker (1.0 for one not seen)."""
        return [self._series[n].speed if n in self._series else 1.0 for n in names]

    def _adjust_speeds(self, now: float, rows: list[dict]) -> None:
        work = {r["worker"]: r["work"] for r in rows if r["pool"] == "expert"}
        total = sum(w for w in work.values() if w)
        for name, s in self._series.items():
            if s.pool != "expert":  # only expert placement acts on speeds
                continue
            if work.get(name) and total and work[name] / total > CARRIES / len(work):
                continue  # waited on because it carries the pool's work (EPLB's tokens balance that)
            if name in self.flagged:
                newly = s.changed_at < self._flagged_at[name]  # named since its speed last changed
                if s.speed > MIN_SPEED and (newly or now - s.changed_at >= self.window_s):
                    s.relapses += newly and s.speed < 1.0  # slow again after its speed was raised
                    s.speed, s.changed_at = max(s.speed / 2, MIN_SPEED), now
                    log.info("straggler: %s worker %s: speed for expert placement %.3g", s.pool, name, s.speed)
            elif s.speed < 1.0 and now - max(s.changed_at, self._cleared_at[name]) >= RECOVER_S * 2 ** min(s.relapses, 4):
                s.speed, s.changed_at = min(1.0, s.speed * 2), now
                log.info("straggler: %s worker %s: speed for expert placement raised to %.3g", s.pool, name, s.speed)

    def table(self) -> list[dict]:
        """Per worker over the window: its length, the share of it spent computing, the share its
        peers spent waiting on it (summed over peers), and the score."""
        rows = []
        for name, s in sorted(list(self._series.items())):  # (a scrape reads it from another thread)
            (t0, b0, w0, k0), (t1, b1, w1, k1) = s.points[0], s.points[-1]
            span = t1 - t0
            rows.append({"pool": s.pool, "worker": name, "window_s": round(span, 3),
                         "busy": (b1 - b0) / 1e9 / span if span > 0 else None,
                         "waited_on": (w1 - w0) / 1e9 / span if span > 0 else None, "speed": s.speed,
                         "work": None if k0 is None or k1 < k0 else k1 - k0})
        for r in rows:
            others = [o["waited_on"] for o in rows if o["pool"] == r["pool"] and o is not r and o["waited_on"] is not None]
            r["score"] = ((r["waited_on"] + FLOOR) / (statistics.median(others) + FLOOR)
                          if r["waited_on"] is not None and others else 1.0)
        return rows

    def _log(self, rows: list[dict], now: float) -> None:
        for r in rows:
            name, slow = r["worker"], r["score"] >= self.threshold
            if slow and name not in self.flagged and r["window_s"] >= self.window_s / 2:  # not on a glimpse
                self.flagged.add(name)
                self._flagged_at[name] = now
                log.warning("straggler: %s worker %s: its peers waited on it %.0f%% of the last %.0f s, %.1fx the "
                            "median of the other %s workers", r["pool"], name, 100 * r["waited_on"], r["window_s"],
                            r["score"], r["pool"])
            elif not slow and name in self.flagged:
                self.flagged.discard(name)
                self._cleared_at[name] = now
                log.warning("straggler: %s worker %s is back within %.1fx of its pool (%.1fx)", r["pool"], name,
                            self.threshold, r["score"])
