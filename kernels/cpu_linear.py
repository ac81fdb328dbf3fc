"""Linear layers for CPU inference with weights pre-packed for oneDNN.

torch's F.linear on the CPU re-lays out the weight on every call; at decode sizes (a few rows per
matmul) that halves the rate at which weights stream from memory. Packing once into oneDNN's
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's CPU freezing does)
measured 1.6-1.8x faster for bf16 and 2-3.7x for float32 at 1-16 rows on our 2-core machines
(bench/results/engine.json). Inference only: packed weights have no autograd.

Legend: T rows, P rows padded (packed_rows), I input features, O output features, E experts.
"""
import functools
import os

# oneDNN's primitive cache and torch's own (ideep's: LRU_CACHE_CAPACITY, 1,024 entries) each keep a
# compiled GEMM per weight shape (not per weight) and row count, ~0.55 MiB a row count between them
# (torch 2.13, oneDNN 3.12). Serving sees every row count from 1 to the token budget, so a float32
# worker grew by that much per new row count, up to ~560 MiB; packed_linear pads the rows to a
# bucket (packed_rows), so each shape compiles a bounded set. oneDNN's cap, read at first use:
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from kernels import native  # noqa: E402

BATCH_HINT = 16  # rows oneDNN picks its blocking for; any row count works
# Rows up to which cpu_linear streams the bf16 copy of float32 weights until kernels/choice.py has
# measured it on this CPU (its "skinny" table, then read on every call). Measured on a 2-core AVX2
# EPYC, 4096 x 1024 weights, against oneDNN's packed float32 GEMM: 1.80x at 1 row, 1.45x at 4, 1.06x
# at 16, 0.93x at 32 and 0.84x at 64 with 2 threads.
SKINNY_MAX_ROWS = 16
# The "skinny" table, read on every float32 linear call: whether the bf16 copy streams at each row
# bucket (native.BUCKET_ROWS). kernels/choice.py replaces it with what it measured.
_SKINNY_NATIVE = [rows <= SKINNY_MAX_ROWS for rows in native.BUCKET_ROWS]


def set_skinny_native(picks: list[bool]) -> None:
    if len(picks) != len(native.BUCKET_ROWS):
        raise ValueError(f"{len(picks)} picks for {len(native.BUCKET_ROWS)} row buckets")
    _SKINNY_NATIVE[:] = picks


def skinny_native(rows: int) -> bool:
    """Whether a float32 linear with a bf16 copy of its weights runs the native bf16 GEMM at `rows`."""
    return _SKINNY_NATIVE[native.bucket(rows)]


@functools.cache
def gemm_is_emulated(dtype: torch.dtype) -> bool:
    """Whether CPU GEMMs in `dtype` lack a native path here: bf16 without AVX-512 BF16/AMX (or
    AVX-NE-CONVERT), fp16 without AVX-512 FP16/AMX-FP16. There torch converts element by element
    (about 1 GFLOP/s on a 2-core AVX2 EPYC, against 130-160 GFLOP/s in float32). The one place that
    decides it: the MoE upcast (kernels/moe.py), packing (below) and `--dtype auto`
    (models/loader.auto_dtype) all ask here."""
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported()


