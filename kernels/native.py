"""Our C kernels for the CPU, built on first use with the system's C compiler and loaded with ctypes.

- `gemm_bf16`: y = x W^T with W in bfloat16 and x, y in float32, for decode's few rows
  (kernels/csrc/skinny_gemm.c; kernels/cpu_linear.py decides when it runs).
- `paged_decode_attention`: one query token per sequence against a paged bf16 or float32 KV cache
  (values may be narrower than keys; each sequence from its own first visible position), read in
  place (kernels/csrc/paged_attention.c; kernels/attention.py decides when it runs).
- `add_rms_norm`: RMSNorm with the residual add fused, bf16 or float32, one call instead of six torch
  ops (kernels/csrc/rmsnorm.c; kernels/rmsnorm.py decides when it runs).
- `gemm_bf16_panels`: y = x W^T in bf16 with AVX-512 BF16 on W packed by `pack_panels32`, any row
  count (kernels/cpu_linear.CpuWeight holds such panels instead of oneDNN's packing on these CPUs).
- `route_softmax_topk`: softmax routing's top-k choice and weights (kernels/csrc/decode_step.c;
  kernels/routing.py decides when it runs).
- `decode_step` / `decode_attention`: a whole bf16 decode step's layers, or one layer's attention
  side, these kernels in sequence from C (kernels/csrc/decode_step.c; models/native_decode.py builds
  their tables and decides where they run).
- `fused_moe_bf16`: a whole bf16 MoE block (SiLU experts) in one call with AVX-512 BF16's dot
  products (kernels/csrc/moe_avx512bf16.c; models/cpu_inference.PackedExperts decides), on weights
  packed by `pack_panels32`. Compiled with a target attribute, called only where the CPU has
  AVX-512 BF16 (`avx512_bf16()`); everything else in the library needs AVX2 + FMA only.

Every source in kernels/csrc/ goes into one library. Building it takes about a second (`cc -O3
-mavx2 -mfma -fopenmp`, no torch headers), so a fresh machine pays that once; the library is cached
under $XDG_CACHE_HOME/shuttle (default ~/.cache/shuttle) by the sources' hash, written atomically
(worker processes may build it at the same time).

Unavailable (and everything keeps its oneDNN/torch path, with one INFO line saying why) where the
CPU lacks AVX2 + FMA, no C compiler is found, the build fails, or SHUTTLE_NATIVE_KERNELS=0; this
module is the only place that reads that variable. The library links libgomp by its soname, which
the process already has loaded from torch, so its OpenMP threads are torch's own pool.
"""
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("shuttle")
ENV_VAR = "SHUTTLE_NATIVE_KERNELS"
# Row buckets of the kernel tables (the C library's, and kernels/cpu_linear.py's skinny one): bucket
# b holds 2^(b-1) < rows <= 2^b, the last one every larger count. kernels/choice.py fills them.
BUCKET_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.c"))
HEADERS = sorted((Path(__file__).with_name("csrc")).glob("*.h"))  # hashed with the sources
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def bucket(rows: int) -> int:
    """The row bucket of `rows` (>= 1): 0 for 1 row, b for 2^(b-1) < rows <= 2^b, the last open-ended."""
    return min(len(BUCKET_ROWS) - 1, max(rows - 1, 0).bit_length())


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shuttle"


def _digest(cc: str) -> str:
    text = b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join([cc, *FLAGS]).encode()
    return hashlib.sha256(text).hexdigest()[:16]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_digest() -> str:
    """The hash naming this build of the library (its sources, compiler and flags), "" without one."""
    cc = _compiler()
    return _digest(cc) if cc and available() else ""


