"""The rendezvous store leaks nothing and obeys no stranger (m2n_comm/_hello.py, SignedStore;
pools/roles.py, listen_store).

Every value a party of a deployment acts on (epochs, placements, load reports, failure reports,
acks, the shutdown flag) is signed with the deployment token under its own key. A stranger who
reaches the store and writes there without the token (unsigned, signed with another token, or a
genuine value moved from another key) is refused, logged naming the key, and ignored: the
deployment goes on. The front's store listens on its own address only, not on every interface.
"""
import json
import socket
import subprocess
import threading
import time
import types
import uuid
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from attention_nodes.config import CacheConfig, EngineConfig, ParallelConfig
from attention_nodes.engine import LLMEngine
from attention_nodes.sampling_params import SamplingParams
from expert_nodes import worker as expert_worker
from expert_nodes.placement import epoch_placement, watch_placements
from m2n_comm._hello import VALUE_AT, SignedStore, seal
from m2n_comm.placement import ExpertPlacement, Placement
from pools.engine import PoolEngine
from pools.eplb import PlacementControl, read_expert_load
from pools.roles import listen_store
from pools.supervision import Supervision, Worker, _Broken

TOKEN = "store-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def master():
    return listen_store("127.0.0.1", 0)


def client(master) -> TCPStore:
    return TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))


def forgeries(key: str, value: str, genuine_elsewhere: bytes):
    """What a stranger without the token can write under `key`: the value unsigned, signed with
    another token, the MAC of a genuine value over another body, a genuine value of another key."""
    yield value
    yield seal("guess", key, value.encode())
    yield genuine_elsewhere[:VALUE_AT] + value.encode()
    yield genuine_elsewhere


def refusals(caplog, key: str) -> int:
    return caplog.text.count(f"refused the store value {key!r}")


def test_signed_values_are_bound_to_their_key(master, caplog):
    """A value the front signs reads back as written on another connection; under the same key a
    forged one is absent to check (logged once per value, naming the key), and one written between
    check and get is not what get returns; the token is in no stored value."""
    sess = uuid.uuid4().hex[:8]
    front, worker, stranger = SignedStore(client(master), TOKEN), SignedStore(client(master), TOKEN), client(master)
    key, other = f"{sess}/epoch", f"{sess}/epoch/g1/placement"
    front.set(key, "3")
    front.set(other, "7")
    assert worker.check([key]) and worker.get(key) == b"3" and not worker.refused(key)
    assert TOKEN.encode() not in stranger.get(key)
    with caplog.at_level("WARNING", logger="shuttle"):
        assert worker.check([key])
        stranger.set(key, "9")
        assert worker.get(key) == b"3"  # what check verified, not the stranger's
        for n, value in enumerate(forgeries(key, "9", stranger.get(other)), 1):
            stranger.set(key, value)
            assert not worker.check([key]) and not worker.check([other, key]) and worker.refused(key)
            assert worker.check([key]) is False  # the same forgery again: not logged again
            assert refusals(caplog, key) == n
    front.set(key, "4")
    assert worker.check([key]) and worker.get(key) == b"4" and not worker.refused(key)


