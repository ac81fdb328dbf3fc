"""MXFP4 weights kept as shipped on the CPU: E2M1 codes, 4 bits a weight, with one E8M0 scale byte per
output row and block of 32 inputs (OCP microscaling: gpt-oss's published experts, kernels/quant.py's
MXFP4_BLOCK, FP4_VALUES), multiplied by C kernels that decode them in registers
(kernels/csrc/mxfp4_gemm.c, in the native library).

- `Mxfp4Weight.from_checkpoint(blocks, scales)`: a checkpoint's `X_blocks` (O, G, 16) uint8 (two codes
  a byte, input 2j in the low nibble of byte j of its block) and `X_scales` (O, G) uint8, the bytes
  moved into the kernels' panels bit for bit (no requantisation); `Mxfp4Weight.quantize(w)` quantises
  a float weight with quantize_mxfp4 first. 17 bytes per 32 weights: 0.27x bf16's bytes, 0.53x int8's.
- `mxfp4_linear(x, w, bias)`: y = x W^T (+ bias), W = FP4 value * 2^(e - 127), for bf16 or float32 x
  (y in x's dtype), any row count, any O; I a multiple of 32 (the weight refuses others).
  `mxfp4_linear_reference`: torch, x.float() @ dequantize_mxfp4(blocks, scales)^T in float32.

Panels: (P, G, 16, 16) uint8, element [p, g, j, o] = the checkpoint's byte j of block g of row 16p + o
(codes of inputs 32g + 2j and 32g + 2j + 1), so that 16 bytes hold one input pair of 16 rows;
scales (P, G, 16) uint8, [p, g, o] = row 16p + o's scale byte of block g. Rows past O: code 0,
scale 127. The scale byte 0xFF (E8M0's NaN) is refused.

Kernels (kernels/int8.py's numbers; `kernels()` lists those that run here). Every value is an FP4
value times a power of two, exact in float32 and, but for exponents past bf16's normal range, in bf16:
  AVX2, AVX512  float32 x (bf16 x widened once): 16 bytes of a panel zero-extended to 16 lanes index
           a 16-entry table of FP4 values (vpermps reads the low nibble; a shift by 4, the high one;
           AVX2's vpermps takes 8 entries: the magnitudes, the sign bit moved in apart), FMA against
           broadcast x into per-block partial sums, scaled by the block's 16 row scales (a shift of the
           bytes into float32's exponent field). Equal to the reference up to float32 summation order.
  BF16DOT  bf16 x only: each panel decoded once per block of rows into a bf16 copy with the scales
           folded in (by the first tile of rows, as it dots them), then AVX-512 BF16 dot products
           (int8_panels.h's rows_bf), float32 accumulation.
For float32 x AVX512 where it runs, else AVX2; for bf16 x the same, or BF16DOT at the row counts where
kernels/choice.py measured it faster ("mxfp4", per weight shape of the packed model: choose_kernels).
There is no MXFP4 AMX kernel. Where none runs (no AVX2, no library, autograd, torch.compile)
mxfp4_linear is the torch reference.

Experts: models/cpu_inference.PackedExperts (quantization "mxfp4") keeps each expert's gate/up and down
weights as Mxfp4Weights (`Mxfp4Experts`), and `fused_moe_mxfp4` runs a layer's block in one native call
(kernels/csrc/moe_int8.c: the int8 / FP8 block's one parallel region): kernels/moe.fused_moe_packed's
ops on mxfp4_linear, biases and gpt-oss's clamped activation included, without its torch ops and Python
per expert.

Legend: T rows, I input features, O output features, P panels of PANEL rows, G blocks of 32 inputs.
"""
import ctypes
import functools

import torch

from kernels import int8, native
from kernels.int8 import AVX2, AVX512, BF16DOT, PANEL  # noqa: F401 (the kernels' names)
from kernels.quant import MXFP4_BLOCK, dequantize_mxfp4, quantize_mxfp4

UNIT_SCALE = 127  # the E8M0 byte of 2^0: rows past O
# Whether bf16 x takes BF16DOT at each row bucket (native.BUCKET_ROWS): kernels/choice.py's "mxfp4"
# table where it measured one, else never (the FMA kernel, as int8_linear's default without AMX).
_BF16DOT_ROWS = [False] * len(native.BUCKET_ROWS)


def set_bf16dot_rows(picks: list[bool]) -> None:
    """The measured table (kernels/choice.py): BF16DOT for bf16 x at the buckets marked True."""
    if len(picks) != len(native.BUCKET_ROWS):
        raise ValueError(f"{len(picks)} picks for {len(native.BUCKET_ROWS)} row buckets")
    _BF16DOT_ROWS[:] = picks


