"""The M2N slot transport (m2n_comm.shm, m2n_comm.tcp) between real processes.

The test process is one endpoint; the others run in a small pool of spawned worker processes that
execute the scenario functions below (by name) against a torch.distributed.TCPStore whose master
lives here. Workers a test kills are replaced. Content is always checked byte for byte.
"""
import ctypes
import multiprocessing as mp
import os
import random
import signal
import subprocess
import threading
import time
import traceback
import uuid
import zlib

import pytest
import torch

from m2n_comm.endpoints import open_endpoint
from m2n_comm.nixl import import_nixl
from m2n_comm.transport import (KIND_DATA, SLOT_HEADER_BYTES, MessageMeta, PeerDeadError, TransportConfig,
                                TransportTimeout, message_nbytes)

# nixl runs over UCX's tcp and over its shared-memory transports (UCX_TLS, read by UCX in each process).
UCX_TLS = {"nixl-tcp": "tcp", "nixl-shm": "sm,self"}
BACKENDS = ["shm", "tcp", *UCX_TLS]


def _nixl_missing() -> str:
    try:
        import_nixl()
        return ""
    except ImportError as e:
        return str(e)


# Without NIXL (make setup NIXL=0) its cases are skipped, saying how to install it.
NEEDS_NIXL = pytest.mark.skipif(bool(_nixl_missing()), reason=_nixl_missing() or "NIXL is installed")


def params(*backends: str) -> list:
    """pytest parameters for these backends (nixl-* skipped when NIXL is missing)."""
    return [pytest.param(b, marks=NEEDS_NIXL) if b in UCX_TLS else b for b in backends]
SLOT_BYTES = SLOT_HEADER_BYTES + (16 << 10)   # 16 KiB of payload per slot
NUM_SLOTS = 4
RESULT_TIMEOUT_S = 60.0


