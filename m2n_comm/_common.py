"""What the shm and tcp backends share: tensor descriptors and the payload layout, argument checks,
the store rendezvous, the poll-then-block wait loop with its liveness checks, and the public
Endpoint methods, written once on top of a few backend hooks (`_has_message`, `_take`, `_slot_free`,
`_write`, `_release`, `_dead_reason`, `_block`, `_close_backend`).

Keys: a (peer, slot) pair is the integer `peer_index * num_slots + slot` in this endpoint's own
`peers` order, for the slots it receives into and for the slots it sends into alike.
Sequence numbers: the n-th message a sender writes into one slot has seq n (from 1); the receiver
acknowledges it by publishing release = n, and the sender writes message n + 1 only after that.
"""
import atexit
import ctypes
import functools
from abc import ABC, abstractmethod
import json
import os
import time
import weakref
from typing import Callable, NamedTuple, Sequence, TypeVar

import torch

from m2n_comm.transport import (CODE_DTYPES, DTYPE_CODES, MAX_DIMS, MAX_TENSORS, SLOT_HEADER_BYTES, Message,
                                MessageMeta, PeerDeadError, TransportConfig, TransportTimeout, payload_offsets)

BLOCK_S = 0.05          # longest single block inside a wait: deadlines and liveness are checked between blocks
STORE_POLL_S = 0.01     # how often the rendezvous re-checks the store for missing peers
HEADER_WORDS = 6 + 5 * MAX_TENSORS  # kind, step, layer, mb, aux, n, then (code, ndim, d0, d1, d2) per tensor
CONTENDED_YIELD_S = 50e-6  # a sched_yield that kept us off the core longer: other processes want it
VIEW_CACHE_SIZE = 256   # distinct (slot, layout) pairs whose views and checked headers are kept

T = TypeVar("T")


class TensorDesc(NamedTuple):
    """One tensor of a message: dtype code (DTYPE_CODES), shape, byte offset in the payload, size."""

    code: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def describe(tensors: Sequence[torch.Tensor]) -> tuple[list[TensorDesc], list[torch.Tensor], int]:
    """Check the tensors a caller sends; returns their descriptors, each one contiguous (itself when
    it already is), and the payload size in bytes. No torch op for contiguous tensors: reshaping and
    viewing cost more per message than the syscall that sends it (bench/m2n.py's phases)."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a message carries at most {MAX_TENSORS} tensors, got {len(tensors)}")
    srcs, specs = [], []
    for j, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {j} is a {type(t).__name__}, not a torch.Tensor")
        if not t.is_cpu:
            raise ValueError(f"tensor {j} is on {t.device}; the transport sends CPU tensors")
        code = DTYPE_CODES.get(t.dtype)
        if code is None:
            raise ValueError(f"tensor {j} has dtype {t.dtype}; supported: {', '.join(map(str, DTYPE_CODES))}")
        shape = tuple(t.shape)
        if len(shape) > MAX_DIMS:
            raise ValueError(f"tensor {j} has {len(shape)} dims (shape {shape}); at most {MAX_DIMS}")
        srcs.append(t if t.is_contiguous() else t.contiguous())
        specs.append((code, shape))
    descs, end = _layout(tuple(specs))
    return descs, srcs, end


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a flat memoryview (format "B") of its memory."""
    n = t.nbytes
    if not n:
        return memoryview(b"")
    arr = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    arr.keep = t  # the memory lives as long as the view
    return memoryview(arr).cast("B")


def copy_payload(dst_addr: int, descs: Sequence[TensorDesc], srcs: Sequence[torch.Tensor]) -> None:
    """Copy contiguous CPU tensors to their offsets in the payload that starts at address dst_addr:
    one memmove each (no torch op: torch's copy_ wakes its OpenMP pool, whose spinning threads
    starve the other processes on a small machine, 8 ms round trips; and ctypes releases the GIL
    for the copy, so the heartbeat thread is not held up by a large one)."""
    for d, t in zip(descs, srcs):
        if d.nbytes:
            ctypes.memmove(dst_addr + d.offset, t.data_ptr(), d.nbytes)


