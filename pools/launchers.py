"""How a deployment's workers come to exist. PoolEngine asks its launcher for one process-like
handle per worker (start, name, exitcode, join, kill) and drives them all alike:

    spawn   (default) each worker a process of this host, forked from multiprocessing's fork
            server, which imported torch and the worker code once (the first start, or a restart,
            costs milliseconds instead of the ~3 CPU-seconds of importing torch; nothing else is
            shared: the fork server never touches a model, a thread pool or a transport)
    ray     each worker a Ray actor in one placement group: a bundle per worker carrying its pool's
            resources (--attention-resources / --expert-resources, e.g. {"H20": 1}), so each pool
            lands on the nodes that have them; the actors still talk over M2N (tcp or nixl across
            nodes), listening on their node's address
    (rendezvous: no launcher; workers started by hand with `shuttle serve --role` join the store)

Ray is optional (`pip install shuttle-moe[ray]`); only RayLauncher imports it.

Workers end with their front, however it ended (SIGKILL included): an attention worker reads EOF on
its control connection, an expert worker sees its peers leave and the store gone, and a Ray actor's
process, which Ray would keep after its worker returned, watches the front's store address and
exits once nothing listens there (watch_front). A local Ray cluster that ray.init starts here dies
with the front too (_RayConnection, _REAPER).
"""
import errno
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from attention_nodes.config import ParallelConfig

log = logging.getLogger("shuttle")
RAY_HINT = "--launcher ray needs Ray: pip install 'shuttle-moe[ray]' (make setup installs it unless RAY=0)"
PLACE_TIMEOUT_S = 120.0  # how long Ray may take to find nodes for every worker's bundle
KILLED = -9              # the exit code a Ray actor that died without returning reports
FRONT_GRACE_S = 2.0      # a Ray actor whose front is gone exits after this, if its worker has not returned
# TCP keepalive on the watch connection: a front whose host vanished is declared gone after about
# KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S of silence
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 5, 1, 3


# What the fork server imports before it forks workers: torch and the workers' modules (models,
# kernels, m2n_comm), and nothing that reads the environment at import time (triton's interpreter
# switch, NIXL/UCX): those are imported by the worker itself.
PRELOAD = ["torch", "attention_nodes.worker", "expert_nodes.worker"]


def _in_environment(env: dict[str, str], target: Callable[[Any], None], spec: Any) -> None:
    """Run target(spec) with the environment the server had when it started this worker (the fork
    server's own is the one of its start, which may be older: tests and users set variables later).
    Only what differs is changed: setproctitle finds the space for a title in the process's original
    environment block, which rewriting every variable would move."""
    for key in set(os.environ) - set(env):
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    target(spec)


class SpawnLauncher:
    """Workers as processes of this host (multiprocessing forkserver with PRELOAD); they reach the
    server at 127.0.0.1. Each worker runs with the server's environment of the moment it starts,
    its working directory and sys.path, exactly as a spawned process would."""

    host = "127.0.0.1"

    def __init__(self) -> None:
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)  # no effect once this process's fork server runs
        # The pools share this host's cores, and at m = 1 they take turns (worker_threads gives each
        # all the cores then): an OpenMP thread that spins after its parallel region (libgomp's
        # default) takes the core the other pool's worker just woke up to use. OpenMP reads this once,
        # when the fork server imports torch, so it is set before the fork server starts (the front
        # itself has read its own already); OMP_WAIT_POLICY=active in the environment overrides it.
        # Measured in bench/pingpong.py (2 threads per worker, m = 1, batch 64): the expert worker's
        # reply 37.8 -> 1.7 ms a step and the step 315 -> 206 ms. A short spin instead (GOMP_SPINCOUNT
        # 10000, no wait policy) ran a lone process's 2-thread layers as fast as spinning, but a served
        # 1 + 1, m = 1 (25M bf16 model, AVX-512 host) fell from 2,200-2,350 to 1,500-1,860 tok/s.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    def worker(self, name: str, pool: str, target: Callable[[Any], None], spec: Any) -> mp.process.BaseProcess:
        return self.ctx.Process(target=_in_environment, args=(dict(os.environ), target, spec), name=name,
                                daemon=True)

    def close(self) -> None:
        pass


