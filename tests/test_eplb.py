"""Expert load balancing: per-(layer, expert) counting, the greedy placement (hand-computed cases),
the placement-version handshake over real M2N endpoints, the front's re-placement state machine,
/metrics, and one end-to-end run whose greedy output must equal the colocated engine's while the
experts are re-placed live every few steps."""
import json
import random
import threading
import types

import numpy as np
import pytest
import torch
from torch.distributed import TCPStore

from attention_nodes.config import ParallelConfig
from attention_nodes.sampling_params import SamplingParams
from m2n_comm.endpoints import open_endpoint
from m2n_comm.m2n import M2NReceiver, M2NSender
from m2n_comm.placement import ExpertPlacement, Placement, check_redundancy, worker_slots
from m2n_comm.transport import TransportConfig
from models.config import ModelConfig
from pools.eplb import PlacementControl, eplb_policy, greedy_placement, predicted_worker_load, step_cost


# -- the greedy placement ---------------------------------------------------------------------------
def test_greedy_replicates_the_hottest_and_balances():
    # R=2: expert 0 (100) gets a second copy (50 each), then expert 7 (40 > 50's next 33? no: 0 is
    # at W copies already), so 7 gets one (20 each). Slots 5 + 5. Heaviest first, least-loaded worker:
    # e0 -> w0, w1; e7 -> w0, w1 (70, 70); e1..e6 alternate from w0 (10 each): 100 / 100.
    p = greedy_placement([100, 10, 10, 10, 10, 10, 10, 40], 2, 2)
    assert p.copies == ((0, 1), (0,), (1,), (0,), (1,), (0,), (1,), (0, 1))
    assert p.worker_loads([100, 10, 10, 10, 10, 10, 10, 40]) == [100.0, 100.0]


def test_greedy_without_copies_is_longest_processing_time_first():
    # 8 -> w0; 7 -> w1; 6 -> w1 (7 < 8); 5 -> w0 (13 = 13, w0 first); 4 -> w0 (tie, equal room);
    # 3 -> w1 (16 < 17); 2 -> w1 (16 < 17; w1 now full); 1 -> w0: 18 / 18.
    p = greedy_placement([8, 7, 6, 5, 4, 3, 2, 1], 2, 0)
    assert [p.experts_on(0), p.experts_on(1)] == [[0, 3, 4, 7], [1, 2, 5, 6]]


def test_greedy_respects_worker_slots():
    # One dominant expert and 2 slots per worker: w1 fills with e1, e2, so e3 must go to w0.
    p = greedy_placement([100, 1, 1, 1], 2, 0)
    assert p.copies == ((0,), (1,), (1,), (0,))
    # Explicit uneven memory: w0 has room for 1 copy, w1 for 3.
    assert greedy_placement([5, 4, 3, 2], 2, 0, slots_W=[1, 3]).copies == ((0,), (1,), (1,), (1,))


def test_greedy_always_feasible_and_within_slots():
    rng = random.Random(0)
    for _ in range(300):
        E, W = rng.randint(1, 12), rng.randint(1, 6)
        if W > E:
            continue
        R = rng.randint(0, E * (W - 1))
        load = [rng.choice([0, 1, rng.randint(0, 1000)]) for _ in range(E)]
        p = greedy_placement(load, W, R)
        assert [len(p.experts_on(w)) for w in range(W)] == worker_slots(E, W, R)
        assert sum(len(ws) for ws in p.copies) == E + R
        assert max(p.worker_loads(load)) <= sum(load) / W + max(load) + 1e-9  # LPT's bound


def test_redundancy_checks():
    with pytest.raises(ValueError, match="at most 8 extra"):
        check_redundancy(8, 2, 9)
    with pytest.raises(ValueError, match="at least one copy"):
        check_redundancy(2, 3, 0)
    with pytest.raises(ValueError, match="add --eplb"):
        ParallelConfig(colocated=False, expert_workers=2, num_redundant_experts=2)
    with pytest.raises(ValueError, match="eplb_interval"):
        ParallelConfig(eplb=True, eplb_interval=0)