def layout(specs: Sequence[tuple[int, Sequence[int]]]) -> tuple[list[TensorDesc], int]:
    """Descriptors for (dtype code, shape) pairs laid out as payload_offsets does; and the payload end."""
    return _layout(tuple((c, tuple(s)) for c, s in specs))


@functools.lru_cache(maxsize=1024)
def _layout(specs: tuple[tuple[int, tuple[int, ...]], ...]) -> tuple[list[TensorDesc], int]:
    """layout() memoized: a decode loop sends the same few shapes over and over. The list it
    returns is shared: callers never modify it."""
    sizes = []
    for code, shape in specs:
        n = CODE_DTYPES[code].itemsize
        for d in shape:
            n *= d
        sizes.append(n)
    offsets, end = payload_offsets(sizes)
    return [TensorDesc(c, tuple(s), o, n) for (c, s), o, n in zip(specs, offsets, sizes)], end


def check_specs(specs: object, capacity: int) -> tuple[list[TensorDesc], int]:
    """layout() for specs that came off the wire or out of shared memory: validated first, so a
    corrupt header raises ValueError instead of producing views outside the slot."""
    if not isinstance(specs, (list, tuple)) or len(specs) > MAX_TENSORS:
        raise ValueError(f"bad tensor list in message header: {specs!r}")
    for spec in specs:
        ok = (isinstance(spec, (list, tuple)) and len(spec) == 2 and spec[0] in CODE_DTYPES
              and isinstance(spec[1], (list, tuple)) and len(spec[1]) <= MAX_DIMS
              and all(isinstance(d, int) and d >= 0 for d in spec[1]))
        if not ok:
            raise ValueError(f"bad tensor spec in message header: {spec!r}")
    descs, end = layout(specs)
    if end > capacity:
        raise ValueError(f"message header claims {end} payload bytes, the slot holds {capacity}")
    return descs, end


def header_words(meta: MessageMeta, descs: Sequence[TensorDesc]) -> list[int]:
    """The fixed header as HEADER_WORDS int64 words (shm writes them into the slot header)."""
    words = [meta.kind, meta.step, meta.layer, meta.mb, meta.aux, len(descs)]
    for d in descs:
        words += [d.code, len(d.shape), *d.shape, *([0] * (MAX_DIMS - len(d.shape)))]
    return words + [0] * (HEADER_WORDS - len(words))


def parse_words(words: Sequence[int], capacity: int) -> tuple[MessageMeta, list[TensorDesc]]:
    """Inverse of header_words, validated against the slot's payload capacity (bytes)."""
    n = int(words[5])
    if not 0 <= n <= MAX_TENSORS:
        raise ValueError(f"corrupt slot header: {n} tensors")
    specs = []
    for j in range(n):
        code, ndim, *dims = (int(w) for w in words[6 + 5 * j: 11 + 5 * j])
        specs.append((code, tuple(dims[:ndim]) if 0 <= ndim <= MAX_DIMS else (-1,)))
    descs, _ = check_specs(specs, capacity)
    meta = MessageMeta(int(words[0]), int(words[1]), int(words[2]), int(words[3]), int(words[4]))
    return meta, descs


def views(payload: torch.Tensor, descs: Sequence[TensorDesc]) -> list[torch.Tensor]:
    """The message's tensors as views of a slot's payload (a 1-D uint8 tensor): no copy."""
    return [payload[d.offset: d.offset + d.nbytes].view(CODE_DTYPES[d.code]).view(d.shape) for d in descs]


def store_key(session: str, who: str, what: str) -> str:
    return f"shuttle-m2n/{session}/{who}/{what}"


def publish(store, session: str, me: str, what: str, info: dict) -> None:
    """Publish `info` as JSON (open_endpoint's store signs it: _hello.SignedStore)."""
    store.set(store_key(session, me, what), json.dumps(info))


