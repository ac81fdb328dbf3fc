"""The expert worker process: holds the experts placed on it (every MoE layer) and serves M2N slots.

For each step, MoE layer and micro-batch, in the order attention workers dispatch them: gather every
attention worker's chunk (an empty chunk is a valid chunk), run the local experts on all gathered
tokens at once, and send each attention worker its rows back (m2n_comm.m2n.M2NReceiver).
Every second while busy, and after each idle step, it publishes its load (busy time, tokens per
(MoE layer, expert)) in the store under SESSION/stats/eN, for the server's /metrics and EPLB.
Placement versions (live re-placement) are prepared by a watcher thread: expert_nodes/placement.py.

Epochs: when an attention worker dies or goes silent (or closes its endpoint because the server
reset the data plane), the expert worker reports the peer under SESSION/broken/g<epoch>/eN, closes
its endpoint and waits for the server to publish the next epoch (SESSION/epoch); then it opens its
endpoint again under that epoch's session, with its experts (every placement version it holds)
still loaded. A restarted expert worker loads only its own experts and joins the current epoch.
An epoch may start with a new placement (failover without this worker or another, or a restarted
worker added back: SESSION/epoch/g<epoch>/placement): it is built (from the experts held, so a
survivor loads nothing) and held before the endpoint opens. After loading, SESSION/up/eN says the
epoch the worker was started for (the front adds a worker started during a failover back then).
Every value it writes or reads in the store is signed with the deployment token (SignedStore): one
a stranger wrote is refused and logged, and acted on as if absent.
"""
import functools
import json
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from setproctitle import setproctitle
from torch import nn
from torch.distributed import TCPStore

from expert_nodes.placement import HeldExperts, epoch_placement, loader_for, watch_placements
from kernels import native
from kernels.ops import choose_backend
from m2n_comm._hello import SignedStore
from m2n_comm.endpoints import open_endpoint
from m2n_comm.m2n import M2NReceiver, run_local_experts
from m2n_comm.placement import ExpertPlacement
from m2n_comm.transport import PeerDeadError, TransportConfig, TransportTimeout, data_session
from models.config import ModelConfig
from models.cpu_inference import resident_weight_bytes
from models.loader import freeze_loaded_heap
from telemetry.trace import Tracer

log = logging.getLogger("shuttle.expert")
STATS_EVERY_S = 1.0
EPOCH_POLL_S = 0.05  # while the data plane is down: how often to look for the server's next epoch


@dataclass(frozen=True)
class ExpertWorkerSpec:
    """Everything an expert worker needs to start (sent once, when the process is spawned)."""

    model: str
    dtype: torch.dtype | None
    device: str
    kernels: str | None
    rank: int
    attention_workers: int
    micro_batches: int
    placement: ExpertPlacement
    transport: TransportConfig
    store_addr: tuple[str, int]
    session: str
    torch_threads: int | None = None
    trace_dir: str | None = None
    epoch: int = 0  # the data plane epoch to join first
    quantization: str | None = None  # EngineConfig.quantization


