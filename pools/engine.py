"""Disaggregated deployment: start (or meet) the attention and expert worker pools, and drive them
through an engine-shaped front, so LLM (and the HTTP server) use them as they use LLMEngine.

    engine = PoolEngine(engine_cfg, eos_token_ids)          # spawns the pools on this host
    engine.add_request("r1", prompt_ids, SamplingParams())  # to the least loaded attention worker
    deltas = engine.step()                                  # whatever the workers produced since

On one host the pools are spawned processes; on a Ray cluster, Ray actors placed by each pool's
resources (pools/launchers.py: the launcher makes them, PoolEngine drives them alike). Without
Ray, across hosts every host runs `shuttle serve --role
attention|expert --rendezvous HOST:PORT` (pools/roles.py) and the front runs with
`rendezvous=HOST:PORT`: the deployment is published in a torch.distributed TCPStore there and
each worker takes the next rank.

Supervision (spawned pools; pools/supervision.py): a worker that exits, fails, or goes silent is
started again in a new epoch of the data plane. When only expert workers failed the attention
workers keep their requests and caches (with copies of their experts on live expert workers they are
routed around meanwhile: failover); when an attention worker failed, requests are resumed from
prompt + delivered tokens. Past `max_worker_restarts`
within `restart_window_s`, or for workers started elsewhere, WorkerFailedError names it.
"""
import collections
import itertools
import json
import logging
import multiprocessing as mp
import os
import queue
import secrets
import socket
import sys
import threading
import time
import weakref
from dataclasses import asdict, replace

from attention_nodes import messages as wire
from attention_nodes.config import EngineConfig, worker_threads
from attention_nodes.engine import SequenceDelta, max_new_tokens
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import check_fits
from attention_nodes.worker import AttentionWorkerSpec, run_attention_worker
from expert_nodes.worker import ExpertWorkerSpec, run_expert_worker
from m2n_comm._common import process_gone
from m2n_comm._hello import SignedStore
from m2n_comm.m2n import slot_bytes_for
from m2n_comm.placement import ExpertPlacement, Placement, check_redundancy
from m2n_comm.transport import TransportConfig
from models.config import ModelConfig
from pools.control import admitted, read_events, shutdown_pools
from pools.eplb import PlacementControl, read_expert_load
from pools.launchers import check_installed, make_launcher
from pools.roles import engine_config_to_json, front_token, listen_store, publish_deployment, split_addr
from pools.stragglers import Stragglers
from pools.supervision import (MAIN_GUARD_EXIT, Supervision, Worker, WorkerFailedError, _Broken, _Request,
                               _suspect)

log = logging.getLogger("shuttle")
TIMING_EVERY_S = 1.0  # how often the straggler window is fed
START_TIMEOUT_S = 300.0  # loading big checkpoints takes a while; dead workers are noticed sooner