def wait_published(store, session: str, peers: Sequence[str], what: str, deadline: float) -> dict[str, dict]:
    """Wait until every peer published `what`; returns peer -> its info. Polls the store (check()
    never blocks) so the deadline holds; TransportTimeout names the peers still missing."""
    keys = {p: store_key(session, p, what) for p in peers}
    missing = list(peers)
    while missing:
        missing = [p for p in missing if not store.check([keys[p]])]
        if missing and time.monotonic() >= deadline:
            raise TransportTimeout(f"M2N connect: peers {missing} did not publish {what!r} in time")
        if missing:
            time.sleep(STORE_POLL_S)
    return {p: json.loads(store.get(keys[p])) for p in peers}


def check_peer_info(me: str, peer: str, info: dict, num_slots: int, slot_bytes: int) -> int:
    """Check that a peer agrees on the slot geometry and lists me; returns my index in its peers."""
    if info["num_slots"] != num_slots or info["slot_bytes"] != slot_bytes:
        raise ValueError(f"M2N peer {peer!r} has num_slots={info['num_slots']}, slot_bytes={info['slot_bytes']}; "
                         f"{me!r} has num_slots={num_slots}, slot_bytes={slot_bytes}")
    if me not in info["peers"]:
        raise ValueError(f"M2N peer {peer!r} does not list {me!r} among its peers {info['peers']}")
    return info["peers"].index(me)


def _close_at_exit(ref: "weakref.ref[EndpointBase]") -> None:
    ep = ref()
    if ep is not None:
        ep.close()


