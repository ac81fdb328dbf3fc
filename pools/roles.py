"""Workers of a deployment started on other hosts (`shuttle serve --role attention|expert
--rendezvous HOST:PORT`): read the deployment the front published in the TCPStore, take the next
rank of the role, serve. Also the deployment's JSON form (EngineConfig <-> dict) and its record.

The store has no authentication, so it holds nothing secret: every value in it, the deployment record
included, is signed with the deployment token (m2n_comm/_hello.py, SignedStore) and none holds the
token; every --role worker brings the token itself (SHUTTLE_DEPLOYMENT_TOKEN) and refuses a record
it cannot verify. The front's store listens on the rendezvous address only (listen_store).

A --role worker watches its front's store address as a Ray actor does (launchers.watch_front): cut
off from the front by a partition, it would otherwise wait for it (a parked attention worker for
ever), since no FIN or reset crosses.
"""
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict
from datetime import timedelta

from torch.distributed import DistError, TCPStore

from attention_nodes.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from attention_nodes.worker import AttentionWorkerSpec, run_attention_worker
from expert_nodes.worker import ExpertWorkerSpec, run_expert_worker
from m2n_comm._hello import open_record, signed_store
from m2n_comm.placement import ExpertPlacement
from m2n_comm.transport import TransportConfig
from models.config import DTYPES
from pools.launchers import watch_front

log = logging.getLogger("shuttle")
FRONT_WAIT_S = 600.0  # how long a --role worker waits for its front (its store, then its deployment)
MAX_RETRY_S = 30.0    # the longest pause between two tries
DEPLOYMENT_KEY = "shuttle/deployment"


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous must be HOST:PORT, got {addr!r}")
    return host, int(port)


def engine_config_to_json(cfg: EngineConfig) -> dict:
    d = asdict(cfg)
    d["dtype"] = None if cfg.dtype is None else str(cfg.dtype).removeprefix("torch.")
    return d


def engine_config_from_json(d: dict) -> EngineConfig:
    return EngineConfig(d["model"], None if d["dtype"] is None else DTYPES[d["dtype"]], d["device"], d["kernels"],
                        d["seed"], SchedulerConfig(**d["scheduler"]), CacheConfig(**d["cache"]),
                        ParallelConfig(**d["parallel"]), d.get("enforce_eager", EngineConfig.enforce_eager),
                        d.get("native_decode", EngineConfig.native_decode), d.get("quantization"),
                        d.get("speculative"), d.get("quantize_linears", False))


def run_role(role: str, rendezvous: str, host: str | None = None, torch_threads: int | None = None,
             token: str | None = None) -> None:
    """Run one worker of a deployment whose front waits at `rendezvous` (HOST:PORT): read the
    deployment from the store, take the next rank of `role` ("attention" or "expert"), serve.
    host: this machine's address for the tcp transport (default: the one that reaches the store).
    token: the deployment token (SHUTTLE_DEPLOYMENT_TOKEN); ValueError without it, before anything
    is read, and when the published deployment is not signed with it."""
    if not token:
        raise ValueError(f"set SHUTTLE_DEPLOYMENT_TOKEN on this worker to the deployment token of the front at "
                         f"{rendezvous} (the rendezvous store never holds it; a front started without one "
                         f"logged the line to export)")
    store_host, port = split_addr(rendezvous)
    store = wait_for_front(rendezvous, FRONT_WAIT_S)
    d = read_deployment(store, token, rendezvous)
    cfg = engine_config_from_json(d["engine"])
    transport = TransportConfig(**{**d["transport"], "host": host or _local_address(store_host, port),
                                   "token": token})
    placement = ExpertPlacement.from_json(d["placement"], cfg.parallel.expert_workers)
    rank = store.add(f"shuttle/rank/{role}", 1) - 1
    par = cfg.parallel
    # As a Ray actor's: once the front is gone or cut off, the worker has FRONT_GRACE_S to return by
    # itself (the process ends then; the event is never set), else the watch ends the process.
    threading.Thread(target=watch_front, args=((store_host, port), threading.Event()), daemon=True,
                     name="front-watch").start()
    if role == "attention":
        if rank >= par.attention_workers:
            raise ValueError(f"the deployment has {par.attention_workers} attention workers; this would be one more")
        run_attention_worker(AttentionWorkerSpec(cfg, rank, d["eos"], placement, transport, (store_host, port),
                                                 tuple(d["control"]), d["session"]))
    elif role == "expert":
        if rank >= par.expert_workers:
            raise ValueError(f"the deployment has {par.expert_workers} expert workers; this would be one more")
        run_expert_worker(ExpertWorkerSpec(cfg.model, cfg.dtype, cfg.device, cfg.kernels, rank, par.attention_workers,
                                           par.micro_batches, placement, transport, (store_host, port), d["session"],
                                           torch_threads or par.torch_threads, par.trace_dir,
                                           quantization=cfg.quantization))
    else:
        raise ValueError(f"role must be attention or expert, got {role!r}")


