"""Data and expert parallelism over torch.distributed (gloo on the CPU, NCCL on GPUs), as started
by torchrun.

Ranks form groups of `ep` consecutive ranks; each group holds every expert once (rank r of a group
holds experts [r*E/ep, (r+1)*E/ep)), and everything else is replicated on every rank. Every rank
reads its own rows of the global batch (data parallel). In each MoE layer the AllToAllDispatcher
sends each (token, expert) pair to the rank of its expert and the results back, with an autograd
Function whose backward is the reverse all-to-all. After backward, replicated gradients are averaged
over all ranks and expert gradients over the ranks holding the same experts, so that every step is
the step one process would take on the whole global batch.

Legend: T tokens, D hidden, K experts per token, N = T*K token-expert pairs, E experts.
"""
import datetime
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from kernels.moe import Permutation, permute, unpermute


@dataclass(frozen=True)
class ParallelContext:
    """This process's place: rank of world_size, its device, and its expert-parallel group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    ep_size: int = 1
    ep_group: Any = None  # the ep consecutive ranks that hold every expert once
    expert_dp_group: Any = None  # the world_size/ep ranks that hold the same experts as this one
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def expert_ids(self, num_experts: int) -> tuple[int, ...]:
        """Global ids of the experts this rank holds (a contiguous range)."""
        n = num_experts // self.ep_size
        return tuple(range(self.ep_rank * n, (self.ep_rank + 1) * n))

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun (or its launcher API) tells a rank through the environment; the one place the
    training module reads it."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT: restarts of the job so far
    by_torchrun: bool = False  # this process is a rank torchrun started
    omp_num_threads: int | None = None  # OMP_NUM_THREADS when set

    @classmethod
    def from_environ(cls, env: Any = None) -> "LaunchEnv":
        """Read from `env` (default os.environ); a malformed number is a ValueError naming the variable."""
        env = os.environ if env is None else env

        def integer(name: str, default: int | None) -> int | None:
            value = env.get(name)
            if value in (None, ""):
                return default
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None

        return cls(world_size=integer("WORLD_SIZE", 1), rank=integer("RANK", 0),
                   local_rank=integer("LOCAL_RANK", 0), restart_count=integer("TORCHELASTIC_RESTART_COUNT", 0),
                   by_torchrun="TORCHELASTIC_RUN_ID" in env or "WORLD_SIZE" in env,
                   omp_num_threads=integer("OMP_NUM_THREADS", None))


def init_distributed(device: str | None, expert_parallel: int | None, num_experts: int,
                     timeout_s: float = 600.0) -> ParallelContext:
    """Join the job torchrun started (its RANK / WORLD_SIZE / LOCAL_RANK variables; without them a
    single process) and build the expert-parallel groups. expert_parallel: ranks that share one copy
    of the experts (default: all of them, when the experts divide evenly; else 1, pure data parallel).
    timeout_s: how long a collective waits for the other ranks before it fails (and the job with it).
    """
    env = LaunchEnv.from_environ()
    world, rank, local, restarts = env.world_size, env.rank, env.local_rank, env.restart_count
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(f"cuda:{local}") if kind == "cuda" else torch.device(kind)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ep = expert_parallel or (world if num_experts % world == 0 else 1)
    if world % ep or num_experts % ep:
        raise ValueError(f"--expert-parallel {ep} must divide both the number of ranks ({world}) and the "
                         f"number of experts ({num_experts})")
    if world == 1:
        return ParallelContext(device=dev, restart_count=restarts)
    if not dist.is_initialized():
        # torchrun keeps one store across restarts, and a restarted group could read the addresses
        # its dead predecessors published there (gloo: "connection refused"): a prefix per attempt.
        timeout = datetime.timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timeout, rank=rank,
                                world_size=world, store=dist.PrefixStore(f"shuttle/attempt-{restarts}", store))
    ep_group = expert_dp_group = None
    for g in range(world // ep):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(g * ep, (g + 1) * ep)))
        if rank // ep == g:
            ep_group = group
    for e in range(ep):
        group = dist.new_group(list(range(e, world, ep)))
        if rank % ep == e:
            expert_dp_group = group
    return ParallelContext(rank, world, local, dev, ep, ep_group, expert_dp_group, restarts)


class CommClock:
    """Seconds this rank spent in collectives, waiting for the other ranks included: a step's time
    minus this is the rank's own work, which names a straggler (everyone's step time is the same)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with autograd: backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any,
                clock: CommClock) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.clock = (out_splits, in_splits), group, clock
        with clock():
            return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out_splits, in_splits = ctx.splits
        with ctx.clock():
            return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


@dataclass(frozen=True)
class _Handle:
    y_ND: torch.Tensor  # expert outputs, back in this rank's permuted order
    perm: Permutation
    topk_weights_TK: torch.Tensor


