"""Wait until a `shuttle serve` (or any server with GET /health) answers 200, for scripts that start
a server and then use it: clients/live_server.py, the planner's front profile (planner/front.py).
`shuttle bench serve --ready-check-timeout-sec` does the same through its backends (a test request).
"""
import subprocess
import time

import httpx

POLL_S = 0.25


class NotReady(RuntimeError):
    """The server exited (`returncode` set) or did not answer in time (`returncode` None)."""

    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode


def wait_until_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None, what: str = "the server") -> None:
    """Poll `url`/health every POLL_S seconds until it answers 200. Raises NotReady when `proc`
    (the server's process, if given) exits first or `timeout_s` seconds pass; the message names
    `what` and the exit code."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise NotReady(f"{what} exited with {proc.returncode}", proc.returncode)
        try:
            if httpx.get(f"{url.rstrip('/')}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(POLL_S)
    raise NotReady(f"{what} was not ready in {timeout_s:.0f} s")
