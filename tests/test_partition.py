"""Network partitions: tcp peers whose packets are dropped, not killed.

Deployments over `--transport tcp` across network namespaces: the front on the host at HOST_IP, the
`--role` workers on the host or in namespace NS at NS_IP. Between the two a switch: a bridge in
namespace SWITCH, a veth pair to each side. After a few requests the switch drops every packet (a
qdisc on both of its ports) while a stream runs; no process is touched, and neither end's kernel
sees the drops (a drop on an end's own interface is reported to its TCP, which then times the
connection out by itself within seconds).

- e0 in NS: the attention worker hears nothing from e0 for dead_after_s and reports it (M2N's
  heartbeats); the front, which does not restart `--role` workers, fails with WorkerFailedError
  naming e0 and the silence. Once the partition heals and the front stops, every process exits.
- a0 and e0 in NS: the front's only links to them are its control connection to a0 (TCP keepalive
  and TCP_USER_TIMEOUT, pools/control.py) and the store. The front fails naming a0; the partition
  never heals, and the workers leave by themselves once their front is cut off (watch_front).
Either way the stream ends with an error event within the heartbeat bound and /health says 503
engine_dead.

Needs root (network namespaces, tc); skipped otherwise. CI runs as root.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import pytest

from clients.live_server import LiveServer
from m2n_comm._common import BLOCK_S
from m2n_comm.transport import TransportConfig
from pools.launchers import FRONT_GRACE_S, KEEPALIVE_COUNT, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S
from pools.supervision import Supervision

NS, SWITCH = "shuttle-part", "shuttle-part-sw"
VETH_HOST, VETH_NS = "shpart-h", "shpart-n"  # the ends' interfaces; their peers are the switch's ports:
PORTS = ("shpart-sh", "shpart-sn")
HOST_IP, NS_IP = "10.203.0.1", "10.203.0.2"
ROOT = Path(__file__).resolve().parents[1]
TOKEN = "partition-" + os.urandom(8).hex()
# The bound: silence for dead_after_s, seen at the next liveness check (M2N: BLOCK_S later at most;
# the front: its half-second look at the store for an expert worker's report); SLACK_S for the
# report, the front's handling and the SSE write on a busy 2-core host.
SLACK_S = 2.0
BOUND_S = TransportConfig.dead_after_s + max(BLOCK_S, 0.5) + SLACK_S
# Workers cut off from their front leave once the watch's keepalive gives up, and FRONT_GRACE_S later.
LEAVE_S = KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S + FRONT_GRACE_S + SLACK_S
DROPS = (("netem", "loss", "100%"), ("pfifo", "limit", "0"))  # root qdiscs that drop every packet


def _run(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    out = subprocess.run(full, capture_output=True, text=True, timeout=30)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(full)}: {out.stderr.strip()}")
    return out


def _remove_network() -> None:
    for ns in (NS, SWITCH):
        _run("ip", "netns", "del", ns, check=False)
    _run("ip", "link", "del", VETH_HOST, check=False)  # gone with the switch, unless a process kept it


@pytest.fixture
def network():
    """NS reached from the host through SWITCH; yields the qdisc (from DROPS) that drops packets
    here. Removed afterwards, and any leftover of an earlier run first."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs iproute2's ip and tc")
    _remove_network()
    try:
        _run("ip", "netns", "add", NS)
        _run("ip", "netns", "add", SWITCH)
    except RuntimeError as e:
        _remove_network()
        pytest.skip(f"cannot create network namespaces: {e}")
    try:
        _run("ip", "link", "add", "br0", "type", "bridge", ns=SWITCH)
        _run("ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", PORTS[0], "netns", SWITCH)
        _run("ip", "link", "add", VETH_NS, "netns", NS, "type", "veth", "peer", "name", PORTS[1], "netns", SWITCH)
        for port in PORTS:
            _run("ip", "link", "set", port, "master", "br0", "up", ns=SWITCH)
        _run("ip", "link", "set", "br0", "up", ns=SWITCH)
        _run("ip", "addr", "add", f"{HOST_IP}/24", "dev", VETH_HOST)
        _run("ip", "link", "set", VETH_HOST, "up")
        _run("ip", "addr", "add", f"{NS_IP}/24", "dev", VETH_NS, ns=NS)
        _run("ip", "link", "set", VETH_NS, "up", ns=NS)
        _run("ip", "link", "set", "lo", "up", ns=NS)
        drop = next((q for q in DROPS if _run("tc", "qdisc", "add", "dev", PORTS[0], "root", *q, ns=SWITCH,
                                             check=False).returncode == 0), None)
        if drop is None:
            pytest.skip(f"tc has none of the qdiscs {[q[0] for q in DROPS]} to drop packets with")
        _run("tc", "qdisc", "del", "dev", PORTS[0], "root", ns=SWITCH)
        yield drop
    finally:
        _remove_network()