def test_eplb_policy_moves_only_when_it_pays():
    current = ExpertPlacement.uniform(Placement.balanced(4, 2), [1, 3])
    skewed = [[90, 5, 3, 2], [1, 1, 1, 1]]  # layer 1: experts 0 and 1 (both on w0) take 95%
    new = eplb_policy(skewed, current, num_redundant=1)
    assert new.version == 1 and new.of(1).copies[0] == (0, 1)
    assert max(predicted_worker_load(new, skewed)) < max(predicted_worker_load(current, skewed))
    # per layer, the busiest worker's tokens: 95 + 2 before (w0 holds 0, 1); after, layer 1's w0 holds
    # half of expert 0 and experts 1, 3 (45 + 5 + 2), layer 3's w0 half of 0 and two more (2.5)
    assert step_cost(current, skewed) == 97 and step_cost(new, skewed) == 54.5
    assert eplb_policy([[1, 1, 1, 1], [1, 1, 1, 1]], current, 0) is None  # balanced already
    assert ExpertPlacement.from_json(new.to_json(), 2) == new


def test_a_slow_worker_gets_the_lightest_experts_and_small_shares():
    """Speeds (pools/stragglers.py): loads compared as tokens / speed, so a worker at a quarter of
    the speed fills its slots last, with the lightest experts, and its copies of replicated experts
    take a quarter of the share of a full-speed copy."""
    load = [8, 7, 6, 5, 4, 3, 2, 1]
    p = greedy_placement(load, 2, 0, speed_W=[1.0, 0.25])
    # 8, 7, 6 -> w0 (w1's time would be 32, 28, 24); 5 -> w1 (20 < 26); 4 -> w0 (30 < 36, w0 full).
    assert p.experts_on(1) == [3, 5, 6, 7] and p.worker_loads(load) == [25.0, 11.0] and p.shares is None
    assert greedy_placement(load, 2, 0).worker_loads(load) == [18.0, 18.0]
    hot = [100, 10, 10, 10, 10, 10, 10, 40]
    p = greedy_placement(hot, 2, 2, speed_W=[1.0, 0.25])
    assert p.copies[0] == p.copies[7] == (0, 1) and p.shares[0] == p.shares[7] == (4, 1)
    assert p.worker_loads(hot) == [142.0, 58.0]  # 80 + 32 + 3 x 10 on w0; 20 + 8 + 3 x 10 on w1
    with pytest.raises(ValueError, match="speeds"):
        greedy_placement(hot, 2, 2, speed_W=[1.0, 0.0])
    # At MIN_SPEED (1/32) a copy gets no tokens: with every expert on both workers, none reach w1.
    p = greedy_placement(hot, 2, 8, speed_W=[1.0, 1 / 32])
    assert all(ws == (0, 1) for ws in p.copies) and set(p.shares) == {(1, 0)} and p.worker_loads(hot)[1] == 0


def test_eplb_policy_moves_load_off_a_slow_worker_when_copies_allow():
    current = ExpertPlacement.uniform(Placement.balanced(4, 2), [1])
    even = [[10, 10, 10, 10]]
    assert eplb_policy(even, current, 0, [1.0, 0.25]) is None  # 2 equal experts each: nothing to move
    assert eplb_policy(even, current, 2, [1.0, 1.0]) is None  # balanced already
    new = eplb_policy(even, current, 2, [1.0, 0.25])
    # Copies of two experts on both workers, the slow one's share 1 of 5: w0 16 + 10, w1 4 + 10.
    assert new.of(1).copies == ((0, 1), (0, 1), (1,), (0,)) and new.of(1).shares == ((4, 1), (4, 1), (1,), (1,))
    assert step_cost(current, even, [1.0, 0.25]) == 80 and step_cost(new, even, [1.0, 0.25]) == 56
    assert ExpertPlacement.from_json(new.to_json(), 2) == new
    # Back at full speed, even loads cost the same on the first placement with fewer copies read.
    first = ExpertPlacement.uniform(Placement.balanced(8, 2), [1])
    slow = eplb_policy([[10] * 8], first, 8, [1.0, 1 / 32], also=first.layers)
    assert set(slow.of(1).shares) == {(1, 0)} and step_cost(slow, [[10] * 8], [1.0, 1 / 32]) == 80
    back = eplb_policy([[10] * 8], slow, 8, [1.0, 1.0], also=first.layers)
    assert back.layers == first.layers and back.version == slow.version + 1
    both = Placement(3, 3, ((0, 1, 2), (1, 2), (0,)), shares=((8, 0, 1), (0, 1), (1,)))
    # Failover keeps the others' shares; held copies that got no tokens take them when alone.
    assert both.without({2}).shares == ((8, 0), (1,), (1,)) and both.without({1}).shares == ((8, 1), (1,), (1,))


