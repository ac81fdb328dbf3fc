"""The HELLO every inbound M2N connection starts with (tcp data plane, nixl metadata exchange):
u32 length + JSON {name, num_slots, slot_bytes, token, ...backend fields}. A HELLO without the
deployment's token is refused and logged with the address it came from, so a stranger who reaches
a listener can neither join nor inject anything; a peer with the right token but the wrong name or
slot geometry is a configuration error (ValueError).
"""
import hmac
import json
import logging
import select
import socket
import struct
import time
from typing import Sequence

from m2n_comm._common import check_peer_info, publish, wait_published
from m2n_comm.transport import TransportTimeout

log = logging.getLogger("shuttle.m2n")

LEN = struct.Struct("<I")
HELLO_WAIT_S = 5.0  # a connection that says nothing for this long is dropped


def hello_frame(me: str, num_slots: int, slot_bytes: int, token: str, **extra: object) -> bytes:
    """The HELLO bytes; `extra` adds backend fields (JSON-serialisable)."""
    body = json.dumps(dict(name=me, num_slots=num_slots, slot_bytes=slot_bytes, token=token, **extra)).encode()
    return LEN.pack(len(body)) + body


def dial_peers(store, session: str, me: str, peers: Sequence[str], kind: str, listener: socket.socket, host: str,
               num_slots: int, slot_bytes: int, hello: bytes, deadline: float) -> tuple[list[socket.socket], list[int]]:
    """Publish this endpoint's listener (under `kind`), read every peer's, check that it agrees on the
    slot geometry, connect to it and send `hello`. Returns the outbound sockets (non-blocking,
    TCP_NODELAY) in peer order, and my index in each peer's own list of peers."""
    info = dict(host=host, port=listener.getsockname()[1], num_slots=num_slots, slot_bytes=slot_bytes,
                peers=list(peers))
    publish(store, session, me, kind, info)
    infos = wait_published(store, session, peers, kind, deadline)
    socks, positions = [], []
    for p in peers:
        positions.append(check_peer_info(me, p, infos[p], num_slots, slot_bytes))
        try:
            sock = socket.create_connection((infos[p]["host"], infos[p]["port"]),
                                            timeout=max(0.1, deadline - time.monotonic()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(hello)
        except OSError as e:
            raise TransportTimeout(f"M2N connect: cannot reach {p!r} at {infos[p]['host']}:{infos[p]['port']}: {e}")
        sock.setblocking(False)
        socks.append(sock)
    return socks, positions


class Admitted:
    """A peer that said HELLO with the right token: its socket (non-blocking), its HELLO fields and
    the bytes that came after the HELLO in the same reads."""

    def __init__(self, sock: socket.socket, pi: int, hello: dict, leftover: bytes):
        self.sock, self.pi, self.hello, self.leftover = sock, pi, hello, leftover


class HelloGate:
    """Accept connections on `listener` until every one of `peers` said HELLO with `token`.

    me/session name this endpoint in logs; max_hello: the largest HELLO body accepted (bytes)."""

    def __init__(self, listener: socket.socket, me: str, session: str, peers: Sequence[str], num_slots: int,
                 slot_bytes: int, token: str, max_hello: int):
        self.listener, self.me, self.session, self.peers = listener, me, session, list(peers)
        self.index = {p: i for i, p in enumerate(self.peers)}
        self.geometry, self.token, self.max_hello = (num_slots, slot_bytes), token, max_hello
        self.pending: dict[socket.socket, tuple[bytearray, str, float]] = {}

    def accept_all(self, deadline: float) -> dict[int, Admitted]:
        """Peer index -> Admitted, once all peers are in; TransportTimeout after `deadline`
        (time.monotonic) naming the missing ones."""
        got: dict[int, Admitted] = {}
        try:
            while len(got) < len(self.peers):
                if time.monotonic() >= deadline:
                    missing = [p for pi, p in enumerate(self.peers) if pi not in got]
                    raise TransportTimeout(f"M2N connect: peers {missing} did not connect to {self.me!r} in time")
                for s in select.select([self.listener, *self.pending], [], [], 0.05)[0]:
                    if s is self.listener:
                        self._accept()
                    elif (a := self._read(s, got)) is not None:
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
        return got

    def _accept(self) -> None:
        try:
            c, addr = self.listener.accept()
        except BlockingIOError:
            return
        c.setblocking(False)
        self.pending[c] = (bytearray(), f"{addr[0]}:{addr[1]}", time.monotonic() + HELLO_WAIT_S)

    def _read(self, s: socket.socket, got: dict) -> Admitted | None:
        buf, addr, _ = self.pending[s]
        try:
            data = s.recv(self.max_hello + LEN.size)
        except BlockingIOError:
            return None
        except OSError as e:
            return self._refuse(s, addr, f"connection failed before HELLO: {e}")
        if not data:
            return self._refuse(s, addr, "closed before HELLO")
        buf += data
        if len(buf) < LEN.size:
            return None
        hlen = LEN.unpack_from(buf)[0]
        if hlen > self.max_hello:
            return self._refuse(s, addr, f"HELLO of {hlen} bytes")
        if len(buf) < LEN.size + hlen:
            return None
        try:
            h = json.loads(bytes(buf[LEN.size: LEN.size + hlen]))
            name, num_slots, slot_bytes, token = h["name"], h["num_slots"], h["slot_bytes"], h.get("token")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return self._refuse(s, addr, f"malformed HELLO: {type(e).__name__}: {e}")
        if not isinstance(token, str):
            return self._refuse(s, addr, f"missing deployment token (claimed to be {name!r})")
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            return self._refuse(s, addr, f"wrong deployment token (claimed to be {name!r})")
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
        return Admitted(s, pi, h, bytes(buf[LEN.size + hlen:]))

    def _refuse(self, s: socket.socket, addr: str, why: str) -> None:
        log.warning("M2N endpoint %r (session %s) refused a connection from %s: %s", self.me, self.session, addr, why)
        del self.pending[s]
        s.close()
        return None
