"""Which CPU kernel runs each hot op at each row count, chosen by timing the candidates on this CPU.

What a kernel is good at depends on the machine (AMX tiles won from 3 rows on the 2-core Intel
Xeon and do not exist on an EPYC; AVX-512 BF16 dot products stream one row's weights fastest) and
on the row count, so nothing here is decided from the ISA alone: every candidate the CPU can run is
timed once per op, weight shape and row bucket, and the fastest is taken. The results are cached
on disk by CPU model, ISA flags, thread count and kernel build, as oneDNN and Triton's autotuner
cache theirs, and the table is logged once per process.

Ops (each candidate reads the same weights, so the choice can change with the row count):
  gemm    a dense bf16 linear on our panels (kernels/native.pack_panels32): q/k/v, o, router, LM head
          avx512  AVX-512 BF16 dot products (kernels/csrc/moe_avx512bf16.c)
          amx     AMX tiles on the same panels (kernels/csrc/amx_bf16.c)
          onednn  oneDNN's packed bf16 GEMM, timed for the table only: it needs its own copy of every
                  weight (the panels stay the layout wherever they can run)
  moe     one expert's rows in the fused bf16 MoE block: avx512 or amx, chosen per expert by its rows
  skinny  a float32 linear whose weights are exactly bf16 (a bf16 checkpoint served in float32):
          native  our bf16 GEMM on the bf16 copy, half the bytes (kernels/csrc/skinny_gemm.c)
          onednn  oneDNN's packed float32 GEMM
  int8_moe  one int8 expert's bf16 rows in the fused int8 block (kernels/int8.fused_moe_int8; int8 dense
          linears take the same choice; a process with such linears and no such experts, an attention
          worker, times the block on its largest linear's (I, O / 2)): fma (codes widened in
          registers; AVX-512, else AVX2), or each panel dequantised to bf16 once per block of rows for
          bf16dot (AVX-512 BF16 dot products) or amx; the kernel takes one big kernel and threshold:
          the one that won the largest bucket, from the first bucket after which it always won. Also
          vnni (AVX-512 VNNI on the same codes with per-token int8 activations: w8a8's arithmetic, so
          a NUMERICS candidate): experts take it from the first bucket after which it always won, the
          weight-only picks below and for the linears
  fp8_moe  the same on FP8 codes (128 x 128 blocks; the FP8 block and FP8 dense linears): their decode
          costs differ from int8's (fma widens E4M3 through float16, bf16dot looks bytes up in a
          table), so the threshold does too
  mxfp4   an MXFP4 linear's bf16 rows (kernels/mxfp4_weights.mxfp4_linear), shape (O, I): fma (FP4 codes
          decoded in registers, AVX-512, else AVX2) or bf16dot (each panel decoded to bf16 once per
          block of rows, AVX-512 BF16 dot products); only where bf16dot runs
  attention  paged decode attention (kernels/attention.paged_decode_attention) per bucket of the
          batch's sequences, each attending over ATTENTION_CONTEXT (256) tokens in pages of
          ATTENTION_PAGE (16) slots scattered over the cache; shape (N, K, H, bytes per element):
          native  the pages read in place (kernels/csrc/paged_attention.c)
          torch   the pages gathered, then torch's flash-attention CPU kernel (_paged_flash)
  rmsnorm  residual add + RMSNorm of rows of D, shape (D, bytes per element) (kernels/rmsnorm.py; the
          q/k norms, without the add, run the same kernel): native (kernels/csrc/rmsnorm.c) or torch
  routing  softmax top-k of (T, E) logits, shape (E, top_k, bytes per element) (kernels/routing.py;
          other routers have no kernel): native (decode_step.c's route, one thread) or torch
(Bytes per element 2: bf16, 4: float32.) These three are kernels/native.NATIVE_OR_TORCH: their picks
fill its tables, read by every eager call; without the library nothing is chosen and torch runs. The
native decode step (models/native_decode.py) calls the same kernels from C, so it takes a batch only
where all three tables say native at its size (elsewhere the eager layers run, each op as picked).

Row buckets: 1, 2, 3-4, 5-8, ..., 513-1024, over 1024 (the C table's, kernels/csrc/amx_bf16.c), each
timed at its largest count (2048 for the last); the three cheap ops only up to the largest bucket
whose input fits TIMED_BYTES (larger ones take its pick: the work per row is the same), each timing
STEP_MIN_S long: tenths of a second each, once per machine and shapes. The candidates of a bucket are
timed in turn, three rounds, the median kept; a candidate that lost by more than LOSING_RATIO in two
buckets in a row is not timed at larger counts (it loses there too) if its ratio to the best grew
between the two. A bucket keeps the previous bucket's kernel unless another is faster by more than
TIE (5%), so that timing noise between kernels that stream the same bytes does not interleave them.
A table where a candidate's time falls by more than a third from a bucket to a larger one was
disturbed by other work and is measured again, once (`disturbed`).

SHUTTLE_KERNEL_CHOICE (this module is the only place that reads it): unset or "auto": the cached
table, else measure; "measure": measure again; "CANDIDATE" or "op=CANDIDATE,...": that candidate at
every row count where it can run (benchmarks set old against new with it; "torch" sends every op
that has a torch path there, "attention=torch" attention alone).
"""
import functools
import hashlib
import itertools
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import native
from kernels.native import BUCKET_ROWS, bucket