def run_expert_worker(spec: ExpertWorkerSpec) -> None:
    """Process entry point: load, connect, serve until the attention workers go away. A failure is
    published in the store (key SESSION/failed/eN) so the server can name its cause."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s e{spec.rank}: %(message)s")
    setproctitle(f"shuttle-expert-e{spec.rank}")  # what ps and top show
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    store = SignedStore(TCPStore(*spec.store_addr, is_master=False, wait_for_workers=False),
                        spec.transport.token)
    try:
        _serve(spec, store)
        _done(store, spec)
    except BaseException as e:
        if isinstance(e, PeerDeadError) and _shutting_down(store, spec.session):
            _done(store, spec)
        else:
            log.exception("expert worker %d failed", spec.rank)
            try:
                store.set(f"{spec.session}/failed/e{spec.rank}", f"{type(e).__name__}: {e}")
            except Exception:
                pass
            raise SystemExit(1)


def _serve(spec: ExpertWorkerSpec, store: SignedStore) -> None:
    """Load the experts once, then serve one data-plane epoch after another until shutdown."""
    cfg = ModelConfig.from_pretrained(spec.model)
    moe_layers = [i for i, moe in enumerate(cfg.moe_layers) if moe]
    device = torch.device(spec.device)
    triton = choose_backend(device, spec.kernels) == "triton"
    pack = (functools.partial(pack_for_triton_experts, quantization=spec.quantization) if triton
            else functools.partial(pack_for_cpu, quantization=spec.quantization) if device.type == "cpu"
            else (lambda m: m))
    keep_fp8 = spec.quantization == "fp8" and cfg.fp8_block is not None  # the checkpoint's codes as shipped
    keep_mxfp4 = spec.quantization == "mxfp4" and cfg.mxfp4 and (device.type == "cpu" or triton)  # (pack runs them)
    load_fn = loader_for(spec.model, cfg, spec.dtype, device, spec.kernels, pack, keep_fp8, keep_mxfp4)
    held = HeldExperts(spec.placement, load_fn(spec.placement.experts_on(spec.rank)), spec.rank, load_fn, device)
    freeze_loaded_heap()
    weight_bytes = _expert_bytes(held)
    log.info("serving %d MoE layers, placement version %d, %d torch thread(s); expert weights %.1f MiB resident%s",
             len(moe_layers), spec.placement.version, torch.get_num_threads(), weight_bytes / 2 ** 20,
             f" ({spec.quantization})" if spec.quantization else "")
    tracer = Tracer(f"e{spec.rank}", enabled=spec.trace_dir is not None)
    load = _Load(spec, store, tracer, device, cfg.num_experts, moe_layers)
    load.meta["weight_bytes"] = weight_bytes  # the version in use's; re-placements update it
    load.step_done(idle=True)  # (published from the start: /metrics has the resident weights before a request)
    store.set(f"{spec.session}/up/e{spec.rank}", str(spec.epoch))  # loaded: the front may add it back now
    stop = threading.Event()
    watcher = threading.Thread(target=watch_placements,
                               args=(held, spec.store_addr, spec.session, stop, spec.transport.token), daemon=True,
                               name="placement-watcher")
    watcher.start()
    epoch: int | None = spec.epoch
    try:
        while epoch is not None:
            placement = epoch_placement(store, spec.session, epoch, spec.placement.num_workers)
            if placement is not None:  # failover or a worker added back: routed with from the first step
                held.hold_now(placement)
                load.meta["weight_bytes"] = _expert_bytes(held, placement.version)
            try:
                _serve_epoch(spec, store, epoch, held, moe_layers, device, tracer, load)
            except (PeerDeadError, TransportTimeout) as e:
                if _shutting_down(store, spec.session):
                    raise
                log.warning("data plane of epoch %d broke: %s", epoch, e)
            epoch = _next_epoch(store, spec.session, epoch)
    finally:
        stop.set()
        # Joined, not left to the interpreter's exit: a daemon thread still inside a TCPStore call when
        # Python finalizes is unwound through C++ frames and aborts the process (exit code -6, seen
        # once in a suite run of tests/test_pools.py::test_roles_meet_at_a_rendezvous).
        watcher.join(timeout=5)
        if spec.trace_dir:
            tracer.dump(spec.trace_dir)


def _expert_bytes(held: HeldExperts, version: int | None = None) -> int:
    """Bytes of the experts a placement version (default: the one in use) holds here, as served."""
    modules = held.modules(held.active if version is None else version)
    return resident_weight_bytes(nn.ModuleList(modules.values()))["experts"]


def _serve_epoch(spec: ExpertWorkerSpec, store: SignedStore, epoch: int, held: HeldExperts, moe_layers: list[int],
                 device: torch.device, tracer: Tracer, load: "_Load") -> None:
    peers = [f"a{i}" for i in range(spec.attention_workers)]
    endpoint = open_endpoint(spec.transport, store, data_session(spec.session, epoch), f"e{spec.rank}", peers,
                             spec.micro_batches)
    receiver = M2NReceiver(endpoint, peers, moe_layers, spec.micro_batches, device, tracer=tracer,
                           waited_ns=load.waited_ns)
    receiver.held = set(held.versions)
    try:
        _serve_steps(spec, store, receiver, held, moe_layers, load)
    except (PeerDeadError, TransportTimeout) as e:
        # Reported before the endpoint closes: the attention workers see the close and report it
        # too, and the server must learn from us which peer is to blame.
        if not _shutting_down(store, spec.session):
            store.set(f"{spec.session}/broken/g{epoch}/e{spec.rank}",
                      json.dumps({"peer": getattr(e, "peer", ""), "why": str(e)}))
        raise
    finally:
        endpoint.close()


def _serve_steps(spec: ExpertWorkerSpec, store: SignedStore, receiver: M2NReceiver, held: HeldExperts,
                 moe_layers: list[int], load: "_Load") -> None:
    narrow = receiver.device.type == "cpu" and narrows(held.modules(held.active).values())
    with torch.inference_mode(), native.native_parallel_only(narrow):
        while True:
            for layer in moe_layers:
                for mb in range(spec.micro_batches):
                    batch = receiver.recv(layer, mb)
                    load.count(layer, held.global_ids(batch.version, layer), batch.local_ids_RK)
                    receiver.reply(batch, run_local_experts(held.modules(batch.version)[layer], batch))
            if held.step_done(receiver):
                store.set(f"{spec.session}/placement/active/e{spec.rank}", str(held.active))
                load.meta["weight_bytes"] = _expert_bytes(held)
            load.step_done(receiver.idle)


def _next_epoch(store: SignedStore, session: str, epoch: int) -> int | None:
    """Wait for the server to publish an epoch after `epoch`; None when the deployment shuts down."""
    key = f"{session}/epoch"
    while True:
        if _shutting_down(store, session):
            return None
        if store.check([key]):
            nxt = int(store.get(key))
            if nxt > epoch:
                return nxt
        time.sleep(EPOCH_POLL_S)


class _Load:
    """Tokens per (MoE layer, global expert) this worker computed, and its busy time, published in
    the store: SESSION/stats/eN (JSON: busy_ns, uptime_ns, pairs, waited_ns per attention worker,
    moe_layers, num_experts) and
    SESSION/stats/eN/tokens (the (L, E) int64 counts as raw little-endian bytes: 58 x 256 DeepSeek
    layers are 119 KB, cheap once a second)."""

    def __init__(self, spec: ExpertWorkerSpec, store: SignedStore, tracer: Tracer, device: torch.device,
                 num_experts: int, moe_layers: list[int]):
        self.key, self.store, self.tracer = f"{spec.session}/stats/e{spec.rank}", store, tracer
        self.meta = {"moe_layers": moe_layers, "num_experts": num_experts}
        self.row = {layer: i for i, layer in enumerate(moe_layers)}
        self.E = num_experts
        self.tokens_LE = torch.zeros(len(moe_layers) * num_experts, dtype=torch.long, device=device)
        self.start_ns, self.last = time.monotonic_ns(), 0.0
        self.waited_ns: defaultdict[str, int] = defaultdict(int)  # the receivers' waits per attention worker

    def count(self, layer: int, global_ids: torch.Tensor, local_ids_RK: torch.Tensor) -> None:
        """Add one slot's (token, expert) pairs: local ids (-1: an expert elsewhere) -> global ids."""
        ids = local_ids_RK.reshape(-1)
        here = ids >= 0
        flat = self.row[layer] * self.E + global_ids[ids.clamp(min=0)]  # both on the expert device
        self.tokens_LE.index_add_(0, flat.to(self.tokens_LE.device), here.to(self.tokens_LE.dtype))

    def step_done(self, idle: bool) -> None:
        """After each step; publishes at most every STATS_EVERY_S (and when idle)."""
        if idle or time.monotonic() - self.last >= STATS_EVERY_S:
            self.store.set(f"{self.key}/tokens", self.tokens_LE.cpu().numpy().astype("<i8").tobytes())
            self.store.set(self.key, json.dumps({
                "busy_ns": self.tracer.totals.get("expert", 0), "uptime_ns": time.monotonic_ns() - self.start_ns,
                "pairs": int(self.tokens_LE.sum()), "waited_ns": dict(self.waited_ns), **self.meta}))
            self.last = time.monotonic()