def _build(cc: str) -> Path:
    """The compiled library for these sources and flags: built unless already cached."""
    digest = _digest(cc)
    for where in (_cache_dir(), Path(tempfile.gettempdir()) / f"shuttle-{os.getuid()}"):
        lib = where / f"shuttle_native-{digest}.so"
        if lib.exists():
            return lib
        try:
            where.mkdir(parents=True, exist_ok=True)
            tmp = where / f".{lib.name}.{os.getpid()}"
            subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(tmp), "-lm"], check=True, capture_output=True, text=True,
                           timeout=120)
            os.replace(tmp, lib)  # atomic: a concurrent builder's copy is as good
            return lib
        except PermissionError:
            continue
    raise PermissionError(f"no writable cache directory for the native kernels ({_cache_dir()})")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (logged once) where they cannot run here."""
    if os.environ.get(ENV_VAR, "1") == "0":
        log.info("native CPU kernels off (%s=0)", ENV_VAR)
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("native CPU kernels unavailable: this CPU has no AVX2 (%s)", torch.backends.cpu.get_cpu_capability())
        return None
    cc = _compiler()
    if cc is None:
        log.info("native CPU kernels unavailable: no C compiler (install gcc, or set CC)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.info("native CPU kernels unavailable: building %s failed: %s", " ".join(s.name for s in SOURCES), str(detail).strip()[-500:])
        return None
    fn = lib.shuttle_gemm_bf16
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int]
    fn = lib.shuttle_fused_moe_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_float, ctypes.c_int])
    fn = lib.shuttle_add_rms_norm
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn = lib.shuttle_gemm_bf16_panels
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int]
    fn = lib.shuttle_rotary
    fn.restype = None
    fn.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 3
                   + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int, ctypes.c_int])
    for name, restype, argtypes in (("shuttle_amx_init", ctypes.c_int, []), ("shuttle_amx_built", ctypes.c_int, []),
                                    ("shuttle_kernel_buckets", ctypes.c_int, []),
                                    ("shuttle_use_amx", ctypes.c_int, [ctypes.c_int, ctypes.c_int64]),
                                    ("shuttle_set_kernel_choice", ctypes.c_int, [ctypes.c_int] * 3)):
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    fn = lib.shuttle_route_softmax_topk
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                   ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    fn = lib.shuttle_decode_step
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn = lib.shuttle_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    fn = lib.shuttle_mtp_draft
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    fn = lib.shuttle_paged_decode_attention
    fn.restype = None
    fn.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4
                   + [ctypes.c_int64] * 12 + [ctypes.c_float] + [ctypes.c_int] * 4)
    for name in ("shuttle_fp8_quantize", "shuttle_fp8_dequantize"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3
    lib.shuttle_fp8_avx512_built.restype = ctypes.c_int
    fn = lib.shuttle_delta_rule_decode
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    fn = lib.shuttle_argmax_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    fn = lib.shuttle_hyper_weights
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_int, ctypes.c_float]
    return lib


_local = threading.local()  # .n: the native kernels' own thread count inside native_parallel_only


def threads() -> int:
    """How many OpenMP threads the native kernels may use: torch's count, or inside
    native_parallel_only the count torch had on entering it."""
    return getattr(_local, "n", None) or torch.get_num_threads()


def passive_waits() -> bool:
    """Whether OpenMP's idle threads sleep (OMP_WAIT_POLICY=passive, as the worker pools run on one
    host: pools/launchers.py), so that each parallel region first wakes them (20-60 us here). The
    C kernels read the same variable (bf16_avx2.h: passive_waits)."""
    return os.environ.get("OMP_WAIT_POLICY", "").lower().startswith("p")


@contextlib.contextmanager
def native_parallel_only(on: bool = True):
    """Within: torch's own ops on one thread, the native kernels on the threads torch had.

    Under passive waits every parallel region pays a wake-up. The native kernels decide per call
    whether a second thread pays for it; torch's small ops do not (a decode layer's softmax over the
    router's logits, the casts and copies around attention: 8-17 of them per step at batch 64 on the
    425M shapes, each waking the pool). For a step whose heavy work is all native (a bf16 decode
    step on an AVX-512 BF16 CPU, or an expert worker's native MoE block), keeping torch on one
    thread measured 1.06x at batch 16 and 1.09x at 64 (interleaved, passive waits, 2 threads);
    with spinning threads it changes nothing. The native count is per thread; torch's is torch's
    (torch.set_num_threads also sets the count that threads starting meanwhile begin with)."""
    n = torch.get_num_threads()
    if not on or n == 1:
        yield
        return
    prev = getattr(_local, "n", None)
    _local.n = prev or n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _local.n = prev


@contextlib.contextmanager
def torch_parallel():
    """Undo native_parallel_only within: for a torch op worth the wake-up (the LM head's cast of
    rows x vocabulary logits)."""
    n, prev = torch.get_num_threads(), getattr(_local, "n", None)
    if prev is None:
        yield
        return
    torch.set_num_threads(prev)
    _local.n = None
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _local.n = prev


def available() -> bool:
    """Whether the native kernels run here (builds them on the first call)."""
    return _library() is not None


def eager_cpu(*tensors: torch.Tensor) -> bool:
    """What every optional native kernel's caller checks before its own dtype and shape checks: the
    tensors are on the CPU, none needs its gradient, torch.compile is not tracing, and the kernels
    run here. (Their ctypes calls are opaque to autograd and to the compiler; the torch path is the
    reference.)"""
    return (all(t.device.type == "cpu" for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and not torch.compiler.is_compiling() and available())


def gemm_bf16(x_TI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """y_TO = x_TI w_OI^T in float32: x float32 (T, I), w bfloat16 (O, I), both contiguous CPU tensors.
    Call only where available() is True."""
    if x_TI.dtype != torch.float32 or w_OI.dtype != torch.bfloat16 or x_TI.shape[-1] != w_OI.shape[1]:
        raise ValueError(f"gemm_bf16 takes float32 x (T, I) and bfloat16 w (O, I); got {x_TI.dtype} "
                         f"{tuple(x_TI.shape)} and {w_OI.dtype} {tuple(w_OI.shape)}")
    x_TI = x_TI.contiguous()
    T, I = x_TI.shape
    y_TO = torch.empty(T, w_OI.shape[0], dtype=torch.float32)
    _library().shuttle_gemm_bf16(x_TI.data_ptr(), w_OI.data_ptr(), y_TO.data_ptr(), T, I, w_OI.shape[0],
                                 threads())
    return y_TO


ATTENTION_DTYPES = (torch.float32, torch.bfloat16)


def paged_decode_attention(q_BKGH: torch.Tensor, k_cache_PSKH: torch.Tensor, v_cache_PSKH: torch.Tensor,
                           table_BM: torch.Tensor, start_B: torch.Tensor, len_B: torch.Tensor,
                           scale: float, wide: bool = True,
                           out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BKGV, lse_BKG): softmax(scale q k^T) v for each sequence's one query token over its cached
    positions [start_B[b], len_B[b]) (at least one), read in place from the pages table_BM names.
    q: float32 or bfloat16, contiguous (bf16 is widened inside: no cast of its own); o in `out_dtype`
    (float32, or bfloat16 rounded to nearest even as torch's cast; default q's dtype), lse float32.
    Caches: one dtype of ATTENTION_DTYPES, keys (P, S, K, H) and values (P, S, K, V) (V may be
    narrower than H: MiMo-V2-Flash), the last dimension contiguous; table, start,
    len: int64, contiguous. lse is the natural-log log-sum-exp of the scaled scores. wide: the
    AVX-512 loops where H % 16 == V % 16 == 0 and the CPU has them (False: the AVX2 ones everywhere;
    tests compare both). Call only where available() is True."""
    B, K, G, H = q_BKGH.shape
    kc, vc = k_cache_PSKH, v_cache_PSKH
    V = vc.shape[-1]
    out_dtype = out_dtype or q_BKGH.dtype
    if (q_BKGH.dtype not in ATTENTION_DTYPES or out_dtype not in ATTENTION_DTYPES or kc.dtype not in ATTENTION_DTYPES
            or vc.dtype != kc.dtype or kc.stride(-1) != 1 or vc.stride(-1) != 1 or not q_BKGH.is_contiguous()
            or any(t.dtype != torch.int64 or not t.is_contiguous() for t in (table_BM, start_B, len_B))
            or kc.shape[:3] != vc.shape[:3] or kc.shape[-1] != H):
        raise ValueError("paged_decode_attention: float32/bf16 contiguous q and output, bf16/float32 caches with "
                         f"contiguous heads (keys of q's head size), int64 tables; got q {q_BKGH.dtype} "
                         f"{tuple(q_BKGH.shape)}, output {out_dtype}, caches {kc.dtype} {tuple(kc.shape)}/{vc.dtype} "
                         f"{tuple(vc.shape)}")
    o_BKGV = torch.empty(B, K, G, V, dtype=out_dtype)
    lse_BKG = torch.empty(B, K, G, dtype=torch.float32)
    _library().shuttle_paged_decode_attention(
        q_BKGH.data_ptr(), kc.data_ptr(), vc.data_ptr(), int(kc.dtype == torch.bfloat16), table_BM.data_ptr(),
        table_BM.shape[1], start_B.data_ptr(), len_B.data_ptr(), o_BKGV.data_ptr(), lse_BKG.data_ptr(), B, K, G, H,
        V, kc.shape[1], kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), scale,
        threads(), int(q_BKGH.dtype == torch.bfloat16), int(out_dtype == torch.bfloat16), int(wide))
    return o_BKGV, lse_BKG


