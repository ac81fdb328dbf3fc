"""The shm backend of the M2N slot transport: every endpoint owns one shared-memory segment holding
its receive slots; a sender writes header and tensor bytes straight into the peer's slot and
publishes the sequence number last. One host (and one pid and network namespace) only.

Segment layout (int64 words; all offsets multiples of 64 bytes):

    [0, 4096)             endpoint header: MAGIC, PID, HEARTBEAT_NS (time.monotonic_ns, written every
                          heartbeat_s), CLOSED; SLEEPING on its own cache line (byte 64)
    4096 + k * stride     slot k = peer_index * num_slots + slot, in the OWNER's peer order;
                          stride = slot_bytes rounded up to 64:
        word 0            SEQ      written by the sender, last (after header and payload)
        word 8            RELEASE  written by the owner on release (the sender's credit)
        word 16..         the fixed header, HEADER_WORDS words (_common.header_words)
        byte 512..        payload, tensors at payload_offsets (SLOT_HEADER_BYTES = 512)

Waiting: spin on the words for cfg.spin_s, then set SLEEPING, re-check, and block on the endpoint's
doorbell, a Unix datagram socket in the abstract namespace ("\\0shuttle-<session>-<me>"), for at
most BLOCK_S. Whoever changes what a sleeper may wait for (a sender publishing SEQ, a receiver
publishing RELEASE, a peer closing) reads the sleeper's SLEEPING after its own store and rings the
doorbell when it is set. Between that store and that load there must be a full fence (x86 reorders
a later load before an earlier store): `_fence` takes a threading.Lock, whose acquire is an atomic
read-modify-write (a locked instruction) in CPython. Payload-then-SEQ needs no fence on x86 (stores
are not reordered with stores); a weakly ordered CPU would need a release store here. A missed ring
would cost at most one BLOCK_S, never correctness.

Cleanup: segments live under /dev/shm. Each endpoint unlinks its own segment as soon as every peer
has mapped it (a second rendezvous at start), so even a SIGKILLed process leaks nothing; the
mapping itself lives until the last process unmaps it. No multiprocessing.resource_tracker is
involved, so nothing is unlinked twice or reported as leaked.
"""
import mmap
import os
import select
import socket
import threading
import time
import uuid
from typing import Callable, TypeVar

import numpy as np
import torch

from m2n_comm._common import (HEADER_WORDS, EndpointBase, TensorDesc, check_peer_info, copy_payload, header_words,
                              process_gone, publish, wait_published)
from m2n_comm.transport import SLOT_HEADER_BYTES, MessageMeta, TransportConfig

T = TypeVar("T")

SEG_HEADER = 4096
MAGIC, PID, HEARTBEAT_NS, CLOSED, SLEEPING = 0, 1, 2, 3, 8   # endpoint header words
SEQ, RELEASE, META = 0, 8, 16                                # slot header words
MAGIC_VALUE = 0x53485554544C4531                             # "SHUTTLE1"
SHM_DIR = "/dev/shm"


class _Segment:
    """One mapped segment: int64 words and uint8 bytes over the same memory."""

    def __init__(self, name: str, size: int, create: bool):
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)  # zero-filled: every SEQ and RELEASE starts at 0
            size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name, self.path = name, path
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.bytes = torch.from_numpy(self.array)
        self.words = np.frombuffer(self.mm, dtype=np.int64)
        self.addr = self.array.ctypes.data  # where the mapping starts in this process

    def close(self) -> None:
        self.array = self.bytes = self.words = None
        try:
            self.mm.close()
        except BufferError:
            pass  # the caller still holds tensor views of the slots; the mapping goes with the last one


