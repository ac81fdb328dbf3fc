"""The tcp backend of the M2N slot transport: any hosts, same slots and credits as shm.

Connections: one TCP connection per direction. Each endpoint listens on cfg.host (ephemeral port,
published in the store in a record signed with the deployment token, cfg.token) and connects to
every peer; its outgoing connection carries everything it writes to that peer (DATA, RELEASE for
the peer's messages, HEARTBEAT) and, after the handshake, nothing comes back on it. Every
connection starts with _hello.py's challenge-response HELLO: both sides prove the token without
sending it, the dialer checks the listener's proof before it sends its HELLO body, and a dialer
without a valid MAC is refused and logged with its address, so a stranger who reaches the port (or
publishes a fake endpoint) can neither join nor inject anything. The listener closes once every
peer is in.

Frames (little-endian, fixed layout: no serializer on the hot path):
    OPEN      b"shuttle\x01", 16-byte nonce                 dialer -> listener, first (_hello.py)
    PROOF     16-byte nonce, 32-byte HMAC-SHA256           listener -> dialer: the only bytes that come back
    HELLO     u32 length, JSON {name, num_slots, slot_bytes}, 32-byte HMAC-SHA256     dialer -> listener
    DATA      u32 type, u32 slot, i64 seq, HEADER_WORDS i64 header words (_common.header_words),
              then the payload (tensors at payload_offsets, zero padding between: the shm layout)
    RELEASE   u32 type, u32 slot, i64 seq            receiver -> sender: slot free again (the credit;
              held back until this endpoint next sends to that peer or waits, see _release)
    HEARTBEAT u32 type, u32 0, i64 0                 every heartbeat_s when nothing else was sent

No reader thread on the hot path: the one thread that waits on the endpoint (the M2N loop) reads
its sockets itself while it waits ("progress"): it polls them non-blockingly for cfg.spin_s, then
blocks in poll(2) on them. A payload is received straight into its slot with recv_into (only the
bytes that came in the same read as the header go through a small scratch buffer), and a send is
one sendmsg of the header and memoryviews of the tensors (scatter-gather, no copy). The previous
design (a uvloop reader thread handing each message to the waiter: a GIL hand-off and an eventfd
wake-up per message, msgpack headers) was 1.4-2x slower up to 256 KiB in a same-load A/B of
bench/m2n.py's tcp column; `phases` shows where a round goes now. A send that cannot complete (the peer's buffer is full) keeps
reading our own sockets while it waits, so two peers sending each other large messages cannot
deadlock. While the owner thread is busy elsewhere, the heartbeat thread drains the sockets
(`_rx_lock` decides who reads), so slots fill and credits arrive in the background too.

Liveness: any bytes from a peer count as a sign of life; EOF or a reset marks the peer dead at once
(a killed process's kernel closes its sockets), silence over dead_after_s marks it dead when
checked (after reading what is pending, so a long compute is never mistaken for silence). A failed
send marks it dead too. Each peer has its own sockets, so a dead one does not disturb the others.
"""
import select
import socket
import struct
import threading
import time
from typing import Callable, TypeVar

import torch

from m2n_comm._common import HEADER_WORDS, EndpointBase, TensorDesc, header_words, parse_words, tensor_bytes
from m2n_comm._hello import HelloGate, dial_peers, hello_body
from m2n_comm.transport import MessageMeta, PeerDeadError, TransportConfig, TransportTimeout

T = TypeVar("T")

DATA, RELEASE, HEARTBEAT = 2, 3, 4
FRAME = struct.Struct("<IIq")                          # type, slot, seq
DATA_HDR = struct.Struct("<IIq" + "q" * HEADER_WORDS)  # the same, then the message header words
MAX_HELLO = 4096
SCRATCH_BYTES = 1 << 16    # per connection: frame headers and payload bytes that came with them
ZEROS = memoryview(bytes(64))
PHASES = ("pack_ns", "send_ns", "recv_ns", "parse_ns", "block_ns", "sends", "recvs", "blocks")