def avx512_bf16() -> bool:
    """Whether fused_moe_bf16 runs here: the library is available and the CPU has AVX-512 BF16 (with
    the BW and VL subsets the kernel's loads and stores use), as /proc/cpuinfo lists them."""
    return available() and _cpu_has_avx512_bf16() and bool(_library().shuttle_avx512bf16_built())


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first value /proc/cpuinfo gives `field` ("" where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[-1].strip() for line in lines if line.split(":", 1)[0].strip() == field), "")


def cpu_flags() -> frozenset[str]:
    """The ISA flags /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    return frozenset(_cpuinfo("flags").split())


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ("" where it cannot be read)."""
    return _cpuinfo("model name")


def _cpu_has_avx512_bf16() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


@functools.cache
def amx() -> bool:
    """Whether the panel kernels can take AMX tiles here (kernels/csrc/amx_bf16.c): AVX-512 BF16
    (their other half), AMX-BF16 and AMX-TILE listed by the CPU, the library built with them, and the
    kernel's permission for the tile state granted to this process. Whether they do, per op and row
    count, is kernels/choice.py's measurement."""
    if not (avx512_bf16() and {"amx_bf16", "amx_tile"} <= cpu_flags() and _library().shuttle_amx_built()):
        return False
    if not _library().shuttle_amx_init():
        log.info("AMX unavailable: the kernel refused this process the tile state (arch_prctl)")
        return False
    return True


