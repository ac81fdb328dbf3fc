"""Our C kernels for the CPU, built on first use with the system's C compiler and loaded with ctypes.

Today one kernel: `gemm_bf16`, y = x W^T with W in bfloat16 and x, y in float32, for decode's few
rows (kernels/csrc/skinny_gemm.c; kernels/cpu_linear.py decides when it runs). Building it takes
about half a second (`cc -O3 -mavx2 -mfma -fopenmp`, no torch headers), so a fresh machine pays that
once; the library is cached under $XDG_CACHE_HOME/shuttle (default ~/.cache/shuttle) by the
source's hash, written atomically (worker processes may build it at the same time).

Unavailable (and everything keeps its oneDNN/torch path, with one INFO line saying why) where the
CPU lacks AVX2 + FMA, no C compiler is found, the build fails, or SHUTTLE_NATIVE_KERNELS=0; this
module is the only place that reads that variable. The library links libgomp by its soname, which
the process already has loaded from torch, so its OpenMP threads are torch's own pool.
"""
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("shuttle")
ENV_VAR = "SHUTTLE_NATIVE_KERNELS"
SOURCE = Path(__file__).with_name("csrc") / "skinny_gemm.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shuttle"


def _build(cc: str) -> Path:
    """The compiled library for this source and these flags: built unless already cached."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    for where in (_cache_dir(), Path(tempfile.gettempdir()) / f"shuttle-{os.getuid()}"):
        lib = where / f"skinny_gemm-{digest}.so"
        if lib.exists():
            return lib
        try:
            where.mkdir(parents=True, exist_ok=True)
            tmp = where / f".{lib.name}.{os.getpid()}"
            subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], check=True, capture_output=True, text=True,
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
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("native CPU kernels unavailable: no C compiler (install gcc, or set CC)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.info("native CPU kernels unavailable: building %s failed: %s", SOURCE.name, str(detail).strip()[-500:])
        return None
    fn = lib.shuttle_gemm_bf16
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the native kernels run here (builds them on the first call)."""
    return _library() is not None


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
                                 torch.get_num_threads())
    return y_TO