def test_failover_placement_without_workers():
    """Failover: a worker is out only when every expert it holds has a copy elsewhere in every
    layer; the placement without it keeps the other copies, marks it down and survives JSON."""
    v = ExpertPlacement((1, 3), (Placement(4, 3, ((0, 1), (1, 2), (1, 2), (0, 2))),
                                 Placement(4, 3, ((0, 1), (1, 2), (1, 2), (0,)))), 5)
    assert v.covers_without({1}) and not v.covers_without({0})  # layer 3: expert 3 only on worker 0
    assert not v.covers_without({1, 2})
    f = v.without({1}, 6)
    assert f.down == (1,) and f.version == 6 and f.of(1).copies == ((0,), (2,), (2,), (0, 2))
    assert f.of(3).experts_on(1) == [] and f.of(3).experts_on(2) == [1, 2]
    assert ExpertPlacement.from_json(f.to_json(), 3) == f
    assert not f.covers_without({2})  # expert 1 would be lost with both down
    with pytest.raises(ValueError, match=r"experts \[3\] have no copy outside expert workers \[0\]"):
        v.without({0}, 6)
    with pytest.raises(ValueError, match="on expert worker 1, which is down"):
        Placement(2, 2, ((0, 1), (1,)), down=(1,))


# -- counting ---------------------------------------------------------------------------------------
def test_expert_worker_counts_per_layer_and_global_expert():
    from expert_nodes.worker import _Load

    spec = types.SimpleNamespace(session="s", rank=1)
    load = _Load(spec, None, None, torch.device("cpu"), num_experts=6, moe_layers=[1, 3])
    # worker holds experts [2, 5] in layer 1 and [0, 4, 5] in layer 3; -1: an expert elsewhere
    load.count(1, torch.tensor([2, 5]), torch.tensor([[0, -1], [1, 0], [-1, -1]]))
    load.count(3, torch.tensor([0, 4, 5]), torch.tensor([[2, 1], [2, -1]]))
    want = np.zeros((2, 6), dtype=np.int64)
    want[0, 2], want[0, 5], want[1, 5], want[1, 4] = 2, 1, 2, 1
    assert (load.tokens_LE.view(2, 6).numpy() == want).all()


def test_metrics_show_worker_load_imbalance_and_bounded_hot_experts():
    from server.metrics import HOT_EXPERTS, ServerMetrics

    stats = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "num_blocks": 1, "free_blocks": 1,
             "expert_worker_tokens": {"e0": 300, "e1": 100},
             "expert_layer_tokens": {1: list(range(32)), 3: [0] * 31 + [62]},
             "placement_version": 2, "placement_changes": 2}
    m = ServerMetrics("tiny")
    m.bind(lambda: stats)
    text = m.render().decode()
    assert 'shuttle_expert_worker_tokens_total{worker="e0"} 300.0' in text
    assert 'shuttle_expert_load_imbalance{model_name="tiny"} 1.5' in text  # 300 / mean 200
    assert 'shuttle_expert_layer_imbalance{layer="3"} 32.0' in text
    assert text.count("shuttle_expert_hot_tokens{") == HOT_EXPERTS
    assert 'shuttle_expert_hot_tokens{expert="31",layer="3"} 62.0' in text
    assert 'shuttle_expert_placement_version{model_name="tiny"} 2.0' in text
    stats["expert_worker_tokens"] = {"e0": 400, "e1": 200}  # since the last scrape: 100 and 100
    assert 'shuttle_expert_load_imbalance{model_name="tiny"} 1.0' in m.render().decode()