def wait_for_front(rendezvous: str, wait_s: float, first_retry_s: float = 1.0) -> TCPStore:
    """The front's rendezvous store, once it has published the deployment. Until then this retries,
    each pause twice the last (at most MAX_RETRY_S), saying each time what it waits for; TimeoutError
    after `wait_s` seconds."""
    host, port = split_addr(rendezvous)
    deadline, pause, store = time.monotonic() + wait_s, first_retry_s, None
    while True:
        try:
            if store is None:
                store = TCPStore(host, port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=max(1.0, min(pause, MAX_RETRY_S))))
            if store.check([DEPLOYMENT_KEY]):
                return store
            what, why = "its front to publish the deployment", " (the front is still starting)"
        except DistError as e:
            store, what, why = None, "the front's rendezvous store", f" ({type(e).__name__}: {str(e).splitlines()[0]})"
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no deployment at {rendezvous} after {wait_s:.0f} s: start `shuttle serve "
                               f"--rendezvous {rendezvous} ...` (the front) there, or check the address") from None
        log.info("waiting for %s at %s%s; next try in %.1f s", what, rendezvous, why, min(pause, left))
        time.sleep(min(pause, left))
        pause = min(2 * pause, MAX_RETRY_S)


def front_token(given: str | None, rendezvous: str | None) -> str:
    """The front's deployment token: `given` (SHUTTLE_DEPLOYMENT_TOKEN), or 128 random bits. With a
    rendezvous, on a loopback address or not, a generated token is logged once with the line that
    gives it to the --role workers (the front does not refuse to start without one)."""
    if given is not None:
        return given
    token = secrets.token_hex(16)
    if rendezvous:
        log.warning("no SHUTTLE_DEPLOYMENT_TOKEN given: this front generated the deployment token (it is never "
                    "written to the rendezvous store); start every --role worker of %s with: "
                    "export SHUTTLE_DEPLOYMENT_TOKEN=%s", rendezvous, token)
    return token


def listen_store(host: str, port: int) -> TCPStore:
    """The deployment's TCPStore server, listening on `host` only (its first address; port 0: any
    free one). torch's server binds its port on every interface, but takes over a listening socket
    given as master_listen_fd: it gets its own descriptor of one bound here (and closes it when it
    goes)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.create_server((host, port), family=family) as sock:
        return TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                        master_listen_fd=os.dup(sock.fileno()))


def publish_deployment(store, spec: dict, token: str) -> None:
    """Publish the deployment (JSON, no token in it) for --role workers, signed with the token."""
    signed_store(store, token).set(DEPLOYMENT_KEY, json.dumps(spec))


def read_deployment(store: TCPStore, token: str, rendezvous: str) -> dict:
    """The published deployment, verified with the token; ValueError when it is not signed with it."""
    d = open_record(token, DEPLOYMENT_KEY, store.get(DEPLOYMENT_KEY))
    if d is None:
        raise ValueError(f"the deployment at {rendezvous} ({DEPLOYMENT_KEY!r}) is not signed with this worker's "
                         f"SHUTTLE_DEPLOYMENT_TOKEN: refused (the front has a different token, or someone who "
                         f"reached the store wrote it)")
    return d


def _local_address(host: str, port: int) -> str:
    """The address of this machine's interface that routes to host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]
