"""The fault schedule of bench/soak.py --faults (its docstring says what each kind does and what a
record holds): parse_faults reads the spec, FaultInjector carries it out against the live server while
the load runs, a watch thread polls /health (and /workers for a straggler) around each fault, and
fault_outcomes completes each record from the load's token flow and responses.
"""
import bisect
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from clients.live_server import LiveServer

FAULT_TARGETS = {"kill-expert": "e0", "kill-attention": "a0", "stop": "e0", "straggler": "e1"}  # kind: default
RECOVERY_S = 30.0  # a fault is scheduled only when it and this much time after it fit in the load
STRAGGLER_STOP_S, STRAGGLER_RUN_S = 0.2, 0.1  # the straggler's stop/continue cycle
HEALTH_POLL_S = 0.1
WORKERS_POLL_S = 1.0
WATCH_AFTER_S = 3.0  # after a fault's action: how long /health is watched when it never said 503
WATCH_MAX_S = 180.0  # the longest /health is watched after a fault


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


@dataclass
class Fault:
    at_s: float  # seconds into the load
    kind: str    # a key of FAULT_TARGETS
    worker: str  # "e0", "a1", ...


@dataclass
class FaultSchedule:
    spec: str
    faults: list[Fault]
    stop_s: float
    straggler_s: float

    def kinds(self) -> set[str]:
        return {f.kind for f in self.faults}


def parse_faults(spec: str | None, duration_s: float) -> FaultSchedule | None:
    """The schedule of --faults (module docstring); None for no spec or "none". ValueError names what
    is wrong."""
    if not spec or spec == "none":
        return None
    fields = {}
    for part in spec.split(","):
        key, eq, value = part.partition("=")
        if not eq or key not in ("every", "start", "kinds", "stop-s", "straggler-s"):
            raise ValueError(f"--faults: {part!r} is not every=S, start=S, kinds=K+K, stop-s=S or straggler-s=S")
        fields[key] = value
    if "every" not in fields:
        raise ValueError("--faults needs every=S (seconds between faults)")
    every, start = float(fields["every"]), float(fields.get("start", duration_s / 3))
    stop_s, straggler_s = float(fields.get("stop-s", 2.0)), float(fields.get("straggler-s", 30.0))
    if every <= 0 or start < 0 or stop_s <= 0 or straggler_s <= 0:
        raise ValueError(f"--faults {spec}: every, stop-s and straggler-s must be positive, start at least 0")
    cycle = []
    for item in fields.get("kinds", "+".join(FAULT_TARGETS)).split("+"):
        kind, _, worker = item.partition("@")
        if kind not in FAULT_TARGETS:
            raise ValueError(f"--faults: unknown kind {kind!r} (kinds: {', '.join(FAULT_TARGETS)})")
        worker = worker or FAULT_TARGETS[kind]
        if not re.fullmatch(r"[ae]\d+", worker) or (kind.startswith("kill-") and worker[0] != kind[5]):
            raise ValueError(f"--faults: {item!r}: the target must be a worker of its pool (a0, e1, ...)")
        cycle.append((kind, worker))
    faults, t = [], start
    while True:
        kind, worker = cycle[len(faults) % len(cycle)]
        lasts = {"stop": stop_s, "straggler": straggler_s}.get(kind, 0.0)
        if t + lasts + RECOVERY_S > duration_s:
            break
        faults.append(Fault(round(t, 1), kind, worker))
        t += every
    if not faults:
        raise ValueError(f"--faults {spec}: no fault fits in {duration_s:g} s (each needs {RECOVERY_S:g} s after it)")
    return FaultSchedule(spec, faults, stop_s, straggler_s)


def fault_server_flags(schedule: FaultSchedule | None) -> list[str]:
    """The `shuttle serve` flags a schedule needs (placed before --server-arg, which overrides them)."""
    if schedule is None:
        return []
    flags = ["--max-worker-restarts", str(len(schedule.faults) + 3)]
    return flags + (["--expert-workers", "2"] if "straggler" in schedule.kinds() else [])


def _get(url: str, timeout: float = 5.0) -> tuple[int | None, bytes]:
    """GET url: (status, body); (None, b"") when it could not be reached."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError):
        return None, b""


def process_title(pid: int) -> str:
    """The process title (first word of its command line), "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace").split("\0")[0]
    except OSError:
        return ""