def _import_ray():
    try:
        import ray
        from ray.util.placement_group import placement_group  # noqa: F401 (checks the install is whole)
    except ImportError:
        raise RuntimeError(RAY_HINT) from None
    return ray


class RayWorker:
    """A worker running as a Ray actor, with the process interface PoolEngine uses. `node_id` and
    `ip` say where Ray placed it (asked once, when first read); `title` is its process title."""

    def __init__(self, ray, actor_cls, name: str, options: dict, target: Callable[[Any], None], spec: Any,
                 title: str):
        self.ray, self.name, self._cls, self._options = ray, name, actor_cls, options
        self._target, self._spec, self.title = target, spec, title
        self.actor = self._ref = self._where_ref = None
        self._code: int | None = None
        self._where: dict | None = None
        self._killed = False

    def start(self) -> None:
        self.actor = self._cls.options(**self._options).remote(self.name)
        self._where_ref = self.actor.where.remote()  # queued before run, so answered first
        self._ref = self.actor.run.remote(self._target, self._spec, self.title)

    @property
    def where(self) -> dict:
        if self._where is None:
            self._where = self.ray.get(self._where_ref, timeout=PLACE_TIMEOUT_S)
        return self._where

    @property
    def node_id(self) -> str:
        return self.where["node_id"]

    @property
    def pid(self) -> int | None:
        """The actor's pid when it runs on this node (PoolEngine checks local pids: stopped or gone);
        None while it starts, or on another node (its peers' heartbeats cover it there)."""
        if self._where_ref is None or (self._where is None and not self.ray.wait([self._where_ref], timeout=0)[0]):
            return None
        return self.where["pid"] if self.where["node_id"] == self.ray.get_runtime_context().get_node_id() else None

    @property
    def exitcode(self) -> int | None:
        if self._code is None and self._ref is not None and self.ray.wait([self._ref], timeout=0)[0]:
            try:
                self._code = int(self.ray.get(self._ref))
            except self.ray.exceptions.RayActorError:
                self._code = KILLED  # killed, or its process died
            except self.ray.exceptions.RayError:
                self._code = 1
        return self._code

    def is_alive(self) -> bool:
        return self._ref is not None and self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker to return; then end its actor, whose process would stay (holding its
        bundle and memory) until its owner kills it."""
        if self._ref is not None:
            self.ray.wait([self._ref], timeout=timeout)
            if self.exitcode is not None:
                self.kill()

    def kill(self) -> None:
        if self.actor is not None and not self._killed:
            self.ray.kill(self.actor, no_restart=True)
            self._killed = True


def _front_gone(addr: tuple[str, int]) -> bool:
    """Whether nothing listens at the front's store address any more (connection refused)."""
    try:
        socket.create_connection(addr, timeout=5.0).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def watch_front(addr: tuple[str, int], returned: threading.Event) -> None:
    """Exit this process once the front is gone: hold an idle connection to its store (addr),
    which ends when the front's process does (or, with keepalive, when its host stops answering),
    confirm that nothing listens there any more, give the worker FRONT_GRACE_S to return by itself
    (it closes its endpoint), then os._exit. Runs in a daemon thread of a Ray actor, whose process
    would otherwise outlive its task: Ray keeps an actor until its owner kills it."""
    while True:
        try:
            conn = socket.create_connection(addr, timeout=10.0)
        except OSError:
            if _front_gone(addr):
                break
            time.sleep(1.0)
            continue
        conn.settimeout(None)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
        try:
            while conn.recv(4096):  # the store never writes unasked: only EOF or an error returns
                pass
        except OSError as e:
            if isinstance(e, TimeoutError) or e.errno == errno.ETIMEDOUT:  # keepalive: the host is gone
                break
        finally:
            conn.close()
        if _front_gone(addr):
            break
        time.sleep(1.0)  # the store dropped us, yet it listens: watch again
    returned.wait(FRONT_GRACE_S)
    log.warning("the front at %s:%d is gone: this worker exits", *addr)
    os._exit(0)


