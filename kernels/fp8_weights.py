"""FP8 block-quantised weights kept as FP8 at rest on the CPU: E4M3 codes with one float32 scale per
block of the weight (a checkpoint's `weight_scale_inv`, kernels/quant.py), multiplied by the int8
kernels' loops with an FP8 decode in registers (kernels/csrc/int8_panels.h, int8_gemm.c, moe_int8.c).

- `Fp8Weight.from_checkpoint(w, scale_inv, block)`: a checkpoint's float8_e4m3fn weight (O, I) and its
  scale_inv (ceil(O / bo), ceil(I / bi)), the codes copied bit for bit into int8.py's panels (no
  requantisation); `Fp8Weight.quantize(w, block)` quantises a float weight with quantize_fp8_blocks
  first. Codes and scales only: a quarter of float32's bytes, half of bf16's, as int8.
- `fp8_linear(x, w, bias)`: y = x W^T (+ bias), W = code * scale_inv of its block, for bf16 or float32
  x (y in x's dtype), any row count and any I, O (partial edge blocks). `fp8_linear_reference`: torch,
  x.float() @ dequantize_fp8_blocks(w, scale_inv, block)^T in float32.

Kernels (int8.py's constants; `kernels()` lists those that run here). Each sums a panel's products
over one block of bi inputs in float32, then adds that partial sum times the block's scale; every
product is exact, so all four equal the reference up to float32 summation order. Except BF16DOT from
FOLD_ROWS rows (a linear's call, an expert's block of rows in the MoE): it decodes each block's codes
with the block's scale folded in, code * scale rounded to bf16 once (the checkpoint dequantised to
bf16, `fp8_linear_reference(..., folded=True)`), so no tile scales its sums per block (kernels/csrc/
int8_panels.h: rows_bf):
  AVX2, AVX512  decode 8 / 16 codes to float32 in registers (the E4M3 bits moved into an IEEE half,
                vcvtph2ps: exact) and FMA them against float32 x (bf16 x widened once). AVX2 needs
                F16C (every AVX2 CPU has it; checked all the same).
  BF16DOT, AMX  bf16 x only: each panel decoded once per block of rows into a bf16 copy (E4M3 values
                are exact in bf16), then AVX-512 BF16 dot products or AMX-BF16 tiles; AMX stores its
                tiles once per input block to scale them, so it takes blocks of whole k-steps (bi a
                multiple of 32, as 128 is; elsewhere AVX512 runs instead).
A panel of 16 outputs lies inside one block of bo rows (bo a multiple of 16, as 128 is), so within a
block of bi inputs its scale is one scalar: `scales` holds (panels, input blocks). The codes 0x7F and
0xFF (E4M3's NaNs) are refused: the decode would read them as +-480, and weights have none
(quantize_fp8_blocks saturates at 448).

The fused MoE block (the int8 block's contract, kernels/int8.fused_moe_int8): `Fp8ExpertPanels` (an
expert's gate/up rows interleaved as Int8ExpertPanels interleaves them, or its down projection),
`Fp8Experts` (a layer's experts and the kernel's table), `fused_moe_fp8(x, ids, weights, experts)`, and
`fused_moe_fp8_reference` (fused_moe_packed's ops on fp8_linear) where the kernels are unavailable.

Legend: T rows, I input features, O output features, P panels of PANEL outputs, Ip I rounded up to
even, NB input blocks ceil(I / bi); in the MoE block D hidden, I intermediate, K experts per token, E
experts.
"""
import ctypes
import functools

import torch

from kernels import int8, native
from kernels.int8 import AMX, AVX2, AVX512, BF16DOT, PANEL, PanelExperts  # noqa: F401 (the kernels' names)
from kernels.quant import fp8_block_scale_shape, quantize_fp8_blocks