# -- an expert worker's versions ---------------------------------------------------------------------
def test_held_experts_reuse_held_copies_and_load_only_new_ones():
    from expert_nodes.placement import HeldExperts
    from kernels.ops import select_ops
    from models.moe_decoder import Experts

    def experts(ids: list[int]) -> Experts:  # expert e's weights are all e (so we can tell them apart)
        m = Experts(len(ids), 4, 3, select_ops("cpu"))
        with torch.no_grad():
            for i, e in enumerate(ids):
                m.w13[i].fill_(e), m.w2[i].fill_(e)
        return m

    loads = []

    def load_fn(ids_by_layer):
        loads.append(ids_by_layer)
        return {layer: experts(ids) for layer, ids in ids_by_layer.items()}

    v0 = ExpertPlacement.uniform(Placement.balanced(4, 2), [0, 2])  # worker 1: experts 2, 3
    held = HeldExperts(v0, load_fn(v0.experts_on(1)), rank=1, load_fn=load_fn)
    layer0 = Placement(4, 2, ((0, 1), (0,), (1,), (0,)))  # worker 1 in layer 0: 0 (new) and 2 (held)
    v1 = ExpertPlacement((0, 2), (layer0, v0.layers[1]), 1)
    held.build(v1)
    assert loads[-1] == {0: [0]}  # only the new copy is read; layer 2 is unchanged
    rx = types.SimpleNamespace(version=0, held={0})
    held.step_done(rx)
    assert rx.held == {0, 1} and held.modules(1)[2] is held.modules(0)[2]
    assert held.modules(1)[0].w13[:, 0, 0].tolist() == [0.0, 2.0]
    assert held.global_ids(1, 0).tolist() == [0, 2]
    rx.version = 1  # the attention workers switched: version 0 is freed
    assert held.step_done(rx) and rx.held == {1} and set(held.versions) == {1}


# -- the version handshake over real endpoints ------------------------------------------------------
D, K, E = 8, 2, 4


def fake_experts(x_RD, global_ids_RK, weights_RK):
    """Expert e maps x to (e + 1) x."""
    return x_RD * ((global_ids_RK + 1).float() * weights_RK).sum(dim=1, keepdim=True)


def serve_versions(ep, versions: dict[int, ExpertPlacement], worker: int, steps: int, seen: list) -> None:
    rx = M2NReceiver(ep, ["a0"], [0], 1)
    rx.held = set(versions)
    for _ in range(steps):
        b = rx.recv(0, 0)
        seen.append((worker, b.step, b.version))
        to_global = torch.tensor(versions[b.version].of(0).experts_on(worker))
        local = b.local_ids_RK
        glob = torch.where(local >= 0, to_global[local.clamp(min=0)], 0)
        rx.reply(b, fake_experts(b.x_RD, glob, torch.where(local >= 0, b.weights_RK, 0.0)))