class ShmEndpoint(EndpointBase):
    """One process's end of the shm links to `peers` (all on this host): num_slots receive slots of
    cfg.slot_bytes per peer in one /dev/shm segment, created and published (via `store`, keys under
    `session`) here; returns once every peer is mapped (TransportTimeout after connect_timeout_s)."""

    def __init__(self, cfg: TransportConfig, store, session: str, me: str, peers: list[str], num_slots: int):
        super().__init__(cfg, session, me, peers, num_slots)
        self._spin_s = cfg.spin_s
        self._stride = -(-cfg.slot_bytes // 64) * 64
        self._seen = [0] * (len(self.peers) * num_slots)  # per key: last seq recv() took
        self._fence_lock = threading.Lock()
        self._own: _Segment | None = None
        self._remote: list[_Segment] = []
        self._doorbell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._ringer = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._poller = select.poll()
        self._poller.register(self._doorbell, select.POLLIN)
        self._stop = threading.Event()
        self._heart: threading.Thread | None = None
        try:
            self._connect(store)
        except BaseException:
            self.close()
            raise

    def _connect(self, store) -> None:
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        name = f"shuttle-{self.session}-{self.me}-{os.getpid()}-{uuid.uuid4().hex[:8]}".replace("/", "_")
        self._own = _Segment(name, SEG_HEADER + len(self._sent) * self._stride, create=True)
        w = self._own.words
        w[PID], w[HEARTBEAT_NS], w[MAGIC] = os.getpid(), time.monotonic_ns(), MAGIC_VALUE
        # Beat from now on: a peer that finished connecting first already checks our heartbeat.
        self._heart = threading.Thread(target=self._beat, name=f"m2n-shm-heartbeat-{self.me}", daemon=True)
        self._heart.start()
        self._doorbell.bind(self._bell_address(self.me))  # EADDRINUSE: this name is already open in this session
        self._doorbell.setblocking(False)
        self._ringer.setblocking(False)
        info = dict(segment=name, pid=os.getpid(), num_slots=self.num_slots, slot_bytes=self.slot_bytes,
                    peers=self.peers)
        publish(store, self.session, self.me, "shm", info)
        infos = wait_published(store, self.session, self.peers, "shm", deadline)
        self._pids, self._remote_base, self._bells = [], [], []
        for p in self.peers:
            me_there = check_peer_info(self.me, p, infos[p], self.num_slots, self.slot_bytes)
            seg = _Segment(infos[p]["segment"], 0, create=False)
            self._remote.append(seg)
            if seg.words[MAGIC] != MAGIC_VALUE:
                raise ValueError(f"M2N peer {p!r}: segment {seg.name} is not a Shuttle slot segment")
            self._pids.append(int(infos[p]["pid"]))
            self._remote_base.append(me_there * self.num_slots)
            self._bells.append(self._bell_address(p))
        # A pid outside our pid namespace cannot be checked; such peers rely on heartbeats alone.
        self._check_pid = [process_gone(pid) is None for pid in self._pids]
        n = self.capacity
        self._rx_payload = [self._own.bytes[self._payload_at(k): self._payload_at(k) + n] for k in range(len(self._sent))]
        publish(store, self.session, self.me, "shm-mapped", {})
        wait_published(store, self.session, self.peers, "shm-mapped", deadline)
        self._unlink()

    def _bell_address(self, who: str) -> bytes:
        addr = f"\0shuttle-{self.session}-{who}".encode()
        if len(addr) > 107:
            raise ValueError(f"session + endpoint name too long for a doorbell address: {addr!r}")
        return addr

    def _word_at(self, k: int) -> int:
        """Word index of slot k's header in a segment."""
        return (SEG_HEADER + k * self._stride) // 8

    def _payload_at(self, k: int) -> int:
        return SEG_HEADER + k * self._stride + SLOT_HEADER_BYTES

    def _fence(self) -> None:
        self._fence_lock.acquire()
        self._fence_lock.release()

    def _ring(self, pi: int) -> None:
        if self._remote[pi].words[SLEEPING]:
            try:
                self._ringer.sendto(b"!", self._bells[pi])
            except OSError:
                pass  # its queue is full (it will wake anyway) or it is gone (liveness reports that)

    # -- hooks ------------------------------------------------------------------------------------
    def _has_message(self, i: int) -> bool:
        return self._own.words[self._word_at(i) + SEQ] > self._seen[i]

    def _take(self, i: int) -> tuple[int, MessageMeta, list[TensorDesc]]:
        base = self._word_at(i)
        seq = int(self._own.words[base + SEQ])
        meta, descs = self._parsed(self._own.words[base + META: base + META + HEADER_WORDS].tolist())
        self._seen[i] = seq
        return seq, meta, descs

    def _slot_free(self, i: int) -> bool:
        pi, slot = divmod(i, self.num_slots)
        base = self._word_at(self._remote_base[pi] + slot)
        return self._remote[pi].words[base + RELEASE] == self._sent[i]

    def _write(self, i: int, meta: MessageMeta, descs: list[TensorDesc], srcs: list[torch.Tensor], end: int) -> None:
        pi, slot = divmod(i, self.num_slots)
        seg, k = self._remote[pi], self._remote_base[pi] + slot
        base = self._word_at(k)
        seg.words[base + META: base + META + HEADER_WORDS] = header_words(meta, descs)
        copy_payload(seg.addr + self._payload_at(k), descs, srcs)
        seg.words[base + SEQ] = self._sent[i]  # publish last: the receiver reads the payload only after this
        self._fence()
        self._ring(pi)

    def _release(self, i: int, seq: int) -> None:
        self._own.words[self._word_at(i) + RELEASE] = seq
        self._fence()
        self._ring(i // self.num_slots)

    def _dead_reason(self, pi: int, thorough: bool) -> str | None:
        w = self._remote[pi].words
        if w[CLOSED]:
            return "it closed its endpoint"
        age = (time.monotonic_ns() - int(w[HEARTBEAT_NS])) / 1e9
        if age > self.cfg.dead_after_s:
            return f"no heartbeat for {age:.1f} s (dead_after_s={self.cfg.dead_after_s})"
        return process_gone(self._pids[pi]) if thorough and self._check_pid[pi] else None

    def _block(self, ready: Callable[[], T], seconds: float) -> T | None:
        w = self._own.words
        w[SLEEPING] = 1
        self._fence()  # SLEEPING must be visible before we re-read what we wait for (see module doc)
        try:
            r = ready()
            if r:
                return r
            self._poller.poll(max(1, round(seconds * 1000)))  # the doorbell; releases the GIL
        finally:
            w[SLEEPING] = 0
        while True:  # drain rings that raced with our wake-up so the next block really blocks
            try:
                self._doorbell.recv(64)
            except BlockingIOError:
                break
        return ready()

    def _beat(self) -> None:
        words = self._own.words  # close() joins this thread before it unmaps
        while not self._stop.wait(self.cfg.heartbeat_s):
            words[HEARTBEAT_NS] = time.monotonic_ns()

    # -- teardown -----------------------------------------------------------------------------
    def _unlink(self) -> None:
        try:
            os.unlink(self._own.path)
        except FileNotFoundError:
            pass

    def _close_backend(self) -> None:
        self._stop.set()
        if self._heart is not None:
            self._heart.join()
        if self._own is not None:
            self._own.words[CLOSED] = 1
            self._fence()
            for pi in range(len(self._remote)):
                self._ring(pi)  # wake peers blocked on us so they see CLOSED now
            self._unlink()
        self._doorbell.close()
        self._ringer.close()
        self._rx_payload = []
        for seg in [*self._remote, *([self._own] if self._own else [])]:
            seg.close()

