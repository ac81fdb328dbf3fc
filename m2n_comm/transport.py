"""The slot protocol every M2N backend implements: pairwise slots, one-sided writes, sequence flags.

An Endpoint is one process's end of the links to its peers (named strings such as "a0", "e1").
For every ordered pair (me -> peer) there are `num_slots` slots, each a receive buffer of
`slot_bytes` allocated once at start on the receiving side. A message is a fixed binary header
(MessageMeta: kind, step, layer, mb, aux, then each tensor's dtype and shape) plus the raw tensor
bytes: never pickled, never a per-message allocation or handshake. The receiver learns that a slot
holds a new message from its sequence number; `release` hands the slot back, and a sender writing
into a slot whose last message was not released yet waits for that release (credit-based flow
control, so a receiver never has to stall its reader).

Liveness: every endpoint publishes a heartbeat; any wait (for a message, for a release, for a
connection) checks the peer's heartbeat and raises PeerDeadError naming the peer when it has been
silent for `dead_after_s` or its process is gone, and TransportTimeout when an explicit deadline
passes. Nothing waits forever.

Backends (opened by m2n_comm/endpoints.py, which this module does not import): shm (one host, m2n_comm/shm.py), tcp (any hosts, m2n_comm/tcp.py), nixl (any hosts, RDMA
where the NIC has it: m2n_comm/nixl.py maps `send` to a NIXL WRITE into the peer's registered slot
with a notification, and `recv` to polling NIXL's notifications).
"""
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

# Message kinds used by the M2N layer (m2n_comm/m2n.py); the transport carries them unchanged.
KIND_DATA = 1     # tokens for (step, layer, mb), or the experts' rows back
KIND_WAKE = 2     # expert -> attention: a new step began after an all-idle step

BACKENDS = ("shm", "tcp", "nixl")
MAX_TENSORS = 4
MAX_DIMS = 3

# Wire constants every backend shares, so a slot holds the same messages on shm and tcp.
SLOT_HEADER_BYTES = 512  # of every slot's slot_bytes: sequence/release words plus the fixed header
TENSOR_ALIGN = 64        # each tensor starts at a multiple of this many bytes into the payload
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3,
                                       torch.int32: 4, torch.int64: 5, torch.uint8: 6, torch.float8_e4m3fn: 7}
CODE_DTYPES: dict[int, torch.dtype] = {c: d for d, c in DTYPE_CODES.items()}


