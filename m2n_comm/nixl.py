"""The nixl backend of the M2N slot transport: the same slots and credits as shm and tcp, moved by
NIXL's UCX backend. On a cluster UCX drives the RDMA NIC (verbs: one-sided writes straight into
the peer's registered memory); on one host, or without RDMA, the same code runs over UCX's shared
memory or tcp transports (UCX_TLS / UCX_NET_DEVICES choose, read by UCX itself).

Memory: every endpoint registers two regions once, at start: its receive slots (one per
(peer, slot) key, cfg.slot_bytes each, rounded up to 64) and as many send-staging slots. A message
is staged (header words at byte 0, tensors from byte SLOT_HEADER_BYTES at payload_offsets, the shm
layout) and moved by one NIXL WRITE into the peer's slot, carrying a notification (DATA, slot,
seq) that NIXL delivers after the data: the notification is the sequence word written last.
Credits and heartbeats are notifications too (RELEASE slot seq, HEARTBEAT); any notification
counts as a sign of life.

Metadata exchange (who may write where): each endpoint listens on a tcp port (published in the
store, signed with the deployment token) and connects to every peer with _hello.py's
challenge-response HELLO, whose body carries its NIXL agent metadata and its receive region's
address: the token is proven, never sent; the dialer sends its metadata only after the listener
proved the token, and a peer's metadata is loaded only from a HELLO with a valid MAC (a stranger
is refused and logged with its address). The HELLO connections stay open and carry nothing else
after the handshake: a killed process's kernel closes them, so its peers see it dead at once,
without waiting dead_after_s.

Waiting: NIXL's Python API gives no file descriptor to block on, and UCX over tcp only applies an
incoming write while the target progresses its worker. So a wait polls (get_new_notifs progresses
UCX) for cfg.spin_s yielding the core between polls, then naps between polls: each nap an eighth of
the time waited so far, between NAP_MIN_S and NAP_MAX_S. A message that arrives after a long wait is
therefore seen late by at most 1/8 of that wait (and NAP_MAX_S); an idle endpoint wakes about
1000 times a second. The heartbeat thread progresses UCX while the owner thread is busy elsewhere.

UCX error handling: cfg.ucx_error_handling ("none" by default) is passed to NIXL's UCX backend.
UCX's shared-memory transports only run with "none" (they have no peer-failure handler); liveness
is ours anyway (heartbeats, the HELLO connections), and a write to a dead peer fails with NIXL's
disconnect error either way (measured over tcp and shared memory). "peer" lets UCX drop a failed
peer's endpoint on its own, which RDMA deployments may prefer. GPU memory: NIXL registers CUDA
tensors (VRAM) through the same calls; Shuttle's slots are CPU tensors and VRAM is untested here.
"""
import base64
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Callable, TypeVar

import numpy as np
import torch

from m2n_comm._common import HEADER_WORDS, EndpointBase, TensorDesc, copy_payload, header_words
from m2n_comm._hello import HelloGate, dial_peers, hello_body, publish_signed, wait_signed
from m2n_comm.transport import SLOT_HEADER_BYTES, MessageMeta, PeerDeadError, TransportConfig, TransportTimeout

T = TypeVar("T")
log = logging.getLogger("shuttle.m2n")

DATA, RELEASE, HEARTBEAT, BYE, BYE_ACK = 1, 2, 3, 4, 5
NOTIF = struct.Struct("<BIq")   # type, slot (in the receiver's numbering of my keys), seq
MAX_HELLO = 1 << 20             # NIXL metadata (worker address and memory keys) is a few KiB
NAP_MIN_S, NAP_MAX_S = 50e-6, 1e-3
FLUSH_S = 2.0                   # close() waits at most this long for writes still in flight
INSTALL_HINT = ("the nixl transport needs NIXL: pip install --no-deps nixl-cu12==1.5.1 (its meta package "
                "`nixl` pulls a CUDA torch); `make setup` installs it unless NIXL=0")


def import_nixl():
    """NIXL's Python module (nixl_cu12, nixl_cu13 or nixl), or ImportError saying how to install it."""
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        try:
            mod = __import__(name)
            mod.nixl_agent  # noqa: B018  (the meta package without a wheel has no agent)
            logging.getLogger("nixl").setLevel(logging.WARNING)  # one INFO line per agent otherwise
            return mod
        except (ImportError, AttributeError):
            continue
    raise ImportError(INSTALL_HINT)


