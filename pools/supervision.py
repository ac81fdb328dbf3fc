"""Supervision of spawned worker pools, the front's side: notice a worker that exits, fails or
goes silent, and restart it in a new data-plane epoch. When only expert workers failed, the
attention workers keep their requests and KV caches: with a copy of every expert they held on a live
expert worker, fail over (route around them from the next epoch, add them back once restarted);
without, restart them and go on where the step broke (it is computed again, nothing else). When an
attention worker failed, survivors drop their requests, which are resumed from prompt + delivered
tokens (`recomputed_tokens` counts what is prefilled again). docs/architecture.md, "Supervision",
has the whole story.

A PoolEngine holds one Supervision (`engine.supervision`), which keeps the restart budget and the
failover state and drives the engine's pools through `Pools` below.
"""
import collections
import json
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from attention_nodes import messages as wire
from attention_nodes.config import EngineConfig
from attention_nodes.engine import SequenceDelta
from attention_nodes.sampling_params import SamplingParams
from m2n_comm._common import process_gone
from m2n_comm._hello import SignedStore
from m2n_comm.placement import ExpertPlacement
from m2n_comm.transport import TransportConfig
from pools.eplb import PlacementControl

log = logging.getLogger("shuttle")
RESTART_TIMEOUT_S = 120.0  # a restart (spawn, load, every endpoint re-opened) must finish within this
REPORT_GRACE_S = 1.0  # after a failure: how long to wait for the report that names its cause
ADD_BACK_POLL_S = 0.05  # during a failover: how often to look whether the restarted worker has loaded
MAIN_GUARD_EXIT = 3  # a spawned worker found its script starting pools while being imported
MAIN_GUARD_HINT = ("the worker pools are separate processes that re-import your script: start them under "
                   "`if __name__ == \"__main__\":` (put the LLM(...) / AsyncLLM(...) call and what uses it in that block)")


class Worker(NamedTuple):
    """One worker of the pools: its kind and its rank within its pool. str() is its name on the
    M2N wire, in the store and in process lists ("a0", "e1"); `named` reads such a name back."""

    kind: str  # "attention" or "expert"
    rank: int

    def __str__(self) -> str:
        return f"{self.kind[0]}{self.rank}"

    @classmethod
    def named(cls, name: str) -> "Worker":
        kind = {"a": "attention", "e": "expert"}.get(name[:1])
        if kind is None or not name[1:].isdigit():
            raise ValueError(f"{name!r} is not a worker name (a0, a1, ... or e0, e1, ...)")
        return cls(kind, int(name[1:]))


class WorkerFailedError(RuntimeError):
    """A worker process failed or exited and was not (or could no more be) restarted; the message
    names it and says why."""


class _Broken(Exception):
    """A worker died, failed or went silent, or a data plane broke: restart (or give up).
    suspects: the workers to kill and start again."""

    def __init__(self, why: str, suspects: set["Worker"] | None = None):
        super().__init__(why)
        self.why, self.suspects = why, set(suspects or ())


@dataclass
class _Request:
    """What the front keeps of a running request, enough to resume it elsewhere."""

    prompt: list[int]
    params: SamplingParams
    worker: int
    cost: int  # tokens it may queue: (prompt + max_tokens) * n
    live: set[int]  # indices of unfinished samples
    outputs: list[list[int]]  # per sample, the token ids delivered so far
    aborting: bool = False


