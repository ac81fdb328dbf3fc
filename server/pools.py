"""Disaggregated deployment: start (or meet) the attention and expert worker pools, and drive them
through an engine-shaped front, so LLM (and later the HTTP server) use them as they use LLMEngine.

    engine = PoolEngine(engine_cfg, eos_token_ids)          # spawns the pools on this host
    engine.add_request("r1", prompt_ids, SamplingParams())  # to the least loaded attention worker
    deltas = engine.step()                                  # whatever the workers produced since

On one host the pools are spawned processes; on a Ray cluster, Ray actors placed by each pool's
resources (server/launchers.py). Without Ray, across hosts every host runs `shuttle serve --role
attention|expert --rendezvous HOST:PORT` and the front runs with `rendezvous=HOST:PORT`: the
deployment is published in a torch.distributed TCPStore there and each worker takes the next rank.
A worker that fails or exits is reported (WorkerFailedError naming it), never waited on for ever.
"""
import hmac
import json
import logging
import multiprocessing as mp
import os
import queue
import secrets
import socket
import threading
import time
import weakref
from dataclasses import asdict, replace

from torch.distributed import TCPStore

from attention_nodes import messages as wire
from attention_nodes.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from attention_nodes.engine import SequenceDelta, check_prompt
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.worker import AttentionWorkerSpec, run_attention_worker
from expert_nodes.worker import ExpertWorkerSpec, run_expert_worker
from m2n_comm.m2n import Placement, slot_bytes_for
from m2n_comm.transport import TransportConfig
from models.config import DTYPES, ModelConfig
from server.launchers import check_installed, make_launcher

log = logging.getLogger("shuttle")
START_TIMEOUT_S = 300.0  # loading big checkpoints takes a while; dead workers are noticed sooner


MAIN_GUARD_EXIT = 3  # a spawned worker found its script starting pools while being imported
MAIN_GUARD_HINT = ("the worker pools are separate processes that re-import your script: start them under "
                   "`if __name__ == \"__main__\":` (put the LLM(...) / AsyncLLM(...) call and what uses it in that block)")


class WorkerFailedError(RuntimeError):
    """A worker process failed or exited; the message names it and says why."""


