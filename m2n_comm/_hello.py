"""Who may connect: the HELLO handshake that every M2N connection (tcp data plane, nixl metadata
exchange) and every control connection (attention worker -> front) starts with, and the values
every party writes in the store. Both prove the deployment token without sending it.

Handshake, D dialing L (nD, nL: 16 fresh random bytes each; MAC: HMAC-SHA256 keyed by the token):
    D -> L  OPEN    MAGIC (8 bytes) + nD
    L -> D  PROOF   nL + MAC("shuttle hello listener\\0" | nL | nD)                     48 bytes
    D -> L  HELLO   u32 length + JSON body + MAC("shuttle hello dialer\\0" | nL | nD | body)
D checks L's proof before it sends its body, so a listener that does not know the token (a fake
endpoint) learns a nonce and nothing else, and D raises HelloRefused. L admits D only with a valid
MAC over D's body. Fresh nonces on both sides make a recorded handshake worthless. A stranger is
refused and logged with its address; a connection silent for HELLO_WAIT_S is dropped; a body over
the listener's max_body is refused. Reads never go past the HELLO, so what follows it (DATA
frames, control messages) stays in the socket for its reader. An M2N HELLO body is {name,
num_slots, slot_bytes, ...backend fields}; a control one is {name}. A peer with the right token
but the wrong name or slot geometry is a configuration error (ValueError).

The store (`SignedStore`): whoever reaches the TCPStore's port may read and write it, so every value
a party acts on carries a MAC by the token, bound to its key: "hmac-sha256:" + 64 hex digits of
MAC("shuttle store value\\0" | u32 len(key) | key | value) + "\\n" + value (any bytes). Set signs;
check and get accept only a value signed under its own key (keys name the session, and the epoch
or placement version where a value is written more than once), so a value cannot be moved to
another key; one without a valid MAC is as if absent, refused and logged once naming the key.
Records (`sign_record`, `open_record`: endpoints, the deployment) are such values holding JSON.
"""
import hashlib
import hmac
import json
import logging
import secrets
import select
import socket
import struct
import time
from datetime import timedelta
from typing import Callable, Sequence

from torch.distributed import DistStoreError

from m2n_comm._common import STORE_POLL_S, check_peer_info, store_key
from m2n_comm.transport import TransportTimeout

log = logging.getLogger("shuttle.m2n")

LEN = struct.Struct("<I")
HELLO_WAIT_S = 5.0  # a connection that has not completed its HELLO within this is dropped
MAGIC = b"shuttle\x01"  # Shuttle's HELLO, version 1
NONCE_BYTES, MAC_BYTES = 16, 32
OPEN_BYTES, PROOF_BYTES = len(MAGIC) + NONCE_BYTES, NONCE_BYTES + MAC_BYTES
LISTENER, DIALER, VALUE = b"shuttle hello listener\0", b"shuttle hello dialer\0", b"shuttle store value\0"
SIGNED = b"hmac-sha256:"  # a signed store value: SIGNED + hex MAC + b"\n" + the value
VALUE_AT = len(SIGNED) + 2 * MAC_BYTES + 1


class HelloRefused(ConnectionError):
    """A handshake that failed: the other side does not know the token, or speaks something else."""