class AllToAllDispatcher:
    """Expert parallelism: the (token, expert) pairs of this rank go to the ranks holding their
    experts; each rank runs its local experts on what it receives and sends the rows back, where
    they are weighted and summed (kernels.moe.unpermute) as the local dispatcher does."""

    def __init__(self, ctx: ParallelContext, num_experts: int, clock: CommClock | None = None):
        self.group, self.ep, self.local = ctx.ep_group, ctx.ep_size, num_experts // ctx.ep_size
        self.num_experts, self.clock = num_experts, clock or CommClock()

    def dispatch(self, layer: int, experts: nn.Module | None, x_TD: torch.Tensor,
                 topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, mb: int = 0) -> _Handle:
        """Send each (token, expert) pair to its expert's rank, run the local experts on what arrives,
        send the outputs back (two all-to-alls with autograd); combine() weights and sums them."""
        if experts is None:
            raise RuntimeError(f"layer {layer}: no local experts to run")
        x_ND, perm = permute(x_TD, topk_ids_TK, self.num_experts)  # sorted by expert, hence by rank
        send_EL = torch.tensor(perm.counts_E, dtype=torch.long, device=x_TD.device).view(self.ep, self.local)
        recv_EL = torch.empty_like(send_EL)  # rows from each source rank for each local expert
        with self.clock():
            dist.all_to_all_single(recv_EL, send_EL, group=self.group)
            recv_EL = recv_EL.cpu()
        send, recv = send_EL.sum(1).tolist(), recv_EL.sum(1).tolist()
        x_RD = _AllToAll.apply(x_ND, recv, send, self.group, self.clock)
        local_ids_R = torch.repeat_interleave(torch.arange(self.local).repeat(self.ep), recv_EL.reshape(-1))
        local_ids_R = local_ids_R.to(x_TD.device)
        ones_R = torch.ones(local_ids_R.shape[0], 1, dtype=torch.float32, device=x_TD.device)
        y_RD = experts(x_RD, local_ids_R[:, None], ones_R)
        if not y_RD.requires_grad and x_RD.requires_grad:  # nothing received: stay in the graph so
            y_RD = x_RD * 0.0                               # this rank's backward all-to-all still runs
        y_ND = _AllToAll.apply(y_RD, send, recv, self.group, self.clock)
        return _Handle(y_ND, perm, topk_weights_TK)

    def combine(self, handle: _Handle) -> torch.Tensor:
        return unpermute(handle.y_ND, handle.perm, handle.topk_weights_TK)

    def begin_step(self) -> None:
        pass

    def end_step(self) -> None:
        pass


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks (no gradient); the tensor itself on one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return t
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def reduce_gradients(replicated: list[nn.Parameter], sharded: list[nn.Parameter], ctx: ParallelContext) -> None:
    """Average gradients: replicated ones over all ranks; sharded (expert) ones, already summed over
    their expert-parallel group by the all-to-all backward, over the ranks holding the same experts.
    A parameter without a gradient counts as zeros (an expert that got no token)."""
    if not ctx.distributed:
        return
    _all_reduce_flat(replicated, None, 1.0 / ctx.world_size)
    _all_reduce_flat(sharded, ctx.expert_dp_group if ctx.world_size > ctx.ep_size else False, 1.0 / ctx.world_size)


def _all_reduce_flat(params: list[nn.Parameter], group: Any, scale: float) -> None:
    """One all-reduce of all gradients as a flat buffer (group False: no reduction, scale only)."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    if group is not False:
        dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def clip_grad_norm_(replicated: list[nn.Parameter], sharded: list[nn.Parameter], max_norm: float,
                    ctx: ParallelContext) -> float:
    """Scale all gradients so their global L2 norm (each expert counted once) is at most max_norm
    (0: no clipping). Returns the norm before clipping."""
    grads = [p.grad for p in replicated if p.grad is not None]
    sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), device=ctx.device)
    shard_grads = [p.grad for p in sharded if p.grad is not None]
    sq_sh = (torch.stack([g.float().pow(2).sum() for g in shard_grads]).sum() if shard_grads
             else torch.zeros((), device=ctx.device))
    if ctx.distributed and ctx.ep_size > 1:
        dist.all_reduce(sq_sh, group=ctx.ep_group)
    norm = float((sq + sq_sh).sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads + shard_grads:
            g.mul_(coef)
    return norm


def all_gather_floats(values: list[float], ctx: ParallelContext) -> list[list[float]]:
    """Every rank's `values` (the same length everywhere), indexed by rank."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if not ctx.distributed:
        return [t.tolist()]
    out = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def broadcast_object(obj: Any, ctx: ParallelContext) -> Any:
    """Rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
