"""Supervision of spawned worker pools (the front's side; PoolEngine inherits it): notice a worker
that exits, fails or goes silent, and either restart it (a new data-plane epoch; survivors drop
their requests, which are resumed from prompt + delivered tokens) or, when only expert workers
failed and every expert they held has a copy on a live expert worker, fail over: route around them
from the next epoch (every request goes on where it was) and add them back once restarted.
docs/architecture.md, "Supervision", has the whole story.

The host class (PoolEngine) provides: cfg, session, epoch, _store, _procs, _socks, _conn_rank,
_conn_epoch, _requests, _load, _ready, _remote, _restarts, num_restarts, placement, placements
(server.eplb.PlacementControl), _degraded, _next_add_back, and the methods _worker, _send,
_await_ready.
"""
import json
import logging
import time
from dataclasses import dataclass

from attention_nodes import messages as wire
from attention_nodes.engine import SequenceDelta
from attention_nodes.sampling_params import SamplingParams
from m2n_comm._common import process_gone
from m2n_comm.placement import ExpertPlacement

log = logging.getLogger("shuttle")
RESTART_TIMEOUT_S = 120.0  # a restart (spawn, load, every endpoint re-opened) must finish within this
REPORT_GRACE_S = 1.0  # after a failure: how long to wait for the report that names its cause
ADD_BACK_POLL_S = 0.05  # during a failover: how often to look whether the restarted worker has loaded
MAIN_GUARD_EXIT = 3  # a spawned worker found its script starting pools while being imported
MAIN_GUARD_HINT = ("the worker pools are separate processes that re-import your script: start them under "
                   "`if __name__ == \"__main__\":` (put the LLM(...) / AsyncLLM(...) call and what uses it in that block)")


class WorkerFailedError(RuntimeError):
    """A worker process failed or exited and was not (or could no more be) restarted; the message
    names it and says why."""


class _Broken(Exception):
    """A worker died, failed or went silent, or a data plane broke: restart (or give up).
    suspects: the workers ("a0", "e1") to kill and start again."""

    def __init__(self, why: str, suspects: set[str] | None = None):
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
    """The worker process cannot take part in a step: it exited, or it is stopped (SIGSTOP, a
    debugger), which its peers would only notice after their dead_after_s."""
    if process_gone(pid):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _suspect(peer: str, why: str) -> set[str]:
    """The peer a transport report blames: one that died or went silent, not one that merely closed
    its endpoint (that is a survivor leaving a broken epoch)."""
    return {peer} if peer and "closed" not in why else set()


