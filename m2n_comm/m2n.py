"""M2N dispatch and combine over the slot transport (m2n_comm/transport.py).

Legend: T tokens of one micro-batch on one attention worker, D hidden, K experts per token,
E experts, W expert workers; R rows gathered on an expert worker from all attention workers.

    sender = M2NSender(endpoint, placement, expert_peers, hidden, top_k)   # attention worker
    sender.begin_step()
    handle = sender.dispatch(layer, experts=None, x_TD, topk_ids_TK, topk_weights_TK, mb=i)
    y_TD = sender.combine(handle)                                           # waits on this handle only
    sender.end_step()

    receiver = M2NReceiver(endpoint, attention_peers, moe_layers, num_micro_batches)   # expert worker
    batch = receiver.recv(layer, mb)     # every attention worker's chunk for the slot, concatenated
    receiver.reply(batch, y_RD)          # each attention worker gets its rows back

Slots: micro-batch i uses slot i in both directions, so m micro-batches are in flight at once and
a slot is reused only after its previous answer was combined. A chunk for expert worker w holds
the tokens with at least one expert on w: x (T_w, D), local expert ids (T_w, K) int32 with -1 for
experts elsewhere (with a single expert worker: the router's ids as they are, int32 or int64),
router weights (T_w, K). The answer is y (T_w, D): the weighted sum over the
tokens' experts on w; the attention worker adds the answers of all expert workers.

FP8 dispatch (`wire_dtype=torch.float8_e4m3fn`, --m2n-dtype fp8): x travels as float8 e4m3 with one
scale per token (its largest magnitude / 448, in x's dtype) as a fourth tensor (T_w, 1); the expert
worker multiplies it back into x's dtype before computing. Answers stay in x's dtype. A chunk says
by its tensor count which it is, so expert workers need no setting.

Lock-step and idling: every attention worker takes part in every step (an idle one sends empty
chunks), and each answer carries the number of tokens the expert worker gathered for the slot. When
a whole step gathered nothing anywhere, attention workers with no work park (`poll_wake`) instead
of spinning empty steps; an expert worker that saw an empty step sends WAKE (slot 0) to the other
attention workers as soon as one of them starts the next step. A stray WAKE is skipped.

Waits on peers (`waited_ns`, for pools/stragglers.py): where a slot needs several peers' messages,
they are taken in the order they arrive, and each peer is charged the time from the previous
arrival (or from when the wait began) to its own: a peer that is consistently late is charged the
wait it alone caused. An expert worker does not count its wait for a step's first slot (idle time).
"""
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.fp8 import FP8, dequantize_fp8, quantize_fp8
from m2n_comm.placement import ExpertPlacement, Placement
from m2n_comm.transport import KIND_DATA, KIND_WAKE, Endpoint, MessageMeta
from telemetry.trace import Tracer