GEMM, MOE = 0, 1  # the ops of the choice table (kernels/csrc/amx_bf16.c)
AVX512, AMX = 0, 1  # its entries


def kernel_buckets() -> int:
    """Row-count buckets of the choice table: 1, 2, 3-4, 5-8, ..., the last open-ended."""
    return _library().shuttle_kernel_buckets()


def set_kernel_choice(op: int, bucket: int, which: int) -> int:
    """Set the panel kernels' choice for `op` (GEMM, MOE) at row bucket `bucket` to AVX512 or AMX;
    returns the previous entry. Call only where avx512_bf16() is True (AMX: where amx() is)."""
    was = _library().shuttle_set_kernel_choice(op, bucket, which) if which != AMX or amx() else -1
    if was < 0:
        raise ValueError(f"no choice table entry ({op}, {bucket}) or AMX is not ready here")
    return was


def uses_amx(op: int, rows: int) -> bool:
    """Whether the table sends `rows` rows of `op` to AMX now."""
    return bool(_library().shuttle_use_amx(op, rows))


# Ops with a native kernel and a torch path (the paged decode attention, RMSNorm, softmax routing),
# and per row bucket whether the kernel runs: kernels/choice.py sets them by measurement; until then,
# and where nothing is measured, the kernel wherever it can run. Read on every eager call.
NATIVE_OR_TORCH = ("attention", "rmsnorm", "routing")
_NATIVE_ROWS = {op: [True] * len(BUCKET_ROWS) for op in NATIVE_OR_TORCH}


def set_runs_native(op: str, picks: list[bool]) -> None:
    """Install op's table (one entry per row bucket; True: the native kernel)."""
    if op not in _NATIVE_ROWS or len(picks) != len(BUCKET_ROWS):
        raise ValueError(f"set_runs_native: op {op!r} (one of {NATIVE_OR_TORCH}) takes {len(BUCKET_ROWS)} picks, "
                         f"got {len(picks)}")
    _NATIVE_ROWS[op][:] = picks