@pytest.mark.parametrize("held_by_e1", [(0, 1), (0,)])
def test_all_workers_switch_at_the_same_step(held_by_e1):
    """The attention worker gets version 1 before step 2; its step-2 headers advertise it, the
    expert workers confirm it in their step-2 answers, and step 3 routes with it. An expert worker
    that does not hold version 1 holds the switch back (nobody switches)."""
    v0 = ExpertPlacement.uniform(Placement.balanced(E, 2), [0])
    v1 = ExpertPlacement((0,), (Placement(E, 2, ((1,), (0, 1), (0,), (0,))),), 1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = TransportConfig("shm", slot_bytes=1 << 14, heartbeat_s=0.2, dead_after_s=2.0)
    eps = {}
    openers = [threading.Thread(target=lambda n, p: eps.__setitem__(n, open_endpoint(cfg, store, "v", n, p, 1)),
                                args=(n, p)) for n, p in (("a0", ["e0", "e1"]), ("e0", ["a0"]), ("e1", ["a0"]))]
    for t in openers:
        t.start()
    for t in openers:
        t.join()
    steps, seen = 5, []
    held = {0: {0: v0, 1: v1}, 1: {v: {0: v0, 1: v1}[v] for v in held_by_e1}}
    workers = [threading.Thread(target=serve_versions, args=(eps[f"e{w}"], held[w], w, steps, seen), daemon=True)
               for w in range(2)]
    for t in workers:
        t.start()
    try:
        tx = M2NSender(eps["a0"], v0, ["e0", "e1"], D, K)
        g = torch.Generator().manual_seed(0)
        versions = []
        for step in range(1, steps + 1):
            if step == 2:
                tx.set_placement(v1)
            tx.begin_step()
            versions.append(tx.placement_version)
            x, w = torch.randn(6, D, generator=g), torch.rand(6, K, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(6)])
            torch.testing.assert_close(tx.combine(tx.dispatch(0, None, x, ids, w)), fake_experts(x, ids, w))
            tx.end_step()
        for t in workers:
            t.join(5)
    finally:
        for ep in eps.values():
            ep.close()
    want = [0, 0, 1, 1, 1] if held_by_e1 == (0, 1) else [0] * 5
    assert versions == want
    assert sorted(seen) == sorted((w, s, want[s - 1]) for w in range(2) for s in range(1, steps + 1))


# -- the front's state machine ----------------------------------------------------------------------
class FakeStore:
    def __init__(self):
        self.d: dict[str, bytes] = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.d[k]

    def check(self, keys):
        return all(k in self.d for k in keys)


def test_placement_control_phases(monkeypatch):
    monkeypatch.setattr("pools.eplb.POLL_EVERY_S", 0.0)
    store, sent = FakeStore(), []
    v0 = ExpertPlacement.uniform(Placement.balanced(4, 2), [1])
    ctl = PlacementControl(store, "s", v0, sent.append, interval=10, num_redundant=1)
    counts = np.array([[50, 40, 5, 5]])
    ctl.poll(5, lambda: counts)
    assert ctl.pending is None  # the interval has not passed
    ctl.poll(10, lambda: counts)
    v1 = ctl.pending
    assert v1.version == 1 and json.loads(store.get("s/placement/1"))["version"] == 1
    ctl.poll(11, lambda: counts)
    assert not sent  # expert worker e1 has not loaded it yet
    store.set("s/placement/1/loaded/e0", "1"), store.set("s/placement/1/loaded/e1", "1")
    ctl.poll(12, lambda: counts)
    assert sent == [v1]
    store.set("s/placement/active/e0", "1"), store.set("s/placement/active/e1", "1")
    ctl.poll(13, lambda: counts)
    assert ctl.current is v1 and ctl.pending is None and ctl.stats()["placement_changes"] == 1
    with pytest.raises(ValueError, match="next one is 2"):
        ctl.apply(v1)
    # A worker that cannot load a version: abandoned, the next attempt takes the version after it.
    v2 = ExpertPlacement(v1.moe_layers, v0.layers, 2)
    ctl.apply(v2)
    store.set("s/placement/2/failed/e1", "CheckpointError: gone")
    ctl.poll(14, lambda: counts)
    assert ctl.pending is None and ctl.current.version == 2 and ctl.current.layers == v1.layers


def test_a_change_of_speeds_replaces_at_once(monkeypatch):
    """EPLB waits for its interval, except when a worker's speed changes: then the loads so far
    decide at once, and the placement sent splits replicated experts by speed."""
    monkeypatch.setattr("pools.eplb.POLL_EVERY_S", 0.0)
    store, speeds = FakeStore(), [1.0, 1.0]
    v0 = ExpertPlacement.uniform(Placement.balanced(4, 2), [1])
    ctl = PlacementControl(store, "s", v0, lambda msg: None, interval=1000, num_redundant=2)
    ctl.speeds = lambda: list(speeds)
    counts = np.array([[10, 10, 10, 10]])
    ctl.poll(5, lambda: counts)
    assert ctl.pending is None
    speeds[1] = 0.25
    ctl.poll(6, lambda: counts)
    assert ctl.pending.version == 1 and json.loads(store.get("s/placement/1"))["shares"] == [[[4, 1], [4, 1], [1], [1]]]
    assert ctl.pending.of(1).worker_loads([10] * 4) == [26.0, 14.0]