class _Conn:
    """Receive state of one inbound connection (owned by whoever holds the endpoint's _rx_lock)."""

    __slots__ = ("sock", "pi", "buf", "start", "end", "target", "filled", "key", "entry", "open")

    def __init__(self, sock: socket.socket, pi: int):
        self.sock, self.pi, self.open = sock, pi, True
        self.buf = memoryview(bytearray(SCRATCH_BYTES))
        self.start = self.end = 0
        self.target: memoryview | None = None  # the payload being received straight into its slot
        self.filled = self.key = 0
        self.entry: tuple = ()


class TcpEndpoint(EndpointBase):
    """One process's end of the tcp links to `peers`: num_slots receive buffers of cfg.slot_bytes
    per peer, a listening socket published via `store` (keys under `session`) and one outgoing
    connection per peer; returns once every peer connected to it and it to every peer
    (TransportTimeout after connect_timeout_s naming the missing ones).

    `phases` counts where time went (nanoseconds, and counts): pack_ns building frames, send_ns in
    sendmsg, recv_ns in recv_into, parse_ns parsing and validating headers, block_ns blocked in poll."""

    # Credits ride with the next frame: release() queues the RELEASE and the next send to that peer
    # carries it in the same sendmsg, or the next wait (or poll) sends it first. In the M2N round
    # (the expert releases, then replies; the attention worker releases, then dispatches) that halves
    # the syscalls and the peer's wake-ups. bench/m2n.py's "tcp:eager-release" turns it off for an A/B.
    coalesce_releases = True

    def __init__(self, cfg: TransportConfig, store, session: str, me: str, peers: list[str], num_slots: int):
        super().__init__(cfg, session, me, peers, num_slots)
        self._spin_s = cfg.spin_s
        n, npeers = len(self._sent), len(self.peers)
        # Slots 64-byte aligned, as shm's and nixl's: payload offsets are aligned within a slot, and an
        # int64 tensor in slot k >= 1 of an odd-sized capacity could not be viewed otherwise.
        stride = -(-self.capacity // 64) * 64
        self._rx = torch.empty(n * stride, dtype=torch.uint8)
        self._rx_payload = [self._rx[k * stride:k * stride + self.capacity] for k in range(n)]
        self._rx_views = [memoryview(p.numpy()) for p in self._rx_payload]
        self._arrived: list[tuple[int, MessageMeta, list[TensorDesc]] | None] = [None] * n
        self._rx_seq = [0] * n               # last seq received per key
        self._released = [0] * n             # per key: seq of my last message the peer released
        self._dead: dict[int, str] = {}
        self._heard = [time.monotonic()] * npeers
        self._last_sent = [0.0] * npeers
        self._conns: list[_Conn] = []
        self._specs: dict[tuple, list[TensorDesc]] = {}  # header words after the meta -> their checked layout
        self._poller = select.poll()
        self._rx_lock = threading.Lock()      # who reads the inbound sockets: the waiter or the heartbeat thread
        self._out: list[socket.socket | None] = [None] * npeers
        self._send_locks = [threading.Lock() for _ in range(npeers)]  # caller vs heartbeat thread
        self._credits: list[list[bytes]] = [[] for _ in range(npeers)]  # RELEASE frames not sent yet (owner)
        self._owed = False  # some peer has credits queued
        self._stop = threading.Event()
        self.phases = dict.fromkeys(PHASES, 0)
        self._listener: socket.socket | None = None
        # Beat from the start (to the peers connected so far): a peer that finished connecting first
        # already checks that it hears from us.
        self._heart = threading.Thread(target=self._beat, name=f"m2n-tcp-heartbeat-{me}", daemon=True)
        self._heart.start()
        try:
            self._connect(store)
        except BaseException:
            self.close()
            raise

    # -- start ------------------------------------------------------------------------------------
    def _connect(self, store) -> None:
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        self._listener = socket.create_server((self.cfg.host, 0), backlog=max(16, 2 * len(self.peers)))
        self._listener.setblocking(False)
        outs, _ = dial_peers(store, self.session, self.me, self.peers, "tcp", self._listener, self.cfg.host,
                             self.num_slots, self.slot_bytes, self.cfg.token, deadline)
        # _hello.HelloGate: strangers are logged and dropped without stopping us. A connection joins
        # _out (and the heartbeats) once our HELLO on it is sent whole.
        gate = HelloGate(self._listener, self.me, self.session, self.peers, self.num_slots, self.slot_bytes,
                         self.cfg.token, MAX_HELLO)
        try:
            admitted = gate.meet(outs, hello_body(self.me, num_slots=self.num_slots, slot_bytes=self.slot_bytes),
                                 deadline, said=self._out.__setitem__)
        except BaseException:
            for s in outs:
                s.close()
            raise
        for pi, a in sorted(admitted.items()):
            self._conns.append(_Conn(a.sock, pi))
            self._poller.register(a.sock, select.POLLIN)
            self._heard[pi] = time.monotonic()
        self._listener.close()
        self._listener = None

    # -- reading (progress) -------------------------------------------------------------------------
    def _progress(self) -> None:
        """Read whatever arrived on every inbound connection, without blocking."""
        with self._rx_lock:
            for c in self._conns:
                if c.open:
                    self._pump(c)

    def _pump(self, c: _Conn) -> None:
        """Read connection `c` until the socket is drained: payloads straight into their slots."""
        ph, clock = self.phases, time.perf_counter_ns
        while True:
            if c.target is not None:
                view, want = c.target[c.filled:], len(c.target) - c.filled
            else:
                view, want = c.buf[c.end:], SCRATCH_BYTES - c.end
            t0 = clock()
            try:
                n = c.sock.recv_into(view, want)
            except BlockingIOError:
                ph["recv_ns"] += clock() - t0
                return
            except OSError as e:
                return self._drop(c, f"connection lost: {e}")
            t1 = clock()
            ph["recv_ns"] += t1 - t0
            ph["recvs"] += 1
            if n == 0:
                return self._drop(c, "its connection was closed (process exited or endpoint closed)")
            self._heard[c.pi] = time.monotonic()
            if c.target is not None:
                c.filled += n
                if c.filled == len(c.target):
                    c.target = None
                    self._arrived[c.key] = c.entry
            else:
                c.end += n
                self._parse(c)
                ph["parse_ns"] += clock() - t1
                if not c.open:
                    return
            if n < want:
                return  # the socket is drained: another recv would only say EAGAIN

    def _parse(self, c: _Conn) -> None:
        """Handle the complete frames in c's scratch buffer; a DATA payload that did not arrive
        whole becomes c.target (the rest is read straight into the slot)."""
        buf = c.buf
        while c.end - c.start >= FRAME.size:
            typ, slot, seq = FRAME.unpack_from(buf, c.start)
            if not 0 <= slot < self.num_slots:
                return self._drop(c, f"protocol error: frame type {typ} for slot {slot}")
            i = c.pi * self.num_slots + slot
            if typ == DATA:
                if c.end - c.start < DATA_HDR.size:
                    break
                if seq != self._rx_seq[i] + 1 or self._arrived[i] is not None:
                    state = "not released" if self._arrived[i] is not None else "out of order"
                    return self._drop(c, f"protocol error: seq {seq} into slot {slot} after {self._rx_seq[i]} ({state})")
                words = DATA_HDR.unpack_from(buf, c.start)
                descs = self._specs.get(words[8:])  # the same shapes as a recent message: checked already
                if descs is None:
                    try:
                        descs = parse_words(words[3:], self.capacity)[1]
                    except ValueError as e:
                        return self._drop(c, f"protocol error: {e}")
                    if len(self._specs) > 256:
                        self._specs.clear()
                    self._specs[words[8:]] = descs
                meta = MessageMeta(*words[3:8])
                self._rx_seq[i] = seq
                c.start += DATA_HDR.size
                nbytes = descs[-1].offset + descs[-1].nbytes if descs else 0
                target = self._rx_views[i][:nbytes]
                have = min(nbytes, c.end - c.start)
                target[:have] = buf[c.start: c.start + have]
                c.start += have
                if have < nbytes:  # the scratch buffer is empty now; the rest goes to the slot
                    c.target, c.filled, c.key, c.entry = target, have, i, (seq, meta, descs)
                    c.start = c.end = 0
                    return
                self._arrived[i] = (seq, meta, descs)
            elif typ == RELEASE:
                self._released[i] = seq
                c.start += FRAME.size
            elif typ == HEARTBEAT:
                c.start += FRAME.size
            else:
                return self._drop(c, f"protocol error: frame type {typ}")
        rest = c.end - c.start  # keep a partial frame at the front of the scratch buffer
        if rest and c.start:
            buf[:rest] = bytes(buf[c.start: c.end])
        c.start, c.end = 0, rest

    def _drop(self, c: _Conn, why: str) -> None:
        self._mark_dead(c.pi, why)
        if c.open:
            c.open = False
            try:
                self._poller.unregister(c.sock)
            except (KeyError, ValueError):
                pass
            c.sock.close()

    def _mark_dead(self, pi: int, why: str) -> None:
        self._dead.setdefault(pi, why)

    # -- hooks ----------------------------------------------------------------------------------------
    def _has_message(self, i: int) -> bool:
        return self._arrived[i] is not None

    def poll(self, peer: str, slot: int) -> bool:
        i = self._key(peer, slot)
        if self._owed:
            self._send_credits()
        if self._arrived[i] is None:
            self._progress()
        return self._arrived[i] is not None

    def _take(self, i: int) -> tuple[int, MessageMeta, list[TensorDesc]]:
        entry, self._arrived[i] = self._arrived[i], None  # nothing writes this key again before release
        return entry

    def _slot_free(self, i: int) -> bool:
        return self._released[i] == self._sent[i]

    def _write(self, i: int, meta: MessageMeta, descs: list[TensorDesc], srcs: list[torch.Tensor], end: int) -> None:
        t0 = time.perf_counter_ns()
        pi, slot = divmod(i, self.num_slots)
        parts: list = [DATA_HDR.pack(DATA, slot, self._sent[i], *header_words(meta, descs))]
        pos = 0
        for d, src in zip(descs, srcs):
            if d.offset > pos:
                parts.append(ZEROS[:d.offset - pos])
            if d.nbytes:
                parts.append(tensor_bytes(src))
            pos = d.offset + d.nbytes
        if self._credits[pi]:
            parts[:0], self._credits[pi] = self._credits[pi], []
        self.phases["pack_ns"] += time.perf_counter_ns() - t0
        self._sendall(pi, parts, drain=True)

    def _release(self, i: int, seq: int) -> None:
        pi, slot = divmod(i, self.num_slots)
        self._credits[pi].append(FRAME.pack(RELEASE, slot, seq))
        self._owed = True
        if not self.coalesce_releases:
            self._send_credits()

    def _send_credits(self) -> None:
        """Send every queued RELEASE (before this thread waits: a peer may be waiting for one)."""
        self._owed = False
        for pi, frames in enumerate(self._credits):
            if frames:
                self._credits[pi] = []
                try:
                    self._sendall(pi, frames, drain=True)
                except PeerDeadError:
                    pass  # nobody waits for these credits any more; the next wait on the peer reports it

    def _dead_reason(self, pi: int, thorough: bool) -> str | None:
        why = self._dead.get(pi)
        if why is None and thorough:
            self._progress()  # what is pending counts as heard: a long compute is not silence
            why = self._dead.get(pi)
            age = time.monotonic() - self._heard[pi]
            if why is None and age > self.cfg.dead_after_s:
                why = f"nothing heard for {age:.1f} s (dead_after_s={self.cfg.dead_after_s})"
        return why

    def _spin_pause(self) -> bool:
        if self._owed:
            self._send_credits()
        contended = super()._spin_pause()
        self._progress()
        return contended

    def _block(self, ready: Callable[[], T], seconds: float) -> T | None:
        # Held while blocked, so the heartbeat thread cannot read (and so swallow) what wakes us.
        if self._owed:
            self._send_credits()
        with self._rx_lock:
            self._progress_locked()
            r = ready()
            if r:
                return r
            t0 = time.perf_counter_ns()
            self._poller.poll(max(1, round(seconds * 1000)))
            self.phases["block_ns"] += time.perf_counter_ns() - t0
            self.phases["blocks"] += 1
            self._progress_locked()
        return ready()

    def _progress_locked(self) -> None:
        for c in self._conns:
            if c.open:
                self._pump(c)

    # -- sending ----------------------------------------------------------------------------------------
    def _sendall(self, pi: int, parts: list, drain: bool) -> None:
        with self._send_locks[pi]:
            self._send_locked(pi, parts, drain)

    def _send_locked(self, pi: int, parts: list, drain: bool) -> None:
        """Write whole frames (byte-like parts) to peer `pi` holding its send lock. A frame once
        started is always finished or the peer is declared dead: half a frame breaks the stream.
        drain: read our inbound sockets while the peer's buffer is full (the owner thread only)."""
        sock = self._out[pi]
        if sock is None:
            raise PeerDeadError(self.peers[pi], "its connection was closed")
        ph, clock = self.phases, time.perf_counter_ns
        while True:
            t0 = clock()
            try:
                n = sock.sendmsg(parts)
            except BlockingIOError:
                n = 0
            except OSError as e:
                self._mark_dead(pi, f"send failed: {e}")
                raise PeerDeadError(self.peers[pi], f"send failed: {e}") from e
            ph["send_ns"] += clock() - t0
            ph["sends"] += 1
            while parts and n >= len(parts[0]):
                n -= len(parts[0])
                parts.pop(0)
            if not parts:
                self._last_sent[pi] = time.monotonic()
                return
            if n:
                parts[0] = memoryview(parts[0])[n:]
            self._wait_writable(pi, sock, drain)

    def _wait_writable(self, pi: int, sock: socket.socket, drain: bool) -> None:
        """Wait (up to 50 ms) for room on peer pi's socket, reading ours meanwhile when `drain`;
        raises PeerDeadError when the peer is dead or silent."""
        if drain:
            p = select.poll()
            p.register(sock, select.POLLOUT)
            for c in self._conns:
                if c.open:
                    p.register(c.sock, select.POLLIN)
            p.poll(50)
            self._progress()
            self._raise_if_dead(pi, thorough=True)
        else:
            select.select([], [sock], [], 0.05)
            if pi in self._dead or self._closed:
                raise PeerDeadError(self.peers[pi], self._dead.get(pi, "endpoint closed"))

    def _beat(self) -> None:
        beat = FRAME.pack(HEARTBEAT, 0, 0)
        while not self._stop.wait(self.cfg.heartbeat_s):
            for pi, sock in enumerate(self._out):
                if (sock is None or pi in self._dead or time.monotonic() - self._last_sent[pi] < self.cfg.heartbeat_s
                        or not self._send_locks[pi].acquire(blocking=False)):
                    continue  # a frame sent recently, or a send in progress, is a sign of life already
                try:
                    # Only when there is room: a peer that stopped reading must not stall our beats to others.
                    if select.select([], [sock], [], 0)[1]:
                        self._send_locked(pi, [beat], drain=False)
                except (PeerDeadError, OSError, ValueError):
                    pass
                finally:
                    self._send_locks[pi].release()
            if self._rx_lock.acquire(blocking=False):  # the owner thread is elsewhere: read for it
                try:
                    self._progress_locked()
                except Exception:
                    pass
                finally:
                    self._rx_lock.release()

    # -- teardown -----------------------------------------------------------------------------------
    def _close_backend(self) -> None:
        self._stop.set()
        if self._heart is not None:
            self._heart.join()
        for pi, sock in enumerate(self._out):
            if sock is not None:
                with self._send_locks[pi]:
                    self._out[pi] = None
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    sock.close()
        with self._rx_lock:
            for c in self._conns:
                if c.open:
                    c.open = False
                    c.sock.close()
        if self._listener is not None:
            self._listener.close()
        self._rx_payload, self._rx_views = [], []