def _down(pid: int) -> bool:
    """The worker process cannot take part in a step now: it exited, or it is stopped (SIGSTOP, a
    debugger)."""
    if process_gone(pid):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _switches(pid: int) -> int | None:
    """Context switches of the process's main thread so far (they grow whenever it has run)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return sum(int(line.split()[1]) for line in f if line.split(b":")[0].endswith(b"ctxt_switches"))
    except (OSError, ValueError, IndexError):
        return None


class _StopWatch:
    """How long each worker process has been stopped without running in between. A stop/continue
    cycle (a CPU quota, a noisy neighbour, a debugger stepping) is a straggler, not a failure: a
    worker is failed only when it is seen stopped throughout `bound` s (its peers' dead_after_s),
    as a silent peer would be; it ran in between when its context switches grew."""

    def __init__(self):
        self._since: dict[int, tuple[float, int | None]] = {}  # pid -> (first seen stopped, switches then)

    def stopped_too_long(self, pid: int, bound: float) -> bool:
        if process_gone(pid):
            return True
        if not _down(pid):
            self._since.pop(pid, None)
            return False
        now, switches = time.monotonic(), _switches(pid)
        since, seen = self._since.get(pid, (now, switches))
        if switches != seen:  # it ran since: a new stop
            since = now
        self._since[pid] = (since, switches)
        return now - since >= bound


def _suspect(peer: str, why: str) -> set[Worker]:
    """The peer a transport report blames: one that died or went silent, not one that merely closed
    its endpoint (that is a survivor leaving a broken epoch)."""
    return {Worker.named(peer)} if peer and "closed" not in why else set()


def _names(workers: set[Worker]) -> str:
    return ", ".join(sorted(str(w) for w in workers))


class Pools(Protocol):
    """What supervision reads and drives of the pool engine (PoolEngine implements it)."""

    cfg: EngineConfig
    session: str
    epoch: int                        # of the data plane; supervision opens the next one
    placement: ExpertPlacement        # the placement new workers start with
    placements: PlacementControl
    _store: SignedStore               # the deployment's store: every value signed (m2n_comm/_hello.py)
    _procs: list                      # the worker processes (or Ray actors), each named "a0", "e1", ...
    _conn_rank: dict[int, int]        # current control connection -> attention worker rank
    _conn_epoch: dict[int, int]       # current control connection -> epoch of its Ready
    transport: TransportConfig        # dead_after_s: how long a worker may be silent or stopped
    _requests: dict[str, _Request]
    _load: list[int]
    _ready: bool

    def _worker(self, worker: Worker, placement: ExpertPlacement | None = None, epoch: int | None = None): ...
    def _send(self, rank: int, msg) -> None: ...
    def _await_ready(self, ranks: set[int], timeout_s: float) -> list[SequenceDelta]: ...


class Supervision:
    """Failure handling of a pool engine (see the module docstring). remote: the workers were
    started elsewhere (`shuttle serve --role`), so a failure is reported, never restarted."""

    def __init__(self, pools: Pools, remote: bool):
        self.pools, self.remote = pools, remote
        self.num_restarts = 0
        self.restarts: collections.deque[float] = collections.deque()  # when, within the window
        # During a failover: (the placement to add the workers back with, their names, the epoch
        # they were started for); None otherwise.
        self.degraded: tuple[ExpertPlacement, set[Worker], int] | None = None
        self.next_add_back = 0.0
        self.recomputed_tokens = 0  # prompt + delivered tokens of resumed requests (sent to be prefilled again)
        self._stops = _StopWatch()

    # -- failures ----------------------------------------------------------------------------------
    def check_procs(self, wait: float = 0.0) -> None:
        """Raise _Broken for a worker that exited, waiting up to `wait` s in all for one to exit
        (a closed connection comes a moment before its process can be reaped; --role workers have
        none here to wait for)."""
        deadline = time.monotonic() + wait
        while self.pools._procs and time.monotonic() < deadline and all(p.exitcode is None for p in self.pools._procs):
            time.sleep(0.02)
        bound = self.pools.transport.dead_after_s
        for p in list(self.pools._procs):
            down = p.exitcode is None and p.pid is not None and self._stops.stopped_too_long(p.pid, bound)
            if down:  # an exited, not yet reaped process looks down too: reap it to report its code
                p.join(0.2)
            if p.exitcode == MAIN_GUARD_EXIT:
                raise WorkerFailedError(MAIN_GUARD_HINT)
            if p.exitcode is not None:
                raise _Broken(f"worker {p.name} exited with code {p.exitcode}{self._causes()}", {Worker.named(p.name)})
            if down:  # stopped since dead_after_s
                raise _Broken(f"worker {p.name} is stopped (SIGSTOP or a debugger) for {bound:g} s or more",
                              {Worker.named(p.name)})

    def check_store(self) -> None:
        """Raise _Broken for an expert worker's report that its data plane broke in this epoch (an
        attention worker died or went silent)."""
        for w in range(self.pools.cfg.parallel.expert_workers):
            key = f"{self.pools.session}/broken/g{self.pools.epoch}/e{w}"
            if self.pools._store.check([key]):
                report = json.loads(self.pools._store.get(key))
                raise _Broken(f"expert worker e{w}: {report['why']}", _suspect(report["peer"], report["why"]))

    def _reported_suspects(self, epoch: int) -> set[Worker]:
        """Every worker the expert workers' reports of `epoch` blame."""
        found = set()
        for w in range(self.pools.cfg.parallel.expert_workers):
            key = f"{self.pools.session}/broken/g{epoch}/e{w}"
            if self.pools._store.check([key]):
                report = json.loads(self.pools._store.get(key))
                found |= _suspect(report["peer"], report["why"])
        return found

    def _causes(self) -> str:
        causes = []
        for w in range(self.pools.cfg.parallel.expert_workers):
            key = f"{self.pools.session}/failed/e{w}"
            if self.pools._store.check([key]):
                causes.append(f"expert worker e{w} failed: {self.pools._store.get(key).decode()}")
        return "".join(f"; {c}" for c in causes)

    def exited(self, grace_s: float = 1.0) -> str:
        """The workers that exited, giving a killed one a moment to be reaped: a failure often
        reaches us through a survivor before the root cause's exit is visible."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not any(p.exitcode is not None and p.exitcode < 0 for p in self.pools._procs):
            time.sleep(0.05)
        gone = [f"{p.name} (exit code {p.exitcode})" for p in self.pools._procs if p.exitcode is not None]
        return self._causes() + (f"; exited: {', '.join(gone)}" if gone else "")

    def recover(self, b: _Broken) -> list[SequenceDelta]:
        """Restart what failed and resume every request; returns the finish deltas of requests that
        were being aborted. Raises WorkerFailedError when the budget is spent or nothing here can
        restart the worker."""
        self.pools._ready = False
        while True:
            suspects = self._suspects(b)
            self._count_restart(b, suspects)
            try:
                if self._can_fail_over(suspects):
                    return self._fail_over(suspects, b.why)
                if self._experts_only(suspects):
                    return self._restart_experts(suspects, b.why)
                self._restart(suspects, b.why)
                return self._resume()
            except _Broken as again:
                b = again

    def _suspects(self, b: _Broken) -> set[Worker]:
        """The workers to blame for b: the ones it names, those that exited, and those the expert
        workers' reports name (a root cause may be reported a moment after the survivor that saw
        it leave, so this waits up to REPORT_GRACE_S for one)."""
        suspects, deadline = set(b.suspects), time.monotonic() + REPORT_GRACE_S
        while True:
            suspects |= self._reported_suspects(self.pools.epoch) | {Worker.named(p.name) for p in self.pools._procs if p.exitcode is not None}
            if suspects or time.monotonic() > deadline:
                return suspects
            time.sleep(0.05)

    def _count_restart(self, b: _Broken, suspects: set[Worker]) -> None:
        par = self.pools.cfg.parallel
        why = b.why + self.exited(0.0) + (f"; failed: {_names(suspects)}" if suspects else "")
        if self.remote:
            raise WorkerFailedError(f"{why}; workers started with `shuttle serve --role` on other hosts are not "
                                    f"restarted by the server: restart the deployment")
        if par.max_worker_restarts == 0:
            raise WorkerFailedError(why)
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > par.restart_window_s:
            self.restarts.popleft()
        if len(self.restarts) >= par.max_worker_restarts:
            raise WorkerFailedError(f"{why}; giving up: {len(self.restarts)} restarts within the last "
                                    f"{par.restart_window_s:g} s already (--max-worker-restarts "
                                    f"{par.max_worker_restarts}, --restart-window-s {par.restart_window_s:g})")
        self.restarts.append(now)
        self.num_restarts += 1

    def _restart(self, suspects: set[Worker], why: str) -> None:
        """Kill and start again the suspects, open the next epoch, and wait until every attention
        worker joined it."""
        if self.pools.placements.pending is not None or self.degraded is not None:
            # Survivors may hold, or route with, placement versions a new worker would not know (a
            # re-placement under way), or route around workers being added back (a failover): every
            # worker starts again with the placement in use (docs/architecture.md, Supervision).
            suspects = {Worker.named(p.name) for p in self.pools._procs}
            if self.degraded is not None:  # with the workers that were out back in
                back = self.degraded[0]
                self.pools.placements.set_current(ExpertPlacement(back.moe_layers, back.layers,
                                                            self.pools.placements.next_version()))
                self.degraded = None
        self.pools.placements.restarted()  # new workers count tokens and steps from zero
        self.pools.placement = self.pools.placements.current
        log.warning("restarting %s (restart %d): %s", _names(suspects) or "the data plane",
                    self.num_restarts, why)
        self.pools.epoch += 1
        restarted = {w.rank for w in suspects if w.kind == "attention"}
        for c, rank in list(self.pools._conn_rank.items()):
            if rank in restarted:  # what the old process still sends (its connection closing) is stale
                del self.pools._conn_rank[c]
                self.pools._conn_epoch.pop(c, None)
        for i, p in enumerate(self.pools._procs):
            if Worker.named(p.name) in suspects:
                if p.exitcode is None:
                    p.kill()  # silent (or stopped): a restart replaces it
                p.join(5.0)
                self.pools._procs[i] = self.pools._worker(Worker.named(p.name))
        self.pools._store.set(f"{self.pools.session}/epoch", str(self.pools.epoch))
        for rank in range(self.pools.cfg.parallel.attention_workers):
            if rank not in restarted:
                self.pools._send(rank, wire.Reset(self.pools.epoch))
        for p in self.pools._procs:
            if Worker.named(p.name) in suspects:
                p.start()
        self.pools._await_ready(set(range(self.pools.cfg.parallel.attention_workers)), RESTART_TIMEOUT_S)

    def _experts_only(self, suspects: set[Worker]) -> bool:
        """Only expert workers failed, and every worker routes with the placement in use (no
        re-placement or failover under way): the attention workers can keep their requests."""
        return (bool(suspects) and all(w.kind == "expert" for w in suspects) and self.degraded is None
                and self.pools.placements.pending is None)

    def _restart_experts(self, suspects: set[Worker], why: str) -> list[SequenceDelta]:
        """Start the failed expert workers again for the next epoch, with the placement in use, and
        switch the attention workers to it keeping their requests and KV caches: the step that broke
        is computed again, no request from its prompt. Returns the deltas that came meanwhile."""
        cur = self.pools.placements.current
        log.warning("restarting %s (restart %d): %s; the attention workers keep their requests", _names(suspects),
                    self.num_restarts, why)
        self.pools.placements.restarted()  # the new workers count tokens and steps from zero
        self.pools.epoch += 1
        for i, p in enumerate(self.pools._procs):
            if Worker.named(p.name) in suspects:
                if p.exitcode is None:
                    p.kill()  # silent (or stopped): it is replaced
                p.join(5.0)
                self.pools._procs[i] = self.pools._worker(Worker.named(p.name), cur, self.pools.epoch)
        self._switch_epoch(cur)
        for p in self.pools._procs:
            if Worker.named(p.name) in suspects:
                p.start()
        return self._switched()

    # -- failover ----------------------------------------------------------------------------------
    def _can_fail_over(self, suspects: set[Worker]) -> bool:
        """Only expert workers failed, and every expert they hold has a copy on a live expert worker
        in every layer: route around them instead of restarting anyone else. Not while a
        re-placement or another failover is under way (those restart every worker)."""
        if (not suspects or any(w.kind != "expert" for w in suspects) or self.degraded is not None
                or self.pools.placements.pending is not None):
            return False
        return self.pools.placements.current.covers_without({w.rank for w in suspects})

    def _fail_over(self, suspects: set[Worker], why: str) -> list[SequenceDelta]:
        """Open the next epoch without the failed expert workers (placement v + 1: their copies
        dropped); attention workers keep their requests and route around them from the epoch's first
        step. The failed workers are started again (loading the placement v + 2, the one in use now)
        for the epoch after, which `poll_add_back` opens once they have loaded. Returns the deltas
        that came meanwhile."""
        cur = self.pools.placements.current
        without = cur.without({w.rank for w in suspects}, self.pools.placements.next_version())
        back = ExpertPlacement(cur.moe_layers, cur.layers, without.version + 1)
        log.warning("failover: expert workers %s are out (%s); routing around them with placement version %d, "
                    "restarting them to be added back with version %d", _names(suspects), why,
                    without.version, back.version)
        self.pools.epoch += 1
        # Published for the placement watchers (which build versions in order; both cost survivors
        # nothing: they hold every expert of both) and named as the epoch's placement.
        self.pools._store.set(f"{self.pools.session}/placement/{without.version}", without.to_json())
        self.pools._store.set(f"{self.pools.session}/placement/{back.version}", back.to_json())
        self.pools._store.set(f"{self.pools.session}/epoch/g{self.pools.epoch}/placement", str(without.version))
        for i, p in enumerate(self.pools._procs):
            if Worker.named(p.name) in suspects:
                if p.exitcode is None:
                    p.kill()  # silent (or stopped): it is replaced
                p.join(5.0)
                self.pools._procs[i] = self.pools._worker(Worker.named(p.name), back, self.pools.epoch + 1)
        self.degraded = (back, set(suspects), self.pools.epoch + 1)
        self.pools.placements.set_current(without)
        self._switch_epoch(without)
        for p in self.pools._procs:
            if Worker.named(p.name) in suspects:
                p.start()
        return self._switched()

    def _switch_epoch(self, placement: ExpertPlacement) -> None:
        """Tell every attention worker to rejoin the current epoch keeping its requests and routing
        with `placement`; what their connections send from now on belongs to this epoch (deltas of
        steps before the switch included: the workers keep those requests, nothing is resumed)."""
        self.pools._store.set(f"{self.pools.session}/epoch", str(self.pools.epoch))
        for conn in list(self.pools._conn_rank):
            self.pools._conn_epoch[conn] = self.pools.epoch
        msg = wire.Reset(self.pools.epoch, placement.to_json())
        for rank in range(self.pools.cfg.parallel.attention_workers):
            self.pools._send(rank, msg)

    def _switched(self) -> list[SequenceDelta]:
        """Wait until every attention worker joined the epoch of a switch; returns the deltas that
        came meanwhile."""
        out = self.pools._await_ready(set(range(self.pools.cfg.parallel.attention_workers)), RESTART_TIMEOUT_S)
        self.pools._ready = True
        log.info("epoch %d: every worker is up; placement version %d, %d requests went on", self.pools.epoch,
                 self.pools.placements.current.version, len(self.pools._requests))
        return out

    def poll_add_back(self) -> list[SequenceDelta]:
        """During a failover: once the restarted expert workers have loaded, open the epoch they
        were started for, with the placement from before the failure (every worker keeps its
        requests; at most one step is computed again). Returns the deltas that came meanwhile."""
        if self.degraded is None or time.monotonic() < self.next_add_back:
            return []
        self.next_add_back = time.monotonic() + ADD_BACK_POLL_S
        back, names, epoch = self.degraded
        keys = [f"{self.pools.session}/up/{n}" for n in sorted(names)]
        if not self.pools._store.check(keys) or any(int(self.pools._store.get(k)) != epoch for k in keys):
            return []
        log.info("adding %s back: placement version %d", _names(names), back.version)
        self.pools._ready, self.pools.epoch = False, epoch
        self.pools._store.set(f"{self.pools.session}/epoch/g{epoch}/placement", str(back.version))
        self.degraded = None
        self.pools.placements.set_current(back)
        self._switch_epoch(back)
        return self._switched()

    def _resume(self) -> list[SequenceDelta]:
        """Send every running request again, with the tokens it already delivered (the workers of
        the new epoch know none); requests being aborted just finish."""
        out, self.pools._load = [], [0] * self.pools.cfg.parallel.attention_workers
        for rid, r in list(self.pools._requests.items()):
            if r.aborting:
                out += [SequenceDelta(rid, i, [], None, "abort") for i in sorted(r.live)]
                del self.pools._requests[rid]
                continue
            r.worker = min(range(len(self.pools._load)), key=self.pools._load.__getitem__)
            self.pools._load[r.worker] += r.cost
            resume = [r.outputs[i] if i in r.live else None for i in range(r.params.n)]
            started = any(r.outputs) or len(r.live) < r.params.n
            self.recomputed_tokens += sum(len(r.prompt) + len(out) for out in resume if out is not None) \
                if started else len(r.prompt)
            self.pools._send(r.worker, wire.AddRequest(rid, r.prompt, wire.params_to_wire(r.params),
                                                 resume if started else None))
        self.pools._ready = True
        log.info("epoch %d: every worker is up; %d requests resumed", self.pools.epoch, len(self.pools._requests))
        return out

