"""An expert worker's experts under live re-placement: every placement version it holds, and a
thread that prepares the next one while the worker keeps serving.

The front publishes version v as JSON under SESSION/placement/v (m2n_comm.placement.ExpertPlacement).
The watcher thread (its own store connection) sees it, builds this worker's modules for v, and
says SESSION/placement/v/loaded/eN (or .../failed/eN with the reason). Building reuses the weights
of the experts this worker already holds (packed weights are shared, not copied) and reads only the
new copies from the checkpoint (`load_experts` with per-layer ids: safe_open slices). The serving
thread adopts a loaded version between steps (`step_done`: then M2NReceiver.held includes it) and
drops every version older than the one the attention workers route with, so old copies are freed
one step after the switch. Memory: while a re-placement is pending, a layer whose experts changed
holds its old and its new set (the new copies are extra only until the switch).
"""
import logging
import threading
import time

import torch
from torch import nn
from torch.distributed import TCPStore

from m2n_comm._hello import SignedStore
from m2n_comm.m2n import M2NReceiver
from m2n_comm.placement import ExpertPlacement
from models.config import ModelConfig
from models.loader import load_experts
from models.moe_decoder import Experts

log = logging.getLogger("shuttle.expert")
WATCH_EVERY_S = 0.05  # how often the watcher looks for a new placement version


class HeldExperts:
    """{version: (ExpertPlacement, {layer: experts module})} of one expert worker. `modules(v)` and
    `global_ids(v)` serve the step's version; `step_done` adopts and frees versions."""

    def __init__(self, placement: ExpertPlacement, modules: dict[int, nn.Module], rank: int, load_fn,
                 device: torch.device | str = "cpu"):
        """load_fn(ids_by_layer) -> {layer: module}: this worker's loader (dtype, device, packing).
        device: where the routed ids arrive (the global-id tables live there)."""
        self.rank, self.load_fn, self.num_workers, self.device = rank, load_fn, placement.num_workers, device
        self.versions = {placement.version: (placement, modules)}
        self._global = {placement.version: self._global_ids(placement)}
        self._loaded: dict[int, tuple[ExpertPlacement, dict]] = {}  # built by the watcher, not adopted yet
        self._lock = threading.Lock()
        self.active = placement.version

    def _global_ids(self, placement: ExpertPlacement) -> dict[int, torch.Tensor]:
        return {layer: torch.tensor(ids, device=self.device) for layer, ids in placement.experts_on(self.rank).items()}

    def modules(self, version: int) -> dict[int, nn.Module]:
        return self.versions[version][1]

    def global_ids(self, version: int, layer: int) -> torch.Tensor:
        """(local experts,) int64: the global id of each local expert of `layer` under `version`."""
        return self._global[version][layer]

    def step_done(self, receiver: M2NReceiver) -> bool:
        """Adopt versions the watcher built, free versions older than the one in use; True when the
        version in use changed since the last call."""
        with self._lock:
            loaded, self._loaded = self._loaded, {}
        for v, (placement, modules) in loaded.items():
            self.versions[v] = (placement, modules)
            self._global[v] = self._global_ids(placement)
        for v in [v for v in self.versions if v < receiver.version]:
            del self.versions[v], self._global[v]
        receiver.held = set(self.versions)
        changed, self.active = receiver.version != self.active, receiver.version
        return changed

    def hold_now(self, placement: ExpertPlacement) -> None:
        """(Serving thread, between epochs.) Build `placement` unless held, and adopt it at once:
        an epoch that starts routing with it (failover, a worker added back) must find it here."""
        if placement.version not in self.versions:
            self.build(placement)
            with self._lock:
                loaded = self._loaded.pop(placement.version)
            self.versions[placement.version] = loaded
            self._global[placement.version] = self._global_ids(placement)

    def build(self, placement: ExpertPlacement) -> None:
        """(Watcher thread.) This worker's modules for `placement`, reusing held experts."""
        with self._lock:
            held = list(self.versions.values()) + list(self._loaded.values())
        have: dict[int, dict[int, tuple[nn.Module, int]]] = {}  # layer -> expert -> (module, local index)
        same: dict[int, nn.Module] = {}  # layers whose experts do not change: the module as it is
        want = placement.experts_on(self.rank)
        for old, modules in held:
            for layer, ids in old.experts_on(self.rank).items():
                if ids == want.get(layer):
                    same[layer] = modules[layer]
                for i, e in enumerate(ids):
                    have.setdefault(layer, {}).setdefault(e, (modules[layer], i))
        missing = {layer: [e for e in ids if e not in have.get(layer, {})] for layer, ids in want.items()
                   if layer not in same}
        fresh = self.load_fn({layer: ids for layer, ids in missing.items() if ids}) if any(missing.values()) else {}
        for layer, ids in missing.items():
            for i, e in enumerate(ids):
                have.setdefault(layer, {})[e] = (fresh[layer], i)
        modules = {layer: same[layer] if layer in same else regroup([have[layer][e] for e in ids])
                   for layer, ids in want.items()}
        with self._lock:
            self._loaded[placement.version] = (placement, modules)