def _mac(token: str, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(token.encode(), label + b"".join(parts), hashlib.sha256).digest()


def hello_body(name: str, **fields: object) -> bytes:
    """A HELLO body: JSON {name, **fields} (JSON-serialisable); no token."""
    return json.dumps(dict(name=name, **fields)).encode()


def _claimed(body: bytes) -> str:
    try:
        return f" (claimed to be {json.loads(body)['name']!r})"
    except (ValueError, KeyError, TypeError):
        return ""


class Dialing:
    """The dialer's side of one handshake: send `opening`, then feed the listener's bytes (read at
    most need() at a time) until `feed` returns the HELLO frame to send."""

    def __init__(self, token: str, body: bytes):
        self.token, self.body, self.nonce, self.got = token, body, secrets.token_bytes(NONCE_BYTES), bytearray()
        self.opening = MAGIC + self.nonce

    def need(self) -> int:
        return PROOF_BYTES - len(self.got)

    def feed(self, data: bytes) -> bytes | None:
        """The HELLO frame once the listener proved the token, None while its proof is incomplete;
        HelloRefused when the proof is wrong."""
        self.got += data
        if len(self.got) < PROOF_BYTES:
            return None
        theirs, proof = bytes(self.got[:NONCE_BYTES]), bytes(self.got[NONCE_BYTES:PROOF_BYTES])
        if not hmac.compare_digest(proof, _mac(self.token, LISTENER, theirs, self.nonce)):
            raise HelloRefused("it did not prove the deployment token (a stranger's listener, or a different "
                               "SHUTTLE_DEPLOYMENT_TOKEN)")
        return LEN.pack(len(self.body)) + self.body + _mac(self.token, DIALER, theirs, self.nonce, self.body)


class Listening:
    """The listener's side of one handshake: feed the dialer's bytes (read at most need() at a
    time); `feed` returns what to send back and, once complete and signed, the dialer's body."""

    def __init__(self, token: str, max_body: int):
        self.token, self.max_body, self.nonce = token, max_body, secrets.token_bytes(NONCE_BYTES)
        self.theirs: bytes | None = None
        self.got = bytearray()

    def need(self) -> int:
        if self.theirs is None:
            return OPEN_BYTES - len(self.got)
        if len(self.got) < LEN.size:
            return LEN.size - len(self.got)
        return LEN.size + LEN.unpack_from(self.got)[0] + MAC_BYTES - len(self.got)

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]:
        """(bytes to send the dialer, its body or None); HelloRefused for a stranger."""
        self.got += data
        if self.theirs is None:
            if not MAGIC.startswith(bytes(self.got[:len(MAGIC)])):
                raise HelloRefused("not a Shuttle HELLO")
            if len(self.got) < OPEN_BYTES:
                return b"", None
            self.theirs, self.got = bytes(self.got[len(MAGIC):OPEN_BYTES]), bytearray()
            return self.nonce + _mac(self.token, LISTENER, self.nonce, self.theirs), None
        if len(self.got) < LEN.size:
            return b"", None
        n = LEN.unpack_from(self.got)[0]
        if n > self.max_body:
            raise HelloRefused(f"HELLO of {n} bytes")
        if len(self.got) < LEN.size + n + MAC_BYTES:
            return b"", None
        body, mac = bytes(self.got[LEN.size:LEN.size + n]), bytes(self.got[LEN.size + n:LEN.size + n + MAC_BYTES])
        if not hmac.compare_digest(mac, _mac(self.token, DIALER, self.nonce, self.theirs, body)):
            raise HelloRefused(f"wrong deployment token{_claimed(body)}")
        return b"", body


def dial_hello(sock: socket.socket, token: str, body: bytes, timeout: float) -> None:
    """The dialer's side on a connected blocking socket (the control plane); HelloRefused when the
    listener does not prove the token, OSError (socket.timeout) past `timeout` seconds."""
    deadline, d = time.monotonic() + timeout, Dialing(token, body)
    sock.settimeout(timeout)
    sock.sendall(d.opening)
    hello = None
    while hello is None:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = sock.recv(d.need())
        if not data:
            raise HelloRefused("the listener closed the connection before proving the deployment token")
        hello = d.feed(data)
    sock.sendall(hello)
    sock.settimeout(None)


def accept_hello(sock: socket.socket, token: str, max_body: int, timeout: float) -> bytes:
    """The listener's side on an accepted blocking socket (the control plane): the dialer's body;
    HelloRefused for a stranger, OSError (socket.timeout) past `timeout` seconds."""
    deadline, lst = time.monotonic() + timeout, Listening(token, max_body)
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = sock.recv(lst.need())
        if not data:
            raise HelloRefused("closed before HELLO")
        reply, body = lst.feed(data)
        if reply:
            sock.sendall(reply)
        if body is not None:
            sock.settimeout(None)
            return body


# -- the store ---------------------------------------------------------------------------------------
def seal(token: str, key: str, value: bytes) -> bytes:
    """`value` as stored under `key`, signed with the token."""
    k = key.encode()
    return SIGNED + _mac(token, VALUE, LEN.pack(len(k)), k, value).hex().encode() + b"\n" + value


def unseal(token: str, key: str, raw: bytes | str) -> bytes | None:
    """The value of `raw` if it was sealed with `token` under `key`, else None."""
    raw = raw.encode() if isinstance(raw, str) else bytes(raw)
    if not raw.startswith(SIGNED) or raw[VALUE_AT - 1:VALUE_AT] != b"\n":
        return None
    try:
        mac = bytes.fromhex(raw[len(SIGNED):VALUE_AT - 1].decode("ascii"))
    except ValueError:
        return None
    k, value = key.encode(), raw[VALUE_AT:]
    return value if hmac.compare_digest(mac, _mac(token, VALUE, LEN.pack(len(k)), k, value)) else None