class PoolEngine:
    """The engine interface of LLMEngine (add_request, abort_request, stop_sequence, step,
    has_unfinished_requests, check_prompt) over attention workers in other processes.
    rendezvous: "HOST:PORT" to wait for workers started elsewhere with --role; None spawns the
    pools here."""

    def __init__(self, cfg: EngineConfig, eos_token_ids: set[int], rendezvous: str | None = None):
        if getattr(mp.current_process(), "_inheriting", False):
            # We are a spawned worker re-importing a script that starts pools at its top level:
            # leave quietly with a code the parent turns into the fix (multiprocessing's own
            # RuntimeError here is a page of bootstrapping traceback per worker).
            raise SystemExit(MAIN_GUARD_EXIT)
        par = cfg.parallel
        check_installed(par)  # here, not in every worker: say what to install before anything starts
        self.cfg, self.model_cfg = cfg, ModelConfig.from_pretrained(cfg.model)
        if not any(self.model_cfg.moe_layers):
            raise ValueError(f"{cfg.model}: the model has no MoE layer to disaggregate; run it colocated")
        self.eos_token_ids = set(eos_token_ids)
        self.placement = (Placement.from_file(par.placement, self.model_cfg.num_experts, par.expert_workers)
                          if par.placement else Placement.balanced(self.model_cfg.num_experts, par.expert_workers))
        if rendezvous and par.launcher != "spawn":
            raise ValueError(f"--launcher {par.launcher} starts the workers itself; it takes no --rendezvous")
        self._launcher = None if rendezvous else make_launcher(par)
        host, port = _split(rendezvous) if rendezvous else (self._launcher.host, 0)
        self.session = f"shuttle-{os.getpid()}-{secrets.token_hex(4)}"
        self._store = TCPStore(host, port, is_master=True, wait_for_workers=False)
        self._listener = socket.create_server((host, 0))
        dtype = cfg.dtype or self.model_cfg.dtype
        # The deployment token: every worker gets it (spawn args, or the rendezvous store) and the
        # control listener and the tcp data plane refuse peers without it.
        self.transport = TransportConfig(par.transport, slot_bytes_for(
            self.model_cfg.hidden_size, self.model_cfg.top_k, dtype, cfg.scheduler.max_num_batched_tokens), host=host,
            token=secrets.token_hex(16))
        self._procs: list[mp.process.BaseProcess] = []
        self._events: queue.Queue = queue.Queue()
        self._socks: list[socket.socket] = []
        self._owner: dict[str, int] = {}            # request id -> attention worker
        self._load = [0] * par.attention_workers    # tokens queued per worker (prompt + max_tokens)
        self._cost: dict[str, int] = {}
        self._live: dict[str, set[int]] = {}        # request id -> indices of unfinished sequences
        self._conn_rank: dict[int, int] = {}       # control connection -> attention worker rank
        self._worker_stats: dict[int, dict] = {}    # attention worker rank -> its latest Stats
        self._finalizer = weakref.finalize(self, _shutdown, self._socks, self._procs, self._store, self.session,
                                           par.expert_workers if rendezvous else 0, self._launcher)
        if rendezvous:
            self._publish()
        else:
            self._spawn()
        self._connect()

    # -- start -------------------------------------------------------------------------------------
    def _spawn(self) -> None:
        """Start the pools as processes of this host. Unless torch_threads is given, the cores are
        shared out between the workers: both pools compute at once, and torch's default (every
        core in every process) oversubscribes the CPU, which slows OpenMP several-fold."""
        par = self.cfg.parallel
        if par.torch_threads is None:
            par = replace(par, torch_threads=max(1, len(os.sched_getaffinity(0)) //
                                                 (par.attention_workers + par.expert_workers)))
        cfg = replace(self.cfg, parallel=par)
        store_addr = (self._launcher.host, self._store.port)
        for w in range(par.expert_workers):
            spec = ExpertWorkerSpec(self.cfg.model, self.cfg.dtype, par.expert_device or self.cfg.device, self.cfg.kernels, w,
                                    par.attention_workers, par.micro_batches, self.placement, self.transport,
                                    store_addr, self.session, par.torch_threads, par.trace_dir)
            self._procs.append(self._launcher.worker(f"e{w}", "expert", run_expert_worker, spec))
        for a in range(par.attention_workers):
            spec = AttentionWorkerSpec(cfg, a, sorted(self.eos_token_ids), self.placement, self.transport,
                                       store_addr, self._listener.getsockname()[:2], self.session)
            self._procs.append(self._launcher.worker(f"a{a}", "attention", run_attention_worker, spec))
        for p in self._procs:
            p.start()

    def _publish(self) -> None:
        """For workers on other hosts: the deployment, as JSON, under a well-known key."""
        spec = {"engine": engine_config_to_json(self.cfg), "eos": sorted(self.eos_token_ids),
                "placement": [list(ws) for ws in self.placement.copies], "transport": asdict(self.transport),
                "control": list(self._listener.getsockname()[:2]), "session": self.session}
        self._store.set("shuttle/deployment", json.dumps(spec))
        log.info("waiting for %d attention and %d expert workers at %s:%d", self.cfg.parallel.attention_workers,
                 self.cfg.parallel.expert_workers, *self._listener.getsockname()[:2])

    def _connect(self) -> None:
        """Accept every attention worker's control connection and wait for its Ready."""
        n, deadline = self.cfg.parallel.attention_workers, time.monotonic() + START_TIMEOUT_S
        self._listener.settimeout(0.5)
        conns: list[socket.socket] = []
        while len(conns) < n:
            self._check_procs()
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"only {len(conns)} of {n} attention workers connected in {START_TIMEOUT_S:.0f} s")
            try:
                conn, addr = self._listener.accept()
            except socket.timeout:
                continue
            if _admitted(conn, addr, self.transport.token):
                conns.append(conn)
        for i, c in enumerate(conns):
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_read_events, args=(c, i, self._events, self._worker_stats), daemon=True).start()
        ready: dict[int, socket.socket] = {}
        while len(ready) < n:
            conn, msg = self._next_event(deadline - time.monotonic())
            if not isinstance(msg, wire.Ready):
                raise WorkerFailedError(f"attention worker sent {type(msg).__name__} before Ready")
            ready[msg.rank] = conns[conn]
        self._socks.extend(ready[r] for r in range(n))
        self._conn_rank = {i: next(r for r, s in ready.items() if s is c) for i, c in enumerate(conns)}

    # -- requests ----------------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: list[int]) -> list[int]:
        return check_prompt(prompt_token_ids, self.model_cfg)

    def set_eos_token_ids(self, ids: set[int]) -> None:
        raise RuntimeError("the end-of-sequence ids of running worker pools are fixed when they start")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue the request on the attention worker with the fewest queued tokens."""
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.check_prompt(prompt_token_ids)
        w = min(range(len(self._load)), key=self._load.__getitem__)
        cost = (len(ids) + params.max_tokens) * params.n
        self._owner[request_id], self._cost[request_id], self._live[request_id] = w, cost, set(range(params.n))
        self._load[w] += cost
        wire.send(self._socks[w], wire.AddRequest(request_id, ids, wire.params_to_wire(params)))

    def abort_request(self, request_id: str) -> list[SequenceDelta]:
        """Ask the owning worker to abort; the finish deltas arrive through `step`."""
        if request_id in self._owner:
            try:
                self._send(self._owner[request_id], wire.Abort(request_id))
            except WorkerFailedError:
                pass  # the worker is gone, and its requests with it; the caller is told elsewhere
        return []

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        if request_id in self._owner:
            self._send(self._owner[request_id], wire.StopSequence(request_id, index, stop_reason))
            self._finished(request_id, index)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def step(self, timeout: float | None = None) -> list[SequenceDelta]:
        """Deltas the workers sent since the last call; waits for at least one message (up to
        `timeout` seconds) while requests are in flight."""
        out: list[SequenceDelta] = []
        if not self._owner:
            return out
        _, msg = self._next_event(timeout)
        while msg is not None:
            for v in msg.deltas if isinstance(msg, wire.Deltas) else ():  # else a wake()
                d = wire.decode_delta(v)
                if d.request_id in self._live and d.index in self._live[d.request_id]:
                    out.append(d)
                    if d.finish_reason is not None:
                        self._finished(d.request_id, d.index)
            try:
                _, msg = self._event(self._events.get_nowait())
            except queue.Empty:
                msg = None
        return out

    def wake(self) -> None:
        """Make a `step` that is waiting for the workers return now (thread-safe): the caller has
        new requests or aborts to send."""
        self._events.put((-1, _WAKE))

    def check_health(self) -> None:
        """Raise WorkerFailedError if a worker failed or exited, also while no request is in flight
        (then queued deltas belong to finished requests and are dropped). Call it from the thread
        that calls `step`."""
        if not self._owner:
            self._drain_events()
        self._check_procs()

    def stats(self) -> dict:
        """The attention workers' latest Stats added up (as LLMEngine.stats), each worker's busy
        time, and the expert workers' load (published in the store)."""
        workers = [dict(self._worker_stats[r], rank=r) for r in sorted(self._worker_stats)]
        total = {k: sum(w.get(k, 0) for w in workers) for k in
                 ("running", "waiting", "num_blocks", "free_blocks", "kv_cache_tokens", "prefix_cache_queries",
                  "prefix_cache_hits",
                  "preemptions", "generated_tokens")}
        total["steps"] = max((w.get("steps", 0) for w in workers), default=0)
        total["kv_cache_usage"] = 1 - total["free_blocks"] / total["num_blocks"] if total["num_blocks"] else 0.0
        busy = [{"pool": "attention", "worker": f"a{w['rank']}", "busy_ns": w["busy_ns"], "uptime_ns": w["uptime_ns"]}
                for w in workers]
        experts: dict[int, int] = {}
        for w in range(self.cfg.parallel.expert_workers):
            key = f"{self.session}/stats/e{w}"
            if self._store.check([key]):
                e = json.loads(self._store.get(key))
                busy.append({"pool": "expert", "worker": f"e{w}", "busy_ns": e["busy_ns"], "uptime_ns": e["uptime_ns"]})
                for expert, n in zip(e["experts"], e["tokens"]):
                    experts[expert] = experts.get(expert, 0) + n
        return {**total, "expert_tokens": dict(sorted(experts.items())), "busy": busy}

    def _finished(self, request_id: str, index: int) -> None:
        live = self._live.get(request_id)
        if live is None:
            return
        live.discard(index)
        if not live:
            w = self._owner.pop(request_id)
            self._load[w] -= self._cost.pop(request_id)
            del self._live[request_id]

    # -- events and failures -----------------------------------------------------------------------
    def _next_event(self, timeout: float | None) -> tuple[int, object]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._event(self._events.get(timeout=0.5))
            except queue.Empty:
                self._check_procs()
                if deadline is not None and time.monotonic() > deadline:
                    return -1, None

    def _event(self, item: tuple[int, object]) -> tuple[int, object]:
        conn, msg = item
        if isinstance(msg, wire.Failed):
            raise WorkerFailedError(f"attention worker a{msg.rank} failed: {msg.message}{self._exited()}")
        if msg is None:
            self._check_procs(wait=2.0)
            raise WorkerFailedError(f"attention worker a{self._conn_rank.get(conn, conn)} closed its connection")
        return conn, msg

    def _exited(self, grace_s: float = 1.0) -> str:
        """The workers that exited, giving a killed one a moment to be reaped: a failure often
        reaches us through a survivor before the root cause's exit is visible."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not any(p.exitcode is not None and p.exitcode < 0 for p in self._procs):
            time.sleep(0.05)
        gone = [f"{p.name} (exit code {p.exitcode})" for p in self._procs if p.exitcode is not None]
        causes = []
        for w in range(self.cfg.parallel.expert_workers):
            key = f"{self.session}/failed/e{w}"
            if self._store.check([key]):
                causes.append(f"expert worker e{w} failed: {self._store.get(key).decode()}")
        return "".join(f"; {c}" for c in causes) + (f"; exited: {', '.join(gone)}" if gone else "")

    def _check_procs(self, wait: float = 0.0) -> None:
        for p in self._procs:
            if wait and p.exitcode is None:
                p.join(wait)
            if p.exitcode == MAIN_GUARD_EXIT:
                raise WorkerFailedError(MAIN_GUARD_HINT)
            if p.exitcode is not None:
                self._drain_events()  # a Failed message says more than the exit code
                raise WorkerFailedError(f"worker {p.name} exited with code {p.exitcode}")

    def _drain_events(self) -> None:
        """Handle every event already queued (raises as _event does for a Failed message)."""
        try:
            while True:
                self._event(self._events.get_nowait())
        except queue.Empty:
            pass

    def _send(self, rank: int, msg) -> None:
        try:
            wire.send(self._socks[rank], msg)
        except OSError as e:
            raise WorkerFailedError(f"attention worker a{rank} is unreachable: {e}") from None

    def shutdown(self) -> None:
        self._finalizer()


_WAKE = object()  # an event that only ends a waiting step


HELLO_TIMEOUT_S = 5.0  # a connection that does not say Hello within this is dropped


def _admitted(conn: socket.socket, addr: tuple, token: str) -> bool:
    """Read a new control connection's first message: Hello with the deployment token, or the
    connection is closed and the attempt logged (a stranger must not inject requests or results)."""
    conn.settimeout(HELLO_TIMEOUT_S)
    why = None
    try:
        head = _recv_exact(conn, 4)
        n = int.from_bytes(head, "big")
        if n > 4096:
            why = f"first message of {n} bytes"
        else:
            msg = wire.decode(_recv_exact(conn, n))
            if not isinstance(msg, wire.Hello):
                why = f"{type(msg).__name__} before Hello (missing token)"
            elif not isinstance(msg.token, str) or not hmac.compare_digest(msg.token.encode(), token.encode()):
                why = "wrong deployment token"
    except Exception as e:  # timeout, reset, garbage: all the same to us
        why = f"no valid Hello: {type(e).__name__}: {e}"
    if why is None:
        conn.settimeout(None)
        return True
    log.warning("control listener refused a connection from %s:%s: %s", addr[0], addr[1], why)
    conn.close()
    return False


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def _read_events(sock: socket.socket, conn: int, events: queue.Queue, stats: dict[int, dict]) -> None:
    """A control connection's reader: Stats are kept (latest per worker), the rest is queued."""
    stream = sock.makefile("rb")
    try:
        while (msg := wire.recv(stream)) is not None:
            if isinstance(msg, wire.Stats):
                stats[msg.rank] = msg.stats
            else:
                events.put((conn, msg))
    except OSError:
        pass
    events.put((conn, None))


