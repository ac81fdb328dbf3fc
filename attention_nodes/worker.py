"""The attention worker process: one engine (scheduler, paged KV cache, everything but the experts)
whose MoE layers reach the expert workers through M2N, and a control connection to the server.

Attention workers run steps in lock-step: each loop iteration is exactly one model step (an idle
worker takes an empty one), because every expert worker gathers all attention workers' chunks of a
slot before it computes. When a step gathered no token anywhere and this worker has no work, it
parks: it waits for a request from the server or a WAKE from an expert worker, instead of spinning
empty steps.

Epochs: the data plane (M2N endpoints) of epoch g lives under the session `data_session(session,
g)`. When a peer dies or goes silent, the worker closes its endpoint, tells the server (Broken) and
waits for Reset(g') (carrying out requests, aborts and stops meanwhile), then rejoins under g' and
says Ready again; the model and its weights stay loaded. A Reset without a placement (a restart)
drops every request first (the server resumes them); one with a placement (failover, or a
restarted expert worker added back) keeps them: the step that broke left no trace but KV entries
it rewrites when it runs again (the scheduler moves a sequence on only after its step computed),
so at most that step is computed again. The server sends Reset to a worker that was parked or
between steps, too.
"""
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass

import torch
from setproctitle import setproctitle
from torch.distributed import TCPStore

from attention_nodes import messages as wire
from attention_nodes.config import EngineConfig
from attention_nodes.engine import LLMEngine
from m2n_comm._hello import SignedStore, dial_hello, hello_body
from m2n_comm.endpoints import open_endpoint
from m2n_comm.m2n import FP8, M2NSender
from m2n_comm.placement import ExpertPlacement
from m2n_comm.transport import PeerDeadError, TransportConfig, TransportTimeout, data_session
from models.config import ModelConfig
from models.loader import freeze_loaded_heap
from telemetry.trace import Tracer

log = logging.getLogger("shuttle.attention")
PARK_POLL_S = 0.002  # while parked: how often to look for a WAKE between waits on the server
STATS_EVERY_S = 0.25  # while busy: how often to report Stats to the server
CONTROL_HELLO_S = 60.0  # how long the server may take to answer the control connection's HELLO
# How long a starting attention worker waits for the expert workers to load their experts (quantising a
# float checkpoint's at load included); the front gives up on a deployment sooner (pools/engine.py).
EXPERTS_LOAD_S = 900.0


@dataclass(frozen=True)
class AttentionWorkerSpec:
    """Everything an attention worker needs to start (sent once, when the process is spawned)."""

    engine: EngineConfig
    rank: int
    eos_token_ids: list[int]
    placement: ExpertPlacement
    transport: TransportConfig
    store_addr: tuple[str, int]
    control_addr: tuple[str, int]
    session: str
    epoch: int = 0  # the data plane epoch to join first (a restarted worker joins the current one)


class _Reset(Exception):
    """The server asked this worker to rejoin the data plane in a new epoch."""

    def __init__(self, msg: wire.Reset):
        super().__init__(f"reset to epoch {msg.epoch}")
        self.msg = msg