# -- end to end -------------------------------------------------------------------------------------
def rotation(current: ExpertPlacement, turn: int) -> ExpertPlacement:
    """A different placement per turn: experts alternate over 2 workers with an offset that changes
    per turn and layer, and one expert per turn is on both workers (a replica)."""
    layers = tuple(Placement(8, 2, tuple(((e + turn + i) % 2,) if e != turn % 8 else (0, 1) for e in range(8)))
                   for i in range(len(current.layers)))
    return ExpertPlacement(current.moe_layers, layers, current.version + 1)


def run_replacing(engine, prompts, params, replace: bool) -> dict[str, list[int]]:
    """Run the prompts to the end; with `replace`, start the next placement as soon as the previous
    one is in use, so re-placements happen while every request is mid-generation."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
        ctl = getattr(engine, "placements", None)
        if replace and ctl.pending is None:
            ctl.apply(rotation(ctl.current, ctl.current.version + 1))
    return out


@pytest.mark.slow
def test_greedy_output_equal_while_replacing_live(make_checkpoint):
    """2 attention and 2 expert workers; a new placement is started whenever the previous one is in
    use (new copies loaded on the workers, old ones freed, both attention workers switching at one
    step): greedy ids equal the colocated engine's during the re-placements and after them."""
    from attention_nodes.config import CacheConfig, EngineConfig
    from attention_nodes.engine import LLMEngine
    from pools.engine import PoolEngine

    ckpt = str(make_checkpoint("mixtral"))
    prompts = [[5, 17, 33, 100, 250, 7, 9], [400, 3], [77, 78, 79, 80, 81], [12, 13]]
    # Long enough for two re-placements to finish while generating, on a fast host too (32 tokens
    # left room for only one on the AVX-512 EPYC).
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference, in this process: OpenMP threads on a busy host cost 10x
    try:
        want = run_replacing(LLMEngine(EngineConfig(ckpt, cache=CacheConfig(num_blocks=64)), {0}), prompts, params,
                             False)
    finally:
        torch.set_num_threads(threads)
    par = ParallelConfig(False, 2, 2, 2, torch_threads=1, eplb=True, num_redundant_experts=1)
    engine = PoolEngine(EngineConfig(ckpt, cache=CacheConfig(num_blocks=64), parallel=par), {0})
    try:
        got = run_replacing(engine, prompts, params, replace=True)
        changes = engine.placements.applied
        for n in range(50):  # the last one completes with the next steps
            if engine.placements.pending is None:
                break
            run_replacing(engine, [[n + 1]], SamplingParams(max_tokens=2, ignore_eos=True), replace=False)
        got_after = run_replacing(engine, prompts, params, replace=False)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert got == want and got_after == want
    assert changes >= 2, f"only {changes} live re-placements during generation"
    assert stats["placement_version"] == engine.placements.current.version >= 2
    assert sum(stats["expert_worker_tokens"].values()) == sum(map(sum, stats["expert_layer_tokens"].values()))
    # each expert worker reports the bytes of the experts it holds now (the redundant copies included)
    held = {f"e{w}": sum(map(len, engine.placements.current.experts_on(w).values())) for w in range(2)}
    reported = {r["worker"]: r["bytes"] for r in stats["weights"] if r["pool"] == "expert"}
    per_expert = ModelConfig.from_pretrained(ckpt).expert_bytes(torch.float32)  # packed float32: as stored
    assert reported == {w: n * per_expert for w, n in held.items()} and sum(held.values()) > 16