class NixlEndpoint(EndpointBase):
    """One process's end of the nixl links to `peers`: registered receive and staging slots, a NIXL
    agent named "<session>/<me>" with a UCX backend, metadata exchanged over HELLO connections
    (_hello.py: both sides prove the token; their addresses published via `store`, keys under
    `session`); returns once every peer's metadata is loaded here and ours there (TransportTimeout
    after connect_timeout_s)."""

    def __init__(self, cfg: TransportConfig, store, session: str, me: str, peers: list[str], num_slots: int):
        super().__init__(cfg, session, me, peers, num_slots)
        nixl = import_nixl()
        self._spin_s = cfg.spin_s
        n, npeers = len(self._sent), len(self.peers)
        self._stride = -(-cfg.slot_bytes // 64) * 64
        self._rx = torch.zeros(n * self._stride, dtype=torch.uint8)
        self._tx = torch.zeros(n * self._stride, dtype=torch.uint8)
        self._rx_words, self._tx_bytes = self._rx.numpy().view(np.int64), self._tx.numpy()
        self._tx_words, self._tx_ptr = self._tx_bytes.view(np.int64), self._tx.data_ptr()
        self._rx_payload = [self._rx[k * self._stride + SLOT_HEADER_BYTES: k * self._stride + SLOT_HEADER_BYTES
                                     + self.capacity] for k in range(n)]
        self._arrived: list[tuple[int, MessageMeta, list[TensorDesc]] | None] = [None] * n
        self._rx_seq = [0] * n            # last seq received per key
        self._released = [0] * n          # per key: seq of my last message the peer released
        self._xfer: list = [None] * n     # per key: the NIXL transfer of my last message (staging busy until done)
        self._inflight: set[int] = set()  # keys whose last transfer may still be in progress
        self._acked: set[int] = set()     # peers that acknowledged our BYE (or said BYE themselves)
        self._dead: dict[int, str] = {}
        self._heard = [time.monotonic()] * npeers
        self._last_sent = [0.0] * npeers
        self._rx_lock = threading.Lock()  # who handles notifications: the waiter or the heartbeat thread
        self._stop = threading.Event()
        self._idle_since: float | None = None
        self._listener: socket.socket | None = None
        self._out: list[socket.socket] = []    # my HELLO connection to each peer (kept: EOF = death)
        self._in: list[socket.socket] = []     # each peer's HELLO connection to me
        self._heart: threading.Thread | None = None
        self._agents: list[str] = [f"{session}/{p}" for p in self.peers]
        self._agent_index = {a: pi for pi, a in enumerate(self._agents)}
        self._remote_addr = [0] * npeers
        self._remote_base = [0] * npeers
        self._reg = []
        try:
            conf = nixl.nixl_agent_config(enable_prog_thread=False, backends=[],  # its thread would spin a core
                                          sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            self._agent = nixl.nixl_agent(f"{session}/{me}", conf)
            try:
                self._agent.create_backend("UCX", {"ucx_error_handling_mode": cfg.ucx_error_handling})
            except Exception as e:
                raise RuntimeError(f"M2N endpoint {me!r}: NIXL's UCX backend did not start ({type(e).__name__}: {e}); "
                                   "UCX's log above says why (check UCX_TLS and UCX_NET_DEVICES)") from None
            # The hot path calls NIXL's bindings directly: the Python wrapper's descriptor-list
            # checks cost ~10 us per message here, as much as a small write itself.
            self._b = __import__(f"{nixl.__name__}._bindings", fromlist=["_"])
            self._raw = self._agent.agent
            self._reg = [self._agent.register_memory(self._rx), self._agent.register_memory(self._tx)]
            self._connect(store)
        except BaseException:
            self.close()
            raise

    # -- start ------------------------------------------------------------------------------------
    def _connect(self, store) -> None:
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        self._listener = socket.create_server((self.cfg.host, 0), backlog=max(16, 2 * len(self.peers)))
        self._listener.setblocking(False)
        socks, positions = dial_peers(store, self.session, self.me, self.peers, "nixl", self._listener, self.cfg.host,
                                      self.num_slots, self.slot_bytes, self.cfg.token, deadline)
        self._out.extend(socks)
        for p, me_there in zip(self.peers, positions):
            self._remote_base[self._index[p]] = me_there * self.num_slots
        gate = HelloGate(self._listener, self.me, self.session, self.peers, self.num_slots, self.slot_bytes,
                         self.cfg.token, MAX_HELLO)
        body = hello_body(self.me, num_slots=self.num_slots, slot_bytes=self.slot_bytes, rx=self._rx.data_ptr(),
                          metadata=base64.b64encode(self._agent.get_agent_metadata()).decode())
        admitted = gate.meet(socks, body, deadline)
        self._in = [admitted[pi].sock for pi in range(len(self.peers))]
        self._listener.close()
        self._listener = None
        for pi, a in sorted(admitted.items()):
            self._load_peer(pi, a.hello)
        publish_signed(store, self.session, self.me, "nixl-loaded", {}, self.cfg.token)
        wait_signed(store, self.session, self.peers, "nixl-loaded", self.cfg.token, deadline)
        now = time.monotonic()
        self._heard = [now] * len(self.peers)
        self._heart = threading.Thread(target=self._beat, name=f"m2n-nixl-heartbeat-{self.me}", daemon=True)
        self._heart.start()

    def _load_peer(self, pi: int, hello: dict) -> None:
        """Load an admitted peer's NIXL metadata; it must name the agent we expect."""
        peer = self.peers[pi]
        try:
            md, rx = base64.b64decode(hello["metadata"], validate=True), int(hello["rx"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"M2N peer {peer!r}: HELLO without valid NIXL metadata ({type(e).__name__}: {e})")
        name = self._agent.add_remote_agent(md)
        name = name.decode() if isinstance(name, bytes) else name
        if name != self._agents[pi]:
            self._agent.remove_remote_agent(name)
            raise ValueError(f"M2N peer {peer!r} presented NIXL metadata of agent {name!r}, "
                             f"expected {self._agents[pi]!r}")
        self._remote_addr[pi] = rx
        self._agent.make_connection(name)

    # -- notifications (progress) -------------------------------------------------------------------
    def _progress(self) -> None:
        with self._rx_lock:
            self._progress_locked()

    def _progress_locked(self) -> None:
        """Drive the transfers in flight (UCX over tcp moves their bytes only while we check on them)
        and handle the notifications that arrived."""
        for i in list(self._inflight):
            if self._state(self._xfer[i]) != "PROC":
                self._inflight.discard(i)
        notifs = self._agent.get_new_notifs()
        if not notifs:
            return
        now = time.monotonic()
        for name, msgs in notifs.items():
            name = name.decode() if isinstance(name, bytes) else name
            pi = self._agent_index.get(name)
            if pi is None:
                log.warning("M2N endpoint %r ignored %d notifications from unknown NIXL agent %r",
                            self.me, len(msgs), name)
                continue
            self._heard[pi] = now
            for m in msgs:
                self._handle(pi, m)

    def _handle(self, pi: int, m: bytes) -> None:
        if len(m) != NOTIF.size:
            return self._mark_dead(pi, f"protocol error: notification of {len(m)} bytes")
        typ, slot, seq = NOTIF.unpack(m)
        if not 0 <= slot < self.num_slots:
            return self._mark_dead(pi, f"protocol error: notification type {typ} for slot {slot}")
        i = pi * self.num_slots + slot
        if typ == DATA:
            if seq != self._rx_seq[i] + 1 or self._arrived[i] is not None:
                state = "not released" if self._arrived[i] is not None else "out of order"
                return self._mark_dead(pi, f"protocol error: seq {seq} into slot {slot} after {self._rx_seq[i]} ({state})")
            base = i * self._stride // 8
            try:
                meta, descs = self._parsed(self._rx_words[base: base + HEADER_WORDS].tolist())
            except ValueError as e:
                return self._mark_dead(pi, f"protocol error: {e}")
            self._rx_seq[i] = seq
            self._arrived[i] = (seq, meta, descs)
        elif typ == RELEASE:
            self._released[i] = seq
        elif typ == BYE:  # after all its DATA (one UCX endpoint keeps order): nothing more will come
            self._mark_dead(pi, "it closed its endpoint")
            self._acked.add(pi)
            try:
                self._agent.send_notif(self._agents[pi], NOTIF.pack(BYE_ACK, 0, 0))
            except Exception:
                pass
        elif typ == BYE_ACK:
            self._acked.add(pi)
        elif typ != HEARTBEAT:
            self._mark_dead(pi, f"protocol error: notification type {typ}")

    def _mark_dead(self, pi: int, why: str) -> None:
        self._dead.setdefault(pi, why)

    def _notify(self, pi: int, typ: int, slot: int, seq: int) -> None:
        try:
            self._agent.send_notif(self._agents[pi], NOTIF.pack(typ, slot, seq))
        except Exception as e:  # NIXL raises its own error types (nixlRemoteDisconnectError, ...)
            self._mark_dead(pi, f"NIXL notification failed: {type(e).__name__}: {e}")
            raise PeerDeadError(self.peers[pi], self._dead[pi]) from e
        self._last_sent[pi] = time.monotonic()

    # -- hooks ----------------------------------------------------------------------------------------
    def _has_message(self, i: int) -> bool:
        return self._arrived[i] is not None

    def poll(self, peer: str, slot: int) -> bool:
        i = self._key(peer, slot)
        if self._arrived[i] is None:
            self._progress()
        return self._arrived[i] is not None

    def _take(self, i: int) -> tuple[int, MessageMeta, list[TensorDesc]]:
        entry, self._arrived[i] = self._arrived[i], None
        return entry

    def _slot_free(self, i: int) -> bool:
        return self._released[i] == self._sent[i]

    def _write(self, i: int, meta: MessageMeta, descs: list[TensorDesc], srcs: list[torch.Tensor], end: int) -> None:
        pi, slot = divmod(i, self.num_slots)
        self._finish_xfer(i)  # the staging slot is free once its last write completed
        base = i * self._stride
        self._tx_words[base // 8: base // 8 + HEADER_WORDS] = header_words(meta, descs)
        start = base + SLOT_HEADER_BYTES
        copy_payload(self._tx_ptr + start, descs, srcs)
        n = SLOT_HEADER_BYTES + end
        remote = self._remote_addr[pi] + (self._remote_base[pi] + slot) * self._stride
        b = self._b
        try:
            xfer = self._raw.createXferReq(b.NIXL_WRITE, b.nixlXferDList(b.DRAM_SEG, [(self._tx_ptr + base, n, 0)]),
                                           b.nixlXferDList(b.DRAM_SEG, [(remote, n, 0)]), self._agents[pi], b"", [])
            state = self._status(self._raw.postXferReq(xfer, NOTIF.pack(DATA, slot, self._sent[i])))
        except Exception as e:
            self._mark_dead(pi, f"NIXL write failed: {type(e).__name__}: {e}")
            raise PeerDeadError(self.peers[pi], self._dead[pi]) from e
        with self._rx_lock:  # the heartbeat thread's progress reads both
            self._xfer[i] = xfer
            if state == "PROC":
                self._inflight.add(i)
        self._last_sent[pi] = time.monotonic()
        if state == "ERR":
            self._finish_xfer(i)

    def _finish_xfer(self, i: int) -> None:
        """Wait until key i's last write completed (it has by the time its slot was released; this
        only progresses UCX's local completion) and free its handle."""
        xfer = self._xfer[i]
        if xfer is None:
            return
        pi = i // self.num_slots
        state = self._state(xfer)
        while state == "PROC":
            self._raise_if_dead(pi, thorough=True)
            os.sched_yield()
            state = self._state(xfer)
        with self._rx_lock:
            self._xfer[i] = None
            self._inflight.discard(i)
        self._free(xfer)
        if state != "DONE":
            self._mark_dead(pi, f"NIXL write ended in state {state}")
            raise PeerDeadError(self.peers[pi], self._dead[pi])

    def _status(self, code: int) -> str:
        return "DONE" if code == self._b.NIXL_SUCCESS else "PROC" if code == self._b.NIXL_IN_PROG else "ERR"

    def _state(self, xfer: int) -> str:
        """A transfer's state: DONE, PROC or ERR (an error NIXL raises counts as ERR)."""
        try:
            return self._status(self._raw.getXferStatus(xfer))
        except Exception:
            return "ERR"

    def _free(self, xfer: int) -> None:
        try:
            self._raw.releaseXferReq(xfer)
        except Exception:
            pass  # still active towards a dead peer: NIXL frees it with the agent

    def _release(self, i: int, seq: int) -> None:
        pi, slot = divmod(i, self.num_slots)
        try:
            self._notify(pi, RELEASE, slot, seq)
        except PeerDeadError:
            pass  # nobody waits for this credit any more; the next wait on the peer reports it

    def _dead_reason(self, pi: int, thorough: bool) -> str | None:
        why = self._dead.get(pi)
        if why is None and thorough:
            self._progress()  # what is pending counts as heard: a long compute is not silence
            why = self._dead.get(pi) or self._hello_closed(pi)
            age = time.monotonic() - self._heard[pi]
            if why is None and age > self.cfg.dead_after_s:
                why = f"nothing heard for {age:.1f} s (dead_after_s={self.cfg.dead_after_s})"
            if why is not None:
                self._mark_dead(pi, why)
        return why

    def _hello_closed(self, pi: int) -> str | None:
        """Why peer pi's HELLO connection says it is gone (EOF, reset), or None while it is open."""
        if pi >= len(self._in):
            return None
        for sock in (self._in[pi], self._out[pi]):
            try:
                data = sock.recv(1)
            except BlockingIOError:
                continue
            except OSError as e:
                return f"its connection was lost: {e}"
            return "its connection was closed (process exited or endpoint closed)" if not data else \
                "protocol error: bytes after HELLO"
        return None

    def _spin_pause(self) -> bool:
        contended = super()._spin_pause()
        self._progress()
        return contended

    def _block(self, ready: Callable[[], T], seconds: float) -> T | None:
        now = time.monotonic()
        if self._idle_since is None or now - self._last_block > 2 * NAP_MAX_S:
            self._idle_since = now - self._spin_s  # a new wait (it spun for spin_s already)
        until = now + seconds
        while True:
            self._progress()
            r = ready()
            now = time.monotonic()
            self._last_block = now
            if r:
                self._idle_since = None
                return r
            if now >= until:
                return None
            time.sleep(min(until - now, NAP_MAX_S, max(NAP_MIN_S, (now - self._idle_since) / 8)))

    _last_block = 0.0

    def _beat(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_s):
            for pi in range(len(self.peers)):
                if pi not in self._dead and time.monotonic() - self._last_sent[pi] >= self.cfg.heartbeat_s:
                    try:
                        self._notify(pi, HEARTBEAT, 0, 0)
                    except PeerDeadError:
                        pass
            if self._rx_lock.acquire(timeout=self.cfg.heartbeat_s / 4):  # the owner is elsewhere (or between polls)
                try:
                    self._progress_locked()
                except Exception:
                    pass
                finally:
                    self._rx_lock.release()

    # -- teardown -----------------------------------------------------------------------------------
    def _flush(self, seconds: float) -> None:
        """Say BYE to every live peer and progress until each acknowledged it (or died), so the
        messages sent just before close() are delivered, as tcp's kernel buffers would deliver
        them: UCX moves bytes only while we progress, and NIXL's "DONE" can mean merely buffered."""
        if getattr(self, "_agent", None) is None or not self._in:
            return
        until = time.monotonic() + seconds
        while self._inflight and time.monotonic() < until:  # a BYE must not overtake a write's notification
            self._progress()
            time.sleep(NAP_MIN_S)
        for pi in range(len(self.peers)):
            if pi not in self._dead and (why := self._hello_closed(pi)) is not None:
                self._mark_dead(pi, why)  # gone already: a notification would only fail (and NIXL log it)
            if pi not in self._dead:
                try:
                    self._agent.send_notif(self._agents[pi], NOTIF.pack(BYE, 0, 0))
                except Exception as e:
                    self._mark_dead(pi, f"NIXL notification failed: {e}")
        while time.monotonic() < until:
            try:
                self._progress()
            except Exception:
                return
            waiting = [pi for pi in range(len(self.peers)) if pi not in self._acked
                       and (pi not in self._dead or self._dead[pi] == "it closed its endpoint")]
            waiting = [pi for pi in waiting if pi not in self._acked and self._hello_closed(pi) is None]
            if not waiting:
                return
            time.sleep(NAP_MIN_S)

    def _close_backend(self) -> None:
        self._stop.set()
        if self._heart is not None:
            self._heart.join()
        self._flush(FLUSH_S)
        for sock in [*self._out, *self._in, *([self._listener] if self._listener else [])]:
            sock.close()
        agent = getattr(self, "_agent", None)
        if agent is not None:
            for i, xfer in enumerate(self._xfer):
                if xfer is not None:
                    self._free(xfer)
                    self._xfer[i] = None
            for reg in self._reg:
                try:
                    agent.deregister_memory(reg)
                except Exception:
                    pass
            self._agent = None
        self._rx_payload = []