def run_attention_worker(spec: AttentionWorkerSpec) -> None:
    """Process entry point: connect to the server, load, serve until Shutdown or the server leaves.
    Any failure is reported to the server as Failed (naming the cause) before the process exits."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s a{spec.rank}: %(message)s")
    setproctitle(f"shuttle-attention-a{spec.rank}")  # what ps and top show
    par = spec.engine.parallel
    if par.torch_threads:
        torch.set_num_threads(par.torch_threads)
    ctl = socket.create_connection(spec.control_addr)
    ctl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    dial_hello(ctl, spec.transport.token, hello_body(f"a{spec.rank}"), CONTROL_HELLO_S)  # both prove the token
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read_control, args=(ctl, inbox), daemon=True).start()
    tracer = Tracer(f"a{spec.rank}", enabled=par.trace_dir is not None)
    link = _DataPlane(spec, tracer)
    try:
        model_cfg = ModelConfig.from_pretrained(spec.engine.model)
        link.await_loaded(spec.placement.down)
        link.open(spec.epoch, spec.placement.down)
        sender = M2NSender(link.endpoint, spec.placement, link.experts, model_cfg.hidden_size, model_cfg.top_k,
                           tracer=tracer, wire_dtype=FP8 if par.m2n_dtype == "fp8" else None)
        engine = LLMEngine(spec.engine, set(spec.eos_token_ids), dispatcher=sender)
        freeze_loaded_heap()
        epoch = spec.epoch
        while epoch is not None:
            wire.send(ctl, wire.Ready(spec.rank, engine.runner.num_blocks, epoch))
            epoch = _serve_epoch(spec.rank, epoch, engine, sender, link, inbox, ctl)
    except BaseException as e:
        log.exception("attention worker %d failed", spec.rank)
        try:
            wire.send(ctl, wire.Failed(spec.rank, f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        link.close()
        if par.trace_dir:
            tracer.dump(par.trace_dir)
        ctl.close()


class _DataPlane:
    """This worker's M2N endpoint of the current epoch."""

    def __init__(self, spec: AttentionWorkerSpec, tracer: Tracer):
        self.spec, self.tracer, self.endpoint = spec, tracer, None
        self.experts = [f"e{w}" for w in range(spec.engine.parallel.expert_workers)]
        # The data plane's endpoint records, signed with the deployment token (m2n_comm/_hello.py).
        self.store = SignedStore(TCPStore(*spec.store_addr, is_master=False, wait_for_workers=False),
                                 spec.transport.token)

    def open(self, epoch: int, down: tuple[int, ...] = ()) -> None:
        """Join `epoch`'s data plane with every expert worker but the `down` ones (failover)."""
        self.close()
        live = [e for w, e in enumerate(self.experts) if w not in down]
        self.endpoint = open_endpoint(self.spec.transport, self.store, data_session(self.spec.session, epoch),
                                      f"a{self.spec.rank}", live, self.spec.engine.parallel.micro_batches)

    def await_loaded(self, down: tuple[int, ...] = ()) -> None:
        """Wait until every expert worker but the `down` ones has loaded its experts (its SESSION/up key,
        set once they are held): each opens its endpoint only then, and a big checkpoint (4.5 GiB of
        bf16 experts quantised to MXFP4 at load: about a minute on 2 cores) takes longer to load than
        a connect may wait (connect_timeout_s). The front notices an expert worker that dies meanwhile."""
        keys = [f"{self.spec.session}/up/{e}" for w, e in enumerate(self.experts) if w not in down]
        deadline = time.monotonic() + EXPERTS_LOAD_S
        while keys and not self.store.check(keys):
            if time.monotonic() > deadline:
                raise TransportTimeout(f"expert workers did not load their experts in {EXPERTS_LOAD_S:.0f} s")
            time.sleep(0.05)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


def _serve_epoch(rank: int, epoch: int, engine: LLMEngine, sender: M2NSender, link: _DataPlane, inbox: queue.Queue,
                 ctl: socket.socket) -> int | None:
    """Serve until Shutdown (returns None) or until the data plane breaks or the server resets it;
    then rejoin under the server's next epoch (dropping every request unless the Reset carries a
    placement) and return that epoch."""
    try:
        _serve(rank, engine, sender, inbox, ctl)
        return None
    except (PeerDeadError, TransportTimeout) as e:
        peer = getattr(e, "peer", "")
        wire.send(ctl, wire.Broken(rank, epoch, peer, str(e)))  # first: the front learns the cause from us
        log.warning("data plane of epoch %d broke (%s); waiting for the server's reset", epoch, e)
        link.close()
        reset = _wait_reset(engine, sender, inbox, ctl)
    except _Reset as r:
        reset = r.msg
    while reset is not None:
        placement = None if reset.placement is None else ExpertPlacement.from_json(reset.placement, len(sender.peers))
        if placement is None:
            _drop_requests(engine)
        try:
            link.open(reset.epoch, sender.down if placement is None else placement.down)
        except (PeerDeadError, TransportTimeout) as e:  # a peer of the new epoch failed too
            log.warning("could not join the data plane of epoch %d: %s", reset.epoch, e)
            link.close()
            wire.send(ctl, wire.Broken(rank, reset.epoch, getattr(e, "peer", ""), str(e)))
            reset = _wait_reset(engine, sender, inbox, ctl)
            continue
        sender.reconnect(link.endpoint, placement)
        return reset.epoch
    return None


def _drop_requests(engine: LLMEngine) -> None:
    """Forget every request (their KV blocks are freed): the server resumes them after the reset."""
    for rid in list(engine.requests):
        engine.abort_request(rid)


def _wait_reset(engine: LLMEngine, sender: M2NSender, inbox: queue.Queue, ctl: socket.socket) -> wire.Reset | None:
    """Wait for the server's Reset; None on Shutdown. Requests, aborts and stops that come
    meanwhile are carried out (a failover keeps the requests, and the server sends them once); a
    placement change is not (the Reset says how to route)."""
    while True:
        msg = inbox.get()
        if isinstance(msg, wire.Reset):
            return msg
        if not isinstance(msg, wire.SetPlacement) and not _apply(engine, sender, msg, ctl):
            return None