log = logging.getLogger("shuttle")
ENV_VAR = "SHUTTLE_KERNEL_CHOICE"
LOSING_RATIO = 2.0
TIE = 0.05  # a bucket keeps the previous bucket's kernel unless another is faster by more than this
# Candidates whose arithmetic differs from the others' (vnni: per-token int8 activations, w8a8's rounding),
# taken only where faster than every other by more than NUMERICS_MARGIN: not for timing noise
NUMERICS = {"int8_moe": ("vnni",)}
NUMERICS_MARGIN = 0.10
ROUNDS = 3
MIN_S = 0.002  # each timing runs the call for at least this long
STEP_MIN_S = 0.0005  # the same for the cheap ops (native.NATIVE_OR_TORCH)
TIMED_BYTES = 16 << 20  # the cheap ops' largest timed input (attention: the keys and values it reads)
STREAM_BYTES = 256 << 20  # int8_moe's experts in copies that far exceed any last-level cache (see its runners)
STREAM_COPIES = 64  # at most
ATTENTION_CONTEXT = 256  # tokens per sequence where attention is timed
ATTENTION_PAGE = 16  # token slots per page there (CacheConfig.block_size's default)
CANDIDATES = {"gemm": ("avx512", "amx", "onednn"), "moe": ("avx512", "amx"), "skinny": ("native", "onednn"),
              "int8_moe": ("fma", "bf16dot", "amx", "vnni"), "fp8_moe": ("fma", "bf16dot", "amx"),
              "mxfp4": ("fma", "bf16dot"), **{op: ("native", "torch") for op in native.NATIVE_OR_TORCH}}
CHOOSABLE = {"gemm": ("avx512", "amx"), "moe": ("avx512", "amx"), "skinny": ("native", "onednn"),
             "int8_moe": ("fma", "bf16dot", "amx", "vnni"), "fp8_moe": ("fma", "bf16dot", "amx"),
             "mxfp4": ("fma", "bf16dot"), **{op: ("native", "torch") for op in native.NATIVE_OR_TORCH}}
_DTYPES = {2: torch.bfloat16, 4: torch.float32}  # the cheap ops' shapes name their dtype by its size
_C_OPS = {"gemm": native.GEMM, "moe": native.MOE}
_C_CANDIDATES = {"avx512": native.AVX512, "amx": native.AMX}