E4M3 = torch.float8_e4m3fn
# Rows from which bf16 x takes AMX where it runs: int8's threshold. On the 2-core AMX Xeon, 1 thread,
# 4096 x 14336 (loaded host): FMA 7.1 / 10.7 ms, AMX 8.2 / 9.0 ms at 4 / 8 rows; FP8's FMA decode costs
# ~20-35% more than int8's widening, its AMX ~20% more (tiles stored once per 128 inputs).
AMX_MIN_ROWS = int8.AMX_MIN_ROWS


class Fp8Weight:
    """A weight (O, I) as E4M3 codes in int8.py's panels and float32 block scales.

    panels: uint8 (P, Ip / 2, PANEL, 2), the codes' bytes (int8.to_panels); scales: float32 (P, NB),
    panel p's scale_inv for each block of `block_in` inputs (its rows' block). Rows past O and the input
    past an odd I are code 0."""

    __slots__ = ("panels", "scales", "block_in", "out_features", "in_features")

    def __init__(self, panels: torch.Tensor, scales: torch.Tensor, block_in: int, out_features: int,
                 in_features: int):
        self.panels, self.scales, self.block_in = panels, scales, block_in
        self.out_features, self.in_features = out_features, in_features

    @classmethod
    def from_checkpoint(cls, w_OI: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> "Fp8Weight":
        """A checkpoint's float8_e4m3fn weight (O, I) and its float scale_inv (ceil(O / bo), ceil(I / bi)),
        the codes copied bit for bit. bo: a multiple of 16; bi: even."""
        codes, rows = _checkpoint_rows(w_OI, scale_inv, block)
        return cls.from_rows(codes, rows, block[1])

    @classmethod
    def quantize(cls, w_OI: torch.Tensor, block: tuple[int, int] = (128, 128)) -> "Fp8Weight":
        """A float weight (O, I) quantised by quantize_fp8_blocks (E4M3), then from_checkpoint."""
        q, scale_inv = quantize_fp8_blocks(w_OI.detach(), block, E4M3)
        return cls.from_checkpoint(q, scale_inv, block)

    @classmethod
    def from_rows(cls, codes_OI: torch.Tensor, row_scales_ON: torch.Tensor, block_in: int,
                  real_O: torch.Tensor | None = None) -> "Fp8Weight":
        """Codes (O, I) (E4M3 or their uint8 bytes) whose row o has the scale row_scales[o, b] in input block
        b; every real row (real_O, default all) of a panel must have its panel's first row's scales."""
        O, I = codes_OI.shape
        P, NB = -(-O // PANEL), -(-I // block_in)
        if block_in < 2 or block_in % 2 or row_scales_ON.shape != (O, NB):
            raise ValueError(f"Fp8Weight: blocks of an even number of inputs and (O, {NB}) row scales; got "
                             f"{block_in} inputs, row scales {tuple(row_scales_ON.shape)}")
        rows = torch.zeros(P * PANEL, NB, dtype=torch.float32)
        rows[:O] = row_scales_ON
        scales = rows[::PANEL].contiguous()
        real = torch.zeros(P * PANEL, dtype=torch.bool)
        real[:O] = True if real_O is None else real_O
        if not torch.equal(rows[real], scales.repeat_interleave(PANEL, 0)[real]):
            raise ValueError("Fp8Weight: the 16 rows of a panel need one scale per input block (blocks of a "
                             "multiple of 16 rows)")
        return cls(int8.to_panels(codes_OI.view(torch.uint8)), scales, block_in, O, I)

    @classmethod
    def stack(cls, weights: list["Fp8Weight"]) -> "Fp8Weight":
        """The weights' rows one after another (fused q/k/v): one input block size and input count;
        ValueError where a panel of 16 rows would straddle two weights' scales."""
        if len({(w.block_in, w.in_features) for w in weights}) != 1:
            raise ValueError("Fp8Weight.stack: the weights need one input block size and input count")
        return cls.from_rows(torch.cat([w.codes() for w in weights]), torch.cat([w.row_scales() for w in weights]),
                             weights[0].block_in)

    def codes(self) -> torch.Tensor:
        """The E4M3 codes (O, I)."""
        return int8.from_panels(self.panels, self.out_features, self.in_features).view(E4M3)

    def row_scales(self) -> torch.Tensor:
        """(O, NB) float32: each row's scale per input block."""
        return self.scales.repeat_interleave(PANEL, 0)[:self.out_features]

    def dequantize(self) -> torch.Tensor:
        """code * scale (O, I) in float32: dequantize_fp8_blocks' values, bitwise."""
        s = self.row_scales().repeat_interleave(self.block_in, 1)[:, :self.in_features]
        return self.codes().float() * s

    @property
    def nbytes(self) -> int:
        """Bytes held: the codes (panels) and the float32 scales."""
        return self.panels.numel() + self.scales.numel() * 4

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """fp8_linear(x, self, bias)."""
        return fp8_linear(x, self, bias)


def _checkpoint_rows(w_OI: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (O, I) uint8, row scales (O, NB) float32) of a checkpoint's weight, checked."""
    if w_OI.dtype != E4M3 or w_OI.dim() != 2:
        raise ValueError(f"FP8 weights: a float8_e4m3fn (O, I) weight; got {w_OI.dtype} {tuple(w_OI.shape)}")
    want = fp8_block_scale_shape(tuple(w_OI.shape), block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"FP8 weights: scale_inv of shape {list(want)} for {list(w_OI.shape)} in blocks of "
                         f"{list(block)}; got {list(scale_inv.shape)}")
    codes = w_OI.detach().view(torch.uint8)
    for o0 in range(0, codes.shape[0], 4096):  # E4M3's NaN codes, a row chunk at a time
        if (codes[o0:o0 + 4096] & 0x7F).eq(0x7F).any():
            raise ValueError("FP8 weights: NaN codes (0x7F / 0xFF) in the weight")
    return codes, scale_inv.detach().float().repeat_interleave(block[0], 0)[:w_OI.shape[0]]


FOLD_ROWS = 17  # kernels/csrc/int8_panels.h's: BF16DOT's calls of this many rows fold the scales into the weights


def fp8_linear_reference(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                         folded: bool = False) -> torch.Tensor:
    """The torch path: x.float() @ (code * scale)^T (+ bias) in float32, returned in x's dtype; folded:
    code * scale rounded to bf16 first, as BF16DOT computes FOLD_ROWS rows or more."""
    if not folded:
        return int8.int8_linear_reference(x, w, bias)
    y = x.float() @ w.dequantize().bfloat16().float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """int8's library (kernels/int8.py) with the FP8 entry points' signatures set, or None."""
    lib = int8._library()
    if lib is None:
        return None
    fn = lib.shuttle_fp8_linear
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 2
                   + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int])
    fn = lib.shuttle_fused_moe_fp8
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_void_p]
                   + [ctypes.c_int] * 3 + [ctypes.c_int64])
    return lib