def _read_control(ctl: socket.socket, inbox: queue.Queue) -> None:
    stream = ctl.makefile("rb")
    try:
        while (msg := wire.recv(stream)) is not None:
            inbox.put(msg)
    except OSError:
        pass
    inbox.put(None)  # the server is gone


def _serve(rank: int, engine: LLMEngine, sender: M2NSender, inbox: queue.Queue, ctl: socket.socket) -> None:
    """The step loop. Trace categories besides the sender's (attention, transfer, wait inside the
    model's forward): "step" spans one engine step (schedule, forward, sample, update), "control"
    the control-plane work (applying the server's messages, sending deltas and stats).
    A step's deltas and stats go out right after the next step's first dispatch, while the experts
    compute it (M2NSender.defer), instead of between the steps where the experts wait for us;
    anything pending goes out first when the server's messages are applied, when the worker parks
    and when it leaves, so the server sees every delta in order."""
    runner, stats, tracer = engine.runner, _StatsReporter(rank, engine, sender, ctl), sender.tracer
    try:
        while True:
            t0 = Tracer.now()
            try:
                while True:
                    msg = inbox.get_nowait()
                    sender.flush_deferred()
                    if not _apply(engine, sender, msg, ctl):
                        return
                    stats.stale = True
            except queue.Empty:
                pass
            if engine.has_unfinished_requests() or not sender.peers_idle:
                t1 = Tracer.now()
                tracer.span("apply", "control", t0, t1)
                executed = runner.num_executed
                deltas = engine.step()
                if runner.num_executed == executed:  # nothing was schedulable: still take this step's turn
                    runner.idle_step()
                tracer.span("step", "step", t1, args=engine.step_summary() if tracer.enabled else None)
                if deltas:
                    sender.defer(lambda d=deltas: wire.send(ctl, wire.Deltas([wire.encode_delta(x) for x in d])))
                sender.defer(stats.stepped)
                continue
            sender.flush_deferred()
            stats.parked()
            try:  # parked
                msg = inbox.get(timeout=PARK_POLL_S)
                if not _apply(engine, sender, msg, ctl):
                    return
                stats.stale = True
            except queue.Empty:
                if sender.poll_wake():
                    runner.idle_step()
    finally:
        try:
            sender.flush_deferred()  # before Broken or Failed: the deltas of the last step are valid
        except OSError:
            pass


class _StatsReporter:
    """Sends Stats every STATS_EVERY_S while the worker steps, and once more when it parks, so the
    server also sees the state after the last step (the freed blocks of the last request)."""

    def __init__(self, rank: int, engine: LLMEngine, sender: M2NSender, ctl: socket.socket):
        self.rank, self.engine, self.sender, self.ctl = rank, engine, sender, ctl
        self.start_ns, self.last, self.stale = time.monotonic_ns(), 0.0, True

    def stepped(self) -> None:
        self.stale = True
        if time.monotonic() - self.last >= STATS_EVERY_S:
            self.send()

    def parked(self) -> None:
        if self.stale:
            self.send()

    def send(self) -> None:
        stats = {**self.engine.stats(), "busy_ns": self.sender.tracer.totals.get("attention", 0),
                 "waited_ns": dict(self.sender.waited_ns),
                 "placement_version": self.sender.placement_version,
                 "uptime_ns": time.monotonic_ns() - self.start_ns}
        wire.send(self.ctl, wire.Stats(self.rank, stats))
        self.last, self.stale = time.monotonic(), False


def _apply(engine: LLMEngine, sender: M2NSender, msg, ctl: socket.socket) -> bool:
    """Carry out one control message; False when the worker should stop (_Reset for a Reset)."""
    if msg is None or isinstance(msg, wire.Shutdown):
        return False
    if isinstance(msg, wire.SetPlacement):  # between steps, as the sender requires
        sender.set_placement(ExpertPlacement.from_json(msg.placement, len(sender.peers)))
        return True
    deltas = []
    if isinstance(msg, wire.Reset):
        raise _Reset(msg)
    if isinstance(msg, wire.AddRequest):
        try:
            engine.add_request(msg.request_id, msg.prompt_token_ids, wire.params_from_wire(msg.params), msg.resume)
        except ValueError as e:  # the server checks requests first; report rather than die
            log.error("request %s rejected: %s", msg.request_id, e)
            deltas = [wire.SequenceDelta(msg.request_id, i, [], None, "abort") for i in range(msg.params.get("n", 1))]
    elif isinstance(msg, wire.Abort):
        deltas = engine.abort_request(msg.request_id)
    elif isinstance(msg, wire.StopSequence):
        engine.stop_sequence(msg.request_id, msg.index, msg.stop_reason)
    if deltas:
        wire.send(ctl, wire.Deltas([wire.encode_delta(d) for d in deltas]))
    return True
