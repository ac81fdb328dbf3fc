"""A real `shuttle serve` process on a free port, for end-to-end tests and benchmarks.

    with LiveServer(["--model", str(ckpt), "--grpc-port", "0"]) as srv:
        httpx.get(f"{srv.url}/health")

It waits until /health answers (failing with the server's log if the process exits or takes too
long), and on exit stops the server with SIGTERM (SIGKILL after a grace period), which also stops
its worker pools.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from clients.ready import NotReady, wait_until_healthy

START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="shuttle-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                     cwd=Path(__file__).resolve().parents[1], start_new_session=True)
        self._wait_ready()

    def _wait_ready(self) -> None:
        try:
            wait_until_healthy(self.url, START_TIMEOUT_S, self.proc, "shuttle serve")
        except NotReady as e:
            if e.returncode is None:
                self.stop()
            raise RuntimeError(f"{e}:\n{self.log()}") from None

    @property
    def grpc_port(self) -> int:
        m = re.search(r"gRPC on [\d.]+:(\d+)", self.log())
        assert m, f"the server logged no gRPC port:\n{self.log()}"
        return int(m.group(1))

    def children(self) -> dict[str, int]:
        """The server's worker processes (children of multiprocessing's fork server, a child of
        the server) by process title ("shuttle-attention-a0", "shuttle-expert-e0", ...) -> pid."""
        found, parents = [], [self.proc.pid]
        while parents:
            out = subprocess.run(["pgrep", "-P", ",".join(map(str, parents))], capture_output=True, text=True)
            parents = [int(p) for p in out.stdout.split()]
            found += parents
        titles = {}
        for p in found:
            try:
                titles[p] = Path(f"/proc/{p}/cmdline").read_text(errors="replace").split("\0")[0]
            except OSError:  # exited meanwhile
                pass
        return {t: p for p, t in titles.items() if t.startswith("shuttle-")}

    def log(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def __enter__(self) -> "LiveServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
