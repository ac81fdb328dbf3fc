"""Ending a deployment. SIGTERM (what systemd, docker stop and Kubernetes send) or SIGINT to the
front alone, or SIGKILL of the front, leaves no process of the deployment running STOP_S later,
with the spawn and the Ray launchers: the workers, the fork server, and the local Ray cluster the
front started (GCS, raylet, its agents, the actors). A stream in flight at SIGTERM ends, with its
last chunk or, once the drain is over, an error event; never a hang. Ray actors carry the spawned
workers' process titles.

The deployment's processes are the front's descendants recorded before the signal (with their
start times, so a reused pid is not mistaken for one of them); a zombie counts as gone.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from clients.live_server import LiveServer
from pools.launchers import FRONT_GRACE_S, descendants
from server.api_server import DRAIN_S, STOP_S

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint("qwen3_moe")


def _stat(pid: int) -> tuple[str, bytes] | None:
    """(state, start time) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return fields[0].decode(), fields[19]


def _running(procs: dict[int, bytes]) -> list[int]:
    """The recorded processes still running (not gone, not a zombie, not a new process on the pid)."""
    return [p for p, start in procs.items() if (s := _stat(p)) is not None and s[1] == start and s[0] != "Z"]


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


@contextlib.contextmanager
def _deployment(ckpt, *flags: str, env: dict | None = None):
    """A `shuttle serve` on `flags`, and its processes (pid -> start time) once it answers; whatever
    of them a failed test leaves is SIGKILLed."""
    with LiveServer(["--model", str(ckpt), *flags], env=env) as srv:
        procs = {p: s[1] for p in descendants(srv.proc.pid) if (s := _stat(p)) is not None}
        try:
            yield srv, procs
        finally:
            for p in _running(procs):
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)


def _ends_within(srv: LiveServer, procs: dict[int, bytes], sig: int, bound_s: float) -> float:
    """Send `sig` to the front alone; seconds until it and every recorded process are gone, at most
    bound_s (the assertion names what was left)."""
    t0 = time.monotonic()
    srv.proc.send_signal(sig)
    while time.monotonic() - t0 < bound_s:
        if srv.proc.poll() is not None and not _running(procs):
            return time.monotonic() - t0
        time.sleep(0.1)
    left = {p: _title(p) for p in _running(procs)}
    assert srv.proc.poll() is not None and not left, (
        f"{bound_s:.0f} s after {signal.Signals(sig).name}: front exit code {srv.proc.poll()}, still running "
        f"{left}\n{srv.log()[-3000:]}")
    return time.monotonic() - t0


def _stream(srv: LiveServer, started: threading.Event, out: dict) -> None:
    """A long completion stream: out["lines"] gets its data lines, out["error"] how it broke off."""
    body = {"prompt": "hello", "max_tokens": 480, "ignore_eos": True, "stream": True, "n": 16}
    out["lines"] = []
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    out["lines"].append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    finally:
        out["ended"] = time.monotonic()
        started.set()


# CI, for the suite's time budget: SIGTERM and SIGKILL with the spawn launcher, SIGTERM with Ray;
# `make fault-test` (SHUTTLE_FULL_FAULTS=1) adds SIGINT (SIGTERM's path) and Ray's SIGKILL.
FULL = os.environ.get("SHUTTLE_FULL_FAULTS", "0") == "1"
IN_FULL_RUN = pytest.mark.skipif(not FULL, reason="run by `make fault-test` (SHUTTLE_FULL_FAULTS=1)")


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=IN_FULL_RUN), signal.SIGKILL],
                         ids=lambda s: s.name)