def _actor_class(ray):
    class ShuttleWorker:
        """One worker process under Ray: runs a worker entry point (run_attention_worker or
        run_expert_worker) with the transport listening on this node's address, titled like a
        spawned worker ("shuttle-attention-a0"), and exits once its front is gone (watch_front)."""

        def __init__(self, name: str):
            self.name = name

        def where(self) -> dict:
            return dict(node_id=ray.get_runtime_context().get_node_id(), ip=ray.util.get_node_ip_address(),
                        pid=os.getpid())

        def run(self, target: Callable[[Any], None], spec: Any, title: str) -> int:
            # Ray titles the process itself ("ray::ShuttleWorker.run"), with its own copy of
            # setproctitle: the setproctitle package's call in the entry point changes nothing here.
            set_title = getattr(getattr(ray, "_raylet", None), "setproctitle", None)
            if set_title is not None:
                set_title(title)
            returned = threading.Event()
            threading.Thread(target=watch_front, args=(spec.store_addr, returned), daemon=True,
                             name="front-watch").start()
            spec = replace(spec, transport=replace(spec.transport, host=ray.util.get_node_ip_address()))
            try:
                target(spec)
            except SystemExit as e:  # the entry points exit 1 after reporting a failure
                return e.code if isinstance(e.code, int) else 1
            finally:
                returned.set()
            return 0

    return ray.remote(ShuttleWorker)


def _parents() -> dict[int, int]:
    """pid -> parent pid, for every process of this host (/proc/PID/stat)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    table[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # exited meanwhile
                pass
    return table


def _children(pid: int) -> set[int]:
    return {p for p, parent in _parents().items() if parent == pid}


def descendants(pid: int) -> set[int]:
    """The processes below `pid`: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for p, parent in _parents().items():
        children.setdefault(parent, []).append(p)
    found, todo = set(), list(children.get(pid, ()))
    while todo:
        found.add(p := todo.pop())
        todo += children.get(p, ())
    return found


def kill_descendants() -> None:
    """SIGKILL every process below this one (workers, fork server, a local Ray cluster)."""
    for p in descendants(os.getpid()):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


# The reaper of a local Ray cluster (python -I -S -c, argv: the pids of the daemons ray.init
# started). Those daemons die with the front by themselves (PR_SET_PDEATHSIG), but the raylet's
# children do not: its agents, seeing the raylet killed, first report that to the GCS, gone too,
# and wait 60 s for it. So every REAP_POLL_S the reaper notes the processes of the daemons' trees,
# and at EOF on stdin (the front closed it after ray.shutdown(), or died) SIGKILLs those still running.
REAP_POLL_S = 2.0
_REAPER = """# shuttle-ray-reaper: SIGKILLs what is left of the front's Ray cluster once the front is gone
import os, select, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM):  # sent to the whole process group (Ctrl-C, systemd): the front's
    signal.signal(sig, signal.SIG_IGN)        # to act on; the reaper ends after it
roots, seen = [int(p) for p in sys.argv[1:]], {}
def scan():
    kids, start = {}, {}
    for e in filter(str.isdigit, os.listdir("/proc")):
        try:
            f = open("/proc/" + e + "/stat", "rb").read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(f[1]), []).append(int(e))
        start[int(e)] = f[19]  # the start time: a pid reused since has another
    todo = list(roots)
    while todo:
        p = todo.pop()
        if p in start:
            seen.setdefault(p, start[p])
        todo += kids.get(p, ())
    return start
while not (select.select([0], [], [], POLL)[0] and not os.read(0, 1)):
    scan()
now = scan()
for pid, start in seen.items():
    if now.get(pid) == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
""".replace("POLL", repr(REAP_POLL_S))