def payload_offsets(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offset of each tensor in a slot's payload (aligned to TENSOR_ALIGN) and the payload's
    end. nbytes: each tensor's size in bytes, in message order."""
    offsets, end = [], 0
    for n in nbytes:
        start = -(-end // TENSOR_ALIGN) * TENSOR_ALIGN
        offsets.append(start)
        end = start + n
    return offsets, end


def message_nbytes(nbytes: Sequence[int]) -> int:
    """Bytes of slot a message with tensors of these sizes (bytes each) takes, header included:
    size slot_bytes (TransportConfig) as at least this for the largest message."""
    return SLOT_HEADER_BYTES + payload_offsets(nbytes)[1]


class PeerDeadError(RuntimeError):
    """A peer stopped answering: its process exited, or its heartbeat went silent."""

    def __init__(self, peer: str, why: str):
        super().__init__(f"M2N peer {peer!r} is dead or silent: {why}")
        self.peer = peer


class TransportTimeout(TimeoutError):
    """An explicit deadline passed while the peer was still alive."""


@dataclass(frozen=True)
class MessageMeta:
    """The fixed header fields the M2N layer sets; the backend adds dtype/shape per tensor."""

    kind: int
    step: int = 0
    layer: int = 0
    mb: int = 0
    aux: int = 0  # free for the layer above (e.g. all tokens the expert gathered for this slot)


@dataclass
class Message:
    """A received message: its header and its tensors, which are views of the slot buffer (CPU)
    valid until `Endpoint.release(peer, slot)`."""

    peer: str
    slot: int
    seq: int
    meta: MessageMeta
    tensors: list[torch.Tensor]


class Endpoint(Protocol):
    me: str
    peers: list[str]
    num_slots: int
    slot_bytes: int

    def send(self, peer: str, slot: int, meta: MessageMeta, tensors: Sequence[torch.Tensor],
             timeout: float | None = None) -> None:
        """Write a message into `peer`'s slot `slot` (waiting for that slot's previous message to be
        released first). tensors: up to MAX_TENSORS CPU tensors of up to MAX_DIMS dims (any dtype of
        models.config.DTYPES or int32/int64, may be empty, made contiguous here). Returns once the
        bytes are handed over (shm: written and flagged; tcp: queued on the socket)."""
        ...

    def recv(self, peer: str, slot: int, timeout: float | None = None) -> Message:
        """Wait for the next message from `peer` in my slot `slot` (poll briefly, then block)."""
        ...

    def poll(self, peer: str, slot: int) -> bool:
        """True when a message from `peer` waits in slot `slot` (never blocks)."""
        ...

    def wait_any(self, keys: Sequence[tuple[str, int]], timeout: float | None) -> tuple[str, int] | None:
        """Block until one of the (peer, slot) keys holds a message, without taking it; None on
        timeout. Checks liveness of the peers in `keys` while waiting."""
        ...

    def release(self, peer: str, slot: int) -> None:
        """Give slot `slot` of `peer` back (the message's tensor views become invalid)."""
        ...

    def check_alive(self, peer: str) -> None:
        """Raise PeerDeadError if the peer is dead or silent."""
        ...

    def close(self) -> None:
        """Stop heartbeats, close sockets, free (and for shm unlink) the buffers. Idempotent."""
        ...


@dataclass(frozen=True)
class TransportConfig:
    """backend: "shm", "tcp" or "nixl". slot_bytes: capacity of one slot (header included), sized by the
    caller from the largest batch. heartbeat_s: how often liveness is published; dead_after_s:
    silence after which a peer is declared dead; connect_timeout_s: how long to wait for peers to
    appear at start."""

    backend: str = "shm"
    slot_bytes: int = 1 << 20
    heartbeat_s: float = 0.5
    dead_after_s: float = 3.0
    connect_timeout_s: float = 60.0
    host: str = "127.0.0.1"  # tcp: the address this endpoint listens on and publishes
    # How long a wait polls (yielding the core between polls) before it blocks: waking a blocked
    # process costs ~50-100 us here, more than a whole small round trip.
    spin_s: float = 1e-3
    # "fixed": spin the whole spin_s; "adaptive": stop at the first sched_yield that gave the core
    # away (other processes want the cores: block, and the peer's ring wakes us). Under a load of 8
    # on 2 cores, adaptive was 0.5x to 2x of fixed's round time (bench/m2n.py shm:adaptive): no
    # clear win, so fixed stays the default until a quiet machine says otherwise.
    spin_policy: str = "fixed"
    # The deployment's shared secret: tcp and nixl peers prove it in their HELLO and sign their store
    # records with it (_hello.py); it never crosses the wire. PoolEngine hands it to every worker.
    # "" only for endpoints opened by hand (tests, benches).
    token: str = field(default="", repr=False)
    # nixl: NIXL's UCX backend setting ucx_error_handling_mode. "none" (default) lets UCX use shared
    # memory between processes on one host (its shm transports have no peer-failure handler; our
    # heartbeats cover liveness); "peer" lets UCX drop a failed peer's endpoint itself (tcp, RDMA).
    ucx_error_handling: str = "none"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"transport backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.ucx_error_handling not in ("none", "peer"):
            raise ValueError(f"ucx_error_handling must be none or peer, got {self.ucx_error_handling!r}")
        if self.slot_bytes < 4096:
            raise ValueError(f"slot_bytes must be at least 4096, got {self.slot_bytes}")
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise ValueError(f"need 0 < heartbeat_s ({self.heartbeat_s}) < dead_after_s ({self.dead_after_s})")
        if self.spin_policy not in ("adaptive", "fixed"):
            raise ValueError(f"spin_policy must be adaptive or fixed, got {self.spin_policy!r}")
        if not 0 <= self.spin_s < 0.1:
            raise ValueError(f"spin_s must be in [0, 0.1) seconds, got {self.spin_s}")
        if not isinstance(self.token, str):
            raise ValueError(f"token must be a str, got {type(self.token).__name__}")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be positive, got {self.connect_timeout_s}")


def data_session(session: str, epoch: int) -> str:
    """The session of a deployment's data plane in `epoch`: after a failure every endpoint is opened
    again under a new epoch, so slots, store keys and shm names never mix with the broken one's."""
    return session if epoch == 0 else f"{session}.g{epoch}"