def available() -> bool:
    """Whether the FP8 kernels run here: the native library, and a kernel for float32 x (AVX-512, or
    AVX2 with F16C)."""
    return bool(kernels() & {AVX2, AVX512})


def kernels() -> frozenset[int]:
    """The kernels that run here: int8's weight-only ones (kernels/int8.kernels but VNNI, w8a8's), AVX2
    only where the CPU lists F16C."""
    lib = _library()
    return frozenset() if lib is None else _kernels_here(lib)


@functools.cache
def _kernels_here(lib: ctypes.CDLL) -> frozenset[int]:
    here = int8._kernels_here(lib) - {int8.VNNI}
    return here if "f16c" in native.cpu_flags() else here - {AVX2}


def _here_for(*block_ins: int) -> frozenset[int]:
    """kernels(), less AMX where an input block is not whole k-steps of its tiles (32 inputs)."""
    here = kernels()
    return here - {AMX} if any(b % 32 for b in block_ins) else here


def _kernel(x_dtype: torch.dtype, rows: int, kernel: int | None, here: frozenset[int], name: str) -> int:
    if kernel is None:
        return int8._default_kernel(x_dtype, rows, here, "fp8")
    return int8.check_kernel(kernel, here, x_dtype, name)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
               kernel: int | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) in x's dtype (bfloat16 or float32), W = code * block scale, float32
    accumulation, rounded once: x (..., I) on the CPU, bias (O,) of any float dtype. kernel: AVX2,
    AVX512, BF16DOT or AMX (these two bf16 x only), one of kernels(); by default as int8_linear's (bf16
    x: the big kernel measured on FP8 codes from its rows on, else AVX512 where it runs, else AVX2). The torch
    reference where the kernels are unavailable, for other dtypes, and where autograd or torch.compile
    needs it."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} input features, the weight {w.in_features}")
    if x.dtype not in (torch.bfloat16, torch.float32) or not (int8._eager_cpu(x, bias) and available()):
        return fp8_linear_reference(x, w, bias)
    lead, I, O = x.shape[:-1], w.in_features, w.out_features
    x_TI = x.reshape(-1, I).contiguous()
    T = x_TI.shape[0]
    here = _here_for(w.block_in)
    kernel = _kernel(x.dtype, T, kernel, here, "fp8_linear")
    if kernel not in here:  # the default FMA kernel where only AVX2 without F16C is listed
        return fp8_linear_reference(x, w, bias)
    y_TO = torch.empty(T, O, dtype=x.dtype)
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    bf16 = int(x.dtype == torch.bfloat16)
    rc = _library().shuttle_fp8_linear(x_TI.data_ptr(), bf16, T, I, w.panels.data_ptr(), w.scales.data_ptr(),
                                       w.block_in // 2, 0 if b is None else b.data_ptr(), O, y_TO.data_ptr(), bf16,
                                       native.threads(), kernel)
    if rc != 0:
        raise MemoryError(f"fp8_linear: out of memory for the buffers of {T} x {I} activations")
    return y_TO.view(*lead, O)