def regroup(parts: list[tuple[nn.Module, int]]) -> nn.Module:
    """One experts module made of expert `i` of each (module, i), in order. Packed CPU experts share
    the packed weights; stacked Experts are copied into new stacks."""
    from models.cpu_inference import PackedExperts

    first = parts[0][0]

    def rows(attr: str) -> torch.Tensor | None:  # expert biases (gpt-oss), regrouped like the weights
        return None if getattr(first, attr) is None else torch.stack([getattr(m, attr).detach()[i] for m, i in parts])

    if all(isinstance(m, PackedExperts) for m, _ in parts):
        return PackedExperts.from_packed([m.w13_packed[i] for m, i in parts], [m.w2_packed[i] for m, i in parts],
                                         rows("b13"), rows("b2"), first.act, first.act_int8)
    if all(type(m) is type(first) and hasattr(m, "regroup") for m, _ in parts):  # (models/triton_quant.py)
        return type(first).regroup(parts)
    if not all(isinstance(m, Experts) for m, _ in parts):
        raise TypeError(f"cannot regroup experts of types {sorted({type(m).__name__ for m, _ in parts})}")
    with torch.device("meta"):
        out = Experts(len(parts), first.w13.shape[2], first.w2.shape[2], first.ops, first.b13 is not None, first.act)
    for attr in ("w13", "w2", "b13", "b2"):
        if getattr(first, attr) is not None:
            setattr(out, attr, nn.Parameter(rows(attr), requires_grad=False))
    return out.eval()


def epoch_placement(store: SignedStore, session: str, epoch: int, num_workers: int) -> ExpertPlacement | None:
    """The placement an epoch starts with, if the front set one (SESSION/epoch/g<epoch>/placement
    names its version; failover and adding a worker back), else None."""
    key = f"{session}/epoch/g{epoch}/placement"
    if not store.check([key]):
        return None
    return ExpertPlacement.from_json(store.get(f"{session}/placement/{int(store.get(key))}"), num_workers)


def watch_placements(held: HeldExperts, store_addr: tuple[str, int], session: str, stop: threading.Event,
                     token: str) -> None:
    """(Thread.) Build each new placement version the front publishes, in order, and say so. Its
    torch ops run on one thread: a parallel op here would start a second OpenMP pool in the process,
    after which libgomp (more threads than cores) stops spinning between the serving thread's
    parallel regions and every expert op pays a wake-up (server/async_llm.py measured that at ~2x).
    token: the deployment token; a placement not signed with it is refused (SignedStore)."""
    torch.set_num_threads(1)  # this thread's own team only; the serving thread keeps its count
    store = SignedStore(TCPStore(*store_addr, is_master=False, wait_for_workers=False), token)
    version = max(held.versions) + 1
    while not stop.is_set():
        key = f"{session}/placement/{version}"
        try:
            if not store.check([key]):
                time.sleep(WATCH_EVERY_S)
                continue
            placement = ExpertPlacement.from_json(store.get(key), held.num_workers)
        except Exception:  # the store went away with the front: the serving thread will notice
            return
        start = time.monotonic()
        try:
            with torch.inference_mode():
                held.build(placement)
            store.set(f"{key}/loaded/e{held.rank}", "1")
            log.info("placement version %d ready in %.2f s", version, time.monotonic() - start)
        except Exception as e:
            log.exception("placement version %d failed", version)
            try:
                store.set(f"{key}/failed/e{held.rank}", f"{type(e).__name__}: {e}")
            except Exception:
                return
        version += 1


def loader_for(model: str, cfg: ModelConfig, dtype: torch.dtype | None, device: torch.device, kernels: str | None,
               pack, keep_fp8: bool = False, keep_mxfp4: bool = False) -> callable:
    """load_fn for HeldExperts: the experts of {layer: ids} from the checkpoint, packed like the rest
    (keep_fp8: with an FP8 checkpoint's codes as shipped, for pack; keep_mxfp4: an MXFP4 checkpoint's
    blocks as shipped, not dequantised; load_experts)."""
    def load(ids_by_layer: dict[int, list[int]]) -> dict[int, nn.Module]:
        return pack(load_experts(model, ids_by_layer, cfg, dtype, device, kernels, keep_fp8, keep_mxfp4))
    return load
