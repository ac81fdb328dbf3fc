"""The pools' control plane as the front sees it: the listener's gate (the challenge-response HELLO
of m2n_comm/_hello.py: the worker proves the deployment token, the front proves it back, the token
never crosses the wire), one reader thread per attention worker connection, and stopping the pools.

A worker whose host stops answering (a partition, a host gone) is found by the kernel, as M2N's
heartbeats find a silent peer: keepalive probes after 1 s of silence, and the connection fails once
dead_after_s passed without an answer (TCP_USER_TIMEOUT, which also bounds unacknowledged data);
its reader then reports it as closed."""
import logging
import queue
import socket
import time

from attention_nodes import messages as wire
from m2n_comm._hello import HelloRefused, SignedStore, accept_hello
from m2n_comm.transport import TransportConfig

log = logging.getLogger("shuttle")

HELLO_TIMEOUT_S = 5.0  # a connection that does not complete its HELLO within this is dropped
MAX_HELLO = 4096       # bytes of a control HELLO body ({name})
DEAD_AFTER_S = TransportConfig.dead_after_s  # a control connection silent this long (no ACK either) fails


def admitted(conn: socket.socket, addr: tuple, token: str) -> bool:
    """Run the listener's side of the HELLO on a new control connection: True once the worker
    proved the token; otherwise the connection is closed and the attempt logged with its address (a
    stranger must not inject requests or results)."""
    try:
        accept_hello(conn, token, MAX_HELLO, HELLO_TIMEOUT_S)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(DEAD_AFTER_S * 1000))
        return True
    except HelloRefused as e:
        why = str(e)
    except OSError as e:  # timeout, reset
        why = f"no valid HELLO: {type(e).__name__}: {e}"
    log.warning("control listener refused a connection from %s:%s: %s", addr[0], addr[1], why)
    conn.close()
    return False


def read_events(sock: socket.socket, conn: int, events: queue.Queue, stats: dict[int, dict]) -> None:
    """A control connection's reader: Stats are kept (latest per worker), the rest is queued; None
    once the connection ends (closed, reset, or silent past DEAD_AFTER_S: logged)."""
    try:
        peer = "%s:%s" % sock.getpeername()[:2]
    except OSError:  # gone already
        peer = "a worker"
    stream = sock.makefile("rb")
    try:
        while (msg := wire.recv(stream)) is not None:
            if isinstance(msg, wire.Stats):
                stats[msg.rank] = msg.stats
            else:
                events.put((conn, msg))
    except OSError as e:
        if isinstance(e, TimeoutError):  # ETIMEDOUT: the kernel gave up (above)
            log.warning("control connection from %s: no answer for %g s, its host is gone or cut off", peer,
                        DEAD_AFTER_S)
    events.put((conn, None))


def shutdown_pools(socks: list[socket.socket], procs: list, store: SignedStore, session: str, remote_experts: int,
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
            if s is not None:
                wire.send(s, wire.Shutdown())
        except OSError:
            pass
    deadline = time.monotonic() + 10.0
    procs = [p for p in procs if p.pid is not None]  # a restart that failed half-way left some unstarted
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
        if s is not None:
            s.close()
    if launcher is not None:
        launcher.close()  # Ray: removing the placement group also ends its actors