def test_spawned_deployment_ends_with_its_front(ckpt, sig):
    """Spawned workers and the fork server go with the front, however it ends. On SIGTERM and
    SIGINT streams in flight end properly: finished, or an error event after the drain, then [DONE]."""
    with _deployment(ckpt) as (srv, procs):
        assert {"shuttle-attention-a0", "shuttle-expert-e0"} <= {_title(p) for p in procs}, procs
        outs, started = [{} for _ in range(4)], [threading.Event() for _ in range(4)]
        streams = [threading.Thread(target=_stream, args=(srv, e, o)) for e, o in zip(started, outs)]
        for t in streams:
            t.start()
        for e in started:
            assert e.wait(30)
        t0 = time.monotonic()
        took = _ends_within(srv, procs, sig, STOP_S)
        for t in streams:
            t.join(10)
        print(f"spawn, {sig.name}: every process gone after {took:.1f} s")
    for out in outs:
        assert out["ended"] - t0 < STOP_S, "a stream outlived the deployment"
        if sig == signal.SIGKILL:
            continue  # the connection is cut
        assert "error" not in out and out["lines"][-1] == "[DONE]", out.get("error") or out["lines"][-3:]
        last = json.loads(out["lines"][-2])
        assert "error" in last or last["choices"][0]["finish_reason"] == "length", last
        if "error" in last:
            assert out["ended"] - t0 >= DRAIN_S - 0.5, "the drain was cut short"


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGKILL, marks=IN_FULL_RUN)], ids=lambda s: s.name)
def test_ray_deployment_ends_with_its_front(ckpt, sig):
    """The Ray actors (titled like spawned workers), the local Ray cluster the front started and its
    agents go with the front, however it ends."""
    pytest.importorskip("ray", reason="--launcher ray needs Ray: pip install 'shuttle-moe[ray]' (make setup does)")
    # RAY_ADDRESS empty: Ray's default, a local cluster started by the front (unless one was
    # started with `ray start` on this host); a GCS slow to start on 2 busy cores is waited for.
    env = {"RAY_ADDRESS": "", "RAY_gcs_server_port_wait_time_s": "120"}
    with _deployment(ckpt, "--launcher", "ray", env=env) as (srv, procs):
        titles = {_title(p): p for p in procs}
        if not any("gcs_server" in t for t in titles):
            pytest.skip("the front joined a running Ray cluster (started by `ray start` here) instead of its own")
        for name in ("shuttle-attention-a0", "shuttle-expert-e0"):  # not ray::ShuttleWorker.run
            assert name in titles, sorted(titles)
            with open(f"/proc/{titles[name]}/comm") as f:
                assert f.read().strip() == name[:15]  # the kernel keeps 15 characters
        assert any(t.startswith("ray::") for t in titles), sorted(titles)  # the raylet's agents are recorded
        took = _ends_within(srv, procs, sig, STOP_S)
        print(f"ray, {sig.name}: every process gone after {took:.1f} s")


def test_an_actor_process_leaves_when_its_front_is_gone():
    """watch_front, which every Ray actor runs (on a cluster the front did not start, nothing else
    ends its process): once nothing listens at the front's store address, the process exits within
    FRONT_GRACE_S, and at once when its worker already returned."""
    front = subprocess.Popen([sys.executable, "-c", "import socket\n"
                              "s = socket.create_server(('127.0.0.1', 0)); print(s.getsockname()[1], flush=True)\n"
                              "conns = []\nwhile True: conns.append(s.accept())"], stdout=subprocess.PIPE, text=True)
    port = int(front.stdout.readline())
    watchers = {returned: subprocess.Popen(
        [sys.executable, "-c", "import threading, time\nfrom pools.launchers import watch_front\n"
         f"returned = threading.Event()\nif {returned}: returned.set()\n"
         f"threading.Thread(target=watch_front, args=(('127.0.0.1', {port}), returned), daemon=True).start()\n"
         "print('watching', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True, cwd=REPO)
        for returned in (False, True)}
    try:
        for w in watchers.values():
            assert w.stdout.readline().strip() == "watching"
        time.sleep(0.5)  # connected, and watching
        assert all(w.poll() is None for w in watchers.values())
        front.kill()
        t0, took = time.monotonic(), {}
        while len(took) < len(watchers) and time.monotonic() - t0 < FRONT_GRACE_S + 5:
            took.update({r: time.monotonic() - t0 for r, w in watchers.items()
                         if r not in took and w.poll() is not None})
            time.sleep(0.05)
        # the returned one at once, the other after FRONT_GRACE_S (bounds loose: a loaded host is slow)
        assert took[True] < FRONT_GRACE_S - 0.5 < took[False] < FRONT_GRACE_S + 4.0, took
    finally:
        for p in (front, *watchers.values()):
            p.kill()
            p.wait()