class PoolEngine:
    """The Engine (attention_nodes/engine.py) over attention workers in other processes.
    rendezvous: "HOST:PORT" to wait for workers started elsewhere with --role; None spawns the
    pools here (and supervises them). deployment_token: the token every worker must prove (None: a
    random one, logged with a rendezvous: roles.front_token). It never enters the store: --role
    workers are given it themselves (SHUTTLE_DEPLOYMENT_TOKEN)."""

    def __init__(self, cfg: EngineConfig, eos_token_ids: set[int], rendezvous: str | None = None,
                 deployment_token: str | None = None):
        if getattr(mp.current_process(), "_inheriting", False):
            # We are a spawned worker re-importing a script that starts pools at its top level:
            # leave quietly with a code the parent turns into the fix (multiprocessing's own
            # RuntimeError here is a page of bootstrapping traceback per worker). os._exit, not
            # SystemExit: the fork server's child turns any exception, SystemExit too, into code 1.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(MAIN_GUARD_EXIT)
        par = cfg.parallel
        if deployment_token is not None and (not isinstance(deployment_token, str) or not deployment_token.strip()):
            raise ValueError("deployment_token (SHUTTLE_DEPLOYMENT_TOKEN) must be a non-empty string")
        check_installed(par)  # here, not in every worker: say what to install before anything starts
        self.cfg, self.model_cfg = cfg, ModelConfig.from_pretrained(cfg.model)
        if not any(self.model_cfg.moe_layers):
            raise ValueError(f"{cfg.model}: the model has no MoE layer to disaggregate; run it colocated")
        self.eos_token_ids = set(eos_token_ids)
        self.placement = self._initial_placement()
        if rendezvous and par.launcher != "spawn":
            raise ValueError(f"--launcher {par.launcher} starts the workers itself; it takes no --rendezvous")
        self._launcher = None if rendezvous else make_launcher(par)
        host, port = split_addr(rendezvous) if rendezvous else (self._launcher.host, 0)
        self.session = f"shuttle-{os.getpid()}-{secrets.token_hex(4)}"
        # The deployment token: every worker gets it (spawn args, a Ray actor's spec, or its own
        # SHUTTLE_DEPLOYMENT_TOKEN), and the control listener, the tcp data plane and the nixl metadata
        # exchange admit only peers that prove it (m2n_comm/_hello.py); every value in the store is
        # signed with it. The store listens on the control listener's address only.
        token = front_token(deployment_token, rendezvous)
        self._store = SignedStore(listen_store(host, port), token)
        self._listener = socket.create_server((host, 0))
        dtype = cfg.dtype or self.model_cfg.dtype
        self.transport = TransportConfig(par.transport, slot_bytes_for(
            self.model_cfg.hidden_size, self.model_cfg.top_k, dtype, cfg.scheduler.max_num_batched_tokens), host=host,
            token=token)
        self.epoch = 0  # of the data plane; every restart opens the next one
        self._ready = False  # a step can run: every worker is up and joined the current epoch
        self._procs: list[mp.process.BaseProcess] = []
        self._events: queue.Queue = queue.Queue()
        self._wake_queued = False  # a _WAKE is in _events (wake)
        self._socks: list[socket.socket | None] = [None] * par.attention_workers
        self._conn_ids = itertools.count()
        self._pending: dict[int, socket.socket] = {}  # connections that have not said Ready yet
        self._waiting: set[int] = set()               # ranks _await_ready still waits for
        self._kv_blocks: dict[int, int] = {}           # rank -> KV cache blocks, from its Ready
        self._conn_rank: dict[int, int] = {}          # current control connection -> attention worker rank
        self._conn_epoch: dict[int, int] = {}         # current control connection -> epoch of its Ready
        self._requests: dict[str, _Request] = {}
        self._load = [0] * par.attention_workers    # tokens queued per worker (prompt + max_tokens)
        self._worker_stats: dict[int, dict] = {}    # attention worker rank -> its latest Stats
        self._last_deltas = 0                       # what the last step returned (step_summary)
        self.stragglers = Stragglers()              # per-worker service times, straggler scores
        self._next_timing = 0.0
        self.supervision = Supervision(self, remote=rendezvous is not None)
        self._finalizer = weakref.finalize(self, shutdown_pools, self._socks, self._procs, self._store, self.session,
                                           par.expert_workers if rendezvous else 0, self._launcher)
        if rendezvous:
            self._publish(rendezvous)
        else:
            self._spawn()
        try:
            self._await_ready(set(range(par.attention_workers)), START_TIMEOUT_S)
        except _Broken as b:  # nothing to restart yet: a worker that cannot start will not start again
            raise WorkerFailedError(b.why) from None
        self._ready = True
        self.placements = PlacementControl(self._store, self.session, self.placement, self._send_placement,
                                           par.eplb_interval if par.eplb else 0, par.num_redundant_experts)
        self.placements.speeds = lambda: self.stragglers.speeds([f"e{w}" for w in range(par.expert_workers)])

    def _initial_placement(self) -> ExpertPlacement:
        """--placement FILE or contiguous blocks, the same in every MoE layer (version 0)."""
        par, E = self.cfg.parallel, self.model_cfg.num_experts
        if par.eplb:
            if par.expert_workers < 2:
                raise ValueError("--eplb moves experts between expert workers: it needs --expert-workers 2 or more")
            check_redundancy(E, par.expert_workers, par.num_redundant_experts)
        p = (Placement.from_file(par.placement, E, par.expert_workers) if par.placement
             else Placement.balanced(E, par.expert_workers))
        return ExpertPlacement.uniform(p, [i for i, moe in enumerate(self.model_cfg.moe_layers) if moe])

    # -- expert placement --------------------------------------------------------------------------
    def apply_placement(self, placement: ExpertPlacement) -> None:
        """Start applying a new expert placement live (version = the current one + 1): expert workers
        load the new copies, then every attention worker switches at the same step boundary.
        `step` advances it; `self.placements.current` is the placement in use (pools/eplb.py)."""
        self.placements.apply(placement)

    def _send_placement(self, placement: ExpertPlacement) -> None:
        msg = wire.SetPlacement(placement.to_json())
        for rank in range(len(self._socks)):
            self._send(rank, msg)

    def _poll_placement(self) -> None:
        steps = max((w.get("steps", 0) for w in self._worker_stats.values()), default=0)
        self.placements.poll(steps, lambda: read_expert_load(self._store, self.session,
                                                             self.cfg.parallel.expert_workers)[0])

    # -- start -------------------------------------------------------------------------------------
    def _spawn(self) -> None:
        """Start the pools as processes of this host, with torch threads per worker from
        worker_threads unless torch_threads is given."""
        par = self.cfg.parallel
        attention, self._expert_threads = worker_threads(par, len(os.sched_getaffinity(0)))
        self._spawn_cfg = replace(self.cfg, parallel=replace(par, torch_threads=attention))
        workers = ([Worker("expert", w) for w in range(par.expert_workers)]
                   + [Worker("attention", a) for a in range(par.attention_workers)])
        self._procs.extend(self._worker(w) for w in workers)
        for p in self._procs:
            p.start()

    def _worker(self, worker: Worker, placement: ExpertPlacement | None = None,
                epoch: int | None = None) -> mp.process.BaseProcess:
        """A (not yet started) process for `worker`, named like it ("a0", "e1"), that joins the
        current epoch (or `epoch`) with the current placement (or `placement`): the launcher's (a
        spawned process, or a Ray actor with the same interface)."""
        cfg, par, launch = self._spawn_cfg, self._spawn_cfg.parallel, self._launcher.worker
        store_addr, rank = (self._launcher.host, self._store.port), worker.rank
        placement, epoch = placement or self.placement, self.epoch if epoch is None else epoch
        if worker.kind == "expert":
            spec = ExpertWorkerSpec(cfg.model, cfg.dtype, par.expert_device or cfg.device, cfg.kernels, rank,
                                    par.attention_workers, par.micro_batches, placement, self.transport,
                                    store_addr, self.session, self._expert_threads, par.trace_dir, epoch,
                                    cfg.quantization)
            return launch(str(worker), "expert", run_expert_worker, spec)
        spec = AttentionWorkerSpec(cfg, rank, sorted(self.eos_token_ids), placement, self.transport,
                                   store_addr, self._listener.getsockname()[:2], self.session, epoch)
        return launch(str(worker), "attention", run_attention_worker, spec)

    def _publish(self, rendezvous: str) -> None:
        """For workers on other hosts: the deployment, as JSON, under a well-known key, signed with
        the token and without it (the store has no authentication)."""
        transport = asdict(self.transport)
        del transport["token"]
        spec = {"engine": engine_config_to_json(self.cfg), "eos": sorted(self.eos_token_ids),
                "placement": self.placement.to_json(), "transport": transport,
                "control": list(self._listener.getsockname()[:2]), "session": self.session}
        publish_deployment(self._store, spec, self.transport.token)
        log.info("waiting for %d attention and %d expert workers: start them with `shuttle serve --role "
                 "attention|expert --rendezvous %s`", self.cfg.parallel.attention_workers,
                 self.cfg.parallel.expert_workers, rendezvous)

    def _await_ready(self, ranks: set[int], timeout_s: float) -> list[SequenceDelta]:
        """Accept the control connections of (re)started attention workers and wait until every
        rank in `ranks` said Ready for the current epoch; returns the deltas that came meanwhile
        (from workers that keep their requests: failover). Raises _Broken if a worker fails
        meanwhile, WorkerFailedError past the deadline."""
        self._listener.settimeout(0.05)
        self._waiting, deadline, out = set(ranks), time.monotonic() + timeout_s, []
        while self._waiting:
            self.supervision.check_procs()
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"attention workers {', '.join(f'a{r}' for r in sorted(self._waiting))} were "
                                        f"not ready within {timeout_s:.0f} s{self.supervision.exited()}")
            try:
                conn, addr = self._listener.accept()
            except socket.timeout:
                conn = None
            if conn is not None and admitted(conn, addr, self.transport.token):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                cid = next(self._conn_ids)
                self._pending[cid] = conn
                threading.Thread(target=read_events, args=(conn, cid, self._events, self._worker_stats),
                                 daemon=True).start()
            try:
                while self._waiting:
                    out += self._handle(self._events.get_nowait())
            except queue.Empty:
                pass
            self.supervision.check_store()
        return out

    # -- requests ----------------------------------------------------------------------------------
    def set_eos_token_ids(self, ids: set[int]) -> None:
        raise RuntimeError("the end-of-sequence ids of running worker pools are fixed when they start")

    @property
    def ready(self) -> bool:
        """Every worker is up and joined the current epoch (thread-safe). A worker stopped for a
        moment (a stop/continue cycle: a straggler) still counts; one stopped for dead_after_s is
        failed by supervision, which clears this until it is replaced."""
        return self._ready and not any(p.pid is not None and process_gone(p.pid) for p in list(self._procs))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue the request on the attention worker with the fewest queued tokens (validated by
        the front, as for LLMEngine.add_request)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        self._check_cache(request_id, ids, params)
        w = min(range(len(self._load)), key=self._load.__getitem__)
        r = _Request(ids, params, w, (len(ids) + params.max_tokens) * params.n, set(range(params.n)),
                     [[] for _ in range(params.n)])
        self._requests[request_id] = r
        self._load[w] += r.cost
        self._send(w, wire.AddRequest(request_id, ids, wire.params_to_wire(params)))

    def _check_cache(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        """ValueError, as the colocated engine raises it, for a request whose prompt plus max_tokens
        needs more KV blocks than an attention worker has (it could never be scheduled: the worker
        would only abort it)."""
        blocks = min(self._kv_blocks.values(), default=None)
        if blocks is not None:
            check_fits(request_id, len(ids), max_new_tokens(params, ids, self.model_cfg), self.cfg.cache.block_size,
                       blocks)

    def abort_request(self, request_id: str) -> list[SequenceDelta]:
        """Ask the owning worker to abort; the finish deltas arrive through `step`."""
        r = self._requests.get(request_id)
        if r is not None:
            r.aborting = True
            self._send(r.worker, wire.Abort(request_id))
        return []

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        r = self._requests.get(request_id)
        if r is not None:
            self._send(r.worker, wire.StopSequence(request_id, index, stop_reason))
            self._finished(request_id, index)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self, timeout: float | None = None) -> list[SequenceDelta]:
        """Deltas the workers sent since the last call; waits for at least one message (up to
        `timeout` seconds) while requests are in flight. A failure is handled here: the workers are
        restarted and the requests resumed before this returns (WorkerFailedError past the
        restart budget)."""
        out = self._step(timeout)
        self._last_deltas = len(out)
        if time.monotonic() >= self._next_timing:
            self._sample_timings()
        return out

    def _sample_timings(self) -> None:
        """Feed the straggler window (pools/stragglers.py) with each worker's busy time and the time
        the other pool waited on it: from the attention workers' Stats and what the expert workers
        publish in the store."""
        self._next_timing = time.monotonic() + TIMING_EVERY_S
        busy, waited_on, pairs = {}, collections.Counter(), {}
        for r, s in self._worker_stats.items():
            busy[("attention", f"a{r}")] = s.get("busy_ns", 0)
            waited_on.update(s.get("waited_ns", {}))
        for w in range(self.cfg.parallel.expert_workers):
            key = f"{self.session}/stats/e{w}"
            if self._store.check([key]):
                e = json.loads(self._store.get(key))
                busy[("expert", f"e{w}")] = e["busy_ns"]
                pairs[f"e{w}"] = e.get("pairs")
                waited_on.update(e.get("waited_ns", {}))
        self.stragglers.sample(time.monotonic(), [(pool, name, b, waited_on[name], pairs.get(name))
                                                  for (pool, name), b in sorted(busy.items())])

    def _step(self, timeout: float | None) -> list[SequenceDelta]:
        out: list[SequenceDelta] = []
        self._poll_placement()
        try:
            out += self.supervision.poll_add_back()
            if not self._requests:
                return out
            item = self._next_event(timeout)
            while item is not None:
                out += self._handle(item)
                try:
                    item = self._events.get_nowait()
                except queue.Empty:
                    item = None
        except _Broken as b:
            out += self.supervision.recover(b)
        return out

    def step_summary(self) -> dict:
        """What the last step returned (the workers' own steps are in their traces)."""
        return {"deltas": self._last_deltas}

    def wake(self) -> None:
        """Make a `step` that is waiting for the workers return now (thread-safe): the caller has
        new requests or aborts to send. About one wake-up at a time is queued (two threads calling
        at once may both queue one: an extra turn, never a lost one): the caller's messages are all
        read when the step returns, so a burst of requests costs the engine thread one extra turn,
        not one each (a served batch of 64 arrivals took 64 turns of its loop)."""
        if self._wake_queued:
            return
        self._wake_queued = True
        self._events.put((-1, _WAKE))

    def check_health(self) -> None:
        """Notice a worker that failed or exited also while no request is in flight (then queued
        deltas belong to finished requests and are dropped) and restart it; WorkerFailedError when
        it cannot be. Call it from the thread that calls `step`."""
        try:
            if not self._requests:
                self._drain_events()
            self.supervision.check_procs()
            self.supervision.check_store()
            self.supervision.poll_add_back()
        except _Broken as b:
            self.supervision.recover(b)

    def stats(self) -> dict:
        """The attention workers' latest Stats added up (as LLMEngine.stats), each worker's busy
        time, the expert workers' load (published in the store) and the restarts so far."""
        workers = [dict(self._worker_stats[r], rank=r) for r in sorted(self._worker_stats)]
        total = {k: sum(w.get(k, 0) for w in workers) for k in
                 ("running", "waiting", "num_blocks", "free_blocks", "kv_cache_tokens", "state_slots",
                  "prefix_cache_queries",
                  "prefix_cache_hits",
                  "preemptions", "generated_tokens")}
        total["steps"] = max((w.get("steps", 0) for w in workers), default=0)
        spec = [w["spec_decode"] for w in workers if "spec_decode" in w]
        if spec:
            total["spec_decode"] = {k: sum(d[k] for d in spec) for k in spec[0] if k != "accepted_per_pos"}
            total["spec_decode"]["accepted_per_pos"] = [sum(p) for p in zip(*(d["accepted_per_pos"] for d in spec))]
        total["kv_cache_usage"] = 1 - total["free_blocks"] / total["num_blocks"] if total["num_blocks"] else 0.0
        busy = [{"pool": "attention", "worker": f"a{w['rank']}", "busy_ns": w["busy_ns"], "uptime_ns": w["uptime_ns"]}
                for w in workers]
        weights = [{"pool": "attention", "worker": f"a{w['rank']}", "kind": kind, "bytes": n}
                   for w in workers for kind, n in w.get("weight_bytes", {}).items()]
        for w in range(self.cfg.parallel.expert_workers):
            key = f"{self.session}/stats/e{w}"
            if self._store.check([key]):
                e = json.loads(self._store.get(key))
                busy.append({"pool": "expert", "worker": f"e{w}", "busy_ns": e["busy_ns"], "uptime_ns": e["uptime_ns"]})
                if "weight_bytes" in e:
                    weights.append({"pool": "expert", "worker": f"e{w}", "kind": "experts", "bytes": e["weight_bytes"]})
        load_LE, per_worker = read_expert_load(self._store, self.session, self.cfg.parallel.expert_workers)
        experts = {} if load_LE is None else dict(enumerate(load_LE.sum(axis=0).tolist()))
        layers = {} if load_LE is None else dict(zip(self.placement.moe_layers, load_LE.tolist()))
        return {**total, "expert_tokens": experts, "expert_layer_tokens": layers,
                "expert_worker_tokens": {f"e{w}": n for w, n in enumerate(per_worker)}, "busy": busy, "weights": weights,
                "worker_restarts": self.supervision.num_restarts,
                "recomputed_tokens": self.supervision.recomputed_tokens, "timings": self.stragglers.table(),
                **self.placements.stats()}

    def _finished(self, request_id: str, index: int) -> None:
        r = self._requests.get(request_id)
        if r is None:
            return
        r.live.discard(index)
        if not r.live:
            self._load[r.worker] -= r.cost
            del self._requests[request_id]

    # -- events ------------------------------------------------------------------------------------
    def _next_event(self, timeout: float | None) -> tuple[int, object] | None:
        """The next control event, or None after `timeout` s; checks the workers twice a second."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._events.get(timeout=0.5)
            except queue.Empty:
                self.supervision.check_procs()
                self.supervision.check_store()
                if deadline is not None and time.monotonic() > deadline:
                    return None

    def _handle(self, item: tuple[int, object]) -> list[SequenceDelta]:
        """Carry out one control event: the deltas of a current connection's Deltas (recorded for
        resumption), Ready; raises _Broken for a failure of the current epoch; stale ones are dropped."""
        conn, msg = item
        if msg is _WAKE:
            # Cleared before the step returns and the caller reads its messages: a wake() after
            # this queues another, one before it is answered by this one.
            self._wake_queued = False
            return []
        if conn in self._pending:
            if isinstance(msg, wire.Ready):
                self._kv_blocks[msg.rank] = msg.num_kv_blocks
                self._joined(conn, self._pending.pop(conn), msg.rank, msg.epoch)
            elif isinstance(msg, wire.Failed):
                raise _Broken(f"attention worker a{msg.rank} failed: {msg.message}{self.supervision.exited()}",
                              {Worker("attention", msg.rank)})
            return []  # a starting worker that dies is found by supervision.check_procs
        rank = self._conn_rank.get(conn)
        if rank is None:  # the connection of a worker that was replaced
            return []
        if isinstance(msg, wire.Failed):
            raise _Broken(f"attention worker a{rank} failed: {msg.message}{self.supervision.exited()}",
                          {Worker("attention", rank)})
        if msg is None:
            self.supervision.check_procs(wait=2.0)
            raise _Broken(f"attention worker a{rank} closed its connection", {Worker("attention", rank)})
        if isinstance(msg, wire.Broken) and msg.epoch == self.epoch:
            raise _Broken(f"attention worker a{rank}: {msg.why}", _suspect(msg.peer, msg.why))
        if isinstance(msg, wire.Ready) and msg.epoch == self.epoch:
            self._conn_epoch[conn] = self.epoch
            self._waiting.discard(rank)
        if isinstance(msg, wire.Deltas) and self._conn_epoch.get(conn) == self.epoch:
            return self._deltas(msg)
        return []

    def _joined(self, conn: int, sock: socket.socket, rank: int, epoch: int) -> None:
        """A (re)started attention worker's connection becomes the current one of its rank; one
        started for an epoch that another failure has ended since is sent on to the current one."""
        old = self._socks[rank]
        for c in [c for c, r in self._conn_rank.items() if r == rank]:
            del self._conn_rank[c]
            self._conn_epoch.pop(c, None)
        if old is not None:
            old.close()
        self._socks[rank] = sock
        self._conn_rank[conn], self._conn_epoch[conn] = rank, epoch
        if epoch == self.epoch:
            self._waiting.discard(rank)
        else:
            self._send(rank, wire.Reset(self.epoch))

    def _deltas(self, msg: wire.Deltas) -> list[SequenceDelta]:
        out = []
        for v in msg.deltas:
            d = wire.decode_delta(v)
            r = self._requests.get(d.request_id)
            if r is not None and d.index in r.live:
                r.outputs[d.index] += d.new_token_ids
                out.append(d)
                if d.finish_reason is not None:
                    self._finished(d.request_id, d.index)
        return out

    def _drain_events(self) -> None:
        """Handle every event already queued (no request runs: deltas are dropped)."""
        try:
            while True:
                self._handle(self._events.get_nowait())
        except queue.Empty:
            pass

    def _send(self, rank: int, msg) -> None:
        """Send to an attention worker; one that is gone is found (and its requests resumed) by the
        next step or health check."""
        sock = self._socks[rank]
        try:
            if sock is not None:
                wire.send(sock, msg)
        except OSError as e:
            log.warning("attention worker a%d is unreachable: %s", rank, e)

    def shutdown(self) -> None:
        self._finalizer()


_WAKE = object()  # an event that only ends a waiting step