class Mxfp4Weight:
    """A weight (O, I) as MXFP4 codes and E8M0 scales in the kernels' panels (see the module's doc)."""

    __slots__ = ("panels", "scales", "out_features", "in_features")

    def __init__(self, panels: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int):
        self.panels, self.scales = panels, scales
        self.out_features, self.in_features = out_features, in_features

    @classmethod
    def from_checkpoint(cls, blocks_OGB: torch.Tensor, scales_OG: torch.Tensor) -> "Mxfp4Weight":
        """A checkpoint's MXFP4 weight: blocks (O, G, 16) uint8 and scales (O, G) uint8, bit for bit."""
        if blocks_OGB.dtype != torch.uint8 or blocks_OGB.dim() != 3 or blocks_OGB.shape[2] != MXFP4_BLOCK // 2:
            raise ValueError(f"Mxfp4Weight: blocks uint8 (O, G, 16); got {blocks_OGB.dtype} {tuple(blocks_OGB.shape)}")
        if scales_OG.dtype != torch.uint8 or tuple(scales_OG.shape) != tuple(blocks_OGB.shape[:2]):
            raise ValueError(f"Mxfp4Weight: scales uint8 {list(blocks_OGB.shape[:2])} for blocks "
                             f"{list(blocks_OGB.shape)}; got {scales_OG.dtype} {list(scales_OG.shape)}")
        if scales_OG.eq(0xFF).any():
            raise ValueError("Mxfp4Weight: NaN scales (E8M0 byte 0xFF) in the weight")
        O, G = scales_OG.shape
        P = -(-O // PANEL)
        blocks = blocks_OGB.new_zeros(P * PANEL, G, MXFP4_BLOCK // 2)
        blocks[:O] = blocks_OGB
        scales = scales_OG.new_full((P * PANEL, G), UNIT_SCALE)
        scales[:O] = scales_OG
        panels = blocks.view(P, PANEL, G, MXFP4_BLOCK // 2).permute(0, 2, 3, 1).contiguous()
        return cls(panels, scales.view(P, PANEL, G).transpose(1, 2).contiguous(), O, G * MXFP4_BLOCK)

    @classmethod
    def quantize(cls, w_OI: torch.Tensor, rows_per_chunk: int = 256) -> "Mxfp4Weight":
        """A float weight (O, I), I a multiple of 32, quantised by quantize_mxfp4 (rows_per_chunk rows at a
        time: its temporaries are 64 bytes a weight), then from_checkpoint."""
        if w_OI.dim() != 2 or w_OI.shape[1] % MXFP4_BLOCK or not w_OI.is_floating_point():
            raise ValueError(f"Mxfp4Weight: a float weight (O, I) with I a multiple of {MXFP4_BLOCK}; got "
                             f"{w_OI.dtype} {list(w_OI.shape)}")
        w_OI = w_OI.detach()
        parts = [quantize_mxfp4(w_OI[o0:o0 + rows_per_chunk]) for o0 in range(0, w_OI.shape[0], rows_per_chunk)]
        return cls.from_checkpoint(torch.cat([b for b, _ in parts]), torch.cat([s for _, s in parts]))

    def checkpoint(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks (O, G, 16), scales (O, G)) uint8: from_checkpoint's arguments, bit for bit (copies)."""
        P, G = self.scales.shape[:2]
        blocks = self.panels.permute(0, 3, 1, 2).reshape(P * PANEL, G, MXFP4_BLOCK // 2)
        return blocks[:self.out_features], self.scales.transpose(1, 2).reshape(P * PANEL, G)[:self.out_features]

    def dequantize(self) -> torch.Tensor:
        """FP4 value * 2^(e - 127), (O, I) float32: dequantize_mxfp4's values."""
        return dequantize_mxfp4(*self.checkpoint())

    @property
    def nbytes(self) -> int:
        """Bytes held: the codes (half a byte a weight) and the scale bytes."""
        return self.panels.numel() + self.scales.numel()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """mxfp4_linear(x, self, bias)."""
        return mxfp4_linear(x, self, bias)


def mxfp4_linear_reference(x: torch.Tensor, w: Mxfp4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path: x.float() @ dequantised W^T (+ bias) in float32, returned in x's dtype."""
    return int8.int8_linear_reference(x, w, bias)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """int8's library (kernels/int8.py: the native library) with the MXFP4 entry point's signature set."""
    lib = int8._library()
    if lib is None:
        return None
    fn = lib.shuttle_mxfp4_linear
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3
                   + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int])
    fn = lib.shuttle_fused_moe_mxfp4
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_int64]
                   + [ctypes.c_float] * 3 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p])
    return lib