def test_forged_shutdown_epoch_and_reports_are_ignored(master, caplog, monkeypatch):
    """What an expert worker acts on (the shutdown flag, the next epoch, an epoch's placement) and
    what the front acts on (an expert worker's broken and up reports, its load, its placement acks
    and failures): a stranger's forgeries change nothing; the real parties' values are acted on."""
    sess = uuid.uuid4().hex[:8]
    front, worker, stranger = SignedStore(client(master), TOKEN), SignedStore(client(master), TOKEN), client(master)
    front.set(f"{sess}/genuine", "1")
    genuine = stranger.get(f"{sess}/genuine")
    v0 = ExpertPlacement.uniform(Placement.balanced(4, 2), [0])
    v1 = ExpertPlacement((0,), (Placement(4, 2, ((1,), (0,), (1,), (0,))),), 1)

    def forge(key: str, value: str) -> None:
        for forged in forgeries(key, value, genuine):
            stranger.set(key, forged)
        stranger.get(key)  # (a reply on the same connection: the sets have landed before the reads below)

    with caplog.at_level("WARNING", logger="shuttle"):
        # the expert worker's side
        forge(f"{sess}/shutdown", "1")
        assert not expert_worker._shutting_down(worker, sess)
        forge(f"{sess}/epoch", "7")
        forge(f"{sess}/epoch/g1/placement", "1")
        assert epoch_placement(worker, sess, 1, 2) is None
        got = []
        t = threading.Thread(target=lambda: got.append(expert_worker._next_epoch(worker, sess, 0)))
        t.start()
        time.sleep(0.3)
        assert t.is_alive()  # the forged epoch 7 is not taken
        front.set(f"{sess}/epoch", "2")
        t.join(5)
        assert got == [2]
        front.set(f"{sess}/shutdown", "1")
        assert expert_worker._shutting_down(worker, sess)
        # the front's side
        cfg = EngineConfig("unused", parallel=ParallelConfig(False, 1, 2))
        pools = types.SimpleNamespace(cfg=cfg, _procs=[], _store=front, session=sess, epoch=0,
                                      placements=types.SimpleNamespace(pending=None), _ready=True)
        sup = Supervision(pools, remote=False)
        forge(f"{sess}/broken/g0/e0", json.dumps({"peer": "a0", "why": "a0 went silent"}))
        sup.check_store()  # no _Broken
        forge(f"{sess}/failed/e1", "forged cause")
        assert sup._causes() == ""
        sup.degraded, sup.next_add_back = (v0, {Worker.named("e1")}, 3), 0.0
        forge(f"{sess}/up/e1", "3")
        assert sup.poll_add_back() == [] and sup.degraded is not None
        forge(f"{sess}/stats/e0", json.dumps({"moe_layers": [0], "busy_ns": 1, "uptime_ns": 1}))
        forge(f"{sess}/stats/e0/tokens", "\x01" * 32)
        assert read_expert_load(front, sess, 2) == (None, [0, 0])
        monkeypatch.setattr("pools.eplb.POLL_EVERY_S", 0.0)
        sent = []
        ctl = PlacementControl(front, sess, v0, sent.append)
        ctl.apply(v1)
        for w in range(2):
            forge(f"{sess}/placement/1/failed/e{w}", "forged failure")
            forge(f"{sess}/placement/1/loaded/e{w}", "1")
        ctl.poll(0, lambda: None)
        assert ctl.pending is v1 and ctl._phase == "loading" and not sent
        worker.set(f"{sess}/broken/g0/e0", json.dumps({"peer": "a0", "why": "a0 went silent"}))
        with pytest.raises(_Broken, match="a0 went silent"):
            sup.check_store()
        for w in range(2):
            worker.set(f"{sess}/placement/1/loaded/e{w}", "1")
        ctl.poll(0, lambda: None)
        assert sent == [v1]
    for key in ("shutdown", "epoch", "epoch/g1/placement", "broken/g0/e0", "failed/e1", "up/e1",
                "stats/e0/tokens", "placement/1/loaded/e0", "placement/1/failed/e1"):
        assert refusals(caplog, f"{sess}/{key}") >= 1, key


def test_a_forged_placement_is_never_built(master, caplog):
    """An expert worker's placement watcher builds only versions the front signed: a stranger's
    version 1 is refused (nothing built, no ack); the front's own version 1 is built and acked."""
    sess = uuid.uuid4().hex[:8]
    v0 = ExpertPlacement.uniform(Placement.balanced(4, 2), [0])
    real = ExpertPlacement((0,), (Placement(4, 2, ((1,), (0,), (1,), (0,))),), 1)
    forged = ExpertPlacement((0,), (Placement(4, 2, ((0,), (0,), (0,), (1,))),), 1)
    built = []
    held = types.SimpleNamespace(versions={0: None}, num_workers=2, rank=0, build=built.append)
    stop, stranger = threading.Event(), client(master)
    stranger.set(f"{sess}/placement/1", forged.to_json())
    watcher = threading.Thread(target=watch_placements, args=(held, ("127.0.0.1", master.port), sess, stop, TOKEN))
    with caplog.at_level("WARNING", logger="shuttle"):
        watcher.start()
        try:
            time.sleep(0.4)
            assert built == [] and not stranger.check([f"{sess}/placement/1/loaded/e0"])
            PlacementControl(SignedStore(client(master), TOKEN), sess, v0, lambda p: None).apply(real)
            deadline = time.monotonic() + 10
            while not built and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            stop.set()
            watcher.join(5)
    assert built == [real]
    assert SignedStore(client(master), TOKEN).check([f"{sess}/placement/1/loaded/e0"])
    assert refusals(caplog, f"{sess}/placement/1") == 1