def _done(store: SignedStore, spec: ExpertWorkerSpec) -> None:
    try:
        store.set(f"{spec.session}/done/e{spec.rank}", "1")
    except Exception:
        pass


def _shutting_down(store: SignedStore, session: str) -> bool:
    try:
        return store.check([f"{session}/shutdown"])
    except Exception:  # the store went away with the server: nothing left to serve
        return True


def narrows(blocks) -> bool:
    """Whether an expert worker's steps run under native.native_parallel_only (CPU blocks): under
    passive OpenMP waits, torch's own ops (the slot copies, the load counts) stay on one thread when
    the blocks are a native kernel's (the fused bf16, int8, FP8 or MXFP4 block), which alone uses the
    cores (kernels/native.py). The planner's profile times the blocks the same way."""
    from kernels import fp8_weights, int8, mxfp4_weights

    return native.passive_waits() and any(getattr(m, "native", None) is not None
                                          or (getattr(m, "int8", None) is not None and int8.available())
                                          or (getattr(m, "fp8", None) is not None and fp8_weights.available())
                                          or (getattr(m, "mxfp4", None) is not None and mxfp4_weights.available())
                                          for m in blocks)


def pack_for_triton_experts(experts: dict, quantization: str | None = None) -> dict:
    """MoE layer -> its experts as the Triton op table serves them: quantised ("fp8", "mxfp4":
    models/triton_quant.py, the checkpoint's codes where load_experts kept them), else as loaded."""
    if quantization is None:
        return experts
    from models.triton_quant import quantized_experts

    return {layer: quantized_experts(m, quantization) for layer, m in experts.items()}


def pack_for_cpu(experts: dict, quantization: str | None = None) -> dict:
    """MoE layer -> its experts, packed for the CPU kernels where this CPU has them (the kernels
    chosen by measurement first), or quantised ("int8": kernels/int8.py, any CPU; "fp8":
    kernels/fp8_weights.py, the checkpoint's codes where load_experts kept them; "mxfp4":
    kernels/mxfp4_weights.py, likewise), as an expert worker serves them; the planner's profile times
    the same modules."""
    from kernels.cpu_linear import packing_available

    from models.cpu_inference import PackedExperts, choose_kernels, compile_expert_gemms

    some = next(iter(experts.values()))
    if quantization is None and not packing_available(some.w13.dtype):
        return experts
    blocks = {layer: PackedExperts(m, quantization) for layer, m in experts.items()}
    choose_kernels(nn.ModuleList(blocks.values()))
    compile_expert_gemms(nn.ModuleList(blocks.values()))
    return blocks