def _signal(pid: int, title: str, sig: int) -> bool:
    """Send sig to pid if it still is the process titled `title`; whether it was."""
    if process_title(pid) != title:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


class FaultInjector(threading.Thread):
    """Carries out a FaultSchedule against the live server (module docstring), from `start` on;
    `records` gets one dict per fault (with "_t0", its monotonic time, for `fault_outcomes`)."""

    def __init__(self, srv: LiveServer, schedule: FaultSchedule, start: float):
        super().__init__(name="soak-faults", daemon=True)
        self.srv, self.schedule, self.load_start = srv, schedule, start
        self.records: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        for f in self.schedule.faults:
            if self.stop.wait(max(0.0, self.load_start + f.at_s - time.monotonic())):
                return
            self.records.append(self._inject(f))

    def _metrics(self) -> str:
        return _get(f"{self.srv.url}/metrics")[1].decode()

    def _inject(self, f: Fault) -> dict:
        title = f"shuttle-{'expert' if f.worker[0] == 'e' else 'attention'}-{f.worker}"
        text = self._metrics()
        pid = self.srv.children().get(title)
        t0 = time.monotonic()
        rec = {"kind": f.kind, "worker": f.worker, "pid": pid, "at_s": round(t0 - self.load_start, 1),
               "_t0": t0, "_restarts": metric(text, "shuttle_worker_restarts_total"),
               "_recomputed": metric(text, "shuttle_recomputed_tokens_total")}
        if pid is None:
            rec["error"] = f"no process titled {title}"
            return rec
        watch = _Watch(self.srv.url, t0, f.worker if f.kind == "straggler" else None, self.stop)
        watch.start()
        log_at = Path(self.srv._log.name).stat().st_size
        if f.kind.startswith("kill-"):
            os.kill(pid, signal.SIGKILL)
        elif f.kind == "stop":
            os.kill(pid, signal.SIGSTOP)
            self.stop.wait(self.schedule.stop_s)
            rec["continued"] = _signal(pid, title, signal.SIGCONT)  # False: the front replaced it meanwhile
        else:
            rec["cycles"], rec["replaced_during"] = self._throttle(pid, title)
            self.srv._log.flush()
            with open(self.srv._log.name, errors="replace") as log:
                log.seek(log_at)
                named = re.search(rf"straggler: \w+ worker {f.worker}: its peers waited", log.read())
            rec["logged"] = named is not None
        rec["action_s"] = round(time.monotonic() - t0, 1)
        watch.action_done.set()
        watch.join()
        rec["health"] = watch.health()
        if f.kind == "straggler":
            rec.update(watch.straggler())
        rec["pid_after"] = self.srv.children().get(title)
        rec["replaced"] = rec["pid_after"] != pid
        return rec

    def _throttle(self, pid: int, title: str) -> tuple[int, bool]:
        """Stop the worker STRAGGLER_STOP_S of every STRAGGLER_STOP_S + STRAGGLER_RUN_S for the phase;
        (cycles done, whether the worker was replaced meanwhile)."""
        end, cycles = time.monotonic() + self.schedule.straggler_s, 0
        try:
            while time.monotonic() < end and not self.stop.is_set():
                if not _signal(pid, title, signal.SIGSTOP):
                    return cycles, True
                time.sleep(STRAGGLER_STOP_S)
                _signal(pid, title, signal.SIGCONT)
                time.sleep(STRAGGLER_RUN_S)
                cycles += 1
        finally:
            _signal(pid, title, signal.SIGCONT)
        return cycles, False