class EndpointBase(ABC):
    """The public Endpoint methods (see m2n_comm.transport.Endpoint) over the backend hooks.

    One thread at a time may wait on an endpoint (the M2N layer's loop); the backends' own threads
    (heartbeat) only touch state they own or state guarded as noted there (tcp: `_rx_lock`)."""

    _spin_s: float = 0.0  # busy-poll before blocking; set by backends where polling is cheap

    def _spin_pause(self) -> bool:
        """Called between polls while spinning: yield the core (spinning costs nothing while no other
        process wants it; tcp and nixl also read their sockets here). True when the yield gave the
        core away for longer than CONTENDED_YIELD_S: other processes want it."""
        t = time.perf_counter()
        os.sched_yield()
        return time.perf_counter() - t > CONTENDED_YIELD_S

    def __init__(self, cfg: TransportConfig, session: str, me: str, peers: Sequence[str], num_slots: int):
        if not isinstance(me, str) or not me or not isinstance(session, str) or not session:
            raise ValueError(f"session and me must be non-empty strings, got {session!r}, {me!r}")
        if len(set(peers)) != len(peers) or me in peers or not all(isinstance(p, str) and p for p in peers):
            raise ValueError(f"peers must be distinct non-empty names other than me={me!r}, got {list(peers)}")
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.cfg, self.session, self.me = cfg, session, me
        self._adaptive = cfg.spin_policy == "adaptive"
        self.peers, self.num_slots, self.slot_bytes = list(peers), num_slots, cfg.slot_bytes
        self.capacity = cfg.slot_bytes - SLOT_HEADER_BYTES  # payload bytes one slot holds
        self._index = {p: i for i, p in enumerate(self.peers)}
        n = len(self.peers) * num_slots
        self._sent = [0] * n   # seq of my last message into each peer's slot
        self._held = [0] * n   # seq of the message recv() handed out and not yet released (0: none)
        self._closed = False
        self._found_dead: dict[int, str] = {}  # peer index -> why it was declared dead
        self._view_cache: dict[tuple, list[torch.Tensor]] = {}  # (key, descs) -> views of the payload
        self._spec_cache: dict[tuple, list[TensorDesc]] = {}  # header words after the meta -> checked layout
        self._exit_hook = lambda ref=weakref.ref(self): _close_at_exit(ref)
        atexit.register(self._exit_hook)

    # -- checks -------------------------------------------------------------------------------
    def _key(self, peer: str, slot: int) -> int:
        i = self._index.get(peer) if isinstance(peer, str) else None
        if i is None:
            raise ValueError(f"unknown M2N peer {peer!r}; {self.me!r} knows {self.peers}")
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an int in [0, {self.num_slots}), got {slot!r}")
        if self._closed:
            raise RuntimeError(f"M2N endpoint {self.me!r} is closed")
        return i * self.num_slots + slot

    def _raise_if_dead(self, pi: int, thorough: bool) -> None:
        """Death is final: once a peer was found dead (or silent), every later call on it raises,
        even if a silent one speaks again, so the layer above sees one consistent failure."""
        why = self._found_dead.get(pi) or self._dead_reason(pi, thorough)
        if why is not None:
            self._found_dead[pi] = why
            raise PeerDeadError(self.peers[pi], why)

    # -- the wait loop ------------------------------------------------------------------------
    def _wait(self, ready: Callable[[], T], peer_idx: Sequence[int], timeout: float | None, what: str) -> T | None:
        """Return ready()'s first truthy value: poll it for _spin_s, then block in slices of at most
        BLOCK_S (the backend's _block wakes early when something arrives), checking the peers'
        liveness between blocks. None once `timeout` seconds passed (None: no deadline).
        With spin_policy "adaptive" the spinning ends at the first contended yield: when more
        processes want the cores than there are, a spinner only waits its turn behind them and is
        last in line when its message comes, while a blocked waiter that is woken runs at once."""
        r = ready()
        if r:
            return r
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        spin_end = time.perf_counter() + self._spin_s
        while time.perf_counter() < spin_end:
            contended = self._spin_pause()
            r = ready()
            if r:
                return r
            if contended and self._adaptive:
                break
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                for pi in peer_idx:
                    self._raise_if_dead(pi, thorough=True)
            except PeerDeadError:
                r = ready()  # what a peer sent before it died is still delivered (tcp reads it in the check)
                if r:
                    return r
                raise
            if self._closed:
                raise RuntimeError(f"M2N endpoint {self.me!r} was closed while waiting for {what}")
            left = BLOCK_S if deadline is None else min(BLOCK_S, deadline - time.monotonic())
            if left <= 0:
                return None
            r = self._block(ready, left)
            if r:
                return r

    # -- public methods -------------------------------------------------------------------------
    def send(self, peer: str, slot: int, meta: MessageMeta, tensors: Sequence[torch.Tensor],
             timeout: float | None = None) -> None:
        """See transport.Endpoint.send. Raises ValueError for a message over slot_bytes, PeerDeadError
        when the peer dies, TransportTimeout when `timeout` (s) passes before the slot is released."""
        i = self._key(peer, slot)
        if not isinstance(meta, MessageMeta):
            raise ValueError(f"meta must be a MessageMeta, got {type(meta).__name__}")
        descs, srcs, end = describe(tensors)
        if end > self.capacity:
            raise ValueError(f"message of {SLOT_HEADER_BYTES + end} bytes ({end} of tensors + {SLOT_HEADER_BYTES} "
                             f"header) does not fit slot_bytes={self.slot_bytes}")
        pi = i // self.num_slots
        self._raise_if_dead(pi, thorough=False)
        if not self._wait(lambda: self._slot_free(i), [pi], timeout, f"{peer!r} to release slot {slot}"):
            raise TransportTimeout(f"{self.me!r}: {peer!r} did not release slot {slot} within {timeout} s")
        self._sent[i] += 1
        self._write(i, meta, descs, srcs, end)

    def recv(self, peer: str, slot: int, timeout: float | None = None) -> Message:
        """See transport.Endpoint.recv; TransportTimeout after `timeout` seconds (None: no deadline)."""
        i = self._key(peer, slot)
        if self._held[i]:
            raise ValueError(f"{self.me!r}: release slot {slot} of {peer!r} before receiving from it again")
        if not self._wait(lambda: self._has_message(i), [i // self.num_slots], timeout,
                          f"a message from {peer!r} in slot {slot}"):
            raise TransportTimeout(f"{self.me!r}: no message from {peer!r} in slot {slot} within {timeout} s")
        seq, meta, descs = self._take(i)
        self._held[i] = seq
        return Message(peer, slot, seq, meta, self._views(i, descs))

    def _views(self, i: int, descs: list[TensorDesc]) -> list[torch.Tensor]:
        """views() of key i's payload, made once per (key, layout): a decode loop receives the same
        few shapes over and over, and three torch view ops per tensor cost more than the copy."""
        k = (i, tuple(descs))
        v = self._view_cache.get(k)
        if v is None:
            if len(self._view_cache) >= VIEW_CACHE_SIZE:
                self._view_cache.clear()
            v = self._view_cache[k] = views(self._rx_payload[i], descs)
        return list(v)

    def _parsed(self, words: list[int]) -> tuple[MessageMeta, list[TensorDesc]]:
        """parse_words() of a slot header, the tensor part checked once per distinct layout."""
        tail = tuple(words[5:])
        descs = self._spec_cache.get(tail)
        if descs is None:
            descs = parse_words(words, self.capacity)[1]
            if len(self._spec_cache) >= VIEW_CACHE_SIZE:
                self._spec_cache.clear()
            self._spec_cache[tail] = descs
        return MessageMeta(*words[:5]), descs

    def poll(self, peer: str, slot: int) -> bool:
        return self._has_message(self._key(peer, slot))

    def wait_any(self, keys: Sequence[tuple[str, int]], timeout: float | None) -> tuple[str, int] | None:
        """See transport.Endpoint.wait_any: the first key (in `keys` order) holding a message."""
        if not keys:
            raise ValueError("wait_any needs at least one (peer, slot) key")
        idx = [self._key(p, s) for p, s in keys]
        has = self._has_message

        def ready() -> int | None:
            for j, i in enumerate(idx):
                if has(i):
                    return j + 1  # 1-based so that a hit on the first key is truthy
            return None

        j = self._wait(ready, sorted({i // self.num_slots for i in idx}), timeout, f"any of {list(keys)}")
        return None if j is None else tuple(keys[j - 1])

    def release(self, peer: str, slot: int) -> None:
        i = self._key(peer, slot)
        if not self._held[i]:
            raise ValueError(f"{self.me!r}: slot {slot} of {peer!r} holds no received message to release")
        seq, self._held[i] = self._held[i], 0
        self._release(i, seq)

    def check_alive(self, peer: str) -> None:
        self._key(peer, 0)
        self._raise_if_dead(self._index[peer], thorough=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._view_cache.clear()  # they hold the receive buffers (shm: the mapping) alive
        atexit.unregister(self._exit_hook)
        self._close_backend()

    # -- backend hooks ----------------------------------------------------------------------------
    _rx_payload: list[torch.Tensor]  # per key: my receive slot's payload, 1-D uint8 of self.capacity bytes

    @abstractmethod
    def _has_message(self, i: int) -> bool:
        ...

    @abstractmethod
    def _take(self, i: int) -> tuple[int, MessageMeta, list[TensorDesc]]:
        """The waiting message's seq, meta and tensor descriptors; marks it taken."""
        ...

    @abstractmethod
    def _slot_free(self, i: int) -> bool:
        """True when the peer released my last message in this slot."""
        ...

    @abstractmethod
    def _write(self, i: int, meta: MessageMeta, descs: list[TensorDesc], srcs: list[torch.Tensor], end: int) -> None:
        """Hand message self._sent[i] over to the peer (payload of `end` bytes; srcs contiguous)."""
        ...

    @abstractmethod
    def _release(self, i: int, seq: int) -> None:
        ...

    @abstractmethod
    def _dead_reason(self, pi: int, thorough: bool) -> str | None:
        """Why peer `pi` counts as dead, or None. thorough=False: only checks that cost no syscall."""
        ...

    @abstractmethod
    def _block(self, ready: Callable[[], T], seconds: float) -> T | None:
        """Sleep until woken (something arrived or was released) or `seconds` pass; then ready()."""
        ...

    @abstractmethod
    def _close_backend(self) -> None:
        ...


def process_gone(pid: int) -> str | None:
    """Why process `pid` (same host, same pid namespace) no longer runs, or None while it does."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"process {pid} is gone"
    except PermissionError:
        return None
    try:  # a killed child its parent has not reaped yet still answers kill(pid, 0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return f"process {pid} exited" if state in (b"Z", b"X") else None