def _refusal(key: str) -> None:
    log.warning("refused the store value %r: no valid MAC by the deployment token (forged, or written with "
                "a different SHUTTLE_DEPLOYMENT_TOKEN)", key)


class SignedStore:
    """A torch.distributed store (`raw`) whose values are signed with the deployment token: `set`
    seals; `check` is True only when every key holds a value sealed under that key, `get` returns
    only such a value. A value without a valid MAC counts as absent: check says False, and it is
    logged once (per key and value). `get` of a refused value returns the value `check` just
    verified for the key (a stranger's write in between is ignored), else waits, like a get of a
    missing key, for a signed one until the store's timeout (DistStoreError then). `add` counters
    are not signed (the store itself adds). A deployment always has a token; endpoints opened by
    hand without one (tests, benches) sign with the empty key, which proves nothing. Thread-safe as
    the raw store is."""

    def __init__(self, store, token: str):
        self.raw, self.token = store, token
        self._checked: dict[str, bytes] = {}  # verified by check, not yet read by get
        self._refused: dict[str, bytes] = {}  # key -> digest of the value last refused (logged)

    @property
    def port(self) -> int:
        return self.raw.port

    def set(self, key: str, value: str | bytes) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.raw.set(key, seal(self.token, key, value))

    def _open(self, key: str, raw: bytes) -> bytes | None:
        value = unseal(self.token, key, raw)
        if value is not None:
            self._refused.pop(key, None)
        elif self._refused.get(key) != (digest := hashlib.sha256(raw).digest()):
            self._refused[key] = digest
            _refusal(key)
        return value

    def check(self, keys: Sequence[str]) -> bool:
        if not self.raw.check(keys):
            return False
        for key in keys:
            value = self._open(key, self.raw.get(key))
            if value is None:
                return False
            self._checked[key] = value
        return True

    def get(self, key: str) -> bytes:
        value, checked = self._open(key, self.raw.get(key)), self._checked.pop(key, None)
        if value is not None or checked is not None:
            return checked if value is None else value
        deadline = time.monotonic() + self._timeout_s()
        while time.monotonic() < deadline:
            time.sleep(STORE_POLL_S)
            if (value := self._open(key, self.raw.get(key))) is not None:
                return value
        raise DistStoreError(f"store key {key!r}: no value signed by the deployment token in {self._timeout_s():g} s")

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Until every key holds a signed value (DistStoreError after `timeout`, default the store's)."""
        limit = timeout.total_seconds() if timeout is not None else self._timeout_s()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise DistStoreError(f"store keys {list(keys)}: no values signed by the deployment token in "
                                     f"{limit:g} s")
            time.sleep(STORE_POLL_S)

    def _timeout_s(self) -> float:
        return getattr(self.raw, "timeout", timedelta(seconds=300)).total_seconds()

    def add(self, key: str, amount: int) -> int:
        return self.raw.add(key, amount)

    def refused(self, key: str) -> bool:
        """Whether the value last read under `key` was refused."""
        return key in self._refused


def signed_store(store, token: str) -> SignedStore:
    """`store` signed with `token` (itself when it already is a SignedStore)."""
    return store if isinstance(store, SignedStore) else SignedStore(store, token)


def sign_record(token: str, key: str, info: dict) -> bytes:
    """The store value for `info` (JSON) under `key`, signed with the token."""
    return seal(token, key, json.dumps(info).encode())


def open_record(token: str, key: str, raw: bytes | str) -> dict | None:
    """The info of a record signed with `token` under `key`; None, logged naming the key, otherwise."""
    value = unseal(token, key, raw)
    try:
        if value is not None:
            return json.loads(value)
    except ValueError:
        pass
    _refusal(key)
    return None


def publish_signed(store, session: str, me: str, what: str, info: dict, token: str) -> None:
    signed_store(store, token).set(store_key(session, me, what), json.dumps(info))


def wait_signed(store, session: str, peers: Sequence[str], what: str, token: str,
                deadline: float) -> dict[str, dict]:
    """Wait until every peer published a validly signed `what`; returns peer -> its info. An invalid
    record is logged once and waited past (its owner's write replaces it); TransportTimeout after
    `deadline` names the peers missing and the keys refused. Polls: check() never blocks."""
    store = signed_store(store, token)
    keys = {p: store_key(session, p, what) for p in peers}
    got: dict[str, dict] = {}
    while True:
        for p in peers:
            if p not in got and store.check([keys[p]]):
                got[p] = json.loads(store.get(keys[p]))
        if len(got) == len(peers):
            return got
        if time.monotonic() >= deadline:
            missing = [p for p in peers if p not in got]
            bad = [keys[p] for p in missing if store.refused(keys[p])]
            raise TransportTimeout(f"M2N connect: peers {missing} did not publish {what!r} in time"
                                   + (f" (refused records without a valid MAC: {bad})" if bad else ""))
        time.sleep(STORE_POLL_S)


# -- M2N endpoints ---------------------------------------------------------------------------------
def dial_peers(store, session: str, me: str, peers: Sequence[str], kind: str, listener: socket.socket, host: str,
               num_slots: int, slot_bytes: int, token: str, deadline: float) -> tuple[list[socket.socket], list[int]]:
    """Publish this endpoint's listener (under `kind`, signed), read every peer's, check that it
    agrees on the slot geometry and connect to it. Returns the outbound sockets (non-blocking,
    TCP_NODELAY, no byte sent yet: HelloGate.meet says HELLO) in peer order, and my index in each
    peer's own list of peers."""
    info = dict(host=host, port=listener.getsockname()[1], num_slots=num_slots, slot_bytes=slot_bytes,
                peers=list(peers))
    publish_signed(store, session, me, kind, info, token)
    infos = wait_signed(store, session, peers, kind, token, deadline)
    socks, positions = [], []
    try:
        for p in peers:
            positions.append(check_peer_info(me, p, infos[p], num_slots, slot_bytes))
            try:
                sock = socket.create_connection((infos[p]["host"], infos[p]["port"]),
                                                timeout=max(0.1, deadline - time.monotonic()))
            except OSError as e:
                raise TransportTimeout(f"M2N connect: cannot reach {p!r} at {infos[p]['host']}:{infos[p]['port']}: {e}")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            socks.append(sock)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks, positions


class Admitted:
    """A peer whose HELLO carried a valid MAC: its socket (non-blocking) and its HELLO fields."""

    def __init__(self, sock: socket.socket, pi: int, hello: dict):
        self.sock, self.pi, self.hello = sock, pi, hello


class HelloGate:
    """Say HELLO on this endpoint's connections to `peers` and accept theirs on `listener`, both at
    once (each side waits for the other's proof, so neither may block on one direction).

    me/session name this endpoint in logs; max_hello: the largest HELLO body accepted (bytes)."""

    def __init__(self, listener: socket.socket, me: str, session: str, peers: Sequence[str], num_slots: int,
                 slot_bytes: int, token: str, max_hello: int):
        self.listener, self.me, self.session, self.peers = listener, me, session, list(peers)
        self.index = {p: i for i, p in enumerate(self.peers)}
        self.geometry, self.token, self.max_hello = (num_slots, slot_bytes), token, max_hello
        self.pending: dict[socket.socket, tuple[Listening, str, float]] = {}  # inbound, not admitted yet
        self.sending: dict[socket.socket, bytearray] = {}  # bytes not sent yet, either direction
        self.outs: dict[socket.socket, int] = {}            # my connections -> peer index
        self.dialing: dict[socket.socket, Dialing] = {}     # mine still waiting for the peer's proof

    def meet(self, outs: Sequence[socket.socket], body: bytes, deadline: float,
             said: Callable[[int, socket.socket], None] = lambda pi, s: None) -> dict[int, Admitted]:
        """Say HELLO with `body` on `outs` (one connected socket per peer, in peer order; said(pi, sock)
        once ours to peer pi is sent whole) and admit every peer's; returns peer index -> Admitted.
        HelloRefused when a peer's listener does not prove the token; TransportTimeout after
        `deadline` (time.monotonic) naming the peers missing."""
        self.outs = {s: pi for pi, s in enumerate(outs)}
        self.dialing = {s: Dialing(self.token, body) for s in outs}
        self.sending.update((s, bytearray(d.opening)) for s, d in self.dialing.items())
        got: dict[int, Admitted] = {}
        try:
            while len(got) < len(self.peers) or self.dialing or any(s in self.sending for s in outs):
                if time.monotonic() >= deadline:
                    missing = [p for pi, p in enumerate(self.peers)
                               if pi not in got or outs[pi] in self.dialing or outs[pi] in self.sending]
                    raise TransportTimeout(f"M2N connect: peers {missing} did not complete HELLO with {self.me!r} "
                                           "in time")
                r, w, _ = select.select([self.listener, *self.pending, *self.dialing], list(self.sending), [], 0.05)
                for s in w:
                    self._send(s, said)
                for s in r:
                    if s is self.listener:
                        self._accept()
                    elif s in self.dialing:
                        self._dial_read(s)
                    elif s in self.pending and (a := self._read(s, got)) is not None:
                        got[a.pi] = a
                for s, (_, addr, until) in list(self.pending.items()):
                    if time.monotonic() > until:
                        self._refuse(s, addr, f"no HELLO within {HELLO_WAIT_S:.0f} s")
        except BaseException:
            for a in got.values():
                a.sock.close()
            raise
        finally:
            for s in self.pending:
                s.close()
            self.pending.clear()
            self.sending.clear()
        return got

    def _send(self, s: socket.socket, said: Callable[[int, socket.socket], None]) -> None:
        buf = self.sending[s]
        try:
            del buf[:s.send(buf)]
        except BlockingIOError:
            return
        except OSError as e:
            if s in self.pending:
                return self._refuse(s, self.pending[s][1], f"connection failed during HELLO: {e}")
            raise self._dial_error(s, f"sending failed: {e}") from None
        if not buf:
            del self.sending[s]
            if s in self.outs and s not in self.dialing:
                said(self.outs[s], s)

    def _dial_read(self, s: socket.socket) -> None:
        d = self.dialing[s]
        try:
            data = s.recv(d.need())
        except BlockingIOError:
            return
        except OSError as e:
            raise self._dial_error(s, f"connection failed: {e}") from None
        if not data:
            raise self._dial_error(s, "it closed the connection before proving the deployment token")
        try:
            hello = d.feed(data)
        except HelloRefused as e:
            raise self._dial_error(s, str(e)) from None
        if hello is not None:
            del self.dialing[s]
            self.sending.setdefault(s, bytearray()).extend(hello)

    def _dial_error(self, s: socket.socket, why: str) -> HelloRefused:
        try:
            where = "%s:%s" % s.getpeername()[:2]
        except OSError:
            where = "?"
        return HelloRefused(f"M2N connect of {self.me!r} (session {self.session}): peer "
                            f"{self.peers[self.outs[s]]!r} at {where}: {why}")

    def _accept(self) -> None:
        try:
            c, addr = self.listener.accept()
        except BlockingIOError:
            return
        c.setblocking(False)
        self.pending[c] = (Listening(self.token, self.max_hello), f"{addr[0]}:{addr[1]}",
                           time.monotonic() + HELLO_WAIT_S)

    def _read(self, s: socket.socket, got: dict) -> Admitted | None:
        lst, addr, _ = self.pending[s]
        try:
            data = s.recv(lst.need())
        except BlockingIOError:
            return None
        except OSError as e:
            return self._refuse(s, addr, f"connection failed before HELLO: {e}")
        if not data:
            return self._refuse(s, addr, "closed before HELLO")
        try:
            reply, body = lst.feed(data)
        except HelloRefused as e:
            return self._refuse(s, addr, str(e))
        if reply:
            self.sending.setdefault(s, bytearray()).extend(reply)
        if body is None:
            return None
        try:
            h = json.loads(body)
            name, num_slots, slot_bytes = h["name"], h["num_slots"], h["slot_bytes"]
        except (ValueError, KeyError, TypeError) as e:
            return self._refuse(s, addr, f"malformed HELLO: {type(e).__name__}: {e}")
        pi = self.index.get(name) if isinstance(name, str) else None
        if pi is None:
            why = f"{name!r} is not a peer of {self.me!r}"
        elif (num_slots, slot_bytes) != self.geometry:
            why = f"{name!r} has num_slots={num_slots}, slot_bytes={slot_bytes}; {self.me!r} has " \
                  f"{self.geometry[0]}, {self.geometry[1]}"
        else:
            why = f"{name!r} connected twice" if pi in got else None
        if why is not None:
            self._refuse(s, addr, why)
            raise ValueError(f"M2N connect of {self.me!r}: {why}")
        del self.pending[s]
        return Admitted(s, pi, h)

    def _refuse(self, s: socket.socket, addr: str, why: str) -> None:
        log.warning("M2N endpoint %r (session %s) refused a connection from %s: %s", self.me, self.session, addr, why)
        del self.pending[s]
        self.sending.pop(s, None)
        s.close()
        return None