def kernels() -> frozenset[int]:
    """The kernels that run here: int8's AVX2, AVX512 and BF16DOT where they run (same ISA, same build)."""
    return frozenset() if _library() is None else int8.kernels() & {AVX2, AVX512, BF16DOT}


def available() -> bool:
    """Whether an MXFP4 kernel runs here for float32 x (the native library: AVX2, or AVX-512)."""
    return bool(kernels() & {AVX2, AVX512})


def mxfp4_linear(x: torch.Tensor, w: Mxfp4Weight, bias: torch.Tensor | None = None,
                 kernel: int | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) in x's dtype (bfloat16 or float32), W = FP4 value * 2^(e - 127), float32
    accumulation, rounded once: x (..., I) on the CPU, bias (O,) of any float dtype. kernel: AVX2, AVX512
    or BF16DOT (bf16 x only), one of kernels(); by default AVX512 where it runs, else AVX2, and for bf16
    x BF16DOT at the row counts where kernels/choice.py measured it faster. The
    torch reference where the kernels are unavailable, for other dtypes, and where autograd or
    torch.compile needs it."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"mxfp4_linear: x has {x.shape[-1]} input features, the weight {w.in_features}")
    if x.dtype not in (torch.bfloat16, torch.float32) or not (int8._eager_cpu(x, bias) and available()):
        return mxfp4_linear_reference(x, w, bias)
    lead, I, O = x.shape[:-1], w.in_features, w.out_features
    x_TI = x.reshape(-1, I).contiguous()
    T = x_TI.shape[0]
    here = kernels()
    if kernel is None:
        bf16dot = x.dtype == torch.bfloat16 and BF16DOT in here and _BF16DOT_ROWS[native.bucket(T)]
        kernel = BF16DOT if bf16dot else AVX512 if AVX512 in here else AVX2
    else:
        int8.check_kernel(kernel, here, x.dtype, "mxfp4_linear")
    y_TO = torch.empty(T, O, dtype=x.dtype)
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    bf16 = int(x.dtype == torch.bfloat16)
    rc = _library().shuttle_mxfp4_linear(x_TI.data_ptr(), bf16, T, I, w.panels.data_ptr(), w.scales.data_ptr(),
                                         0 if b is None else b.data_ptr(), O, y_TO.data_ptr(), bf16, native.threads(),
                                         kernel)
    if rc == -1:
        raise MemoryError(f"mxfp4_linear: out of memory for the buffers of {T} x {I} activations")
    if rc != 0:
        raise RuntimeError(f"mxfp4_linear: the library cannot run kernel {kernel} on I = {I} ({rc})")
    return y_TO.view(*lead, O)


class Mxfp4Experts:
    """One layer's E experts for the fused MXFP4 block (fused_moe_mxfp4): w13_E (2I, D) and w2_E (D, I)
    Mxfp4Weights, their biases b13_EI2 / b2_ED (any float dtype, or None) and the SwiGLU `act`
    (kernels/moe.py). `table` (4, E) int64: every expert's gate/up codes and scales and down codes and
    scales; `biases` (2, E) int64: their float32 biases' addresses (None without biases). The tensors
    they point at are kept here."""

    __slots__ = ("w13_E", "w2_E", "hidden", "inter", "act", "table", "biases", "_b13", "_b2")

    def __init__(self, w13_E: list, w2_E: list, b13_EI2: torch.Tensor | None = None,
                 b2_ED: torch.Tensor | None = None, act=None):
        from kernels.moe import SILU

        if not w13_E or len(w13_E) != len(w2_E):
            raise ValueError(f"Mxfp4Experts: {len(w13_E)} gate/up and {len(w2_E)} down weights")
        self.w13_E, self.w2_E, self.act = list(w13_E), list(w2_E), SILU if act is None else act
        self.hidden, self.inter = w13_E[0].in_features, w2_E[0].in_features
        D, I = self.hidden, self.inter
        if any((w.out_features, w.in_features) != (2 * I, D) for w in self.w13_E) or any(
                (w.out_features, w.in_features) != (D, I) for w in self.w2_E):
            raise ValueError(f"Mxfp4Experts: every expert needs a gate/up weight (2I, D) and a down weight (D, I) of "
                             f"one D and I; the first is ({2 * I}, {D}) / ({D}, {I})")
        self.table = torch.tensor([[w.panels.data_ptr() for w in self.w13_E], [w.scales.data_ptr() for w in self.w13_E],
                                   [w.panels.data_ptr() for w in self.w2_E], [w.scales.data_ptr() for w in self.w2_E]],
                                  dtype=torch.int64)
        self._b13 = None if b13_EI2 is None else b13_EI2.detach().to(torch.float32).contiguous()
        self._b2 = None if b2_ED is None else b2_ED.detach().to(torch.float32).contiguous()
        self.biases = None
        if self._b13 is not None or self._b2 is not None:
            self.biases = torch.tensor([[0 if b is None else b[e].data_ptr() for e in range(len(self.w13_E))]
                                        for b in (self._b13, self._b2)], dtype=torch.int64)

    @property
    def num_experts(self) -> int:
        return len(self.w13_E)


