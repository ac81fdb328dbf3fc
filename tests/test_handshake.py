"""Who may connect (m2n_comm/_hello.py): the challenge-response HELLO of the tcp data plane, nixl's
metadata exchange and the control plane, and the signed store records. Everything runs in this
process over loopback sockets and a real TCPStore: the token never crosses a socket, strangers and
fake listeners are refused on each side, and the store holds no token and no unsigned record."""
import json
import socket
import threading
import time
import uuid

import pytest
from torch.distributed import TCPStore

from attention_nodes.config import CacheConfig, EngineConfig, ParallelConfig
from m2n_comm import _hello
from m2n_comm._common import store_key
from m2n_comm._hello import (MAGIC, OPEN_BYTES, PROOF_BYTES, Dialing, HelloGate, HelloRefused, Listening,
                             dial_hello, hello_body, open_record, sign_record)
from m2n_comm.endpoints import open_endpoint
from m2n_comm.placement import ExpertPlacement, Placement
from m2n_comm.transport import KIND_DATA, SLOT_HEADER_BYTES, MessageMeta, TransportConfig, TransportTimeout
from pools import control
from pools.engine import PoolEngine
from pools.roles import DEPLOYMENT_KEY, front_token, read_deployment, run_role

TOKEN = "s3cret-" + uuid.uuid4().hex
SLOT_BYTES = SLOT_HEADER_BYTES + 4096


@pytest.fixture(scope="module")
def master():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def client(master) -> TCPStore:
    return TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)


