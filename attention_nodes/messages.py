"""Control plane between the server (front) and attention workers: typed messages, msgpack frames.

server -> worker: AddRequest (once per request; again with `resume` after a failure), Abort,
StopSequence, Reset (rejoin the data plane of a new epoch: after a restart, dropping every request;
after a failover or when a restarted expert worker is added back, keeping them and routing with
the placement it carries), Shutdown,
SetPlacement (a new expert placement version, once every expert worker holds it).
worker -> server (after the connection's HELLO, in which both sides prove the deployment token:
m2n_comm/_hello.py): Ready (after loading, and after each Reset), Deltas (each step: only what changed), Stats (at
most a few times a second while busy, and once on going idle), Broken (its data plane failed: a
peer died or went silent; it waits for Reset), Failed (it exits).
A frame is a 4-byte big-endian length and a msgpack array [tag, field values...]. Token ids,
never text, cross this boundary.
"""
import dataclasses
import socket
import struct
from dataclasses import dataclass

import msgpack

from attention_nodes.engine import SequenceDelta, TokenLogprobs
from attention_nodes.sampling_params import SamplingParams


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # SamplingParams fields
    # After a failure: per sample, the token ids already streamed (None: that sample finished);
    # the worker recomputes prompt + these and goes on from there. None for a new request.
    resume: list[list[int] | None] | None = None


@dataclass
class Abort:
    request_id: str


@dataclass
class StopSequence:
    request_id: str
    index: int
    stop_reason: str


@dataclass
class Shutdown:
    pass


@dataclass
class Reset:
    epoch: int  # the data plane's new epoch: endpoints are opened under the session of this epoch
    # Failover and adding a worker back: keep every request (a step that broke is computed again)
    # and route with this placement (ExpertPlacement JSON; its down workers are not peers) from the
    # first step of the epoch. None: drop every request (the server resumes them) and keep routing.
    placement: str | None = None


@dataclass
class Ready:
    rank: int
    num_kv_blocks: int
    epoch: int = 0


@dataclass
class Broken:
    """The worker's data plane failed in `epoch`; it waits for Reset (its requests wait too: the
    Reset says whether to drop them).
    peer: the M2N peer that failed it ("" if none in particular); why: the transport's reason."""

    rank: int
    epoch: int
    peer: str
    why: str


@dataclass
class Deltas:
    deltas: list[list]  # SequenceDelta fields, logprobs as lists (see encode_delta)


@dataclass
class Stats:
    rank: int
    stats: dict  # LLMEngine.stats() plus busy_ns (attention compute) and uptime_ns, for /metrics


@dataclass
class Failed:
    rank: int
    message: str


@dataclass
class SetPlacement:
    placement: str  # m2n_comm.placement.ExpertPlacement.to_json(): route with it once every expert worker agrees


_TYPES = [AddRequest, Abort, StopSequence, Shutdown, Ready, Deltas, Failed, Stats, Reset, Broken, SetPlacement]
_TAG = {t: i for i, t in enumerate(_TYPES)}
_LEN = struct.Struct(">I")


def encode(msg) -> bytes:
    body = msgpack.packb([_TAG[type(msg)], *(getattr(msg, f.name) for f in dataclasses.fields(msg))])
    return _LEN.pack(len(body)) + body


def decode(body: bytes):
    tag, *values = msgpack.unpackb(body, strict_map_key=False)
    if not isinstance(tag, int) or not 0 <= tag < len(_TYPES):
        raise ValueError(f"control message with unknown tag {tag!r}")
    return _TYPES[tag](*values)


def send(sock: socket.socket, msg) -> None:
    sock.sendall(encode(msg))


def recv(stream) -> object | None:
    """Read one message from a buffered binary stream (socket.makefile("rb")); None at EOF."""
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    body = stream.read(n)
    if len(body) < n:
        return None
    return decode(body)


def params_to_wire(params: SamplingParams) -> dict:
    return dataclasses.asdict(params)


def params_from_wire(d: dict) -> SamplingParams:
    return SamplingParams(**d)


def _encode_logprobs(lps: list[TokenLogprobs] | None) -> list | None:
    return None if lps is None else [[t.token_id, t.logprob, t.rank, t.top] for t in lps]


def _decode_logprobs(v: list | None) -> list[TokenLogprobs] | None:
    return None if v is None else [TokenLogprobs(t, lp, r, [tuple(x) for x in top]) for t, lp, r, top in v]


def encode_delta(d: SequenceDelta) -> list:
    return [d.request_id, d.index, d.new_token_ids, _encode_logprobs(d.new_logprobs), d.finish_reason, d.stop_reason,
            d.num_cached_tokens, _encode_logprobs(d.prompt_logprobs)]


def decode_delta(v: list) -> SequenceDelta:
    rid, index, ids, logprobs, finish, stop, cached, prompt_logprobs = v
    return SequenceDelta(rid, index, ids, _decode_logprobs(logprobs), finish, stop, cached,
                         _decode_logprobs(prompt_logprobs))