def config(backend: str, **kw) -> TransportConfig:
    """The test transport config of `backend` (a BACKENDS name; nixl-* also sets this process's UCX_TLS)."""
    if backend in UCX_TLS:
        os.environ.update(UCX_TLS=UCX_TLS[backend], UCX_NET_DEVICES="lo")
        backend = "nixl"
    base = dict(backend=backend, slot_bytes=SLOT_BYTES, heartbeat_s=0.1, dead_after_s=1.0, connect_timeout_s=30.0)
    return TransportConfig(**{**base, **kw})


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def make_tensors(seed: int, dtype: torch.dtype, tokens: int, dim: int = 64) -> list[torch.Tensor]:
    """A data message's tensors: x (tokens, dim) of `dtype` and ids (tokens, 2) int64, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(tokens, dim, generator=g).to(dtype)
    else:
        x = torch.randint(0, 250, (tokens, dim), generator=g).to(dtype)
    return [x, torch.randint(-2**40, 2**40, (tokens, 2), generator=g)]


# ---- scenario functions (run in workers; each returns something picklable) ------------------------
def run_echo(store, session: str, backend: str, me: str, peer: str, count: int, token: str = "") -> int:
    """Echo `count` messages from `peer` back in the slot they came in, from the received views."""
    ep = open_endpoint(config(backend, token=token), store, session, me, [peer], NUM_SLOTS)
    try:
        for k in range(count):
            key = ep.wait_any([(peer, s) for s in range(NUM_SLOTS)], timeout=30)
            m = ep.recv(*key)
            ep.send(peer, m.slot, m.meta, m.tensors)
            ep.release(peer, m.slot)
        return count
    finally:
        ep.close()


def flight_payload(sender: str, receiver: str, k: int) -> tuple[MessageMeta, list[torch.Tensor]]:
    seed = zlib.crc32(f"{sender}>{receiver}#{k}".encode())
    dtype = [torch.float32, torch.bfloat16, torch.float16, torch.int32][k % 4]
    tokens = seed % 37
    return MessageMeta(KIND_DATA, step=k, layer=k % 3, mb=k % 2, aux=tokens), make_tensors(seed, dtype, tokens)


def run_sender(store, session: str, backend: str, me: str, receivers: list[str], count: int) -> int:
    """Send `count` messages to each receiver, message k into slot k % NUM_SLOTS."""
    ep = open_endpoint(config(backend), store, session, me, receivers, NUM_SLOTS)
    try:
        for k in range(count):
            for r in receivers:
                ep.send(r, k % NUM_SLOTS, *flight_payload(me, r, k), timeout=30)
        for r in receivers:
            ep.recv(r, 0, timeout=30)  # "done": stay open until every receiver finished
        return count
    finally:
        ep.close()


def run_receiver(store, session: str, backend: str, me: str, senders: list[str], count: int) -> dict:
    """Take messages as they come (wait_any), hold NUM_SLOTS per sender at once, check all of them,
    and release them in shuffled order; returns counts."""
    ep = open_endpoint(config(backend), store, session, me, senders, NUM_SLOTS)
    rng = random.Random(me)
    try:
        nxt = {s: 0 for s in senders}
        held: dict[str, list] = {s: [] for s in senders}
        full_batches = 0
        while any(n < count for n in nxt.values()):
            keys = [(s, (nxt[s]) % NUM_SLOTS) for s in senders if nxt[s] < count]
            s, slot = ep.wait_any(keys, timeout=30)
            m = ep.recv(s, slot)
            meta, want = flight_payload(s, me, nxt[s])
            assert m.meta == meta and len(m.tensors) == 2 and all(map(same, m.tensors, want)), (s, nxt[s])
            held[s].append((nxt[s], m))
            nxt[s] += 1
            if len(held[s]) == NUM_SLOTS or nxt[s] == count:
                full_batches += len(held[s]) == NUM_SLOTS
                for k, m in held[s]:  # the views stay valid while other slots fill
                    assert all(map(same, m.tensors, flight_payload(s, me, k)[1])), (s, k)
                rng.shuffle(held[s])
                for _, m in held[s]:
                    ep.release(s, m.slot)
                held[s] = []
        for s in senders:
            ep.send(s, 0, MessageMeta(KIND_DATA), [])
        return dict(received=sum(nxt.values()), full_batches=full_batches)
    finally:
        ep.close()


FLOOD_SLOT_BYTES = SLOT_HEADER_BYTES + (8 << 20)


def flood(ep, peer: str, seed: int) -> int:
    """Fill all of `peer`'s slots with 8 MiB messages before taking any of its own: both ends do
    this at once, so each send outgrows the socket buffers while the peer is sending too."""
    for k in range(NUM_SLOTS):
        x = torch.arange(2 << 20, dtype=torch.int32) * (seed + k)
        ep.send(peer, k, MessageMeta(KIND_DATA, step=k), [x], timeout=60)
    ok = 0
    for k in range(NUM_SLOTS):
        m = ep.recv(peer, k, timeout=60)
        ok += m.meta.step == k and bool(torch.equal(m.tensors[0], torch.arange(2 << 20, dtype=torch.int32) * (1 - seed + k)))
        ep.release(peer, k)
    return ok


def run_flood(store, session: str, backend: str) -> int:
    ep = open_endpoint(config(backend, slot_bytes=FLOOD_SLOT_BYTES), store, session, "b", ["a"], NUM_SLOTS)
    try:
        return flood(ep, "a", 0)
    finally:
        ep.close()


def run_wait_any_peer(store, session: str, backend: str) -> bool:
    """Peer "b" of test_wait_any_and_timeouts: on each "go" from "a", sends into slot 2, then slot 0."""
    ep = open_endpoint(config(backend), store, session, "b", ["a"], NUM_SLOTS)
    try:
        for slot in (2, 0):
            ep.recv("a", 0, timeout=30)
            ep.release("a", 0)
            ep.send("a", slot, MessageMeta(KIND_DATA, aux=slot), [torch.full((3,), slot, dtype=torch.int32)])
        ep.recv("a", 1, timeout=30)  # "bye"
        return True
    finally:
        ep.close()


def run_idle(store, session: str, backend: str, me: str, peers: list[str]) -> None:
    """Connect, then do nothing (the test kills or stops us)."""
    ep = open_endpoint(config(backend), store, session, me, peers, NUM_SLOTS)
    time.sleep(60)
    ep.close()


def run_survivor(store, session: str, backend: str) -> dict:
    """Endpoint "a" of test_killed_peer: fills slot 0 of "v", blocks sending into it again until "v"
    is killed, then echoes 20 messages from "p"."""
    ep = open_endpoint(config(backend), store, session, "a", ["p", "v"], NUM_SLOTS)
    try:
        x = torch.arange(100, dtype=torch.float32)
        ep.send("v", 0, MessageMeta(KIND_DATA), [x])
        blocked_at = time.monotonic()
        try:
            ep.send("v", 0, MessageMeta(KIND_DATA), [x])
            return dict(error=None)
        except PeerDeadError as e:
            out = dict(error=str(e), peer=e.peer, blocked_at=blocked_at, detected_at=time.monotonic())
        for k in range(20):
            m = ep.recv("p", 1, timeout=10)
            ep.send("p", 1, m.meta, m.tensors)
            ep.release("p", 1)
        return out
    finally:
        ep.close()


def run_netns_peer(ns: str, role: str, host: str, port_q, results, backend: str = "tcp", dev: str = "") -> None:
    """One end of test_across_network_namespaces, inside network namespace `ns`: "a" hosts the
    store and sends, "b" echoes; puts (role, result dict or error text) on `results`. dev: the veth
    device UCX must use (nixl)."""
    try:
        results.put((role, netns_peer(ns, role, host, port_q, backend, dev)))
    except BaseException as e:
        results.put((role, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def netns_peer(ns: str, role: str, host: str, port_q, backend: str, dev: str) -> dict:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), f"setns({ns})")
    os.close(fd)
    if backend != "tcp":  # UCX lists devices from /sys/class/net: remount it for this namespace, as
        # `ip netns exec` does (in a mount namespace of our own)
        libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
        if (libc.unshare(0x00020000) != 0 or libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0  # CLONE_NEWNS; MS_REC|MS_PRIVATE
                or libc.umount2(b"/sys", 2) != 0 or libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0):  # MNT_DETACH
            raise OSError(ctypes.get_errno(), f"remounting /sys in {ns}")
    import torch.distributed as dist

    if role == "a":
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        port_q.put(store.port)
    else:
        store = dist.TCPStore("10.213.0.1", port_q.get(timeout=30), is_master=False)
    peer = "b" if role == "a" else "a"
    cfg = config(backend, host=host)
    os.environ["UCX_NET_DEVICES"] = dev  # (nixl) the veth, not lo
    ep = open_endpoint(cfg, store, "netns", role, [peer], NUM_SLOTS)
    try:
        if role == "b":
            return dict(echoed=run_echo_loop(ep, peer, 20))
        from m2n_comm._hello import open_record
        key = f"shuttle-m2n/netns/b/{cfg.backend}"
        peer_host = open_record(cfg.token, key, store.get(key))["host"]
        ok = 0
        for k in range(20):
            sent = make_tensors(k, torch.bfloat16, 5 * k)
            ep.send(peer, k % NUM_SLOTS, MessageMeta(KIND_DATA, step=k), sent)
            m = ep.recv(peer, k % NUM_SLOTS, timeout=10)
            ok += m.meta.step == k and all(map(same, m.tensors, sent))
            ep.release(peer, k % NUM_SLOTS)
        return dict(ok=ok, peer_host=peer_host)
    finally:
        ep.close()


def run_echo_loop(ep, peer: str, count: int) -> int:
    for k in range(count):
        m = ep.recv(peer, k % NUM_SLOTS, timeout=10)
        ep.send(peer, m.slot, m.meta, m.tensors)
        ep.release(peer, m.slot)
    return count


# ---- the worker pool --------------------------------------------------------------------------------
def worker_main(port: int, commands, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    while (cmd := commands.get()) is not None:
        name, kwargs = cmd
        try:
            results.put(("ok", globals()[name](store, **kwargs)))
        except BaseException as e:
            results.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Worker:
    def __init__(self, ctx, port: int):
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=worker_main, args=(port, self.commands, self.results), daemon=True)
        self.proc.start()

    def start(self, fn: str, **kwargs) -> None:
        self.commands.put((fn, kwargs))

    def result(self, timeout: float = RESULT_TIMEOUT_S):
        status, value = self.results.get(timeout=timeout)
        assert status == "ok", value
        return value


class Pool:
    """Long-lived workers (each costs a torch import to start); dead ones are replaced on get()."""

    def __init__(self, port: int, size: int):
        self.ctx, self.port = mp.get_context("spawn"), port
        self.workers = [Worker(self.ctx, port) for _ in range(size)]

    def get(self, n: int) -> list[Worker]:
        for j, w in enumerate(self.workers[:n]):
            if not w.proc.is_alive() or w.proc.exitcode is not None:
                w.proc.join(1)
                self.workers[j] = Worker(self.ctx, self.port)
        return self.workers[:n]

    def close(self) -> None:
        for w in self.workers:
            if w.proc.is_alive():
                w.commands.put(None)
        for w in self.workers:
            w.proc.join(5)
            if w.proc.is_alive():
                w.proc.kill()


@pytest.fixture(scope="module")
def store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture(scope="module")
def pool(store):
    p = Pool(store.port, 3)
    yield p
    p.close()


def session() -> str:
    return uuid.uuid4().hex[:10]


# ---- tests --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", params(*BACKENDS))
def test_every_size_roundtrip(backend, store, pool):
    """Messages of every token count up to a full slot, in several dtypes, echoed back intact; one
    byte over capacity raises ValueError and leaves the endpoint usable."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8]
    cases = []
    for dtype in dtypes:
        row = 64 * dtype.itemsize + 16   # bytes per token of x (T, 64) plus ids (T, 2) int64
        cases += [(dtype, t) for t in range(0, (SLOT_BYTES - SLOT_HEADER_BYTES) // row + 1)
                  if message_nbytes([t * 64 * dtype.itemsize, t * 16]) <= SLOT_BYTES]
    cap = SLOT_BYTES - SLOT_HEADER_BYTES
    specials = [[], [torch.tensor(3.5)], [torch.arange(24, dtype=torch.int32).view(2, 3, 4)],
                [torch.zeros(0, 64), torch.ones(3, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64),
                 torch.arange(12.0).view(3, 4).t()],  # non-contiguous: sent as its contiguous copy
                [torch.randint(0, 256, (cap,), dtype=torch.uint8)]]  # exactly a full slot
    sess, (w,) = session(), pool.get(1)
    w.start("run_echo", session=sess, backend=backend, me="b", peer="a", count=len(cases) + len(specials))
    ep = open_endpoint(config(backend), store, sess, "a", ["b"], NUM_SLOTS)
    try:
        with pytest.raises(ValueError, match=f"{SLOT_BYTES + 1} bytes.*slot_bytes={SLOT_BYTES}"):
            ep.send("b", 0, MessageMeta(KIND_DATA), [torch.zeros(cap + 1, dtype=torch.uint8)])
        msgs = [(MessageMeta(KIND_DATA, step=k, aux=t), make_tensors(k, dtype, t)) for k, (dtype, t) in enumerate(cases)]
        msgs += [(MessageMeta(KIND_DATA, step=-1, layer=2**40, mb=j, aux=-5), ts) for j, ts in enumerate(specials)]
        for k, (meta, sent) in enumerate(msgs):
            slot = k % NUM_SLOTS
            ep.send("b", slot, meta, sent)
            m = ep.recv("b", slot, timeout=10)
            assert (m.peer, m.slot, m.seq, m.meta) == ("b", slot, k // NUM_SLOTS + 1, meta)
            assert len(m.tensors) == len(sent) and all(map(same, m.tensors, sent)), (k, meta)
            ep.release("b", slot)
        assert max(t for _, t in cases) >= 60 and len(cases) > 500  # the sweep really reached full slots
        assert w.result() == len(msgs)
    finally:
        ep.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", params(*BACKENDS))
def test_many_messages_in_flight(backend, store, pool):
    """2 senders x 2 receivers x 4 slots, 400 messages: every receiver holds all 4 slots of a sender
    at once and releases them out of order; all content checked."""
    count, sess = 100, session()
    s0, s1, r1 = pool.get(3)
    for w, me in ((s0, "s0"), (s1, "s1")):
        w.start("run_sender", session=sess, backend=backend, me=me, receivers=["r0", "r1"], count=count)
    r1.start("run_receiver", session=sess, backend=backend, me="r1", senders=["s0", "s1"], count=count)
    mine = run_receiver(store, sess, backend, "r0", ["s0", "s1"], count)
    theirs = r1.result()
    assert s0.result() == s1.result() == count
    for got in (mine, theirs):
        assert got["received"] == 2 * count
        assert got["full_batches"] == 2 * count // NUM_SLOTS  # every batch held 4 messages at once


@pytest.mark.slow
@pytest.mark.parametrize("backend", params(*BACKENDS))
def test_wait_any_and_timeouts(backend, store, pool):
    sess, (w,) = session(), pool.get(1)
    w.start("run_wait_any_peer", session=sess, backend=backend)
    ep = open_endpoint(config(backend), store, sess, "a", ["b"], NUM_SLOTS)
    keys = [("b", 0), ("b", 1), ("b", 2)]
    try:
        t0 = time.monotonic()
        assert ep.wait_any(keys, timeout=0.2) is None
        assert 0.2 <= time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout):
            ep.recv("b", 1, timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 1.0
        for expect in (2, 0):
            ep.send("b", 0, MessageMeta(KIND_DATA), [])  # "go"
            assert ep.wait_any(keys, timeout=10) == ("b", expect)
            assert ep.wait_any(keys, timeout=0) == ("b", expect)  # wait_any does not take the message
            assert [ep.poll("b", s) for s in range(NUM_SLOTS)] == [s == expect for s in range(NUM_SLOTS)]
            m = ep.recv("b", expect, timeout=0)
            assert m.meta.aux == expect and same(m.tensors[0], torch.full((3,), expect, dtype=torch.int32))
            with pytest.raises(ValueError, match="release"):
                ep.recv("b", expect)
            ep.release("b", expect)
        check_argument_errors(ep)
        ep.send("b", 1, MessageMeta(KIND_DATA), [])  # "bye"
        assert w.result() is True
    finally:
        ep.close()
        ep.close()  # idempotent


def check_argument_errors(ep) -> None:
    with pytest.raises(ValueError, match="unknown M2N peer 'zz'"):
        ep.recv("zz", 0)
    for bad in (-1, NUM_SLOTS, 1.0):
        with pytest.raises(ValueError, match="slot must be"):
            ep.poll("b", bad)
    with pytest.raises(ValueError, match="no received message"):
        ep.release("b", 3)
    with pytest.raises(ValueError, match="at least one"):
        ep.wait_any([], timeout=0)
    with pytest.raises(ValueError, match="dtype torch.bool"):
        ep.send("b", 0, MessageMeta(KIND_DATA), [torch.zeros(2, dtype=torch.bool)])
    with pytest.raises(ValueError, match="4 dims"):
        ep.send("b", 0, MessageMeta(KIND_DATA), [torch.zeros(1, 1, 1, 1)])
    with pytest.raises(ValueError, match="at most 4 tensors"):
        ep.send("b", 0, MessageMeta(KIND_DATA), [torch.zeros(1)] * 5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", params(*BACKENDS))
def test_killed_peer_reported_and_survivors_go_on(backend, store, pool):
    """SIGKILL "v" while "p" (here) blocks in recv from it and "a" blocks in send waiting for its
    release: both get PeerDeadError naming "v" within 5 s, then "p" and "a" still talk."""
    sess = session()
    a, v = pool.get(2)
    v.start("run_idle", session=sess, backend=backend, me="v", peers=["p", "a"])
    a.start("run_survivor", session=sess, backend=backend)
    ep = open_endpoint(config(backend), store, sess, "p", ["a", "v"], NUM_SLOTS)
    try:
        killed = {}

        def kill() -> None:
            killed["at"] = time.monotonic()
            os.kill(v.proc.pid, signal.SIGKILL)

        threading.Timer(0.5, kill).start()
        with pytest.raises(PeerDeadError) as err:
            ep.recv("v", 0)
        assert err.value.peer == "v" and "'v'" in str(err.value)
        assert 0 <= time.monotonic() - killed["at"] < 5.0
        for k in range(20):
            sent = make_tensors(k, torch.float16, k)
            ep.send("a", 1, MessageMeta(KIND_DATA, step=k), sent)
            m = ep.recv("a", 1, timeout=10)
            assert m.meta.step == k and all(map(same, m.tensors, sent))
            ep.release("a", 1)
        got = a.result()
        assert got["peer"] == "v" and "'v'" in got["error"]
        assert got["blocked_at"] < killed["at"] <= got["detected_at"] < killed["at"] + 5.0
        with pytest.raises(PeerDeadError):
            ep.send("v", 1, MessageMeta(KIND_DATA), [])
    finally:
        ep.close()
        v.proc.kill()
        v.proc.join(5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", params(*BACKENDS))
def test_stopped_peer_reported_after_dead_after_s(backend, store, pool):
    sess, (w,) = session(), pool.get(1)
    w.start("run_idle", session=sess, backend=backend, me="s", peers=["p"])
    cfg = config(backend)
    ep = open_endpoint(cfg, store, sess, "p", ["s"], NUM_SLOTS)
    try:
        time.sleep(3 * cfg.heartbeat_s)
        ep.check_alive("s")  # heartbeats keep an idle peer alive
        os.kill(w.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            with pytest.raises(PeerDeadError, match="'s'.*(heartbeat|heard)"):
                ep.recv("s", 0)
            assert cfg.dead_after_s - 2 * cfg.heartbeat_s <= time.monotonic() - t0 < cfg.dead_after_s + 2.0
        finally:
            os.kill(w.proc.pid, signal.SIGCONT)
            w.proc.kill()
            w.proc.join(5)  # so that the pool sees it dead and replaces it
    finally:
        ep.close()


def test_config_and_constructor_errors(store):
    with pytest.raises(ValueError, match="backend"):
        TransportConfig(backend="ib")
    with pytest.raises(ValueError, match="slot_bytes"):
        TransportConfig(slot_bytes=100)
    with pytest.raises(ValueError, match="heartbeat_s"):
        TransportConfig(heartbeat_s=2.0, dead_after_s=1.0)
    for backend in BACKENDS if not _nixl_missing() else ["shm", "tcp"]:
        with pytest.raises(ValueError, match="peers must be distinct"):
            open_endpoint(config(backend), store, session(), "a", ["a", "b"], 2)
        with pytest.raises(ValueError, match="num_slots"):
            open_endpoint(config(backend), store, session(), "a", ["b"], 0)
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout, match=r"\['nobody'\]"):
            open_endpoint(config(backend, connect_timeout_s=0.3), store, session(), "a", ["nobody"], 2)
        assert time.monotonic() - t0 < 3.0


def test_both_ends_send_more_than_the_socket_buffers(store, pool):
    """tcp: 32 MiB each way at once, before either end receives. A send blocked on a full socket
    keeps reading its own inbound one, so neither end waits for ever on the other (shm has no
    socket buffers to outgrow)."""
    backend = "tcp"
    sess, (w,) = session(), pool.get(1)
    w.start("run_flood", session=sess, backend=backend)
    ep = open_endpoint(config(backend, slot_bytes=FLOOD_SLOT_BYTES), store, sess, "a", ["b"], NUM_SLOTS)
    try:
        assert flood(ep, "b", 1) == NUM_SLOTS
        assert w.result() == NUM_SLOTS
    finally:
        ep.close()


@pytest.mark.parametrize("backend", params("tcp", "nixl-tcp"))
def test_refuses_peers_without_the_token(backend, store, pool, caplog):
    """Strangers reach "a"'s listener (tcp: the data plane; nixl: the metadata exchange) before the
    real "b", each sending all it has at once: the old clear-token HELLO, a HELLO claiming to be "b"
    whose MAC is made without the token (and without "a"'s nonce), and one announcing 4 GiB. Each is
    dropped and logged with its address; the real "b" (right token) still gets in and the two talk
    (tests/test_handshake.py covers the handshake itself)."""
    import json
    import socket

    from m2n_comm._hello import DIALER, LEN, MAGIC, _mac, hello_body, open_record

    sess, (w,) = session(), pool.get(1)
    token = "s3cret-" + sess
    made = {}
    t = threading.Thread(target=lambda: made.setdefault("ep", open_endpoint(
        config(backend, token=token), store, sess, "a", ["b"], NUM_SLOTS)))
    with caplog.at_level("WARNING", logger="shuttle.m2n"):
        t.start()
        key, deadline = f"shuttle-m2n/{sess}/a/{backend.split('-')[0]}", time.monotonic() + 30
        while not store.check([key]) and time.monotonic() < deadline:  # get() would block the store
            time.sleep(0.01)  # client, which the thread's open_endpoint shares
        info = open_record(token, key, store.get(key))
        old = json.dumps(dict(name="b", num_slots=NUM_SLOTS, slot_bytes=SLOT_BYTES, token="guess")).encode()
        body = hello_body("b", num_slots=NUM_SLOTS, slot_bytes=SLOT_BYTES)
        blind = _mac("guess", DIALER, bytes(16), bytes(16), body)
        strangers = []
        for data in (LEN.pack(len(old)) + old, MAGIC + bytes(16) + LEN.pack(len(body)) + body + blind,
                     MAGIC + bytes(16) + b"\xff" * 4):
            strangers.append(socket.create_connection((info["host"], info["port"])))
            strangers[-1].sendall(data)
        w.start("run_echo", session=sess, backend=backend, me="b", peer="a", count=3, token=token)
        t.join(30)
    for s in strangers:  # dropped: EOF (or a reset)
        s.settimeout(10)
        try:
            while s.recv(4096):  # (the PROOF "a" answered an OPEN with)
                pass
        except ConnectionResetError:
            pass
    ep = made["ep"]
    try:
        for k in range(3):
            sent = make_tensors(k, torch.float32, k + 1)
            ep.send("b", 0, MessageMeta(KIND_DATA, step=k), sent)
            m = ep.recv("b", 0, timeout=10)
            assert m.meta.step == k and all(map(same, m.tensors, sent))
            ep.release("b", 0)
        assert w.result() == 3
    finally:
        ep.close()
    refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refused) == 3, refused
    assert "not a Shuttle HELLO" in refused[0] and "127.0.0.1:" in refused[0]
    assert "wrong deployment token (claimed to be 'b')" in refused[1]
    assert "HELLO of 4294967295 bytes" in refused[2]
    for s in strangers:
        s.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", params("tcp", "nixl-tcp"))
def test_across_network_namespaces(backend):
    """Two processes in two network namespaces joined by a veth pair talk over 10.213.0.0/24 (nixl:
    UCX over tcp on the veth devices)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    ns, veth = [f"m2n-{tag}-a", f"m2n-{tag}-b"], [f"m2n{tag}a", f"m2n{tag}b"]
    setup = [["ip", "netns", "add", ns[0]], ["ip", "netns", "add", ns[1]],
             ["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]],
             *[c for j in (0, 1) for c in (
                 ["ip", "link", "set", veth[j], "netns", ns[j]],
                 ["ip", "-n", ns[j], "addr", "add", f"10.213.0.{j + 1}/24", "dev", veth[j]],
                 ["ip", "-n", ns[j], "link", "set", veth[j], "up"],
                 ["ip", "-n", ns[j], "link", "set", "lo", "up"])]]
    try:
        for cmd in setup:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")
        ctx = mp.get_context("spawn")
        port_q, results = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=run_netns_peer, args=(ns[j], role, f"10.213.0.{j + 1}", port_q, results,
                                                          backend, veth[j])) for j, role in enumerate("ab")]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=RESULT_TIMEOUT_S) for _ in procs)
        for p in procs:
            p.join(10)
        assert got == dict(a=dict(ok=20, peer_host="10.213.0.2"), b=dict(echoed=20))
    finally:
        for p in locals().get("procs", []):
            if p.is_alive():
                p.kill()
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_missing_nixl_and_ray_say_how_to_install(monkeypatch):
    """Without NIXL, --transport nixl names the install command; without Ray, --launcher ray its extra;
    both before any worker starts (PoolEngine checks before it reads the model)."""
    from attention_nodes.config import EngineConfig, ParallelConfig
    from pools.engine import PoolEngine

    for name in ("nixl_cu12", "nixl_cu13", "nixl", "ray"):
        monkeypatch.setitem(__import__("sys").modules, name, None)  # import raises ImportError
    with pytest.raises(ImportError, match=r"pip install --no-deps nixl-cu12==1\.5\.1.*NIXL=0"):
        open_endpoint(config("nixl-tcp"), None, session(), "a", ["b"], 2)
    with pytest.raises(RuntimeError, match=r"--transport nixl: .*pip install --no-deps nixl-cu12"):
        PoolEngine(EngineConfig("no-such-model", parallel=ParallelConfig(False, transport="nixl")), {0})
    with pytest.raises(RuntimeError, match=r"--launcher ray needs Ray: pip install 'shuttle-moe\[ray\]'"):
        PoolEngine(EngineConfig("no-such-model", parallel=ParallelConfig(False, launcher="ray")), {0})
