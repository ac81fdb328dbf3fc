"""Stragglers (pools/stragglers.py): scores from the waits each worker's peers charge it, and the
log line that names a straggler once (and its return). The live deployment's version runs in
tests/test_supervision.py (a stop/continue cycle of one expert worker)."""
import logging

import pytest

from m2n_comm.m2n import wait_in_arrival_order
from pools.stragglers import FLOOR, MIN_SPEED, RECOVER_S, Stragglers


def _feed(s: Stragglers, seconds: int, shares: dict[str, float], start: int = 0) -> None:
    """`seconds` samples, one a second, of expert workers waited on for `shares` of each second."""
    for t in range(start, start + seconds + 1):
        s.sample(float(t), [("expert", name, 0, int(t * share * 1e9)) for name, share in shares.items()]
                 + [("attention", "a0", int(t * 0.5e9), 0)])


def test_the_worker_waited_on_is_named_once_and_its_return(caplog):
    s = Stragglers(window_s=10.0, threshold=3.0)
    with caplog.at_level(logging.WARNING, logger="shuttle"):
        _feed(s, 3, {"e0": 0.01, "e1": 0.6, "e2": 0.02})
        assert not caplog.records  # under half a window: not yet
        _feed(s, 10, {"e0": 0.01, "e1": 0.6, "e2": 0.02}, start=4)
    rows = {r["worker"]: r for r in s.table()}
    assert rows["e1"]["score"] == pytest.approx((0.6 + FLOOR) / (0.015 + FLOOR), rel=0.05)
    assert rows["e0"]["score"] < 1 and rows["a0"]["score"] == 1.0 and rows["a0"]["busy"] == pytest.approx(0.5)
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 1 and "expert worker e1" in named[0] and "60%" in named[0], named
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shuttle"):
        for t in range(14, 40):  # e1 as fast as the others from now on
            s.sample(float(t), [("expert", "e0", 0, int(t * 0.01e9)), ("expert", "e1", 0, int((8.4 + t * 0.01) * 1e9)),
                                ("expert", "e2", 0, int(t * 0.02e9))])
    back = [r.getMessage() for r in caplog.records]
    assert len(back) == 1 and back[0].startswith("straggler: expert worker e1 is back within 3.0x of its pool"), back
    assert s.table()[1]["score"] < 1.5 and not s.flagged


def test_equal_waits_and_small_pools_are_not_stragglers():
    s = Stragglers()
    _feed(s, 12, {"e0": 0.001, "e1": 0.009})  # both under FLOOR: noise
    assert all(r["score"] < 1.5 for r in s.table()) and not s.flagged
    single = Stragglers()
    _feed(single, 12, {"e0": 0.9})  # a pool of one: nothing to compare with
    assert {r["worker"]: r["score"] for r in single.table()} == {"a0": 1.0, "e0": 1.0}


def test_a_restarted_worker_starts_its_window_again():
    s = Stragglers()
    _feed(s, 12, {"e0": 0.01, "e1": 0.5})
    s.sample(13.0, [("expert", "e0", 0, int(13 * 0.01e9)), ("expert", "e1", 0, 0)])  # e1 restarted: counts from 0
    rows = {r["worker"]: r for r in s.table()}
    assert rows["e1"]["window_s"] == 0 and rows["e1"]["score"] == 1.0


class _Arrivals:
    """An endpoint whose messages arrive in a given order, one per wait_any call, at given times."""

    def __init__(self, order: list[tuple[str, int]], times: list[int], clock: list[int]):
        self.order, self.times, self.clock = list(order), list(times), clock

    def wait_any(self, keys, timeout):
        got, self.clock[0] = self.order.pop(0), self.times.pop(0)
        assert got in keys
        return got


def test_each_peer_is_charged_the_wait_it_alone_caused(monkeypatch):
    clock = [0]
    monkeypatch.setattr("m2n_comm.m2n.Tracer.now", staticmethod(lambda: clock[0]))
    waited: dict[str, int] = {"e0": 0, "e1": 0, "e2": 0}
    ep = _Arrivals([("e2", 0), ("e0", 0), ("e1", 0)], [100, 130, 900], clock)
    wait_in_arrival_order(ep, [("e0", 0), ("e1", 0), ("e2", 0)], None, 0, waited)
    assert waited == {"e2": 100, "e0": 30, "e1": 770}