def runs_native(op: str, rows: int) -> bool:
    """Whether op (NATIVE_OR_TORCH) takes its native kernel at `rows` rows (attention: sequences)
    where the kernel can take the call; its torch path otherwise."""
    return _NATIVE_ROWS[op][bucket(rows)]


def pack_panels32(w_OI: torch.Tensor, in_features: int) -> torch.Tensor:
    """w (O, I) as fused_moe_bf16's weight panels, bf16: outputs in panels of 32 (zero rows past O),
    inputs zero-padded to in_features (even, >= I) and stored in pairs: (ceil(O/32), in/2, 32, 2)."""
    O, I = w_OI.shape
    P = -(-O // 32)
    padded = torch.zeros(P * 32, in_features, dtype=torch.bfloat16)
    padded[:O, :I] = w_OI
    return padded.view(P, 32, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def fused_moe_bf16(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                   w13_ptrs_E: torch.Tensor, w2_ptrs_E: torch.Tensor, inter_padded: int,
                   limit: float | None = None) -> torch.Tensor:
    """out_TD (bf16) = sum over each token's top-k experts of weight * SiLU-MLP(x), on panels from
    pack_panels32 (w13: 16 gate and the same 16 up rows per panel; w2 over inter_padded inputs), whose
    data pointers w13_ptrs_E / w2_ptrs_E (int64) list. x: bf16 (T, D), D even; ids int64 (ids outside
    [0, E) are skipped); weights float32 or bf16; limit: gate clamped to <= limit and up to [-limit,
    limit] before the SiLU-mul (DeepSeek-V4's swiglu_limit). Call only where avx512_bf16() is True."""
    T, D = x_TD.shape
    if x_TD.dtype != torch.bfloat16 or D % 2 or topk_ids_TK.shape[0] != T:
        raise ValueError(f"fused_moe_bf16 takes bf16 x (T, D) with D even and (T, K) ids; got {x_TD.dtype} "
                         f"{tuple(x_TD.shape)} and ids {tuple(topk_ids_TK.shape)}")
    x_TD = x_TD.contiguous()
    ids_TK = topk_ids_TK.to(torch.int64).contiguous()
    wk_TK = topk_weights_TK.to(torch.float32).contiguous()
    K = ids_TK.shape[1]
    out_TD = torch.zeros(T, D, dtype=torch.bfloat16)
    scratch = torch.empty(T * K, inter_padded, dtype=torch.bfloat16)
    rc = _library().shuttle_fused_moe_bf16(x_TD.data_ptr(), T, D, ids_TK.data_ptr(), wk_TK.data_ptr(), K,
                                           w13_ptrs_E.data_ptr(), w2_ptrs_E.data_ptr(), w13_ptrs_E.numel(),
                                           inter_padded, scratch.data_ptr(), out_TD.data_ptr(),
                                           float("inf") if limit is None else limit, threads())
    if rc != 0:
        raise MemoryError(f"fused_moe_bf16: out of memory for {T} tokens x {K} experts")
    return out_TD


def gemm_bf16_panels(x_TI: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """y_TO = x_TI W^T in bf16 (float32 accumulation, rounded once) for W packed by pack_panels32 with
    in_features = I (even). x: bf16 (T, I). Call only where avx512_bf16() is True."""
    T, I = x_TI.shape
    if x_TI.dtype != torch.bfloat16 or I % 2 or panels.shape[1] * 2 != I:
        raise ValueError(f"gemm_bf16_panels takes bf16 x (T, I) with I even matching the panels' {panels.shape[1] * 2} "
                         f"inputs; got {x_TI.dtype} {tuple(x_TI.shape)}")
    x_TI = x_TI.contiguous()
    y_TO = torch.empty(T, out_features, dtype=torch.bfloat16)
    _library().shuttle_gemm_bf16_panels(x_TI.data_ptr(), T, I, panels.data_ptr(), out_features, y_TO.data_ptr(),
                                        threads())
    return y_TO


def rotary_takes(q_TNR: torch.Tensor, k_TKR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> bool:
    """Whether rotary_ takes these tensors (their shapes, dtypes and strides; not where they live)."""
    if q_TNR.dim() != 3 or k_TKR.dim() != 3:
        return False
    T, R = q_TNR.shape[0], q_TNR.shape[-1]
    return (q_TNR.dtype in (torch.bfloat16, torch.float32) and R % 2 == 0 and k_TKR.shape[::2] == (T, R)
            and all(t.dtype == q_TNR.dtype for t in (k_TKR, cos_TR, sin_TR))
            and q_TNR.stride(-1) == 1 and k_TKR.stride(-1) == 1
            and all(t.shape == (T, R) and t.is_contiguous() for t in (cos_TR, sin_TR)))


def rotary_(q_TNR: torch.Tensor, k_TKR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> None:
    """Rotate q and k in place (neox halves over their last dimension R), rounding as kernels/rotary.py's
    torch ops do. q (T, N, R), k (T, K, R): views whose last dimension is contiguous (the first R dims
    of strided heads); cos, sin: (T, R) contiguous; one dtype, bf16 or float32, on the CPU. Call only
    where available() is True."""
    if not rotary_takes(q_TNR, k_TKR, cos_TR, sin_TR):
        raise ValueError(f"rotary_ takes bf16 or float32 q (T, N, R), k (T, K, R) with contiguous last dims and "
                         f"contiguous (T, R) cos/sin of their dtype, R even; got q {q_TNR.dtype} {tuple(q_TNR.shape)}, "
                         f"k {k_TKR.dtype} {tuple(k_TKR.shape)}, cos {cos_TR.dtype} {tuple(cos_TR.shape)}")
    T, N, R = q_TNR.shape
    _library().shuttle_rotary(q_TNR.data_ptr(), N, q_TNR.stride(0), q_TNR.stride(1), k_TKR.data_ptr(), k_TKR.shape[1],
                              k_TKR.stride(0), k_TKR.stride(1), cos_TR.data_ptr(), sin_TR.data_ptr(), T, R,
                              int(q_TNR.dtype == torch.bfloat16), threads())


def add_rms_norm(x_TD: torch.Tensor, residual_TD: torch.Tensor | None, weight_D: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual), x + residual), or (rms_norm(x), None) without a residual, rounding as
    kernels/rmsnorm.py's torch ops do. x, residual (same shape), weight: one dtype (bf16 or float32),
    contiguous CPU tensors, the last dimension the weight's. Call only where available() is True."""
    D = weight_D.shape[0]
    ok = (x_TD.dtype in (torch.bfloat16, torch.float32) and weight_D.dtype == x_TD.dtype and x_TD.shape[-1] == D
          and x_TD.is_contiguous() and weight_D.is_contiguous()
          and (residual_TD is None or (residual_TD.dtype == x_TD.dtype and residual_TD.shape == x_TD.shape
                                       and residual_TD.is_contiguous())))
    if not ok:
        raise ValueError(f"add_rms_norm takes contiguous bf16 or float32 x, residual and weight of one dtype; got "
                         f"{x_TD.dtype} {tuple(x_TD.shape)} and weight {weight_D.dtype} {tuple(weight_D.shape)}")
    y = torch.empty_like(x_TD)
    r = None if residual_TD is None else torch.empty_like(x_TD)
    _library().shuttle_add_rms_norm(x_TD.data_ptr(), 0 if residual_TD is None else residual_TD.data_ptr(),
                                    weight_D.data_ptr(), y.data_ptr(), 0 if r is None else r.data_ptr(),
                                    x_TD.numel() // max(D, 1), D, eps, int(x_TD.dtype == torch.bfloat16),
                                    threads())
    return y, r


def argmax_rows(x_BV: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x_BV, dim=-1) (int64, B) of float32 rows (B, V), V >= 1, the last dimension contiguous:
    the first index of each row's largest value, or of its first NaN (csrc/argmax.c). Call only where
    available() is True."""
    if x_BV.dtype != torch.float32 or x_BV.dim() != 2 or x_BV.shape[1] < 1 or x_BV.stride(1) != 1:
        raise ValueError(f"argmax_rows takes float32 rows (B, V) with contiguous rows; got {x_BV.dtype} "
                         f"{tuple(x_BV.shape)} strides {x_BV.stride()}")
    B, V = x_BV.shape
    out = torch.empty(B, dtype=torch.int64)
    _library().shuttle_argmax_rows(x_BV.data_ptr(), B, V, x_BV.stride(0), out.data_ptr())
    return out


def delta_rule_decode_(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor,
                       beta_BH: torch.Tensor, states_SHKV: torch.Tensor, slots_B: torch.Tensor,
                       fresh_B: torch.Tensor) -> torch.Tensor:
    """One decode step of the gated delta rule by kernels/csrc/delta_rule.c, each sequence's state
    (row slots_B[b] of states_SHKV, float32 contiguous; zeros first where fresh_B) updated in place:
    kernels/delta_rule.gated_delta_rule_recurrent's result without gathering or writing back the
    states. q, k: (B, Hv, K), L2-normalised (q scaled by K^-1/2) and repeated to the value heads.
    Returns o_BHV float32. Call only where available() is True."""
    B, H, K = q_BHK.shape
    V = v_BHV.shape[-1]
    if not (states_SHKV.dtype == torch.float32 and states_SHKV.is_contiguous() and states_SHKV.shape[1:] == (H, K, V)):
        raise ValueError(f"delta_rule_decode_ takes contiguous float32 states of (S, {H}, {K}, {V}); got "
                         f"{states_SHKV.dtype} {tuple(states_SHKV.shape)}")
    q, k, v, g, beta = (t.float().contiguous() for t in (q_BHK, k_BHK, v_BHV, g_BH, beta_BH))
    slots, fresh = slots_B.to(torch.int64).contiguous(), fresh_B.to(torch.uint8).contiguous()
    out = torch.empty(B, H, V)
    _library().shuttle_delta_rule_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                         states_SHKV.data_ptr(), slots.data_ptr(), fresh.data_ptr(), out.data_ptr(),
                                         B, H, K, V, threads())
    return out


def hyper_weights(mixed_TW: torch.Tensor, base_W: torch.Tensor, scale_3: torch.Tensor, n: int, iters: int,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's hyper-connection weights (pre (T, n), post (T, n), comb (T, n, n), float32) from the
    learned map's output mixed_TW (T, (2 + n) n) by kernels/csrc/hyper.c: models/deepseek_v4's torch
    path in one pass. Call only where available() is True."""
    T = mixed_TW.shape[0]
    mixed, base, scale = (t.float().contiguous() for t in (mixed_TW, base_W, scale_3))
    pre, post, comb = torch.empty(T, n), torch.empty(T, n), torch.empty(T, n, n)
    _library().shuttle_hyper_weights(mixed.data_ptr(), base.data_ptr(), scale.data_ptr(), pre.data_ptr(),
                                     post.data_ptr(), comb.data_ptr(), T, n, iters, eps)
    return pre, post, comb


@functools.cache
def fp8_avx512() -> bool:
    """Whether fp8_quantize / fp8_dequantize take their AVX-512 loops here: compiled in, and the CPU lists
    AVX-512 F, BW and VL."""
    return available() and bool(_library().shuttle_fp8_avx512_built()) and {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags()


def fp8_quantize(x_TD: torch.Tensor, avx512: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/fp8.quantize_fp8 by kernels/csrc/fp8.c: x (T, D) bf16 or float32 on the CPU (made
    contiguous), over threads() threads once large enough. avx512: the AVX-512 loops (same bits) where they run
    here (fp8_avx512()); None: wherever they run. Call only where available() is True."""
    if x_TD.dtype not in (torch.bfloat16, torch.float32) or x_TD.dim() != 2:
        raise ValueError(f"fp8_quantize takes (T, D) bf16 or float32 rows, got {x_TD.dtype} {tuple(x_TD.shape)}")
    x = x_TD.contiguous()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty((x.shape[0], 1), dtype=x.dtype)
    _library().shuttle_fp8_quantize(x.data_ptr(), q.data_ptr(), scale.data_ptr(), x.shape[0], x.shape[1],
                                    int(x.dtype == torch.bfloat16), int(fp8_avx512() and avx512 is not False), threads())
    return q, scale


def fp8_dequantize(q_TD: torch.Tensor, scale_T1: torch.Tensor, avx512: bool | None = None) -> torch.Tensor:
    """kernels/fp8.dequantize_fp8 by kernels/csrc/fp8.c: q (T, D) float8_e4m3fn, scale (T, 1) bf16 or
    float32 on the CPU; avx512 as fp8_quantize's. Call only where available() is True."""
    if q_TD.dtype != torch.float8_e4m3fn or q_TD.dim() != 2 or scale_T1.shape != (q_TD.shape[0], 1) \
            or scale_T1.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_dequantize takes (T, D) float8_e4m3fn and (T, 1) bf16 or float32 scales, got "
                         f"{q_TD.dtype} {tuple(q_TD.shape)} and {scale_T1.dtype} {tuple(scale_T1.shape)}")
    q, scale = q_TD.contiguous(), scale_T1.contiguous()
    x = torch.empty(q.shape, dtype=scale.dtype)
    _library().shuttle_fp8_dequantize(q.data_ptr(), scale.data_ptr(), x.data_ptr(), q.shape[0], q.shape[1],
                                      int(scale.dtype == torch.bfloat16), int(fp8_avx512() and avx512 is not False),
                                      threads())
    return x


def decode_attention(step, layer, index: int, x_ptr: int) -> None:
    """Layer `index`'s attention side of kernels/csrc/decode_step.c (an attention worker's layers,
    whose experts are remote): step and layer built by models/native_decode.py, passed by reference;
    x_ptr the layer's input rows. Call only where avx512_bf16() is True."""
    _step_error("decode_attention", _library().shuttle_decode_attention(step, layer, index, x_ptr))


def decode_step(step, layers, num_layers: int) -> None:
    """Run kernels/csrc/decode_step.c on a step and layer tables built by models/native_decode.py
    (ctypes structures, passed by reference). Call only where avx512_bf16() is True."""
    _step_error("decode_step", _library().shuttle_decode_step(step, layers, num_layers))


def mtp_draft(step, layers, mtp, passes: int, drafts_ptr: int) -> None:
    """Run kernels/csrc/decode_step.c's shuttle_mtp_draft: `passes` passes of an MTP layer and its head
    (tables built by models/mtp.py, passed by reference), drafts (argmax, or drawn from q) into drafts_ptr. Call only
    where avx512_bf16() is True."""
    _step_error("mtp_draft", _library().shuttle_mtp_draft(step, layers, mtp, passes, drafts_ptr))


def _step_error(name: str, rc: int) -> None:
    if rc == -2:
        raise RuntimeError(f"{name}: a kernel of the step cannot run here (built without AVX-512 BF16, or the "
                           "kernel of an int8 / FP8 linear or MoE block)")
    if rc != 0:
        raise MemoryError(f"{name}: out of memory in an int8 / FP8 linear or the MoE block")


def route_softmax_topk(logits_TE: torch.Tensor, top_k: int, renormalize: bool,
                       scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights_TK float32, ids_TK int64): softmax over contiguous bf16 or float32 logits (T, E) in
    float32, the top_k largest (ties: the lowest id), renormalised to sum 1 if asked, times scaling.
    Call only where available() is True."""
    T, E = logits_TE.shape
    if logits_TE.dtype not in (torch.bfloat16, torch.float32) or not logits_TE.is_contiguous() or not 1 <= top_k <= E:
        raise ValueError(f"route_softmax_topk takes contiguous bf16 or float32 logits (T, E) and 1 <= top_k <= E; got "
                         f"{logits_TE.dtype} {tuple(logits_TE.shape)}, top_k={top_k}")
    ids_TK = torch.empty(T, top_k, dtype=torch.int64)
    weights_TK = torch.empty(T, top_k, dtype=torch.float32)
    _library().shuttle_route_softmax_topk(logits_TE.data_ptr(), int(logits_TE.dtype == torch.bfloat16), T, E, top_k,
                                          int(renormalize), scaling, ids_TK.data_ptr(), weights_TK.data_ptr())
    return weights_TK, ids_TK