def _shutdown(socks: list[socket.socket], procs: list, store: TCPStore, session: str, remote_experts: int,
              launcher=None) -> None:
    """Stop the pools: attention workers first (Shutdown), then expert workers, which see their
    peers leave and the shutdown key set; anything still alive after a grace period is killed.
    Workers on other hosts are given the same grace period to say they are done, so the store
    (which lives in this process) outlives their last look at it."""
    try:
        store.set(f"{session}/shutdown", "1")
    except Exception:
        pass
    for s in socks:
        try:
            wire.send(s, wire.Shutdown())
        except OSError:
            pass
    deadline = time.monotonic() + 10.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    done = [f"{session}/done/e{w}" for w in range(remote_experts)]
    while done and time.monotonic() < deadline and not store.check(done):
        time.sleep(0.05)
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join(5.0)
    for s in socks:
        s.close()
    if launcher is not None:
        launcher.close()


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous must be HOST:PORT, got {addr!r}")
    return host, int(port)


def engine_config_to_json(cfg: EngineConfig) -> dict:
    d = asdict(cfg)
    d["dtype"] = None if cfg.dtype is None else str(cfg.dtype).removeprefix("torch.")
    return d


def engine_config_from_json(d: dict) -> EngineConfig:
    return EngineConfig(d["model"], None if d["dtype"] is None else DTYPES[d["dtype"]], d["device"], d["kernels"],
                        d["seed"], SchedulerConfig(**d["scheduler"]), CacheConfig(**d["cache"]),
                        ParallelConfig(**d["parallel"]))