class Recording:
    """A store that remembers every key and value written through it."""

    def __init__(self, store):
        self.store, self.written = store, {}

    def set(self, key, value):
        self.written[key] = value if isinstance(value, bytes) else str(value).encode()
        self.store.set(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.fixture
def wire_bytes(monkeypatch):
    """Every byte this process sends or receives on a Python socket while the test runs."""
    seen, real = [], {n: getattr(socket.socket, n) for n in ("send", "sendall", "recv")}

    def send(self, data, *a):
        n = real["send"](self, data, *a)
        seen.append(bytes(data[:n]))
        return n

    def sendall(self, data, *a):
        seen.append(bytes(data))
        return real["sendall"](self, data, *a)

    def recv(self, n, *a):
        data = real["recv"](self, n, *a)
        seen.append(data)
        return data

    for name, fn in (("send", send), ("sendall", sendall), ("recv", recv)):
        monkeypatch.setattr(socket.socket, name, fn)
    return seen


def tcp_config(token: str, **kw) -> TransportConfig:
    return TransportConfig("tcp", SLOT_BYTES, heartbeat_s=0.1, dead_after_s=2.0, connect_timeout_s=20.0,
                           token=token, **kw)


def open_pair(master, sess: str, token_a: str = TOKEN, token_b: str = TOKEN, stores=None):
    """Endpoints "a" and "b" opened at once (threads); returns {name: endpoint or the exception}."""
    out = {}

    def run(me, peer, token, store):
        try:
            out[me] = open_endpoint(tcp_config(token), store, sess, me, [peer], 2)
        except Exception as e:
            out[me] = e

    stores = stores or {"a": client(master), "b": client(master)}
    threads = [threading.Thread(target=run, args=(me, peer, tok, stores[me]))
               for me, peer, tok in (("a", "b", token_a), ("b", "a", token_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def echo_once(a, b) -> None:
    import torch

    x = torch.arange(12, dtype=torch.float32)
    a.send("b", 0, MessageMeta(KIND_DATA, step=1), [x])
    m = b.recv("a", 0, timeout=10)
    assert m.meta.step == 1 and torch.equal(m.tensors[0], x)
    b.release("a", 0)


def dial_raw(addr, token: str, body: bytes, sign_anyway: bool) -> socket.socket:
    """A stranger's dialer: OPEN, read PROOF, then (sign_anyway) a HELLO whose MAC uses `token`
    whatever the listener proved."""
    s = socket.create_connection(addr, timeout=10)
    d = Dialing(token, body)
    s.sendall(d.opening)
    proof = recv_exactly(s, PROOF_BYTES)
    if sign_anyway:
        mac = _hello._mac(token, _hello.DIALER, proof[:16], d.nonce, body)
        s.sendall(_hello.LEN.pack(len(body)) + body + mac)
    return s


def fake_listener(reply: bytes | None):
    """A listener that does not know the token: it records what a dialer sends and answers the
    OPEN with `reply` (None: a proof made with another token; a short reply, then it hangs up)."""
    srv = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def serve():
        c, _ = srv.accept()
        c.settimeout(5)
        try:
            while len(got) < OPEN_BYTES:
                got.extend(c.recv(OPEN_BYTES - len(got)))
            answer, _ = Listening("not-the-token", 4096).feed(bytes(got))
            c.sendall(answer if reply is None else reply)
            while len(answer if reply is None else reply) == PROOF_BYTES and (data := c.recv(65536)):
                got.extend(data)
        except OSError:
            pass
        c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, got, t


def recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk, "closed"
        data += chunk
    return data


# ---- the token never crosses the wire -----------------------------------------------------------------
def test_handshake_bytes_hold_no_token(master, wire_bytes):
    """Both planes' handshakes, both directions, as this process's sockets sent and received them:
    the HELLO is there, the token (as text, hex or bytes) is not."""
    sess = uuid.uuid4().hex[:10]
    eps = open_pair(master, sess)
    try:
        echo_once(eps["a"], eps["b"])
    finally:
        for ep in eps.values():
            ep.close()
    with socket.create_server(("127.0.0.1", 0)) as srv:
        t = threading.Thread(target=lambda: dial_hello(socket.create_connection(srv.getsockname()), TOKEN,
                                                       hello_body("a0"), 10))
        t.start()
        conn, addr = srv.accept()
        assert control.admitted(conn, addr, TOKEN)
        t.join(10)
        conn.close()
    captured = b"".join(wire_bytes)
    assert captured.count(MAGIC) >= 3  # a -> b, b -> a (the data plane) and a0 -> the front (control)
    for form in (TOKEN.encode(), TOKEN.encode().hex().encode(), TOKEN.encode()[7:]):
        assert form not in captured


# ---- wrong tokens and strangers --------------------------------------------------------------------------
def test_tcp_data_plane_refuses_a_wrong_token_and_admits_the_right_one(master, caplog):
    """Strangers reach endpoint "a"'s listener before its peer "b" (played here with HelloGate, the
    code tcp runs): one with the wrong token who signs its HELLO anyway, one with the wrong token
    that checks "a"'s proof (and so stops there), one speaking the old clear-token HELLO, one that
    announces 4 GiB. Each is refused and logged with its address; then "b" gets in."""
    sess, out = uuid.uuid4().hex[:10], {}
    lb = socket.create_server(("127.0.0.1", 0))
    lb.setblocking(False)
    _hello.publish_signed(master, sess, "b", "tcp", dict(host="127.0.0.1", port=lb.getsockname()[1], num_slots=2,
                                                         slot_bytes=SLOT_BYTES, peers=["a"]), TOKEN)
    t = threading.Thread(target=lambda: out.update(a=open_endpoint(tcp_config(TOKEN), client(master), sess, "a",
                                                                   ["b"], 2)))
    with caplog.at_level("WARNING", logger="shuttle.m2n"):
        t.start()
        key = store_key(sess, "a", "tcp")
        deadline = time.monotonic() + 20
        while not master.check([key]) and time.monotonic() < deadline:
            time.sleep(0.01)
        info = open_record(TOKEN, key, master.get(key))
        addr = (info["host"], info["port"])
        body = hello_body("b", num_slots=2, slot_bytes=SLOT_BYTES)
        checker = socket.create_connection(addr, timeout=10)
        d = Dialing("guess", body)
        checker.sendall(d.opening)
        with pytest.raises(HelloRefused, match="did not prove the deployment token"):
            d.feed(recv_exactly(checker, PROOF_BYTES))
        checker.close()
        strangers = [dial_raw(addr, "guess", body, sign_anyway=True)]
        old = json.dumps(dict(name="b", num_slots=2, slot_bytes=SLOT_BYTES, token="guess")).encode()
        strangers.append(socket.create_connection(addr))
        strangers[-1].sendall(_hello.LEN.pack(len(old)) + old)
        strangers.append(socket.create_connection(addr, timeout=10))
        strangers[-1].sendall(MAGIC + bytes(16))
        recv_exactly(strangers[-1], PROOF_BYTES)
        strangers[-1].sendall(b"\xff" * 4)
        for s in strangers:  # dropped: EOF (or a reset)
            s.settimeout(10)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
            s.close()
        to_a = socket.create_connection(addr)
        to_a.setblocking(False)
        admitted = HelloGate(lb, "b", sess, ["a"], 2, SLOT_BYTES, TOKEN, 4096).meet([to_a], body,
                                                                                  time.monotonic() + 20)
        t.join(20)
    try:
        assert admitted[0].hello["name"] == "a" and "a" in out
    finally:
        out.get("a") and out["a"].close()
        to_a.close()
        lb.close()
        for a in admitted.values():
            a.sock.close()
    refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refused) == 4, refused
    assert "closed before HELLO" in refused[0] and "127.0.0.1:" in refused[0]
    assert "wrong deployment token (claimed to be 'b')" in refused[1]
    assert "not a Shuttle HELLO" in refused[2]
    assert "HELLO of 4294967295 bytes" in refused[3]


def test_control_plane_admits_only_the_token(caplog):
    """pools.control.admitted, the front's gate: a worker that proves the token passes; a worker with
    another token stops at the front's proof (the front sees it leave), a stranger that signs anyway,
    a control message before any HELLO, an oversized HELLO and silence are refused and logged."""
    from attention_nodes import messages as wire

    control.HELLO_TIMEOUT_S, saved = 0.5, control.HELLO_TIMEOUT_S
    results = {}

    def worker(addr, token, name):
        try:
            with socket.create_connection(addr) as s:
                dial_hello(s, token, hello_body(name), 5)
                results[name] = "in"
                s.recv(1)
        except HelloRefused as e:
            results[name] = str(e)

    try:
        with socket.create_server(("127.0.0.1", 0)) as srv, caplog.at_level("WARNING", logger="shuttle"):
            addr = srv.getsockname()
            cases = []
            for name, token in (("a0", TOKEN), ("a1", "tik")):
                t = threading.Thread(target=worker, args=(addr, token, name))
                t.start()
                conn, caddr = srv.accept()
                cases.append(control.admitted(conn, caddr, TOKEN))
                conn.close()
                t.join(10)
            raws = [lambda: dial_raw(addr, "guess", hello_body("a2"), sign_anyway=True),
                    lambda: _sent(addr, wire.encode(wire.Ready(0, 64))),
                    lambda: _sent(addr, MAGIC + bytes(16) + _hello.LEN.pack(1 << 20)),
                    lambda: _sent(addr, b"")]
            for make in raws:
                t = threading.Thread(target=make)
                t.start()
                conn, caddr = srv.accept()
                cases.append(control.admitted(conn, caddr, TOKEN))
                t.join(10)
    finally:
        control.HELLO_TIMEOUT_S = saved
    assert cases == [True, False, False, False, False, False]
    assert results["a0"] == "in" and "did not prove the deployment token" in results["a1"]
    refused = [r.getMessage() for r in caplog.records if "control listener refused" in r.getMessage()]
    assert len(refused) == 5, refused
    assert "closed before HELLO" in refused[0]
    assert "wrong deployment token (claimed to be 'a2')" in refused[1]
    assert "not a Shuttle HELLO" in refused[2]
    assert "HELLO of 1048576 bytes" in refused[3]
    assert "timed out" in refused[4]


def _sent(addr, data: bytes) -> None:
    s = socket.create_connection(addr)
    s.sendall(data)
    s.settimeout(5)
    try:
        while s.recv(4096):
            pass
    except OSError:
        pass
    s.close()


def test_shared_gate_with_a_nixl_body_and_a_wrong_token():
    """HelloGate.meet, which nixl's metadata exchange runs as tcp's does: two gates with the same
    token admit each other and deliver the backend fields; with different tokens each dialer stops
    at the other's proof (HelloRefused) and neither body is admitted."""
    def pair(token_a, token_b):
        lis = {n: socket.create_server(("127.0.0.1", 0)) for n in "ab"}
        out = {}

        def run(me, peer, token):
            gate = HelloGate(lis[me], me, "s", [peer], 2, SLOT_BYTES, token, 1 << 20)
            dial = socket.create_connection(lis[peer].getsockname())
            dial.setblocking(False)
            body = hello_body(me, num_slots=2, slot_bytes=SLOT_BYTES, rx=1234, metadata="bWQ=")
            try:
                out[me] = gate.meet([dial], body, time.monotonic() + 3)
            except Exception as e:
                out[me] = e
            finally:
                dial.close()
        for s in lis.values():
            s.setblocking(False)
        ts = [threading.Thread(target=run, args=args) for args in (("a", "b", token_a), ("b", "a", token_b))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        for s in lis.values():
            s.close()
        return out

    ok = pair(TOKEN, TOKEN)
    assert ok["a"][0].hello == {"name": "b", "num_slots": 2, "slot_bytes": SLOT_BYTES, "rx": 1234,
                                "metadata": "bWQ="}
    assert ok["b"][0].hello["name"] == "a"
    bad = pair(TOKEN, "other")  # the first to fail closes its sockets: the other may see that first
    assert all(isinstance(bad[me], HelloRefused) for me in "ab"), bad
    assert any("did not prove the deployment token" in str(bad[me]) for me in "ab"), bad


# ---- fake listeners ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("reply", [None, bytes(PROOF_BYTES), b"x" * 10])
def test_a_fake_listener_is_found_out_before_the_body_is_sent(reply):
    """A listener that does not know the token (a proof made with another one, zeros, or a short
    answer before it hangs up) gets the dialer's OPEN and nothing else: the dialer raises
    HelloRefused, on the control plane and on the data plane's gate alike."""
    for plane in ("control", "m2n"):
        srv, got, t = fake_listener(reply)
        body = hello_body("a0", num_slots=2, slot_bytes=SLOT_BYTES, metadata="SECRET-METADATA")
        with pytest.raises(HelloRefused, match="did not prove the deployment token|closed the connection"):
            if plane == "control":
                with socket.create_connection(srv.getsockname()) as s:
                    dial_hello(s, TOKEN, body, 5)
            else:
                with socket.create_server(("127.0.0.1", 0)) as lis:
                    gate = HelloGate(lis, "a0", "s", ["e0"], 2, SLOT_BYTES, TOKEN, 4096)
                    dial = socket.create_connection(srv.getsockname())
                    dial.setblocking(False)
                    try:
                        gate.meet([dial], body, time.monotonic() + 5)
                    finally:
                        dial.close()
        t.join(5)
        srv.close()
        assert bytes(got[:len(MAGIC)]) == MAGIC and len(got) == OPEN_BYTES, got  # no body, no name


# ---- the store ------------------------------------------------------------------------------------------
def _front(store) -> PoolEngine:
    """A PoolEngine with just what _publish reads."""
    eng = object.__new__(PoolEngine)
    eng.cfg = EngineConfig("no-such-model", cache=CacheConfig(num_blocks=64), parallel=ParallelConfig(False))
    eng.eos_token_ids, eng.session, eng._store = {0}, "shuttle-test", store
    eng.placement = ExpertPlacement.uniform(Placement.balanced(4, 1), [0])
    eng.transport = tcp_config(TOKEN)
    eng._listener = socket.create_server(("127.0.0.1", 0))
    return eng


def test_the_store_holds_no_token_and_forged_records_are_refused(master, caplog):
    """After a front publishes the deployment and two tcp endpoints their addresses, no value in the
    store holds the token; a worker reads the deployment with its token, refuses it with another
    token, and refuses a record someone rewrote without the token (logged naming the key)."""
    front = Recording(client(master))
    eng = _front(front)
    eng._publish("127.0.0.1:1")
    eng._listener.close()
    sess = uuid.uuid4().hex[:10]
    stores = {"a": Recording(client(master)), "b": Recording(client(master))}
    eps = open_pair(master, sess, stores=stores)
    for ep in eps.values():
        ep.close()
    written = {**front.written, **stores["a"].written, **stores["b"].written}
    assert DEPLOYMENT_KEY in written and store_key(sess, "a", "tcp") in written
    for key, value in written.items():
        assert TOKEN.encode() not in value and TOKEN.encode()[7:] not in value, key
    d = read_deployment(master, TOKEN, "h:1")
    assert d["session"] == "shuttle-test" and "token" not in d["transport"]
    with pytest.raises(ValueError, match="not signed with this worker's SHUTTLE_DEPLOYMENT_TOKEN"):
        read_deployment(master, "other", "h:1")
    forged = dict(d, control=["10.9.9.9", 1])
    genuine, endpoint = master.get(DEPLOYMENT_KEY), master.get(store_key(sess, "a", "tcp"))
    caplog.clear()
    with caplog.at_level("WARNING", logger="shuttle"):
        # unsigned; signed with another token; the genuine MAC over another body; a genuine record
        # of another key moved here
        for value in (json.dumps(forged), sign_record("guess", DEPLOYMENT_KEY, forged),
                      genuine[:_hello.VALUE_AT] + json.dumps(forged).encode(), endpoint):
            master.set(DEPLOYMENT_KEY, value)
            with pytest.raises(ValueError, match="refused"):
                read_deployment(master, TOKEN, "h:1")
    assert caplog.text.count(f"refused the store value {DEPLOYMENT_KEY!r}") == 4


def test_a_forged_endpoint_record_is_refused_and_never_dialed(master, caplog):
    """Someone writes "b"'s tcp record (unsigned, or signed with another token) pointing at their own
    listener: "a" logs the key, never connects there, and times out naming the refused key."""
    sess = uuid.uuid4().hex[:10]
    trap = socket.create_server(("127.0.0.1", 0))
    trap.setblocking(False)
    key = store_key(sess, "b", "tcp")
    info = dict(host="127.0.0.1", port=trap.getsockname()[1], num_slots=2, slot_bytes=SLOT_BYTES, peers=["a"])
    cfg = TransportConfig("tcp", SLOT_BYTES, heartbeat_s=0.1, dead_after_s=2.0, connect_timeout_s=1.0, token=TOKEN)
    for value in (json.dumps(info), sign_record("guess", key, info)):
        master.set(key, value)
        caplog.clear()
        with caplog.at_level("WARNING", logger="shuttle.m2n"), \
                pytest.raises(TransportTimeout, match="refused records without a valid MAC"):
            open_endpoint(cfg, client(master), sess, "a", ["b"], 2)
        assert f"refused the store value {key!r}" in caplog.text
        with pytest.raises(BlockingIOError):
            trap.accept()
    trap.close()


# ---- who needs the token ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rendezvous", ["127.0.0.1:29600", "10.1.2.3:29600"])
def test_a_front_without_a_token_generates_and_logs_one(rendezvous, caplog):
    """With a rendezvous (loopback or not: the chosen rule is to print, not to refuse) a front
    given no token generates 128 bits and logs once the line for the workers; a given token is used
    as it is and never logged; without a rendezvous nobody else needs it, so nothing is logged."""
    with caplog.at_level("WARNING", logger="shuttle"):
        token = front_token(None, rendezvous)
    assert len(token) == 32 and int(token, 16) >= 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"export SHUTTLE_DEPLOYMENT_TOKEN={token}" in lines[0] and rendezvous in lines[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="shuttle"):
        assert front_token("given", rendezvous) == "given"
        assert len(front_token(None, None)) == 32
    assert caplog.records == []


def test_a_role_worker_without_a_token_stops_at_once():
    """No SHUTTLE_DEPLOYMENT_TOKEN: the worker says what to set before it reaches the store (the
    address here has no store: reaching it would wait FRONT_WAIT_S)."""
    with pytest.raises(ValueError, match="set SHUTTLE_DEPLOYMENT_TOKEN on this worker"):
        run_role("expert", "127.0.0.1:1", token=None)