class Supervision:
    """Failure handling of PoolEngine (see the module docstring)."""

    # -- failures ----------------------------------------------------------------------------------
    def _check_procs(self, wait: float = 0.0) -> None:
        """Raise _Broken for a worker that exited, waiting up to `wait` s in all for one to exit
        (a closed connection comes a moment before its process can be reaped)."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and all(p.exitcode is None for p in self._procs):
            time.sleep(0.02)
        for p in list(self._procs):
            down = p.exitcode is None and p.pid is not None and _down(p.pid)
            if down:  # an exited, not yet reaped process looks down too: reap it to report its code
                p.join(0.2)
            if p.exitcode == MAIN_GUARD_EXIT:
                raise WorkerFailedError(MAIN_GUARD_HINT)
            if p.exitcode is not None:
                raise _Broken(f"worker {p.name} exited with code {p.exitcode}{self._causes()}", {p.name})
            if down:  # stopped: its peers would wait dead_after_s to say so
                raise _Broken(f"worker {p.name} is stopped (SIGSTOP or a debugger)", {p.name})

    def _check_store(self) -> None:
        """Raise _Broken for an expert worker's report that its data plane broke in this epoch (an
        attention worker died or went silent)."""
        for w in range(self.cfg.parallel.expert_workers):
            key = f"{self.session}/broken/g{self.epoch}/e{w}"
            if self._store.check([key]):
                report = json.loads(self._store.get(key))
                raise _Broken(f"expert worker e{w}: {report['why']}", _suspect(report["peer"], report["why"]))

    def _reported_suspects(self, epoch: int) -> set[str]:
        """Every worker the expert workers' reports of `epoch` blame."""
        found = set()
        for w in range(self.cfg.parallel.expert_workers):
            key = f"{self.session}/broken/g{epoch}/e{w}"
            if self._store.check([key]):
                report = json.loads(self._store.get(key))
                found |= _suspect(report["peer"], report["why"])
        return found

    def _causes(self) -> str:
        causes = []
        for w in range(self.cfg.parallel.expert_workers):
            key = f"{self.session}/failed/e{w}"
            if self._store.check([key]):
                causes.append(f"expert worker e{w} failed: {self._store.get(key).decode()}")
        return "".join(f"; {c}" for c in causes)

    def _exited(self, grace_s: float = 1.0) -> str:
        """The workers that exited, giving a killed one a moment to be reaped: a failure often
        reaches us through a survivor before the root cause's exit is visible."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not any(p.exitcode is not None and p.exitcode < 0 for p in self._procs):
            time.sleep(0.05)
        gone = [f"{p.name} (exit code {p.exitcode})" for p in self._procs if p.exitcode is not None]
        return self._causes() + (f"; exited: {', '.join(gone)}" if gone else "")

    def _recover(self, b: _Broken) -> list[SequenceDelta]:
        """Restart what failed and resume every request; returns the finish deltas of requests that
        were being aborted. Raises WorkerFailedError when the budget is spent or nothing here can
        restart the worker."""
        self._ready = False
        while True:
            suspects = self._suspects(b)
            self._count_restart(b, suspects)
            try:
                if self._can_fail_over(suspects):
                    return self._fail_over(suspects, b.why)
                self._restart(suspects, b.why)
                return self._resume()
            except _Broken as again:
                b = again

    def _suspects(self, b: _Broken) -> set[str]:
        """The workers to blame for b: the ones it names, those that exited, and those the expert
        workers' reports name (a root cause may be reported a moment after the survivor that saw
        it leave, so this waits up to REPORT_GRACE_S for one)."""
        suspects, deadline = set(b.suspects), time.monotonic() + REPORT_GRACE_S
        while True:
            suspects |= self._reported_suspects(self.epoch) | {p.name for p in self._procs if p.exitcode is not None}
            if suspects or time.monotonic() > deadline:
                return suspects
            time.sleep(0.05)

    def _count_restart(self, b: _Broken, suspects: set[str]) -> None:
        par = self.cfg.parallel
        why = b.why + self._exited(0.0) + (f"; failed: {', '.join(sorted(suspects))}" if suspects else "")
        if self._remote:
            raise WorkerFailedError(f"{why}; workers started with `shuttle serve --role` on other hosts are not "
                                    f"restarted by the server: restart the deployment")
        if par.max_worker_restarts == 0:
            raise WorkerFailedError(why)
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > par.restart_window_s:
            self._restarts.popleft()
        if len(self._restarts) >= par.max_worker_restarts:
            raise WorkerFailedError(f"{why}; giving up: {len(self._restarts)} restarts within the last "
                                    f"{par.restart_window_s:g} s already (--max-worker-restarts "
                                    f"{par.max_worker_restarts}, --restart-window-s {par.restart_window_s:g})")
        self._restarts.append(now)
        self.num_restarts += 1

    def _restart(self, suspects: set[str], why: str) -> None:
        """Kill and start again the suspects, open the next epoch, and wait until every attention
        worker joined it."""
        if self.placements.pending is not None or self._degraded is not None:
            # Survivors may hold, or route with, placement versions a new worker would not know (a
            # re-placement under way), or route around workers being added back (a failover): every
            # worker starts again with the placement in use (docs/architecture.md, Supervision).
            suspects = {p.name for p in self._procs}
            if self._degraded is not None:  # with the workers that were out back in
                back = self._degraded[0]
                self.placements.set_current(ExpertPlacement(back.moe_layers, back.layers,
                                                            self.placements.next_version()))
                self._degraded = None
        self.placements.restarted()  # new workers count tokens and steps from zero
        self.placement = self.placements.current
        log.warning("restarting %s (restart %d): %s", ", ".join(sorted(suspects)) or "the data plane",
                    self.num_restarts, why)
        self.epoch += 1
        restarted = {int(name[1:]) for name in suspects if name[0] == "a"}
        for c, rank in list(self._conn_rank.items()):
            if rank in restarted:  # what the old process still sends (its connection closing) is stale
                del self._conn_rank[c]
                self._conn_epoch.pop(c, None)
        for i, p in enumerate(self._procs):
            if p.name in suspects:
                if p.exitcode is None:
                    p.kill()  # silent (or stopped): a restart replaces it
                p.join(5.0)
                self._procs[i] = self._worker(p.name)
        self._store.set(f"{self.session}/epoch", str(self.epoch))
        for rank in range(self.cfg.parallel.attention_workers):
            if rank not in restarted:
                self._send(rank, wire.Reset(self.epoch))
        for p in self._procs:
            if p.name in suspects:
                p.start()
        self._await_ready(set(range(self.cfg.parallel.attention_workers)), RESTART_TIMEOUT_S)

    # -- failover ----------------------------------------------------------------------------------
    def _can_fail_over(self, suspects: set[str]) -> bool:
        """Only expert workers failed, and every expert they hold has a copy on a live expert worker
        in every layer: route around them instead of restarting anyone else. Not while a
        re-placement or another failover is under way (those restart every worker)."""
        if (not suspects or any(n[0] != "e" for n in suspects) or self._degraded is not None
                or self.placements.pending is not None):
            return False
        return self.placements.current.covers_without({int(n[1:]) for n in suspects})

    def _fail_over(self, suspects: set[str], why: str) -> list[SequenceDelta]:
        """Open the next epoch without the failed expert workers (placement v + 1: their copies
        dropped); attention workers keep their requests and route around them from the epoch's first
        step. The failed workers are started again (loading the placement v + 2, the one in use now)
        for the epoch after, which `_poll_add_back` opens once they have loaded. Returns the deltas
        that came meanwhile."""
        cur = self.placements.current
        without = cur.without({int(n[1:]) for n in suspects}, self.placements.next_version())
        back = ExpertPlacement(cur.moe_layers, cur.layers, without.version + 1)
        log.warning("failover: expert workers %s are out (%s); routing around them with placement version %d, "
                    "restarting them to be added back with version %d", ", ".join(sorted(suspects)), why,
                    without.version, back.version)
        self.epoch += 1
        # Published for the placement watchers (which build versions in order; both cost survivors
        # nothing: they hold every expert of both) and named as the epoch's placement.
        self._store.set(f"{self.session}/placement/{without.version}", without.to_json())
        self._store.set(f"{self.session}/placement/{back.version}", back.to_json())
        self._store.set(f"{self.session}/epoch/g{self.epoch}/placement", str(without.version))
        for i, p in enumerate(self._procs):
            if p.name in suspects:
                if p.exitcode is None:
                    p.kill()  # silent (or stopped): it is replaced
                p.join(5.0)
                self._procs[i] = self._worker(p.name, back, self.epoch + 1)
        self._degraded = (back, set(suspects), self.epoch + 1)
        self.placements.set_current(without)
        self._switch_epoch(without)
        for p in self._procs:
            if p.name in suspects:
                p.start()
        return self._switched()

    def _switch_epoch(self, placement: ExpertPlacement) -> None:
        """Tell every attention worker to rejoin the current epoch keeping its requests and routing
        with `placement`; what their connections send from now on belongs to this epoch (deltas of
        steps before the switch included: the workers keep those requests, nothing is resumed)."""
        self._store.set(f"{self.session}/epoch", str(self.epoch))
        for conn in list(self._conn_rank):
            self._conn_epoch[conn] = self.epoch
        msg = wire.Reset(self.epoch, placement.to_json())
        for rank in range(self.cfg.parallel.attention_workers):
            self._send(rank, msg)

    def _switched(self) -> list[SequenceDelta]:
        """Wait until every attention worker joined the epoch of a switch; returns the deltas that
        came meanwhile."""
        out = self._await_ready(set(range(self.cfg.parallel.attention_workers)), RESTART_TIMEOUT_S)
        self._ready = True
        log.info("epoch %d: every worker is up; placement version %d, %d requests went on", self.epoch,
                 self.placements.current.version, len(self._requests))
        return out

    def _poll_add_back(self) -> list[SequenceDelta]:
        """During a failover: once the restarted expert workers have loaded, open the epoch they
        were started for, with the placement from before the failure (every worker keeps its
        requests; at most one step is computed again). Returns the deltas that came meanwhile."""
        if self._degraded is None or time.monotonic() < self._next_add_back:
            return []
        self._next_add_back = time.monotonic() + ADD_BACK_POLL_S
        back, names, epoch = self._degraded
        keys = [f"{self.session}/up/{n}" for n in sorted(names)]
        if not self._store.check(keys) or any(int(self._store.get(k)) != epoch for k in keys):
            return []
        log.info("adding %s back: placement version %d", ", ".join(sorted(names)), back.version)
        self._ready, self.epoch = False, epoch
        self._store.set(f"{self.session}/epoch/g{epoch}/placement", str(back.version))
        self._degraded = None
        self.placements.set_current(back)
        self._switch_epoch(back)
        return self._switched()

    def _resume(self) -> list[SequenceDelta]:
        """Send every running request again, with the tokens it already delivered (the workers of
        the new epoch know none); requests being aborted just finish."""
        out, self._load = [], [0] * self.cfg.parallel.attention_workers
        for rid, r in list(self._requests.items()):
            if r.aborting:
                out += [SequenceDelta(rid, i, [], None, "abort") for i in sorted(r.live)]
                del self._requests[rid]
                continue
            r.worker = min(range(len(self._load)), key=self._load.__getitem__)
            self._load[r.worker] += r.cost
            resume = [r.outputs[i] if i in r.live else None for i in range(r.params.n)]
            started = any(r.outputs) or len(r.live) < r.params.n
            self._send(r.worker, wire.AddRequest(rid, r.prompt, wire.params_to_wire(r.params),
                                                 resume if started else None))
        self._ready = True
        log.info("epoch %d: every worker is up; %d requests resumed", self.epoch, len(self._requests))
        return out