def moe_kernels() -> tuple[int, torch.Tensor]:
    """(kernel, bf16dot_rows) that fused_moe_mxfp4 runs by default: the FMA kernel (AVX-512, else AVX2),
    and per row bucket a uint8 1 where bf16 rows take BF16DOT (the measured table, where it runs here;
    the caller keeps the tensor alive while C reads it)."""
    here = kernels()
    flags = torch.tensor(_BF16DOT_ROWS if BF16DOT in here else [False] * len(_BF16DOT_ROWS), dtype=torch.uint8)
    return (AVX512 if AVX512 in here else AVX2), flags


def fused_moe_mxfp4_reference(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                              experts: Mxfp4Experts) -> torch.Tensor:
    """kernels/moe.fused_moe_packed on the experts' Mxfp4Weight linears (mxfp4_linear per expert)."""
    from kernels.cpu_linear import CpuWeight
    from kernels.moe import fused_moe_packed

    w13 = [CpuWeight.quantized(w) for w in experts.w13_E]
    w2 = [CpuWeight.quantized(w) for w in experts.w2_E]
    return fused_moe_packed(x_TD, w13, w2, topk_weights_TK, topk_ids_TK, b13_EI2=experts._b13, b2_ED=experts._b2,
                            act=experts.act)


def fused_moe_mxfp4(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                    experts: Mxfp4Experts, kernel: int | None = None) -> torch.Tensor:
    """y_TD (x's dtype) = sum over each token's top-k experts of weight * act-MLP(x) (biases included) on
    MXFP4 experts, in one native call (kernels/csrc/moe_int8.c): fused_moe_mxfp4_reference's ops and
    roundings. x: bf16 or float32 (T, D); ids (T, K) integers (ids outside [0, E) are skipped); weights
    (T, K) float32 or bf16. kernel: AVX2, AVX512 or BF16DOT (bf16 x only) for every expert; by default
    the FMA kernel, and BF16DOT for an expert with as many rows as the measured table's last run of
    BF16DOT buckets starts at (moe_kernels). The reference where the kernels are unavailable, for
    other dtypes, and where autograd or torch.compile needs it."""
    T, D = x_TD.shape
    int8.check_moe_args("fused_moe_mxfp4", x_TD, topk_ids_TK, topk_weights_TK, experts.hidden)
    if x_TD.dtype not in (torch.bfloat16, torch.float32) or not (int8._eager_cpu(x_TD, topk_weights_TK)
                                                                   and available()):
        return fused_moe_mxfp4_reference(x_TD, topk_ids_TK, topk_weights_TK, experts)
    small, table = moe_kernels()
    if kernel is not None:
        int8.check_kernel(kernel, kernels(), x_TD.dtype, "fused_moe_mxfp4")
        small, table = (small, torch.ones_like(table)) if kernel == BF16DOT else (kernel, torch.zeros_like(table))
    x_TD = x_TD.contiguous()
    ids_TK = topk_ids_TK.to(torch.int64).contiguous()
    wk_TK = topk_weights_TK.to(torch.float32).contiguous()
    y_TD = torch.empty(T, D, dtype=x_TD.dtype)
    act, b = experts.act, experts.biases
    rc = _library().shuttle_fused_moe_mxfp4(
        x_TD.data_ptr(), int(x_TD.dtype == torch.bfloat16), T, D, ids_TK.data_ptr(), wk_TK.data_ptr(), ids_TK.shape[1],
        *(experts.table[i].data_ptr() for i in range(4)), *((None, None) if b is None else (b[0].data_ptr(), b[1].data_ptr())),
        experts.num_experts, experts.inter, act.alpha, float("inf") if act.limit is None else act.limit, act.up_offset,
        y_TD.data_ptr(), native.threads(), small, table.data_ptr())
    if rc == -1:
        raise MemoryError(f"fused_moe_mxfp4: out of memory for {T} tokens x {ids_TK.shape[1]} experts")
    if rc != 0:
        raise RuntimeError(f"fused_moe_mxfp4: the library cannot run the MXFP4 kernels ({rc})")
    return y_TD