class Fp8ExpertPanels:
    """One expert weight for fused_moe_fp8, in place of a CpuWeight (as int8.Int8ExpertPanels): `fp8`,
    an Fp8Weight; gate/up (order set): its rows in int8.interleave_gate_up's order, row r of w13 (gate
    rows, then up rows) at order[r]; down (order None): the weight (D, I) as it is. Gate and up rows
    keep their own blocks' scales, so a checkpoint's separate gate and up weights need not have I a
    multiple of the block."""

    __slots__ = ("fp8", "order", "out_features", "in_features", "inter", "inter_padded")
    half = panels = packed = int8 = None  # (no bf16 copy, bf16 panels, oneDNN packing or int8 codes)

    def __init__(self, fp8: Fp8Weight, order: torch.Tensor | None, inter: int):
        self.fp8, self.order, self.inter = fp8, order, inter
        self.inter_padded = -(-inter // PANEL) * PANEL
        self.out_features = 2 * inter if order is not None else fp8.out_features
        self.in_features = fp8.in_features

    @classmethod
    def gate_up(cls, w1_ID: torch.Tensor, s1: torch.Tensor, w3_ID: torch.Tensor, s3: torch.Tensor,
                block: tuple[int, int]) -> "Fp8ExpertPanels":
        """A checkpoint's gate (w1) and up (w3) weights (I, D), float8_e4m3fn, with their scale_inv."""
        if w1_ID.shape != w3_ID.shape:
            raise ValueError(f"Fp8ExpertPanels: gate {tuple(w1_ID.shape)} and up {tuple(w3_ID.shape)} differ")
        (c1, r1), (c3, r3) = _checkpoint_rows(w1_ID, s1, block), _checkpoint_rows(w3_ID, s3, block)
        inter = w1_ID.shape[0]
        rows = lambda a, b: int8.interleave_gate_up(torch.cat((a, b)), inter)  # noqa: E731
        real = int8.interleave_gate_up(torch.ones(2 * inter, 1, dtype=torch.bool), inter)[:, 0]  # not padding
        return cls(Fp8Weight.from_rows(rows(c1, c3), rows(r1, r3), block[1], real), int8.gate_up_order(inter), inter)

    @classmethod
    def down(cls, w2_DI: torch.Tensor, s2: torch.Tensor, block: tuple[int, int]) -> "Fp8ExpertPanels":
        """A checkpoint's down weight (D, I), float8_e4m3fn, with its scale_inv."""
        return cls(Fp8Weight.from_checkpoint(w2_DI, s2, block), None, w2_DI.shape[1])

    @classmethod
    def quantize(cls, w: torch.Tensor, gate_up: bool, inter: int,
                 block: tuple[int, int] = (128, 128)) -> "Fp8ExpertPanels":
        """A float weight, as Int8ExpertPanels(w, gate_up, inter) takes it: w13 (2I, D) (its gate and up
        halves quantised separately, as a checkpoint stores them) or w2 (D, I)."""
        w = w.detach()
        if gate_up:
            if w.shape[0] != 2 * inter:
                raise ValueError(f"Fp8ExpertPanels: a gate/up weight has 2 * {inter} rows, got {w.shape[0]}")
            (q1, s1), (q3, s3) = (quantize_fp8_blocks(h, block, E4M3) for h in w.chunk(2))
            return cls.gate_up(q1, s1, q3, s3, block)
        if w.shape[1] != inter:
            raise ValueError(f"Fp8ExpertPanels: a down weight has {inter} inputs, got {w.shape[1]}")
        return cls.down(*quantize_fp8_blocks(w, block, E4M3), block)

    @property
    def weight(self) -> Fp8Weight:
        """The panels the kernels read."""
        return self.fp8

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T with the rows of w in their own order (gate then up): fp8_linear on the panels."""
        y = fp8_linear(x, self.fp8)
        return y if self.order is None else y.index_select(-1, self.order)


class Fp8Experts(PanelExperts):
    """One layer's E experts for fused_moe_fp8 (int8.PanelExperts of Fp8ExpertPanels; one input block
    size for every gate/up weight and one for every down weight)."""

    __slots__ = ("block13", "block2")

    def __init__(self, w13_E: list[Fp8ExpertPanels], w2_E: list[Fp8ExpertPanels]):
        super().__init__(w13_E, w2_E)
        blocks13, blocks2 = {w.fp8.block_in for w in self.w13_E}, {w.fp8.block_in for w in self.w2_E}
        if len(blocks13) != 1 or len(blocks2) != 1:
            raise ValueError(f"Fp8Experts: one input block size per projection; got {blocks13} and {blocks2}")
        self.block13, self.block2 = blocks13.pop(), blocks2.pop()

    @classmethod
    def from_checkpoint(cls, w1_E: list[torch.Tensor], s1_E: list[torch.Tensor], w3_E: list[torch.Tensor],
                        s3_E: list[torch.Tensor], w2_E: list[torch.Tensor], s2_E: list[torch.Tensor],
                        block: tuple[int, int]) -> "Fp8Experts":
        """A checkpoint's experts: gate (I, D), up (I, D) and down (D, I) float8_e4m3fn weights and their
        scale_inv, one per expert."""
        return cls([Fp8ExpertPanels.gate_up(*a, block) for a in zip(w1_E, s1_E, w3_E, s3_E)],
                   [Fp8ExpertPanels.down(w, s, block) for w, s in zip(w2_E, s2_E)])

    @classmethod
    def quantize(cls, w13_EID2: torch.Tensor | list[torch.Tensor], w2_EDI: torch.Tensor | list[torch.Tensor],
                 block: tuple[int, int] = (128, 128)) -> "Fp8Experts":
        """The experts of float weights w13 (E, 2I, D) and w2 (E, D, I) (or per-expert lists), quantised."""
        inter = w2_EDI[0].shape[1]
        return cls([Fp8ExpertPanels.quantize(w, True, inter, block) for w in w13_EID2],
                   [Fp8ExpertPanels.quantize(w, False, inter, block) for w in w2_EDI])


def fused_moe_fp8_reference(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                            experts: Fp8Experts) -> torch.Tensor:
    """The torch path: kernels/moe.fused_moe_packed's ops with fp8_linear on each expert's panels
    (int8.fused_moe_int8_reference's); pairs whose id is outside [0, E) left out."""
    return int8.fused_moe_int8_reference(x_TD, topk_ids_TK, topk_weights_TK, experts)


def moe_kernels(experts: "Fp8Experts", x_dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int] | None:
    """(kernel, big_kernel, big_rows, 0: no VNNI, which FP8 codes cannot take) that fused_moe_fp8 takes
    by default for x_dtype rows of these experts (also the native decode step's,
    models/native_decode.py); None where no kernel runs them
    here (no library, or AVX2 without F16C): then the torch reference does. The big kernel and its
    row count are measured on FP8 codes (kernels/choice.py "fp8_moe", int8.set_moe_big(codes="fp8")):
    the FMA kernel's float16 decode costs more than int8's widening, so BF16DOT's table decode can win
    from fewer rows than on int8 codes (one row on a Zen 5 EPYC)."""
    if not available():
        return None
    here = _here_for(experts.block13, experts.block2)
    small, big, big_rows = int8._default_moe_kernels(x_dtype, here, "fp8")
    return None if small not in here else (small, big, big_rows, 0)


def fused_moe_fp8(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  experts: Fp8Experts, kernel: int | None = None) -> torch.Tensor:
    """int8.fused_moe_int8 on FP8 experts: y_TD (x's dtype) = sum over each token's top-k experts of
    weight * SiLU-MLP(x), one native call (kernels/csrc/moe_int8.c). x: bf16 or float32 (T, D); ids
    (T, K) integers (ids outside [0, E) skipped); weights (T, K) float32 or bf16. kernel: AVX2, AVX512,
    BF16DOT or AMX (these two bf16 x only), one of kernels(), for every expert; by default each expert
    as fp8_linear's default takes its rows. fused_moe_fp8_reference where the kernels are unavailable,
    for other dtypes, and where autograd or torch.compile needs it."""
    T, D = x_TD.shape
    int8.check_moe_args("fused_moe_fp8", x_TD, topk_ids_TK, topk_weights_TK, experts.hidden)
    if x_TD.dtype not in (torch.bfloat16, torch.float32) or not (int8._eager_cpu(x_TD, topk_weights_TK)
                                                                 and available()):
        return fused_moe_fp8_reference(x_TD, topk_ids_TK, topk_weights_TK, experts)
    here = _here_for(experts.block13, experts.block2)
    if kernel is None:
        chosen = moe_kernels(experts, x_TD.dtype)
        if chosen is None:  # AVX2 without F16C
            return fused_moe_fp8_reference(x_TD, topk_ids_TK, topk_weights_TK, experts)
        small, big, big_rows, _ = chosen
    else:
        small = big = _kernel(x_TD.dtype, T, kernel, here, "fused_moe_fp8")
        big_rows = 0
    x_TD = x_TD.contiguous()
    ids_TK = topk_ids_TK.to(torch.int64).contiguous()
    wk_TK = topk_weights_TK.to(torch.float32).contiguous()
    y_TD = torch.zeros(T, D, dtype=x_TD.dtype)
    rc = _library().shuttle_fused_moe_fp8(
        x_TD.data_ptr(), int(x_TD.dtype == torch.bfloat16), T, D, ids_TK.data_ptr(), wk_TK.data_ptr(), ids_TK.shape[1],
        *(experts.table[i].data_ptr() for i in range(4)), experts.num_experts, experts.inter, experts.block13 // 2,
        experts.block2 // 2, y_TD.data_ptr(), native.threads(), small, big, big_rows)
    if rc == -1:
        raise MemoryError(f"fused_moe_fp8: out of memory for {T} tokens x {ids_TK.shape[1]} experts")
    if rc != 0:
        raise RuntimeError(f"fused_moe_fp8: the library cannot run kernels {small}/{big} ({rc})")
    return y_TD