@dataclass
class Choice:
    """One op's table: the candidate picked per bucket, and the median microseconds each candidate took
    per shape and bucket (None: not timed)."""
    op: str
    shapes: list[tuple[int, ...]]
    picks: list[str]
    times_us: dict[str, list[float | None]] = field(default_factory=dict)
    source: str = "measured"  # measured, cached, or forced

    def runs(self) -> str:
        """The picks as row ranges: "1-4 avx512, 5+ amx"."""
        parts, start = [], 0
        for b in range(1, len(self.picks) + 1):
            if b == len(self.picks) or self.picks[b] != self.picks[start]:
                lo = 1 if start == 0 else BUCKET_ROWS[start - 1] + 1
                hi = "+" if b == len(self.picks) else "" if BUCKET_ROWS[b - 1] == lo else f"-{BUCKET_ROWS[b - 1]}"
                parts.append(f"{lo}{hi} {self.picks[start]}")
                start = b
        return ", ".join(parts)


@functools.cache
def host() -> dict:
    """What a measurement is valid for: the CPU, its matmul ISA, the kernels' build and torch."""
    model = native.cpu_model()
    isa = sorted(native.cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile",
                                       "amx_int8", "avx_vnni"})
    return {"cpu": model or platform.processor(), "isa": isa, "torch": torch.__version__,
            "native": native.build_digest(), "omp_passive": native.passive_waits()}


def _cache_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shuttle" / "kernel_choices.json"


def _method(op: str) -> list:
    """How op is timed, where that can change without the op's name changing (in its cache key)."""
    if op in native.NATIVE_OR_TORCH:
        return [CANDIDATES[op], STEP_MIN_S, TIMED_BYTES] + ([ATTENTION_CONTEXT, ATTENTION_PAGE] if op == "attention"
                                                            else [])
    return []