def packing_available(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` can be packed on this CPU: float32 wherever oneDNN is built in;
    bfloat16 only where its GEMMs are native (gemm_is_emulated), which e.g. an AVX2-only EPYC
    lacks: there the reorder raises, and plain F.linear is the fallback."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and not gemm_is_emulated(dtype)


def pack_weight(w_OI: torch.Tensor) -> torch.Tensor:
    """w_OI (float32 or bfloat16, CPU) in oneDNN's blocked layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w_OI.detach().contiguous(), BATCH_HINT)


# The most rows one packed GEMM runs; more run in chunks of this many. From 128 rows a GEMM does 64+
# FLOP per weight byte it reads in float32, far past where any CPU stops waiting on memory: oneDNN's
# float32 rate was flat from 128 to 2,048 rows (AMX Xeon, 2 vCPUs, 4096x1024 and 1024x2048: 199-219
# GFLOP/s). What chunking buys is a bounded set of row counts whatever the token budget, so no later
# load (resumes re-prefilling a whole batch at once) compiles GEMMs that earlier load had not.
PACKED_MAX_ROWS = 256


def packed_rows(rows: int) -> int:
    """The rows a packed GEMM runs for `rows` (at most PACKED_MAX_ROWS): up to 16 as they are, more
    rounded up to one of 8 steps per power of two (17-32 by 2, 33-64 by 4, ...: under 1/8 more rows,
    ~3% more work over a soak's mix), so a weight shape gets at most 16 + 8 * 4 = 48 compiled GEMMs."""
    if rows > PACKED_MAX_ROWS:
        raise ValueError(f"{rows} rows: packed GEMMs run at most {PACKED_MAX_ROWS} (packed_linear chunks)")
    step = 1 << max(0, (rows - 1).bit_length() - 4)
    return -(-rows // step) * step


# Every row count packed_linear hands oneDNN (16 + 8 * 4 of them).
PACKED_ROW_COUNTS = tuple(sorted({packed_rows(r) for r in range(1, PACKED_MAX_ROWS + 1)}))


def compile_packed(w: "CpuWeight", bias_O: torch.Tensor | None = None) -> int:
    """Run w's packed GEMM once at every row count where cpu_linear gives it to oneDNN, so each is
    compiled and cached at start rather than when load first reaches that count (a process's RSS
    then stays flat under any later mix of row counts). The cache is per shape: one weight of each
    shape is enough. Returns the GEMMs run."""
    if w.packed is None:
        return 0
    counts = [r for r in PACKED_ROW_COUNTS if w.half is None or not skinny_native(r)]
    for rows in counts:
        packed_linear(torch.zeros(rows, w.packed.shape[1], dtype=w.packed.dtype), w.packed, bias_O)
    return len(counts)


def packed_linear(x_TI: torch.Tensor, packed: torch.Tensor, bias_O: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for 2-D x with the weight from pack_weight. Rows run in chunks of
    PACKED_MAX_ROWS, the last chunk zero-padded to packed_rows (oneDNN compiles and caches a GEMM per
    row count, see above) and the padding's outputs dropped: each row's result does not depend on the
    others."""
    rows = x_TI.shape[0]
    if rows <= PACKED_MAX_ROWS:
        return _packed_chunk(x_TI, packed, bias_O)
    return torch.cat([_packed_chunk(x_CI, packed, bias_O) for x_CI in x_TI.split(PACKED_MAX_ROWS)])


def _packed_chunk(x_TI: torch.Tensor, packed: torch.Tensor, bias_O: torch.Tensor | None) -> torch.Tensor:
    rows, padded = x_TI.shape[0], packed_rows(x_TI.shape[0])
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x_TI, packed, bias_O, "none", [], "")
    x_PI = torch.cat((x_TI, x_TI.new_zeros(padded - rows, x_TI.shape[1])))  # (F.pad took twice as long)
    return torch.ops.mkldnn._linear_pointwise(x_PI, packed, bias_O, "none", [], "")[:rows]


class CpuWeight:
    """A weight (O, I) prepared for CPU inference. bf16 on a CPU with AVX-512 BF16 (and I even): our
    panels (kernels/native.pack_panels32, run by native.gemm_bf16_panels at any row count), instead
    of oneDNN's packing. Else packed for oneDNN, plus, for float32, a bfloat16 copy when every value
    is a bfloat16 (a bf16 checkpoint served in float32: `--dtype auto` on a CPU that emulates bf16
    GEMMs) and the native kernels run here (kernels/native.py). At the row counts where
    kernels/choice.py measured it faster, cpu_linear streams the bf16 copy, half the bytes of the
    float32 weights; elsewhere oneDNN's float32 GEMM. The copy costs half the float32 weights' memory
    again. Which panel kernel (AVX-512 BF16 or AMX) multiplies the panels is the choice table's.
    `CpuWeight.quantized(kernels.int8.quantize_int8(w))`: int8 codes with per-output-channel scales
    only, for bf16 or float32 activations on any CPU the native library runs on."""

    __slots__ = ("packed", "half", "panels", "int8", "out_features")

    def __init__(self, w_OI: torch.Tensor | None):
        self.packed = self.half = self.panels = self.int8 = None
        if w_OI is None:
            return
        w_OI = w_OI.detach()
        self.out_features = w_OI.shape[0]
        if w_OI.dtype == torch.bfloat16 and w_OI.shape[1] % 2 == 0 and native.avx512_bf16():
            # bf16 on AVX-512 BF16: our panels instead of oneDNN's packing, at every row count
            self.panels = native.pack_panels32(w_OI, w_OI.shape[1])
            return
        self.packed = pack_weight(w_OI)
        if w_OI.dtype == torch.float32 and native.available():
            half = w_OI.to(torch.bfloat16)
            if torch.equal(half.float(), w_OI):
                self.half = half

    @classmethod
    def quantized(cls, q) -> "CpuWeight":
        """A CpuWeight of an int8 weight (kernels/int8.Int8Weight) or an FP8 one (kernels/fp8_weights.Fp8Weight),
        which cpu_linear runs with q.linear()."""
        w = cls(None)
        w.int8, w.out_features = q, q.out_features
        return w


def cpu_linear(x_TI: torch.Tensor, w: CpuWeight, bias_O: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for 2-D x: our panels (bf16), or for float32 x the native bf16 kernel on w's bf16
    copy where kernels/choice.py picked it for this row count, else oneDNN's packed GEMM. They agree
    up to summation order. An int8 weight runs kernels/int8.int8_linear."""
    if w.int8 is not None:
        return w.int8.linear(x_TI, bias_O)
    if w.panels is not None:
        y = native.gemm_bf16_panels(x_TI, w.panels, w.out_features)
        return y if bias_O is None else y.add_(bias_O)
    if w.half is not None and skinny_native(x_TI.shape[0]):
        y = native.gemm_bf16(x_TI, w.half)
        return y if bias_O is None else y.add_(bias_O)
    return packed_linear(x_TI, w.packed, bias_O)


class PackedLinear(nn.Module):
    """Drop-in for an nn.Linear at inference: any leading shape, same result up to summation order."""

    def __init__(self, linear: nn.Linear, weight: CpuWeight | None = None):
        """weight: the CpuWeight to run (CpuWeight.quantized), default linear's weight packed."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.weight = CpuWeight(linear.weight) if weight is None else weight
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class ExpertPanels:
    """One expert's weight for kernels/native.fused_moe_bf16 (bf16 on a CPU with AVX-512 BF16), in
    place of a CpuWeight: `panels` from native.pack_panels32. gate_up=True: w (2I, D) holds the gate
    rows then the up rows; each panel of 32 outputs gets 16 gate rows and the same 16 up rows (each
    half zero-padded to a multiple of 16 rows, I16), so the kernel's epilogue has both to multiply.
    Else w is the down projection (D, I), its inputs zero-padded to I16."""

    __slots__ = ("panels", "out_features", "in_features", "inter_padded")
    half = int8 = None  # (no bf16 copy or codes for cpu_linear: these weights are only the fused kernel's)

    def __init__(self, w: torch.Tensor, gate_up: bool, inter: int):
        w = w.detach().to(torch.bfloat16)
        self.out_features, self.in_features = w.shape
        self.inter_padded = -(-inter // 16) * 16
        if gate_up:
            gate, up = w.chunk(2)
            halves = [torch.zeros(self.inter_padded, w.shape[1], dtype=w.dtype) for _ in range(2)]
            halves[0][:inter], halves[1][:inter] = gate, up
            rows = torch.stack([h.view(-1, 16, w.shape[1]) for h in halves], dim=1)  # (I16/16, 2, 16, D)
            self.panels = native.pack_panels32(rows.reshape(-1, w.shape[1]), w.shape[1])
        else:
            self.panels = native.pack_panels32(w, self.inter_padded)