class _RayConnection:
    """ray.init(address) made from a thread that lives until close(), which calls ray.shutdown()
    there. Without an address and a running cluster, ray.init starts one here: its daemons (GCS,
    raylet, dashboard, monitors) get PR_SET_PDEATHSIG, which kills them when the *thread* that
    started them ends (from the engine thread, they would die as it returns at shutdown, and
    ray.shutdown() would wait 60 s for the GCS). From this thread they die with the process (the
    front killed, even by SIGKILL) or by ray.shutdown(); the reaper (_REAPER) takes the processes
    Ray does not bind to the front."""

    def __init__(self, ray, address: str | None):
        self.ray, self._stop, ready, failed = ray, threading.Event(), threading.Event(), []
        self._thread = threading.Thread(target=self._hold, args=(address, ready, failed), daemon=True,
                                        name="ray-connection")
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    def _hold(self, address: str | None, ready: threading.Event, failed: list) -> None:
        reaper = None
        try:
            before = _children(os.getpid())
            self.ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
            started = _children(os.getpid()) - before  # none when ray.init joined a running cluster
            if started:
                reaper = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, *map(str, started)],
                                          stdin=subprocess.PIPE)
        except Exception as e:  # ConnectionError, ValueError, ...: one line, not Ray's traceback
            failed.append(RuntimeError(f"--launcher ray: cannot join the Ray cluster at "
                                       f"{address or 'Ray default'}: {type(e).__name__}: {e}"))
            return
        finally:
            ready.set()
        self._stop.wait()
        self.ray.shutdown()
        if reaper is not None:
            reaper.stdin.close()  # what ray.shutdown left is killed
            reaper.wait()

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


class RayLauncher:
    """Workers as Ray actors (see the module docstring). Connects to the cluster at
    par.ray_address ("auto": the running cluster; HOST:PORT; None: Ray's default, which starts a
    local instance when none is running) and reserves one bundle per worker: experts e0.. then
    attention a0.., each {"CPU": 1} plus its pool's resources (which may override CPU)."""

    def __init__(self, par: ParallelConfig):
        ray = self.ray = _import_ray()
        from ray.util.placement_group import placement_group

        self._cluster = None if ray.is_initialized() else _RayConnection(ray, par.ray_address)
        self.host = ray.util.get_node_ip_address()
        pools = [("e", par.expert_workers, dict(par.expert_resources or ())),
                 ("a", par.attention_workers, dict(par.attention_resources or ()))]
        names = [f"{p}{i}" for p, n, _ in pools for i in range(n)]
        bundles = [{"CPU": 1.0, **res} for _, n, res in pools for _ in range(n)]
        self._bundle = {name: i for i, name in enumerate(names)}
        self._bundles = bundles
        self.pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise RuntimeError(f"Ray could not place the workers in {PLACE_TIMEOUT_S:.0f} s: they need bundles "
                               f"{dict(zip(names, bundles))}; the cluster has {ray.cluster_resources()}") from None
        self._cls = _actor_class(ray)

    def worker(self, name: str, pool: str, target: Callable[[Any], None], spec: Any) -> RayWorker:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        i = self._bundle[name]
        res = dict(self._bundles[i])
        options = dict(num_cpus=res.pop("CPU"), resources=res, max_restarts=0,
                       scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i))
        return RayWorker(self.ray, self._cls, name, options, target, spec, f"shuttle-{pool}-{name}")

    def close(self) -> None:
        """End the actors: ray.shutdown() where this launcher connected (Ray ends a driver's actors
        and placement groups with it, and a local cluster it started), else remove the placement
        group (a call to the GCS that blocks while the GCS is stopping, as after SIGTERM to the
        process group)."""
        from ray.util.placement_group import remove_placement_group

        if self._cluster is not None:
            self._cluster.close()
            return
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass


def check_installed(par: ParallelConfig) -> None:
    """RuntimeError saying what to install when the deployment needs NIXL or Ray and it is missing."""
    if par.transport == "nixl":
        from m2n_comm.nixl import import_nixl

        try:
            import_nixl()
        except ImportError as e:
            raise RuntimeError(f"--transport nixl: {e}") from None
    if par.launcher == "ray":
        _import_ray()


def make_launcher(par: ParallelConfig) -> SpawnLauncher | RayLauncher:
    return RayLauncher(par) if par.launcher == "ray" else SpawnLauncher()