def _key(op: str, shapes: list[tuple[int, ...]], threads: int) -> str:
    text = json.dumps([host(), op, sorted(shapes), threads, *_method(op)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _load_cache() -> dict:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _store(key: str, choice: Choice) -> None:
    """Add one table to the cache file (atomically; a concurrent writer's entry may be lost and is
    measured again by the next process that needs it)."""
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _load_cache()
        entries[key] = {"op": choice.op, "shapes": choice.shapes, "picks": choice.picks, "times_us": choice.times_us,
                        "host": host(), "threads": native.threads(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        log.info("kernel choices not cached (%s): %s", path, e)


def _forced() -> dict[str, str] | None:
    """$SHUTTLE_KERNEL_CHOICE's forced candidate by op, or None (auto / measure)."""
    value = os.environ.get(ENV_VAR, "auto").strip()
    if value in ("", "auto", "measure"):
        return None
    if "=" not in value:
        if not any(value in cands for cands in CHOOSABLE.values()):
            raise ValueError(f"{ENV_VAR}={value!r}: expected auto, measure, a candidate or op=candidate pairs "
                             f"(ops and their candidates: {CHOOSABLE})")
        return {op: value for op, cands in CHOOSABLE.items() if value in cands}
    forced = dict(pair.split("=", 1) for pair in value.split(","))
    if not all(op in CHOOSABLE and cand in CHOOSABLE[op] for op, cand in forced.items()):
        raise ValueError(f"{ENV_VAR}={value!r}: expected auto, measure, a candidate or op=candidate pairs "
                         f"(ops and their candidates: {CHOOSABLE})")
    return forced


# -- the candidates, as functions of a row count on one shape ---------------------------------------

def _gemm_runners(shape: tuple[int, int]) -> dict:
    O, I = shape
    w = (torch.randn(O, I) / I ** 0.5).to(torch.bfloat16)
    panels = native.pack_panels32(w, I)

    def panel_kernel(which):
        def run(x):  # the table is the process's: each call sets its entry first
            b = bucket(x.shape[0])
            return lambda: (native.set_kernel_choice(native.GEMM, b, which), native.gemm_bf16_panels(x, panels, O))
        return run

    runners = {"avx512": panel_kernel(native.AVX512)}
    if native.amx():
        runners["amx"] = panel_kernel(native.AMX)
    from kernels.cpu_linear import pack_weight, packed_linear, packing_available
    if packing_available(torch.bfloat16):
        packed = pack_weight(w)
        runners["onednn"] = lambda x: (lambda: packed_linear(x, packed))
    return {"make_x": lambda T: torch.randn(T, I).to(torch.bfloat16), "runners": runners}


def _moe_runners(shape: tuple[int, int]) -> dict:
    D, inter = shape
    from kernels.cpu_linear import ExpertPanels

    w13 = ExpertPanels((torch.randn(2 * inter, D) / D ** 0.5).to(torch.bfloat16), True, inter)
    w2 = ExpertPanels((torch.randn(D, inter) / inter ** 0.5).to(torch.bfloat16), False, inter)
    p13, p2 = (torch.tensor([w.panels.data_ptr()], dtype=torch.int64) for w in (w13, w2))

    def expert_kernel(which):
        def run(x):
            b, ids, weights = bucket(x.shape[0]), torch.zeros(x.shape[0], 1, dtype=torch.int64), torch.ones(x.shape[0], 1)
            return lambda: (native.set_kernel_choice(native.MOE, b, which),
                            native.fused_moe_bf16(x, ids, weights, p13, p2, w13.inter_padded))
        return run

    runners = {"avx512": expert_kernel(native.AVX512)}
    if native.amx():
        runners["amx"] = expert_kernel(native.AMX)
    return {"make_x": lambda T: torch.randn(T, D).to(torch.bfloat16), "runners": runners,
            "keep": (w13, w2)}


def _skinny_runners(shape: tuple[int, int]) -> dict:
    O, I = shape
    from kernels.cpu_linear import pack_weight, packed_linear

    half = (torch.randn(O, I) / I ** 0.5).to(torch.bfloat16)
    packed = pack_weight(half.float())
    return {"make_x": lambda T: torch.randn(T, I),
            "runners": {"native": lambda x: (lambda: native.gemm_bf16(x, half)),
                        "onednn": lambda x: (lambda: packed_linear(x, packed))}}


def _quantised_moe_runners(shape: tuple[int, int], codes: str = "int8") -> dict:
    """One expert of the shape with int8 (or, codes "fp8", FP8 128 x 128 block) codes, in as many copies
    as fill STREAM_BYTES (at most STREAM_COPIES), each call's rows on the next copy: a decode step reads
    its experts from memory, not from a cache they fit in (one copy of 1024 x 2048 in a 32 MiB L3 put
    1-2 rows on the FMA kernel, which is 13% slower from memory)."""
    import copy

    D, inter = shape
    from kernels import fp8_weights, int8

    experts_of, fused = ((int8.Int8Experts, int8.fused_moe_int8) if codes == "int8"
                         else (fp8_weights.Fp8Experts, fp8_weights.fused_moe_fp8))
    one = experts_of.quantize(torch.randn(1, 2 * inter, D) / D ** 0.5, torch.randn(1, D, inter) / inter ** 0.5)

    def moved(p):  # the expert weight with its codes copied elsewhere in memory
        c, w = copy.copy(p), copy.copy(getattr(p, codes))
        w.panels = w.panels.clone()
        setattr(c, codes, w)
        return c

    per_expert = getattr(one.w13_E[0], codes).nbytes + getattr(one.w2_E[0], codes).nbytes
    copies = max(1, min(STREAM_COPIES, -(-STREAM_BYTES // per_expert)))  # (a tiny expert: cached, as served)
    experts = experts_of([one.w13_E[0]] + [moved(one.w13_E[0]) for _ in range(copies - 1)],
                         [one.w2_E[0]] + [moved(one.w2_E[0]) for _ in range(copies - 1)])
    here = int8.kernels() if codes == "int8" else fp8_weights._here_for(experts.block13, experts.block2)
    kernels = {"fma": int8.AVX512 if int8.AVX512 in here else int8.AVX2}
    kernels.update({name: k for name, k in (("bf16dot", int8.BF16DOT), ("amx", int8.AMX)) if k in here})
    # vnni: the same codes with per-token int8 activations (w8a8's experts over them; int8 codes only)
    w8a8 = (int8.Int8Experts(experts.w13_E, experts.w2_E, act_int8=True)
            if codes == "int8" and int8.VNNI in here and max(D, inter) <= int8.VNNI_MAX_K else None)

    def run(kernel):
        def timed(x):
            ids = [torch.full((x.shape[0], 1), e, dtype=torch.int64) for e in range(copies)]
            ones, calls = torch.ones(x.shape[0], 1), itertools.count()
            if kernel == int8.VNNI:
                return lambda: fused(x, ids[next(calls) % copies], ones, w8a8)
            return lambda: fused(x, ids[next(calls) % copies], ones, experts, kernel=kernel)
        return timed

    if w8a8 is not None:
        kernels["vnni"] = int8.VNNI
    return {"make_x": lambda T: torch.randn(T, D).to(torch.bfloat16),
            "runners": {name: run(k) for name, k in kernels.items()}, "keep": (experts, w8a8)}


def _mxfp4_runners(shape: tuple[int, int]) -> dict:
    from kernels import mxfp4_weights as mx

    w = mx.Mxfp4Weight.quantize(torch.randn(*shape) / shape[1] ** 0.5)
    here = mx.kernels()
    kernels = {"fma": mx.AVX512 if mx.AVX512 in here else mx.AVX2, "bf16dot": mx.BF16DOT}

    def run(kernel):
        return lambda x: (lambda: mx.mxfp4_linear(x, w, kernel=kernel))

    return {"make_x": lambda T: torch.randn(T, shape[1]).to(torch.bfloat16),
            "runners": {name: run(k) for name, k in kernels.items()}, "keep": w}


def _timed_rows(row_bytes: int) -> int:
    """The largest bucket row count whose input of row_bytes a row stays within TIMED_BYTES (1 at least)."""
    return max([1] + [r for r in BUCKET_ROWS if r * row_bytes <= TIMED_BYTES])


def _attention_runners(shape: tuple[int, int, int, int]) -> dict:
    N, K, H, size = shape
    dt, S, pages = _DTYPES[size], ATTENTION_PAGE, -(-ATTENTION_CONTEXT // ATTENTION_PAGE)
    row_bytes = 2 * pages * S * K * H * size
    most = _timed_rows(row_bytes)
    k_cache, v_cache = (torch.empty(most * pages, S, K, H, dtype=dt).uniform_(-1, 1) for _ in range(2))
    table = torch.randperm(most * pages).view(most, pages)  # each sequence's pages scattered, as served
    lens = torch.full((most,), ATTENTION_CONTEXT, dtype=torch.int64)
    q = torch.empty(most, N, H, dtype=dt).uniform_(-1, 1)
    scale = H ** -0.5
    from kernels.attention import _paged_flash, _paged_native

    def make_x(B):  # the tables are sliced once per bucket, so the per-step layout is reused as by layers
        return q[:B], table[:B], lens[:B]

    return {"make_x": make_x, "row_bytes": row_bytes, "min_s": STEP_MIN_S, "runners": {
        "native": lambda x: (lambda: _paged_native(x[0], k_cache, v_cache, x[1], x[2], scale, None, None)),
        "torch": lambda x: (lambda: _paged_flash(x[0], k_cache, v_cache, x[1], x[2], scale, None, None).to(dt))}}


def _rmsnorm_runners(shape: tuple[int, int]) -> dict:
    D, size = shape
    dt = _DTYPES[size]
    from kernels.rmsnorm import rms_norm_torch

    most = _timed_rows(2 * D * size)
    x, res = torch.empty(2, most, D, dtype=dt).uniform_(-2, 2)
    w = torch.empty(D, dtype=dt).uniform_(0.5, 1.5)

    def torch_path(x, res):
        r = x + res
        return rms_norm_torch(r, w, 1e-6), r

    return {"make_x": lambda T: (x[:T], res[:T]), "row_bytes": 2 * D * size, "min_s": STEP_MIN_S, "runners": {
        "native": lambda xr: (lambda: native.add_rms_norm(xr[0], xr[1], w, 1e-6)),
        "torch": lambda xr: (lambda: torch_path(*xr))}}


def _routing_runners(shape: tuple[int, int, int]) -> dict:
    E, top_k, size = shape
    from kernels.routing import topk_route_torch

    most = _timed_rows(E * size)
    logits = (torch.randn(most, E) * 2).to(_DTYPES[size])
    return {"make_x": lambda T: logits[:T], "row_bytes": E * size, "min_s": STEP_MIN_S, "runners": {
        "native": lambda x: (lambda: native.route_softmax_topk(x, top_k, True, 1.0)),
        "torch": lambda x: (lambda: topk_route_torch(x, top_k, "softmax", True))}}


_RUNNERS = {"gemm": _gemm_runners, "moe": _moe_runners, "skinny": _skinny_runners,
            "int8_moe": _quantised_moe_runners, "fp8_moe": functools.partial(_quantised_moe_runners, codes="fp8"),
            "mxfp4": _mxfp4_runners,
            "attention": _attention_runners, "rmsnorm": _rmsnorm_runners, "routing": _routing_runners}


def time_us(fn, min_s: float = MIN_S) -> float:
    """Microseconds per call of fn, over enough calls to take at least min_s (one call at least)."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return 1e6 * elapsed / calls


def measure(op: str, shapes: list[tuple[int, ...]]) -> Choice:
    """Time op's candidates on each shape at every bucket (the cheap ops: those within TIMED_BYTES on
    every shape) and pick, per bucket, the choosable one with the least time summed over the shapes."""
    setups = [_RUNNERS[op](shape) for shape in shapes]
    names = [c for c in CANDIDATES[op] if all(c in s["runners"] for s in setups)]
    times = {c: [None] * len(BUCKET_ROWS) for c in names}
    losses, last_ratio = {c: 0 for c in names}, {}
    failed = set()
    timed_rows = min(_timed_rows(s["row_bytes"]) if "row_bytes" in s else BUCKET_ROWS[-1] for s in setups)
    for b, rows in enumerate(BUCKET_ROWS):
        if rows > timed_rows:
            break
        live = [c for c in names if losses[c] < 2 and c not in failed]
        total = dict.fromkeys(live, 0.0)
        for setup in setups:
            x = setup["make_x"](rows)
            calls = {c: setup["runners"][c](x) for c in live}
            for c in list(live):
                try:
                    calls[c]()  # warm: first touch of the weights, oneDNN's primitive
                except Exception as e:  # a candidate that cannot run here is dropped, not fatal
                    log.info("kernel candidate %s for %s dropped: %s: %s", c, op, type(e).__name__, e)
                    failed.add(c)
                    live.remove(c)
                    total.pop(c)
            if not any(c in CHOOSABLE[op] for c in live):
                raise RuntimeError(f"no kernel candidate for {op} runs here ({', '.join(sorted(failed))} failed)")
            rounds, min_s = {c: [] for c in live}, setup.get("min_s", MIN_S)
            for r in range(ROUNDS):
                for c in (live if r % 2 == 0 else live[::-1]):
                    rounds[c].append(time_us(calls[c], min_s))
            for c in live:
                total[c] += statistics.median(rounds[c])
        # the best choosable time sets the ratios: it is never dropped, and oneDNN (timed for the table
        # only) is dropped against it too
        best = min(t for c, t in total.items() if c in CHOOSABLE[op])
        for c in total:
            times[c][b] = round(total[c], 1)
            ratio = total[c] / best
            losses[c] = losses[c] + 1 if ratio > LOSING_RATIO and ratio >= last_ratio.get(c, ratio) else 0
            last_ratio[c] = ratio
    times = {c: t for c, t in times.items() if c not in failed}
    if not any(t is not None for c in CHOOSABLE[op] if c in times for t in times[c]):
        raise RuntimeError(f"no choosable kernel for {op} ran here (failed: {sorted(failed)})")
    return Choice(op, [tuple(s) for s in shapes], pick_buckets(op, times), times)


def pick_buckets(op: str, times: dict[str, list[float | None]], among: tuple[str, ...] | None = None) -> list[str]:
    """The candidate of each bucket from op's times: the fastest choosable one (of `among`, default all),
    unless the previous bucket's is within TIE of it; a candidate that changes the numbers (NUMERICS) only
    where it beats every other by more than NUMERICS_MARGIN. A bucket not timed takes the previous pick."""
    among = CHOOSABLE[op] if among is None else among
    picks = []
    for b in range(len(BUCKET_ROWS)):
        timed = {c: times[c][b] for c in among if c in times and times[c][b] is not None}
        if not timed:  # not timed (TIMED_BYTES): the largest timed bucket's pick
            picks.append(picks[-1] if picks else among[0])
            continue
        others = {c: t for c, t in timed.items() if c not in NUMERICS.get(op, ())}
        for c in NUMERICS.get(op, ()):  # (kept only where it wins by the margin)
            if c in timed and others and timed[c] * (1 + NUMERICS_MARGIN) > min(others.values()):
                del timed[c]
        best = min(timed, key=timed.get)
        if picks and picks[-1] in timed and timed[picks[-1]] <= (1 + TIE) * timed[best]:
            best = picks[-1]  # within the timing's noise of the best: keep the previous bucket's kernel
        picks.append(best)
    return picks


def _apply(choice: Choice) -> None:
    if choice.op in native.NATIVE_OR_TORCH:
        native.set_runs_native(choice.op, [p == "native" for p in choice.picks])
        return
    if choice.op in ("int8_moe", "fp8_moe"):
        from kernels import int8
        # from the first bucket after which vnni always won, experts take it; the weight-only picks (every
        # bucket's fastest without vnni: linears and the experts below) give one big kernel and threshold
        picks = choice.picks
        int8.set_moe_vnni(_from_rows(picks) if picks[-1] == "vnni" else 0)
        if "vnni" in picks:
            picks = (pick_buckets(choice.op, choice.times_us, tuple(c for c in CHOOSABLE[choice.op] if c != "vnni"))
                     if choice.times_us else ["fma"] * len(picks))
        int8.set_moe_big({"bf16dot": int8.BF16DOT, "amx": int8.AMX}.get(picks[-1]), _from_rows(picks),
                         choice.op[:-4])
        return
    if choice.op == "mxfp4":
        from kernels.mxfp4_weights import set_bf16dot_rows
        set_bf16dot_rows([p == "bf16dot" for p in choice.picks])
        return
    if choice.op == "skinny":
        from kernels.cpu_linear import set_skinny_native
        set_skinny_native([p == "native" for p in choice.picks])
        return
    for b, pick in enumerate(choice.picks):
        native.set_kernel_choice(_C_OPS[choice.op], b, _C_CANDIDATES[pick])


def _from_rows(picks: list[str]) -> int:
    """The first row count of the first bucket after which every pick is the last bucket's."""
    first = next(b for b in range(len(picks)) if set(picks[b:]) == {picks[-1]})
    return 1 if first == 0 else BUCKET_ROWS[first - 1] + 1


_chosen: dict[str, Choice] = {}  # this process's tables by op


# A candidate's time at a larger row bucket under this share of its time at a smaller one: the
# smaller was disturbed (more rows never take much less work; one thread below a size, two above, made
# 0.7). A table measured while other jobs ran on a 2-core EPYC timed the int8 MoE block's bf16dot at
# 426, 4079, 2199, 2096 us for 1, 2, 3-4, 5-8 rows (quiet: 430, 624, 639, 950), and sent 9-16 rows
# to the slower kernel in every later process. Such a table is measured again, once. Only times from
# DISTURBED_MIN_US count: below it (the tests' toy shapes) either kernel is as good.
DISTURBED_DROP, DISTURBED_MIN_US = 0.6, 200.0


def disturbed(choice: Choice) -> bool:
    """Whether any candidate's times in `choice` fall by more than DISTURBED_DROP from a bucket to a
    larger one (see DISTURBED_DROP)."""
    for times in choice.times_us.values():
        seen = [t for t in times if t is not None and t >= DISTURBED_MIN_US]
        if any(later < DISTURBED_DROP * max(seen[:i]) for i, later in enumerate(seen) if i):
            return True
    return False


def configure(op: str, shapes: list[tuple[int, ...]]) -> Choice | None:
    """Choose op's kernels for these weight shapes (cached, measured or forced) and install the table
    for the whole process. None where op has no kernels to choose between here."""
    if op in ("gemm", "moe") and not native.avx512_bf16() or op in ("skinny", *native.NATIVE_OR_TORCH) \
            and not native.available():
        return None
    if op in ("int8_moe", "fp8_moe"):
        from kernels import fp8_weights, int8
        if not ({int8.BF16DOT, int8.AMX, int8.VNNI} & int8.kernels() if op == "int8_moe"
                else {int8.BF16DOT, int8.AMX} & fp8_weights.kernels()):
            return None  # one candidate: nothing to choose
    if op == "mxfp4":
        from kernels import mxfp4_weights
        if mxfp4_weights.BF16DOT not in mxfp4_weights.kernels():  # one candidate: nothing to choose
            return None
    shapes = sorted({tuple(int(d) for d in s) for s in shapes})
    if not shapes:
        return None
    threads = native.threads()
    forced = _forced()
    if forced is not None and op in forced:
        cand = forced[op] if forced[op] != "amx" or native.amx() else "avx512"
        choice = Choice(op, shapes, [cand] * len(BUCKET_ROWS), source="forced")
    else:
        key = _key(op, shapes, threads)
        cached = None if os.environ.get(ENV_VAR) == "measure" else _load_cache().get(key)
        if cached and (set(cached["picks"]) <= set(CHOOSABLE[op])) and ("amx" not in cached["picks"] or native.amx()):
            choice = Choice(op, shapes, cached["picks"], cached.get("times_us", {}), source="cached")
        else:
            start = time.perf_counter()
            choice = measure(op, shapes)
            if disturbed(choice):  # once: a host that stays busy keeps the second table
                log.warning("kernel choice for %s measured again: a candidate's time fell by more than a third "
                            "from one row bucket to a larger one (other work on the cores?)", op)
                choice = measure(op, shapes)
            _store(key, choice)
            log.info("kernel choice for %s measured in %.1f s", op, time.perf_counter() - start)
    _apply(choice)
    if _chosen.get(op) is None or _chosen[op].picks != choice.picks:
        log.info("kernels for %s on %s (%s, %d threads, %s): %s", op, host()["cpu"], " ".join(host()["isa"]), threads,
                 choice.source, choice.runs())
    _chosen[op] = choice
    return choice


def chosen() -> dict[str, dict]:
    """This process's tables, for reports (the planner's profile, benchmarks): op -> picks by row range,
    the source and the times."""
    return {op: {"runs": c.runs(), "picks": c.picks, "shapes": c.shapes, "source": c.source, "times_us": c.times_us,
                 "bucket_rows": list(BUCKET_ROWS)} for op, c in _chosen.items()}
