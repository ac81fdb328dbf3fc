"""The decoder's non-GEMM chains as pure functions ("stages"), eager or compiled by torch.compile.

Legend: T tokens, D hidden, N query heads, K kv heads, H head dim, R rotary dims, E experts,
X top-k experts per token.

Between its matmuls a decode step runs short chains of small ops: residual add + RMSNorm, q/k norm
+ rotary, router softmax/sigmoid + top-k + renormalisation + cast. In eager mode each op is one
dispatch (a few microseconds of Python and allocation for a few kilobytes of work at small batches).
`compile_stages` turns the first two into one inductor (C++) kernel call each; routing stays eager
(see compiled_stages). The matmuls stay
outside: the CPU path's oneDNN-packed weights (kernels/cpu_linear.py) are opaque tensors that
dynamo cannot trace, and the router's module keeps its forward (training hooks it for the logits).

Every layer calls the same functions with its own weights as arguments and a frozen spec as the
only constant, so one compiled graph serves all layers. Shapes: T is the only dimension that
changes; the first call (T=1, decode at batch 1) compiles a graph specialised to one row, the
second (T=2) one with T symbolic that every T >= 2 reuses (dynamo's automatic dynamic shapes).
So two shape buckets cover every batch and prefill chunk, with no padding; `warm_up` compiles
both from synthetic inputs at start-up, never while a request is served.
"""
import functools
import itertools
import logging
import threading
import time
import types
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.ops import KernelOps

log = logging.getLogger("shuttle")
BUCKETS = (1, 2)  # T = 1 compiles its own graph; T = 2 compiles the symbolic one every T >= 2 takes
RECOMPILE_LIMIT = 64  # graphs per stage function in one process (dynamo's default of 8 is per code object)
COMPILE_OPTIONS = {"emulate_precision_casts": True, "cpp.threads": 1}  # see compiled_stages


@dataclass(frozen=True)
class HeadSpec:
    """What q_k_v_heads needs of the config: head counts and size, rotary dims (R <= H; 0: a layer
    without rope), q/k norm ("none", "per_head", "full" or "l2") with its eps, the qkv clamp (OLMoE's
    clip_qkv) or None, whether the rotary pairs are interleaved (Llama 4), and the value heads' size
    (MiMo-V2-Flash's are narrower; 0: head_dim)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int
    qk_norm: str
    eps: float
    clip_qkv: float | None
    rope_interleave: bool = False
    v_head_dim: int = 0


@dataclass(frozen=True)
class RouteSpec:
    """What route needs: the router config's fields (kernels.routing.RouterConfig) and the dtype
    the weights are rounded to when the model weighs in the activations' dtype (None: float32)."""

    top_k: int
    scoring: str
    renormalize: bool
    num_groups: int
    topk_groups: int
    group_score: str
    scaling: float
    weights_dtype: torch.dtype | None