def _drop(qdisc: tuple[str, ...]) -> None:
    for port in PORTS:
        _run("tc", "qdisc", "add", "dev", port, "root", *qdisc, ns=SWITCH)


def _heal() -> None:
    for port in PORTS:
        _run("tc", "qdisc", "del", "dev", port, "root", ns=SWITCH)


def _role(role: str, rendezvous: str, ns: str | None, log: Path) -> subprocess.Popen:
    """`shuttle serve --role ROLE` on the host, or in namespace `ns`, with the deployment token."""
    host = NS_IP if ns else HOST_IP
    cmd = [sys.executable, "-m", "server.cli", "serve", "--role", role, "--rendezvous", rendezvous, "--host", host,
           "--torch-threads", "1"]
    with open(log, "w") as out:
        return subprocess.Popen((["ip", "netns", "exec", ns] if ns else []) + cmd, cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "SHUTTLE_DEPLOYMENT_TOKEN": TOKEN})


def _start_workers(rendezvous: str, inside: tuple[str, ...], logs: Path, workers: list,
                   give_up: threading.Event) -> None:
    """Start e0 and a0 (those in `inside` in NS) once the front's store listens: started before,
    they would back off for seconds."""
    host, port = rendezvous.rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            if give_up.wait(0.1):
                return
    for role in ("expert", "attention"):
        workers.append(_role(role, rendezvous, NS if role in inside else None, logs / f"{role}.log"))


def _stream(url: str, model: str, on_chunk) -> tuple[list, float | None]:
    """Stream a long completion, calling on_chunk(i) after the i-th token chunk; returns the other
    events (an error, then [DONE], expected; a note if nothing came for 30 s) and when the error came."""
    body = {"model": model, "prompt": "a partition", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    events, error_at, chunks = [], None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=30)) as r:
        assert r.status_code == 200, r.read()
        try:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    events.append("[DONE]")
                    break
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    error_at = error_at or time.monotonic()
                    events.append(event)
                else:
                    chunks += 1
                    on_chunk(chunks)
        except httpx.ReadTimeout:
            events.append("nothing for 30 s: the front hangs")
    return events, error_at


def partition(ckpt: Path, drop: tuple[str, ...], inside: tuple[str, ...], heal: bool, logs: Path) -> dict:
    """Serve a few requests, drop NS's packets during a stream, heal (or not), stop the front
    (SIGTERM), wait for every process. Returns what was seen: the stream's events after its tokens,
    the seconds from the drop to the error event, /health's answer, whether the workers were alive
    then, the exit codes (front, e0, a0; None: still running), and the seconds from the drop until
    the last worker had exited."""
    with socket.socket() as s:
        s.bind((HOST_IP, 0))
        rendezvous = f"{HOST_IP}:{s.getsockname()[1]}"
    workers: list[subprocess.Popen] = []
    give_up = threading.Event()
    starter = threading.Thread(target=_start_workers, args=(rendezvous, inside, logs, workers, give_up))
    starter.start()
    server, seen, dropped, cut = None, {}, [], False
    try:
        server = LiveServer(["--model", str(ckpt), "--attention-workers", "1", "--expert-workers", "1", "--transport",
                             "tcp", "--rendezvous", rendezvous, "--host", "127.0.0.1", "--num-kv-blocks", "64"],
                            env={"SHUTTLE_DEPLOYMENT_TOKEN": TOKEN})
        starter.join()
        for i in range(3):  # the deployment serves across the namespaces
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": str(ckpt), "prompt": f"request {i}", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text

        def drop_at_second_chunk(i: int) -> None:
            nonlocal cut
            if i == 2:
                _drop(drop)
                cut = True
                dropped.append(time.monotonic())

        seen["events"], error_at = _stream(server.url, str(ckpt), drop_at_second_chunk)
        seen["took"] = error_at - dropped[0] if error_at and dropped else None
        seen["health"] = httpx.get(f"{server.url}/health", timeout=10)
        seen["alive"] = [w.poll() is None for w in workers]
        if heal:
            _heal()
            cut = False
        server.proc.send_signal(signal.SIGTERM)
        procs, gone, deadline = [server.proc, *workers], {}, time.monotonic() + 30
        while len(gone) < len(procs) and time.monotonic() < deadline:
            gone.update({i: time.monotonic() for i, p in enumerate(procs) if i not in gone and p.poll() is not None})
            time.sleep(0.05)
        seen["gone"] = max((gone.get(i, time.monotonic()) for i in range(1, len(procs))), default=0) - dropped[0]
        seen["codes"] = [p.poll() for p in procs]
        return seen
    finally:
        if cut:
            _heal()
        give_up.set()
        starter.join()
        if server is not None:
            server.stop()
            (logs / "front.log").write_text(server.log())
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(10)