class HostStaging:
    """Pinned host buffers for moving GPU tensors to and from the transport: allocated on first use
    at the size asked for and grown only when a larger message comes (page-locked memory lets the
    copy run at full PCIe speed). CPU tensors pass through untouched."""

    def __init__(self):
        self._buf: torch.Tensor | None = None

    def _host_views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the pinned buffer shaped like `tensors`, back to back (grown when too small)."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        if self._buf is None or self._buf.numel() < sum(sizes):
            self._buf = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self._buf[o:o + n].view(t.dtype).view(t.shape) for t, o, n in zip(tensors, offsets, sizes)]

    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if all(t.device.type == "cpu" for t in tensors):
            return tensors
        out = self._host_views(tensors)
        for host, t in zip(out, tensors):
            host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(tensors[0].device).synchronize()
        return out

    def to_device(self, tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """Host tensors (e.g. views of a transport slot) to `device`, through pinned memory."""
        if device.type == "cpu":
            return tensors
        out = []
        for host, t in zip(self._host_views(tensors), tensors):
            host.copy_(t)
            out.append(host.to(device, non_blocking=True))
        torch.cuda.current_stream(device).synchronize()  # the pinned buffer is reused by the next call
        return out


@dataclass
class Handle:
    """What `combine` needs: the slot, and the rows of x sent to each expert worker."""

    step: int
    layer: int
    mb: int
    num_tokens: int
    rows_W: list[torch.Tensor | None]  # per live expert worker: (T_w,) int64 indices into the micro-batch; None: all
    dtype: torch.dtype
    device: torch.device


class _Routes:
    """A placement as lookup tables on one device, per MoE layer (key None: every layer):
    ncopies_E (round-robin slots of each expert: its copies' shares summed), copy_EC (the worker of
    each slot, padded with the first), local_WE (expert e's local id on worker w, -1 where w does
    not hold it)."""

    def __init__(self, placement: Placement | ExpertPlacement):
        if isinstance(placement, Placement):
            self.version, by_layer = 0, {None: placement}
        else:
            self.version, by_layer = placement.version, dict(zip(placement.moe_layers, placement.layers))
        self.num_workers = placement.num_workers
        self.tables = {layer: self._build(p) for layer, p in by_layer.items()}
        self.device = torch.device("cpu")

    @staticmethod
    def _build(p: Placement) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # A copy with share k takes k of the expert's round-robin slots (copies interleaved).
        slots = [_interleave(ws, p.shares_of(e)) for e, ws in enumerate(p.copies)]
        C = max(len(ws) for ws in slots)
        ncopies_E = torch.tensor([len(ws) for ws in slots])
        copy_EC = torch.tensor([ws + [ws[0]] * (C - len(ws)) for ws in slots])
        local_WE = torch.full((p.num_workers, p.num_experts), -1, dtype=torch.int32)
        for w in range(p.num_workers):
            for i, e in enumerate(p.experts_on(w)):
                local_WE[w, e] = i
        return ncopies_E, copy_EC, local_WE

    def of(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if device != self.device:
            self.tables = {k: tuple(t.to(device) for t in v) for k, v in self.tables.items()}
            self.device = device
        t = self.tables.get(layer)
        if t is None:
            t = self.tables.get(None)
            if t is None:
                raise ValueError(f"the placement has no MoE layer {layer} (it places layers "
                                 f"{sorted(k for k in self.tables)})")
        return t


LOCAL_ID_DTYPES = (torch.int32, torch.int64)  # expert ids travel in either; the receiver reads them as int64


def _interleave(workers: tuple[int, ...], shares: tuple[int, ...]) -> list[int]:
    """Round-robin slots for copies with integer shares, each copy's slots spread out (smooth
    weighted round robin): (0, 1) with shares (1, 3) -> [1, 0, 1, 1]; a copy with share 0 gets none."""
    workers, shares = zip(*[(w, s) for w, s in zip(workers, shares) if s])  # a copy with share 0 gets no slot
    total, credit, out = sum(shares), [0] * len(shares), []
    for _ in range(total):
        credit = [c + s for c, s in zip(credit, shares)]
        i = max(range(len(shares)), key=lambda i: (credit[i], -i))
        credit[i] -= total
        out.append(workers[i])
    return out


def pack_aux(low: int, high: int) -> int:
    """Two non-negative numbers below 2**31 in one header word (aux): low | high << 32."""
    return low | high << 32


def unpack_aux(aux: int) -> tuple[int, int]:
    return aux & 0xFFFFFFFF, aux >> 32


class M2NSender:
    """An attention worker's side; implements models.dispatcher.Dispatcher (the `experts`
    argument is ignored: the experts live on the expert workers).

    Placement versions: every chunk's header says which placement version routed it and the newest
    version this worker has been given (`set_placement`); each expert worker answers with the
    version all attention workers have and it holds, and the step after every expert worker said
    so, every attention worker routes with it (the same step everywhere: they all read the same
    answers)."""

    def __init__(self, endpoint: Endpoint, placement: Placement | ExpertPlacement, expert_peers: list[str],
                 hidden: int, top_k: int, data_timeout_s: float | None = 300.0, tracer: Tracer | None = None,
                 wire_dtype: torch.dtype | None = None):
        if len(expert_peers) != placement.num_workers:
            raise ValueError(f"{len(expert_peers)} expert peers for a placement over {placement.num_workers} workers")
        self.ep, self.peers = endpoint, expert_peers
        self.hidden, self.top_k, self.timeout = hidden, top_k, data_timeout_s
        self.routes, self._pending = _Routes(placement), None
        self._set_down(placement.down)
        self._agreed = self._next_agreed = 0  # the version every expert worker offered in the last step
        self._aux = pack_aux(self.routes.version, self.routes.version)
        # One expert worker holding every expert: all tokens go there with their ids unchanged.
        self._single = placement.num_workers == 1
        self._staging = HostStaging()
        self.step = 0
        self._step_tokens = 0
        self.peers_idle = True  # the last step gathered no token anywhere (all expert workers agree)
        # Time between dispatcher calls within a step is the attention side's compute.
        self.tracer = tracer or Tracer(endpoint.me)
        self._last_ns = 0
        self._deferred: list[Callable[[], None]] = []
        self.waited_ns: defaultdict[str, int] = defaultdict(int)  # per expert peer (module docstring)
        if wire_dtype not in (None, FP8):
            raise ValueError(f"M2N wire dtype must be None (the activations') or {FP8}, got {wire_dtype}")
        self.fp8 = wire_dtype == FP8

    @property
    def placement_version(self) -> int:
        """The version this worker routes with."""
        return self.routes.version

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Route with `placement` from the step after every expert worker confirms it holds it (call
        between steps). A version not newer than the one in use is ignored."""
        if placement.num_workers != len(self.peers):
            raise ValueError(f"placement over {placement.num_workers} workers for {len(self.peers)} expert peers")
        if placement.version > self.routes.version:
            self._pending = _Routes(placement)

    def _set_down(self, down: tuple[int, ...]) -> None:
        """Expert workers out of service (failover): no chunk goes to them, no answer is awaited."""
        self.down = tuple(down)
        self._live = [(w, p) for w, p in enumerate(self.peers) if w not in self.down]

    def reconnect(self, endpoint: Endpoint, placement: ExpertPlacement | None = None) -> None:
        """Use a new endpoint (the data plane's next epoch, after a failure): steps count from 0
        again on every attention worker, and the expert workers start idle. placement: route with
        it from the first step (failover, or a worker added back: every expert worker of the epoch
        holds it); its down workers are not peers of the new endpoint. None: keep routing as before."""
        self.ep, self.step, self.peers_idle, self._step_tokens = endpoint, 0, True, 0
        self._agreed = self._next_agreed = 0  # placement offers are made again in the new epoch
        if placement is not None:
            self.routes, self._pending = _Routes(placement), None
            self._set_down(placement.down)

    def defer(self, fn: Callable[[], None]) -> None:
        """Run fn right after this worker's first dispatch of its next step, while the experts
        compute that chunk (the caller's control-plane work of the last step, off the experts'
        critical path between steps), or at that step's end at the latest; `flush_deferred` runs
        what is pending now."""
        self._deferred.append(fn)

    def flush_deferred(self) -> None:
        while self._deferred:
            self._deferred.pop(0)()

    def begin_step(self) -> None:
        if self._pending is not None and self._agreed >= self._pending.version:
            self.routes, self._pending = self._pending, None
        ready = self._pending.version if self._pending is not None else self.routes.version
        self._aux = pack_aux(self.routes.version, ready)
        self._next_agreed = None
        self.step += 1
        self._step_tokens = 0
        self._last_ns = Tracer.now()

    def end_step(self) -> None:
        self.flush_deferred()  # a step without a dispatch (no MoE layer) still sends what waits
        self.peers_idle = self._step_tokens == 0
        self._agreed = self._next_agreed or 0
        self.tracer.span("attention", "attention", self._last_ns)

    def _compute_done(self, layer: int, mb: int) -> int:
        now = Tracer.now()
        self.tracer.span(f"attn L{layer} mb{mb}", "attention", self._last_ns, now)
        return now

    def dispatch(self, layer: int, experts, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, mb: int = 0) -> Handle:
        """Send each expert worker the tokens routed to it (slot `mb`); returns at once."""
        start = self._compute_done(layer, mb)
        T, dev = x_TD.shape[0], x_TD.device
        meta = MessageMeta(KIND_DATA, self.step, layer, mb, self._aux)
        xs = quantize_fp8(x_TD) if self.fp8 else (x_TD,)  # the rows' tensors: x, or q and its scales
        if self._single:  # the only worker holds every expert: ids are already local, no routing
            ids = topk_ids_TK if topk_ids_TK.dtype in LOCAL_ID_DTYPES else topk_ids_TK.long()
            parts = [xs[0], ids, topk_weights_TK, *xs[1:]]
            self.ep.send(self.peers[0], mb, meta, parts if x_TD.is_cpu else self._staging.to_host(parts),
                         timeout=self.timeout)
            return self._dispatched(layer, mb, start, T, [None], x_TD)
        ncopies_E, copy_EC, local_WE = self.routes.of(layer, dev)
        ids_TK = topk_ids_TK.long()
        worker_TK = None
        if T:
            # A replicated expert's tokens go round-robin over its copies by token index.
            copy_TK = torch.arange(T, device=dev)[:, None] % ncopies_E[ids_TK]
            worker_TK = copy_EC[ids_TK, copy_TK]
        rows_W = []
        for w, peer in self._live:
            rows, parts = self._chunk(w, xs, ids_TK, topk_weights_TK, worker_TK, local_WE)
            rows_W.append(rows)
            self.ep.send(peer, mb, meta, self._staging.to_host(parts), timeout=self.timeout)
        return self._dispatched(layer, mb, start, T, rows_W, x_TD)

    def _dispatched(self, layer: int, mb: int, start: int, T: int, rows_W: list, x_TD: torch.Tensor) -> Handle:
        self._last_ns = Tracer.now()
        self.tracer.span(f"dispatch L{layer} mb{mb}", "transfer", start, self._last_ns, {"tokens": T})
        if self._deferred:
            self.flush_deferred()
            now = Tracer.now()
            self.tracer.span("deferred", "control", self._last_ns, now)
            self._last_ns = now
        return Handle(self.step, layer, mb, T, rows_W, x_TD.dtype, x_TD.device)

    def _chunk(self, w: int, xs: tuple[torch.Tensor, ...], ids_TK: torch.Tensor, weights_TK: torch.Tensor,
               worker_TK: torch.Tensor | None,
               local_WE: torch.Tensor) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """(rows of the micro-batch sent to worker w; [x, local ids, weights] (+ [scales] in FP8)),
        several workers. xs: x, or its FP8 values and scales."""
        if worker_TK is None:  # no tokens
            return (torch.empty(0, dtype=torch.long, device=xs[0].device),
                    [xs[0], torch.empty((0, self.top_k), dtype=torch.int32), weights_TK, *xs[1:]])
        mine_TK = worker_TK == w
        rows = mine_TK.any(dim=1).nonzero().squeeze(1)
        local_TK = torch.where(mine_TK, local_WE[w][ids_TK], -1).to(torch.int32)
        if rows.numel() == xs[0].shape[0]:  # every token has an expert here: no gather needed
            return rows, [xs[0], local_TK, weights_TK, *xs[1:]]
        x_rows = [x.index_select(0, rows) for x in xs]
        return rows, [x_rows[0], local_TK.index_select(0, rows), weights_TK.index_select(0, rows), *x_rows[1:]]

    def combine(self, handle: Handle) -> torch.Tensor:
        """Wait for every expert worker's answer to this handle's slot; returns y_TD."""
        start = self._compute_done(handle.layer, handle.mb)
        y_TD = None
        if len(self._live) > 1:
            wait_in_arrival_order(self.ep, [(peer, handle.mb) for _, peer in self._live], self.timeout, start,
                                  self.waited_ns)
        for (_, peer), rows in zip(self._live, handle.rows_W):
            msg = self._recv_data(peer, handle.mb)
            m = msg.meta
            if (m.step, m.layer, m.mb) != (handle.step, handle.layer, handle.mb):
                raise RuntimeError(f"M2N protocol error: expert worker {peer!r} answered step {m.step} layer "
                                   f"{m.layer} mb {m.mb}, expected {handle.step}/{handle.layer}/{handle.mb}")
            y_RD = msg.tensors[0]
            n = handle.num_tokens if rows is None else rows.shape[0]
            if y_RD.shape[0] != n:
                raise RuntimeError(f"M2N protocol error: {peer!r} returned {y_RD.shape[0]} rows for {n}")
            if not y_RD.is_cpu or handle.device.type != "cpu":
                y_RD = self._staging.to_device([y_RD], handle.device)[0]
            if y_RD.dtype != handle.dtype:
                y_RD = y_RD.to(handle.dtype)
            if rows is None:  # the only answer: copy it out of the slot
                y_TD = y_RD.clone() if y_RD.device.type == "cpu" else y_RD
            else:
                if y_TD is None:
                    y_TD = torch.zeros((handle.num_tokens, self.hidden), dtype=handle.dtype, device=handle.device)
                if n:
                    y_TD.index_add_(0, rows, y_RD)
            tokens, offered = unpack_aux(m.aux)
            self._step_tokens += tokens
            self._next_agreed = offered if self._next_agreed is None else min(self._next_agreed, offered)
            self.ep.release(peer, handle.mb)
        if y_TD is None:  # several workers, none of which got a token
            y_TD = torch.zeros((handle.num_tokens, self.hidden), dtype=handle.dtype, device=handle.device)
        self._last_ns = Tracer.now()
        self.tracer.span(f"combine L{handle.layer} mb{handle.mb}", "wait", start, self._last_ns)
        return y_TD

    def _recv_data(self, peer: str, slot: int):
        while True:
            msg = self.ep.recv(peer, slot, timeout=self.timeout)
            if msg.meta.kind != KIND_WAKE:
                return msg
            self.ep.release(peer, slot)  # a stray WAKE (this worker was not parked)

    def poll_wake(self) -> bool:
        """While parked: True (and the WAKE consumed) when an expert worker says a step began."""
        for _, peer in self._live:
            if self.ep.poll(peer, 0):
                msg = self.ep.recv(peer, 0, timeout=self.timeout)
                if msg.meta.kind != KIND_WAKE:
                    raise RuntimeError(f"M2N protocol error: {peer!r} sent kind {msg.meta.kind} to a parked worker")
                self.ep.release(peer, 0)
                return True
        for _, peer in self._live:
            self.ep.check_alive(peer)
        return False


@dataclass
class ExpertBatch:
    """All attention workers' tokens of one (step, layer, mb) slot, concatenated in peer order.
    x_RD (model dtype), local_ids_RK int64 (-1: an expert on another worker), weights_RK;
    counts: rows from each attention worker. With one attention worker the tensors are views of
    the receive slot, valid until `reply`. version: the placement version the attention workers
    routed this step with (local ids are positions in that version's list of this worker's experts)."""

    step: int
    layer: int
    mb: int
    x_RD: torch.Tensor
    local_ids_RK: torch.Tensor
    weights_RK: torch.Tensor
    counts: list[int]
    version: int = 0


class M2NReceiver:
    """An expert worker's side. Slots must be received in the step's order: for each MoE layer,
    micro-batches 0..m-1 (the order in which attention workers dispatch them).

    `held`: the placement versions whose experts this worker holds (the worker updates it); a step
    routed with any other version is a protocol error. Each step's answers offer the newest version
    that every attention worker has been given and this worker holds (see M2NSender)."""

    def __init__(self, endpoint: Endpoint, attention_peers: list[str], moe_layers: list[int], num_micro_batches: int,
                 device: torch.device | str = "cpu", data_timeout_s: float | None = 300.0,
                 tracer: Tracer | None = None, waited_ns: defaultdict | None = None):
        self.ep, self.peers, self.moe_layers, self.m = endpoint, attention_peers, moe_layers, num_micro_batches
        self.tracer = tracer or Tracer(endpoint.me)
        self._recv_done_ns = 0
        self._in, self._out = HostStaging(), HostStaging()
        self.device, self.timeout = torch.device(device), data_timeout_s
        self.step = 0
        self._idle = True  # the last step gathered nothing: attention workers may be parked
        self._step_tokens = 0
        self.held: set[int] = {0}
        self.version = self._offer = 0  # the step's placement version; the version its answers offer
        # per attention peer (module docstring); the caller's, to count across epochs
        self.waited_ns: defaultdict[str, int] = defaultdict(int) if waited_ns is None else waited_ns

    def recv(self, layer: int, mb: int) -> ExpertBatch:
        start = Tracer.now()
        first = layer == self.moe_layers[0] and mb == 0
        if first and self._idle:
            self._wake_parked()
        if not first and len(self.peers) > 1:
            wait_in_arrival_order(self.ep, [(p, mb) for p in self.peers], self.timeout, start, self.waited_ns)
        msgs = [self.ep.recv(p, mb, timeout=None if first else self.timeout) for p in self.peers]
        step = msgs[0].meta.step
        for p, msg in zip(self.peers, msgs):
            m = msg.meta
            if m.kind != KIND_DATA or (m.step, m.layer, m.mb) != (step, layer, mb) or (not first and step != self.step):
                raise RuntimeError(f"M2N protocol error: attention worker {p!r} sent kind {m.kind} step {m.step} "
                                   f"layer {m.layer} mb {m.mb}; expected step {step if first else self.step} "
                                   f"layer {layer} mb {mb}")
        if first:
            self.step, self._step_tokens = step, 0
            self._versions(msgs)
        elif any(unpack_aux(msg.meta.aux)[0] != self.version for msg in msgs):
            raise RuntimeError(f"M2N protocol error: placement versions {[unpack_aux(x.meta.aux)[0] for x in msgs]} "
                               f"within step {step}, which began with version {self.version}")
        if len(msgs) == 1:  # computed straight from the slot, which reply() releases
            parts = msgs[0].tensors
        else:
            parts = [torch.cat([msg.tensors[i] for msg in msgs]) for i in range(len(msgs[0].tensors))]
            for p in self.peers:
                self.ep.release(p, mb)
        counts = [msg.tensors[0].shape[0] for msg in msgs]
        if self.device.type != "cpu":
            parts = self._in.to_device(parts, self.device)
        x, ids, w = parts[:3]
        if len(parts) == 4:  # FP8: values and per-token scales
            x = dequantize_fp8(x, parts[3])
        self._step_tokens += x.shape[0]
        self._recv_done_ns = Tracer.now()
        self.tracer.span(f"recv L{layer} mb{mb}", "wait", start, self._recv_done_ns, {"tokens": x.shape[0]})
        return ExpertBatch(step, layer, mb, x, ids if ids.dtype == torch.int64 else ids.long(), w, counts,
                           self.version)

    def _versions(self, msgs: list) -> None:
        """The step's placement version (every attention worker must route with the same one, and
        this worker must hold it), and the version this step's answers offer."""
        used, ready = zip(*(unpack_aux(msg.meta.aux) for msg in msgs))
        if len(set(used)) != 1 or used[0] not in self.held:
            raise RuntimeError(f"M2N protocol error: step {self.step} routed with placement versions "
                               f"{dict(zip(self.peers, used))}; {self.ep.me} holds versions {sorted(self.held)}")
        self.version = used[0]
        self._offer = max([v for v in self.held if v <= min(ready)], default=self.version)

    @property
    def idle(self) -> bool:
        """The last complete step gathered no token from any attention worker."""
        return self._idle

    def _wake_parked(self) -> None:
        """After an empty step, wait (indefinitely, checking liveness) for the attention worker that
        starts the next step, and wake the others."""
        keys = [(p, 0) for p in self.peers]
        while (first := self.ep.wait_any(keys, timeout=1.0)) is None:
            pass
        for p in self.peers:
            if p != first[0]:
                self.ep.send(p, 0, MessageMeta(KIND_WAKE, self.step + 1), [], timeout=self.timeout)

    def reply(self, batch: ExpertBatch, y_RD: torch.Tensor) -> None:
        """Send each attention worker its rows of y_RD (the weighted sum over its local experts)."""
        start = Tracer.now()
        self.tracer.span(f"experts L{batch.layer} mb{batch.mb}", "expert", self._recv_done_ns, start,
                         {"tokens": y_RD.shape[0]})
        if not y_RD.is_cpu:
            y_RD = self._out.to_host([y_RD])[0]
        meta = MessageMeta(KIND_DATA, batch.step, batch.layer, batch.mb, aux=pack_aux(sum(batch.counts), self._offer))
        if len(self.peers) == 1:
            self.ep.release(self.peers[0], batch.mb)
            self.ep.send(self.peers[0], batch.mb, meta, [y_RD], timeout=self.timeout)
        else:
            for p, part in zip(self.peers, torch.split(y_RD, batch.counts)):
                self.ep.send(p, batch.mb, meta, [part], timeout=self.timeout)
        if batch.layer == self.moe_layers[-1] and batch.mb == self.m - 1:
            self._idle = self._step_tokens == 0
        self.tracer.span(f"reply L{batch.layer} mb{batch.mb}", "transfer", start)


def wait_in_arrival_order(ep: Endpoint, keys: list[tuple[str, int]], timeout: float | None, start_ns: int,
                          waited_ns: dict[str, int]) -> None:
    """Wait until every (peer, slot) key holds a message, charging each peer in `waited_ns` the time
    from the previous arrival (or `start_ns`) to its own. Returns early on a timeout: the recv that
    follows raises it."""
    pending, last = list(keys), start_ns
    while pending:
        got = ep.wait_any(pending, timeout)
        if got is None:
            return
        now = Tracer.now()
        waited_ns[got[0]] += now - last
        last = now
        pending.remove(got)


def run_local_experts(experts, batch: ExpertBatch) -> torch.Tensor:
    """y_RD = sum over each row's local experts of weight * expert(x): the (row, k) pairs whose
    expert is here run through the Experts module as one-expert tokens, then add up per row. Where
    the module is the whole-block native kernel (models/cpu_inference.PackedExperts on an AVX-512
    BF16 CPU), it takes the rows as they are: it skips the other workers' pairs (id -1) itself and
    adds a row's outputs in expert order, as the colocated block does (no gather, no scatter: 5%
    of the block at 16-256 tokens on the 425M shapes)."""
    if getattr(experts, "native", None) is not None:
        return experts(batch.x_RD, batch.local_ids_RK, batch.weights_RK)
    R, K = batch.local_ids_RK.shape
    flat_ids = batch.local_ids_RK.reshape(-1)
    pairs = (flat_ids >= 0).nonzero().squeeze(1)
    row_P = torch.div(pairs, K, rounding_mode="floor")
    y_P = experts(batch.x_RD.index_select(0, row_P), flat_ids[pairs][:, None],
                  batch.weights_RK.reshape(-1)[pairs][:, None])
    return torch.zeros_like(batch.x_RD).index_add_(0, row_P, y_P)


def slot_bytes_for(hidden: int, top_k: int, dtype: torch.dtype, max_tokens: int) -> int:
    """Capacity of one slot for micro-batches of up to `max_tokens` tokens: x or y rows, ids (int64:
    a single expert worker gets the router's ids as they are) and float32 weights, plus room for
    the header."""
    elt = torch.empty((), dtype=dtype).element_size()
    return max_tokens * (hidden * max(elt, 4) + 12 * top_k) + 4096