def run_role(role: str, rendezvous: str, host: str | None = None, torch_threads: int | None = None) -> None:
    """Run one worker of a deployment whose front waits at `rendezvous` (HOST:PORT): read the
    deployment from the store, take the next rank of `role` ("attention" or "expert"), serve.
    host: this machine's address for the tcp transport (default: the one that reaches the store)."""
    store_host, port = _split(rendezvous)
    store = TCPStore(store_host, port, is_master=False, wait_for_workers=False)
    d = json.loads(store.get("shuttle/deployment"))
    cfg = engine_config_from_json(d["engine"])
    transport = TransportConfig(**{**d["transport"], "host": host or _local_address(store_host, port)})
    placement = Placement(len(d["placement"]), cfg.parallel.expert_workers,
                          tuple(tuple(ws) for ws in d["placement"]))
    rank = store.add(f"shuttle/rank/{role}", 1) - 1
    par = cfg.parallel
    if role == "attention":
        if rank >= par.attention_workers:
            raise ValueError(f"the deployment has {par.attention_workers} attention workers; this would be one more")
        run_attention_worker(AttentionWorkerSpec(cfg, rank, d["eos"], placement, transport, (store_host, port),
                                                 tuple(d["control"]), d["session"]))
    elif role == "expert":
        if rank >= par.expert_workers:
            raise ValueError(f"the deployment has {par.expert_workers} expert workers; this would be one more")
        run_expert_worker(ExpertWorkerSpec(cfg.model, cfg.dtype, cfg.device, cfg.kernels, rank, par.attention_workers,
                                           par.micro_batches, placement, transport, (store_host, port), d["session"],
                                           torch_threads or par.torch_threads, par.trace_dir))
    else:
        raise ValueError(f"role must be attention or expert, got {role!r}")


def _local_address(host: str, port: int) -> str:
    """The address of this machine's interface that routes to host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]