def add_rms_norm(x_TD: torch.Tensor, residual_TD: torch.Tensor, w_D: torch.Tensor, eps: float,
                 ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the pre-norm decoder's residual step."""
    return ops.fused_add_rms_norm(x_TD, residual_TD, w_D, eps)


def q_k_v_heads(q_TQ: torch.Tensor, k_TC: torch.Tensor, v_TC: torch.Tensor, cos_TR: torch.Tensor,
                sin_TR: torch.Tensor, q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None, spec: HeadSpec,
                ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections (T, N*H) / (T, K*H) -> roped q_TNH, k_TKH and v_TKH: q/k norm (per head or
    over the whole projection), the qkv clamp, then rotary on the first R dims of each head; Llama 4's
    weightless "l2" norm comes after the rotary, as transformers applies it."""
    T, H = q_TQ.shape[0], spec.head_dim
    q, k, v = q_TQ, k_TC, v_TC
    if spec.qk_norm == "full":
        q, k = ops.rms_norm(q, q_norm_w, spec.eps), ops.rms_norm(k, k_norm_w, spec.eps)
    if spec.clip_qkv is not None:
        q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
    q_TNH, k_TKH = q.view(T, spec.num_heads, H), k.view(T, spec.num_kv_heads, H)
    v_TKH = v.view(T, spec.num_kv_heads, spec.v_head_dim or H)
    if spec.qk_norm == "per_head":
        q_TNH, k_TKH = ops.rms_norm(q_TNH, q_norm_w, spec.eps), ops.rms_norm(k_TKH, k_norm_w, spec.eps)
    R = spec.rope_dim
    interleaved = spec.rope_interleave and R > 0
    if interleaved:
        # Llama 4 rotates the pairs (0, 1), (2, 3), ...: moved to the halves layout (copies), the
        # rotation below gives its result in that order, the same for q and k, so the scores are equal
        q_TNH, k_TKH = _deinterleave(q_TNH, R), _deinterleave(k_TKH, R)
    if torch.compiler.is_compiling() and not interleaved:
        # Without a q/k norm, q and k are still views of the inputs here (with the fused projection,
        # column slices of its output: rows Q + 2C apart). Rotated in place, the graph would return
        # aliases of mutated inputs, which torch 2.13 rebuilds wrongly: with contiguous strides when
        # T is symbolic (rows read Q apart: Mixtral, Qwen2-MoE and gpt-oss gave other greedy ids than
        # eager), and, when one function held the graphs of several specs, at T = 1 without the
        # storage offset (k came back reading q's values; a one-row view counts as contiguous, so
        # the partial path's `.contiguous()` keeps the input too). Rotate copies instead: inductor
        # writes them in the rotary kernel (tests/test_compiled.py).
        q_TNH = q_TNH.clone(memory_format=torch.contiguous_format)
        k_TKH = k_TKH.clone(memory_format=torch.contiguous_format)
    if R == H:
        q_TNH, k_TKH = ops.apply_rotary_(q_TNH, k_TKH, cos_TR, sin_TR)
    elif R:  # partial rotary: rotate the first R dims of each head in place (strided views)
        q_TNH, k_TKH = q_TNH.contiguous(), k_TKH.contiguous()
        ops.apply_rotary_(q_TNH[..., :R], k_TKH[..., :R], cos_TR, sin_TR)
    if spec.qk_norm == "l2":
        q_TNH, k_TKH = _l2_norm(q_TNH, spec.eps), _l2_norm(k_TKH, spec.eps)
    return q_TNH, k_TKH, v_TKH


def _deinterleave(x_TNH: torch.Tensor, R: int) -> torch.Tensor:
    """The first R dims of each head from pairs (0, 1), (2, 3), ... to halves (0, 2, ..., 1, 3, ...)."""
    return torch.cat((x_TNH[..., 0:R:2], x_TNH[..., 1:R:2], x_TNH[..., R:]), dim=-1)


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's q/k norm: RMSNorm over each head without a weight, in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def route(logits_TE: torch.Tensor, correction_bias_E: torch.Tensor | None, spec: RouteSpec,
          ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k choice from the router's logits: (weights_TX float32 or spec.weights_dtype, ids_TX int64)."""
    weights_TX, ids_TX = ops.topk_route(logits_TE, spec.top_k, spec.scoring, spec.renormalize,
                                        correction_bias_E=correction_bias_E, num_groups=spec.num_groups,
                                        topk_groups=spec.topk_groups, group_score=spec.group_score,
                                        scaling=spec.scaling)
    if spec.weights_dtype is not None:
        weights_TX = weights_TX.to(spec.weights_dtype)
    return weights_TX, ids_TX


@functools.cache
def interned(spec: object) -> object:
    """The first-made spec equal to `spec`: dynamo guards specs by identity, so every layer (and
    every model of a process) must pass the same object to share one compiled graph."""
    return spec


@dataclass(frozen=True)
class DecodeStages:
    """The stage functions a model calls (see the module docstring); `compiled` says which kind."""

    add_rms_norm: Callable = add_rms_norm
    q_k_v_heads: Callable = q_k_v_heads
    route: Callable = route
    compiled: bool = False


EAGER = DecodeStages()


def compiled_stages() -> DecodeStages:
    """DecodeStages whose functions are torch.compile'd (inductor); they compile on first call.
    emulate_precision_casts: inductor rounds to bf16/fp16 wherever eager would (it otherwise keeps
    fused intermediates in float32), so the compiled model's numbers follow the eager oracle's.
    cpp.threads=1: these kernels touch kilobytes; an OpenMP region per call cost more than it
    saved, and on a busy machine a region waits for a descheduled thread (bench/stages.py)."""
    # Many checkpoints in one process (the tests) each add graphs to the same functions' caches.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # Routing stays eager: its top-k is no inductor kernel (a fallback call inside the graph), and
    # the compiled chain measured 5-10x slower than the eager one at 1-64 rows (bench/stages.py).
    return DecodeStages(torch.compile(add_rms_norm, dynamic=None, fullgraph=True, options=COMPILE_OPTIONS),
                        _compiled_q_k_v_heads, route=route, compiled=True)


_HEADS_BY_SPEC: dict[HeadSpec, Callable] = {}  # _compiled_q_k_v_heads's functions
_HEADS_LOCK = threading.Lock()  # one name per spec even if two threads meet new specs at once
_HEADS_NAMES = itertools.count()


def _compiled_q_k_v_heads(q_TQ, k_TC, v_TC, cos_TR, sin_TR, q_norm_w, k_norm_w, spec: HeadSpec, ops: KernelOps):
    """q_k_v_heads compiled, one function per head spec. Dynamo keeps a function's graphs and its
    automatic-dynamic record per code name: with one function, a second spec's other widths turned
    them symbolic, and its T = 1 graph then failed at start-up in inductor's generated code
    (`NameError: name 's39' is not defined`; two models with other head sizes, one with q/k norm,
    compiled in one process). A copy of the function under its own name per spec keeps every width
    static, so only T varies (tests/test_compiled.py)."""
    fn = _HEADS_BY_SPEC.get(spec)
    if fn is None:
        with _HEADS_LOCK:
            fn = _HEADS_BY_SPEC.get(spec)
            if fn is None:
                code = q_k_v_heads.__code__.replace(co_name=f"q_k_v_heads_{next(_HEADS_NAMES)}")
                copy = types.FunctionType(code, q_k_v_heads.__globals__, code.co_name)
                fn = _HEADS_BY_SPEC[spec] = torch.compile(copy, dynamic=None, fullgraph=True,
                                                          options=COMPILE_OPTIONS)
    return fn(q_TQ, k_TC, v_TC, cos_TR, sin_TR, q_norm_w, k_norm_w, spec, ops)


def compile_stages(model: torch.nn.Module) -> float:
    """Give every module of `model` that has stages the compiled ones and compile them for each
    bucket now (model: models.moe_decoder.MoEForCausalLM, torch ops). Returns the seconds spent."""
    t0 = time.perf_counter()
    stages = compiled_stages()
    for m in model.modules():
        if hasattr(m, "stages"):
            m.stages = stages
    warm_up(model)
    seconds = time.perf_counter() - t0
    log.info("compiled the decode stages (residual add + RMSNorm, q/k norm + rotary) for %d shape buckets "
             "(T=1, T>=2) in %.1f s", len(BUCKETS), seconds)
    return seconds


@torch.inference_mode()
def warm_up(model: torch.nn.Module) -> None:
    """Call each distinct stage of `model` with synthetic inputs of every bucket's row count, in
    the dtypes and layouts a forward pass gives them, so that serving never compiles."""
    for T in BUCKETS:
        for m in _distinct(model):
            m.warm_up_stages(T)


def _distinct(model: torch.nn.Module) -> list[torch.nn.Module]:
    """One module per distinct stage call signature (the first of each kind: all layers alike)."""
    seen, out = set(), []
    for m in model.modules():
        key = getattr(m, "stage_key", None)
        if key is not None and key() not in seen:
            seen.add(key())
            out.append(m)
    return out
