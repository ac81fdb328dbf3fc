"""Stragglers (pools/stragglers.py): scores from the waits each worker's peers charge it, and the
log line that names a straggler once (and its return). The live deployment's version runs in
tests/test_supervision.py (a stop/continue cycle of one expert worker)."""
import logging

import pytest

from m2n_comm.m2n import wait_in_arrival_order
from pools.stragglers import FLOOR, Stragglers


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
