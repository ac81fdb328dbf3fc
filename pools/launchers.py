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
"""
import logging
import multiprocessing as mp
import os
from dataclasses import replace
from typing import Any, Callable

from attention_nodes.config import ParallelConfig

log = logging.getLogger("shuttle")
RAY_HINT = "--launcher ray needs Ray: pip install 'shuttle-moe[ray]' (make setup installs it unless RAY=0)"
PLACE_TIMEOUT_S = 120.0  # how long Ray may take to find nodes for every worker's bundle
KILLED = -9              # the exit code a Ray actor that died without returning reports


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
    `ip` say where Ray placed it (asked once, when first read)."""

    def __init__(self, ray, actor_cls, name: str, options: dict, target: Callable[[Any], None], spec: Any):
        self.ray, self.name, self._cls, self._options = ray, name, actor_cls, options
        self._target, self._spec = target, spec
        self.actor = self._ref = self._where_ref = None
        self._code: int | None = None
        self._where: dict | None = None

    def start(self) -> None:
        self.actor = self._cls.options(**self._options).remote(self.name)
        self._where_ref = self.actor.where.remote()  # queued before run, so answered first
        self._ref = self.actor.run.remote(self._target, self._spec)

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
        if self._ref is not None:
            self.ray.wait([self._ref], timeout=timeout)

    def kill(self) -> None:
        if self.actor is not None:
            self.ray.kill(self.actor, no_restart=True)


def _actor_class(ray):
    class ShuttleWorker:
        """One worker process under Ray: runs a worker entry point (run_attention_worker or
        run_expert_worker) with the transport listening on this node's address."""

        def __init__(self, name: str):
            self.name = name

        def where(self) -> dict:
            return dict(node_id=ray.get_runtime_context().get_node_id(), ip=ray.util.get_node_ip_address(),
                        pid=os.getpid())

        def run(self, target: Callable[[Any], None], spec: Any) -> int:
            spec = replace(spec, transport=replace(spec.transport, host=ray.util.get_node_ip_address()))
            try:
                target(spec)
            except SystemExit as e:  # the entry points exit 1 after reporting a failure
                return e.code if isinstance(e.code, int) else 1
            return 0

    return ray.remote(ShuttleWorker)


class RayLauncher:
    """Workers as Ray actors (see the module docstring). Connects to the cluster at
    par.ray_address ("auto": the running cluster; HOST:PORT; None: Ray's default, which starts a
    local instance when none is running) and reserves one bundle per worker: experts e0.. then
    attention a0.., each {"CPU": 1} plus its pool's resources (which may override CPU)."""

    def __init__(self, par: ParallelConfig):
        ray = self.ray = _import_ray()
        from ray.util.placement_group import placement_group

        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            try:
                ray.init(address=par.ray_address, include_dashboard=False, logging_level=logging.WARNING)
            except Exception as e:  # ConnectionError, ValueError, ...: one line, not Ray's traceback
                raise RuntimeError(f"--launcher ray: cannot join the Ray cluster at "
                                   f"{par.ray_address or 'Ray default'}: {type(e).__name__}: {e}") from None
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
        return RayWorker(self.ray, self._cls, name, options, target, spec)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception:
            pass
        if self._started_ray:
            self.ray.shutdown()


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