# -- where the store listens ---------------------------------------------------------------------------
def _global_address() -> tuple[str, callable]:
    """An IPv4 address of this host other than loopback, and how to remove it afterwards (a veth
    made here, as root, when the host has none)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        return line.split()[3].split("/")[0], lambda: None
    name = f"shst{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", name + "p"], capture_output=True)
    if made.returncode != 0:
        pytest.skip("no non-loopback address, and no interface can be made (needs root)")
    subprocess.run(["ip", "addr", "add", "10.213.9.1/32", "dev", name], check=True)
    subprocess.run(["ip", "link", "set", name, "up"], check=True)
    return "10.213.9.1", lambda: subprocess.run(["ip", "link", "del", name])


def reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except ConnectionRefusedError:
        return False


def test_the_store_listens_on_its_address_only():
    """listen_store binds the TCPStore's server to the address given: on loopback it is not reached
    at this host's other address, and bound there it is not reached on loopback. torch's own
    server (TCPStore(is_master=True)) listens on every interface."""
    addr, cleanup = _global_address()
    try:
        local, there = listen_store("127.0.0.1", 0), listen_store(addr, 0)
        assert reachable("127.0.0.1", local.port) and not reachable(addr, local.port)
        assert reachable(addr, there.port) and not reachable("127.0.0.1", there.port)
        c = TCPStore(addr, there.port, is_master=False, wait_for_workers=False)
        c.set("k", "v")
        assert there.get("k") == b"v"
        everywhere = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        assert reachable(addr, everywhere.port)
        del local, there, c, everywhere
    finally:
        cleanup()


# -- a deployment under a stranger's writes -------------------------------------------------------------
PROMPTS = [[5, 17, 33, 100, 250, 7, 9], [400, 3, 12]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_a_deployment_keeps_serving_through_forged_store_values(make_checkpoint, caplog):
    """Spawned pools (store on loopback only): a stranger on this host writes a shutdown flag, a
    later epoch, placement version 1 and a broken report into the front's store; the expert worker
    builds no placement, nobody leaves, the front restarts nothing (its health check refuses the
    report, naming the key), and the output equals the colocated engine's."""
    ckpt = make_checkpoint("mixtral")
    cache = CacheConfig(num_blocks=64)
    want = run(LLMEngine(EngineConfig(str(ckpt), cache=cache, parallel=ParallelConfig()), {0}))
    engine = PoolEngine(EngineConfig(str(ckpt), cache=cache, parallel=ParallelConfig(False, 1, 1, 1, "shm",
                                                                                      torch_threads=1)), {0})
    try:
        sess, stranger, p = engine.session, client(engine._store), engine.placement
        for key, value in ((f"{sess}/shutdown", "1"), (f"{sess}/epoch", "5"),
                           (f"{sess}/placement/1", ExpertPlacement(p.moe_layers, p.layers, 1).to_json()),
                           (f"{sess}/epoch/g5/placement", "1"),
                           (f"{sess}/broken/g0/e0", json.dumps({"peer": "a0", "why": "forged"}))):
            stranger.set(key, value)
        got = run(engine)
        with caplog.at_level("WARNING", logger="shuttle"):
            engine.check_health()
        time.sleep(0.2)  # the placement watcher looks every 50 ms
        assert not any(stranger.check([f"{sess}/placement/1/{s}/e0"]) for s in ("loaded", "failed"))
        assert all(proc.exitcode is None for proc in engine._procs)
        assert engine.supervision.num_restarts == 0 and engine.epoch == 0
        assert f"refused the store value '{sess}/broken/g0/e0'" in caplog.text
        addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                              text=True).stdout.split()
        if len(addr) > 3:
            assert not reachable(addr[3].split("/")[0], engine._store.port)
    finally:
        engine.shutdown()
    assert got == want


def run(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, PARAMS)
    while engine.has_unfinished_requests():
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    return out