class _Clock:
    """Samples once a second with each expert worker waited on for a chosen share of every second."""

    def __init__(self, s: Stragglers):
        self.s, self.t, self.waited = s, 0, {"e0": 0.0, "e1": 0.0, "e2": 0.0}

    def run(self, seconds: int, slow_share: float) -> None:
        for _ in range(seconds):
            self.t += 1
            for name in self.waited:
                self.waited[name] += slow_share if name == "e1" else 0.01
            self.s.sample(float(self.t), [("expert", n, 0, int(w * 1e9)) for n, w in self.waited.items()])


def test_a_stragglers_speed_falls_while_it_is_waited_on_and_comes_back_slowly(caplog):
    """EPLB's speed of a straggler halves when it is named and every window it stays one (down to
    MIN_SPEED); after RECOVER_S as no straggler it doubles, and a relapse doubles that wait."""
    s = Stragglers(window_s=10.0, threshold=3.0)
    c = _Clock(s)

    def until(condition, slow_share: float, limit: int = 1000) -> int:
        for _ in range(limit):
            c.run(1, slow_share)
            if condition():
                return c.t
        raise AssertionError(f"not by t={c.t}")

    speed = lambda: s.speeds(["e1"])[0]  # noqa: E731
    with caplog.at_level(logging.INFO, logger="shuttle"):
        c.run(4, 0.6)
        assert s.speeds(["e0", "e1", "e9"]) == [1.0, 1.0, 1.0]  # not named on a glimpse
        named = until(lambda: speed() == 0.5, 0.6)
        assert named == 6 and "e1" in s.flagged  # half a window after the first sample (t=1)
        assert until(lambda: speed() == 0.25, 0.6) == named + 10  # still waited on a window later
        assert until(lambda: speed() == MIN_SPEED, 0.6) == named + 40
        c.run(30, 0.6)
        assert speed() == MIN_SPEED  # the floor
        cleared = until(lambda: "e1" not in s.flagged, 0.01)  # e1 keeps up from now on
        assert until(lambda: speed() == 2 * MIN_SPEED, 0.01) == cleared + RECOVER_S
        until(lambda: speed() == MIN_SPEED, 0.6)  # slow again: a relapse
        cleared = until(lambda: "e1" not in s.flagged, 0.01)
        assert until(lambda: speed() == 2 * MIN_SPEED, 0.01) == cleared + 2 * RECOVER_S
        assert s.table()[1]["speed"] == 2 * MIN_SPEED and s.table()[0]["speed"] == 1.0
    lines = [r.getMessage() for r in caplog.records if "speed for expert placement" in r.getMessage()]
    assert lines[0] == "straggler: expert worker e1: speed for expert placement 0.5", lines
    assert lines[5] == "straggler: expert worker e1: speed for expert placement raised to 0.0625", lines


def test_a_worker_waited_on_for_the_work_it_carries_keeps_its_speed():
    """e0 computes 90% of the pool's (token, expert) pairs (a hot expert, or the load moved off a
    slow e1): its peers wait on it, it is named, but its speed for EPLB stays 1.0; e1, waited on
    as much with a fair share of the work, is slowed."""
    s = Stragglers(window_s=10.0, threshold=3.0)
    for t in range(1, 20):
        s.sample(float(t), [("expert", "e0", 0, int(t * 0.6e9), 90 * t), ("expert", "e1", 0, int(t * 0.01e9), 10 * t)])
    assert "e0" in s.flagged and s.speeds(["e0", "e1"]) == [1.0, 1.0]
    s2 = Stragglers(window_s=10.0, threshold=3.0)
    for t in range(1, 20):
        s2.sample(float(t), [("expert", "e0", 0, int(t * 0.01e9), 50 * t), ("expert", "e1", 0, int(t * 0.6e9), 50 * t)])
    assert "e1" in s2.flagged and s2.speeds(["e1"])[0] < 1.0