class _Watch(threading.Thread):
    """During and after one fault: /health every HEALTH_POLL_S (until it answered 200 after a 503,
    or WATCH_AFTER_S after the action with no 503 seen) and, for a straggler (`worker`), GET /workers
    every WORKERS_POLL_S until the action is done; `stop` ends it early."""

    def __init__(self, url: str, t0: float, worker: str | None, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.t0, self.worker, self.stop = url, t0, worker, stop
        self.codes: list[tuple[float, int | None]] = []  # (s after t0, status)
        self.scores: list[tuple[float, dict]] = []  # (s after t0, {worker: row}), with the threshold under ""
        self.action_done = threading.Event()

    def run(self) -> None:
        next_workers, done_at = time.monotonic(), None
        while time.monotonic() - self.t0 < WATCH_MAX_S and not self.stop.is_set():
            now = time.monotonic()
            self.codes.append((now - self.t0, _get(f"{self.url}/health")[0]))
            if self.worker and not self.action_done.is_set() and now >= next_workers:
                next_workers = now + WORKERS_POLL_S
                status, body = _get(f"{self.url}/workers")
                if status == 200:
                    table = json.loads(body)
                    self.scores.append((now - self.t0, {"": table["threshold"],
                                                        **{w["worker"]: w for w in table["workers"]}}))
            if self.action_done.is_set():
                done_at = done_at or now
                saw_503 = any(c == 503 for _, c in self.codes)
                if (saw_503 and self.codes[-1][1] == 200) or (not saw_503 and now - done_at >= WATCH_AFTER_S):
                    return
            time.sleep(HEALTH_POLL_S)

    def health(self) -> dict:
        """/health from the fault on: polls, 503s, the first and last 503 and the first 200 after it (s)."""
        bad = [t for t, c in self.codes if c != 200]
        last = bad[-1] if bad else None
        again = next((t for t, c in self.codes if c == 200 and last is not None and t > last), None)
        return {"polls": len(self.codes), "not_200": len(bad), "first_not_200_s": _r(bad[0] if bad else None),
                "last_not_200_s": _r(last), "200_again_s": _r(again)}

    def straggler(self) -> dict:
        """Whether GET /workers scored the worker at or over its threshold during the phase, when
        first (s after the phase began), and the highest scores of it and of its pool's others."""
        mine, others, named_at = [], [], None
        for t, rows in self.scores:
            me = rows.get(self.worker)
            if me is None:
                continue
            mine.append(me["score"])
            others += [r["score"] for n, r in rows.items() if n and n != self.worker and r["pool"] == me["pool"]]
            if named_at is None and me["score"] >= rows[""]:
                named_at = t
        return {"named": named_at is not None, "named_after_s": _r(named_at),
                "max_score": _r(max(mine, default=None), 2), "others_max_score": _r(max(others, default=None), 2),
                "workers_polls": len(self.scores)}


def _r(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def _count(x: float) -> int | None:
    """A counter's difference; None where /metrics could not be read (NaN)."""
    return None if x != x else int(x)


class LoadRecord(Protocol):
    """What fault_outcomes reads of the load's record (bench/soak.py's Run)."""

    token_times: list[float]  # every token's arrival (monotonic s)
    unexpected: list[tuple[float, str]]  # (finished, class)
    greedy_checks: list[tuple[float, float]]  # (sent, finished)
    greedy_differed: list[dict]  # sent, finished, prompt, text


def fault_outcomes(records: list[dict], run: LoadRecord, end: float, final_metrics: str) -> list[dict]:
    """Each fault's record completed from the load's record: per window from the fault to the next
    (or the end of the load), the restarts and recomputed tokens, the token flow (first token after
    it, the longest pause from it on and when tokens came again), the unexpected responses and the
    differing greedy texts that finished in it, and the greedy checks in flight at the fault."""
    times = run.token_times
    starts = [r["_t0"] for r in records] + [end]
    after = [(r.get("_restarts"), r.get("_recomputed")) for r in records[1:]] + [
        (metric(final_metrics, "shuttle_worker_restarts_total"),
         metric(final_metrics, "shuttle_recomputed_tokens_total"))]
    out = []
    for i, rec in enumerate(records):
        t0, t1 = starts[i], starts[i + 1]
        flow = times[bisect.bisect_left(times, t0):bisect.bisect_left(times, t1)]
        gaps = [(b - a, b) for a, b in zip([t0] + flow, flow)]
        longest, resumed = max(gaps, default=(None, None))
        r = {k: v for k, v in rec.items() if not k.startswith("_")}
        r.update({"window_s": round(t1 - t0, 1), "restarts": _count(after[i][0] - rec["_restarts"]),
                  "recomputed_tokens": _count(after[i][1] - rec["_recomputed"]),
                  "first_token_s": _r(flow[0] - t0 if flow else None, 2), "pause_s": _r(longest, 2),
                  "tokens_again_s": _r(resumed - t0 if resumed else None, 2),
                  "unexpected": sum(t0 <= t < t1 for t, _ in run.unexpected),
                  "greedy_in_flight": sum(sent < t0 < finished for sent, finished in run.greedy_checks),
                  "greedy_differed": sum(t0 <= g["finished"] < t1 for g in run.greedy_differed)})
        out.append(r)
    return out