def _check_reported(seen: dict, what: str, worker: str, cause: str, logs: Path) -> None:
    events = seen["events"]
    assert len(events) == 2 and "error" in events[0] and events[1] == "[DONE]", (events, _tails(logs))
    print(f"{what}: reported {seen['took']:.2f} s after the drop (bound {BOUND_S:.2f} s)")
    message = events[0]["error"]["message"]
    assert "WorkerFailedError" in message and worker in message and cause in message, message
    assert "--role" in message, message  # not restarted, and why
    assert seen["took"] <= BOUND_S, f"reported {seen['took']:.2f} s after the drop, bound {BOUND_S:.2f} s"
    assert seen["health"].status_code == 503 and seen["health"].json()["error"]["code"] == "engine_dead"
    assert seen["alive"] == [True, True]  # nothing was killed


def _tails(logs: Path) -> dict[str, str]:
    return {p.name: p.read_text()[-3000:] for p in logs.glob("*.log")}


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SHUTTLE_FULL_FAULTS", "0") != "1",
                    reason="run by `make fault-test` (SHUTTLE_FULL_FAULTS=1); CI runs the partition of both workers")
def test_a_silent_expert_worker_is_reported_within_the_heartbeat_bound(network, make_checkpoint, tmp_path):
    """e0 in NS; the partition heals before the front stops."""
    seen = partition(make_checkpoint("mixtral"), network, ("expert",), True, tmp_path)
    _check_reported(seen, f"e0 cut off ({' '.join(network)} at the switch)", "M2N peer 'e0'", "nothing heard",
                    tmp_path)
    assert seen["codes"] == [143, 0, 0], (seen["codes"], _tails(tmp_path))  # SIGTERM; the workers by themselves


@pytest.mark.slow
def test_workers_cut_off_from_their_front_are_reported_and_leave(network, make_checkpoint, tmp_path):
    """a0 and e0 in NS; the partition never heals."""
    seen = partition(make_checkpoint("mixtral"), network, ("expert", "attention"), False, tmp_path)
    _check_reported(seen, f"a0 and e0 cut off ({' '.join(network)} at the switch)", "attention worker a0",
                    "closed its connection", tmp_path)
    assert "no answer for 3 s, its host is gone or cut off" in (tmp_path / "front.log").read_text()
    print(f"both workers left {seen['gone']:.1f} s after the drop (bound {LEAVE_S:.1f} s)")
    assert seen["codes"] == [143, 0, 0], (seen["codes"], _tails(tmp_path))
    assert seen["gone"] <= LEAVE_S, _tails(tmp_path)


def test_a_front_of_role_workers_waits_for_no_process():
    """A closed (or timed out) control connection makes the front look for the worker's exit code
    for up to 2 s; a front of --role workers has no process to look at and reports at once."""
    supervision = Supervision(types.SimpleNamespace(_procs=[], transport=types.SimpleNamespace(dead_after_s=3.0)), remote=True)
    t0 = time.monotonic()
    supervision.check_procs(wait=2.0)
    assert time.monotonic() - t0 < 0.5
