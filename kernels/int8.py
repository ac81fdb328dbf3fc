"""Weight-only INT8 linear layers for the CPU: int8 codes with one float32 scale per output channel,
multiplied by C kernels that dequantise them on the fly (kernels/csrc/int8_gemm.c, in the native library).

- `quantize_int8(w)`: symmetric per-output-channel codes, scale = absmax / 127 in float32 (a row of
  zeros: scale 1, codes 0), packed into the kernels' panels (`Int8Weight`). Only the int8 codes and
  the scales are kept: a quarter of float32's bytes, half of bf16's.
- `int8_linear(x, w, bias)`: y = x (q scale)^T (+ bias) for bf16 or float32 x (y in x's dtype), any
  row count and any I, O. Equal to `int8_linear_reference` (torch: x.float() @ dequantised
  weights^T) up to float32 summation order and, for bf16, the one rounding of y.

Kernels (`kernels()` lists those that run here):
  AVX2, AVX512  widen the codes to float32 in registers for FMA against float32 x (bf16 x widened
                once): AVX2 + FMA, or AVX-512 F/BW/VL;
  BF16DOT, AMX  bf16 x only: each panel is dequantised once per block of rows into a bf16 copy
                that stays in cache (exact: |q| <= 127), multiplied by x's bf16 values with AVX-512
                BF16 dot products or AMX-BF16 tiles, float32 accumulation. BF16DOT decodes FP8 codes
                by byte table lookups (AVX-512 VBMI, which it needs besides BF16). By default bf16 x
                takes the one kernels/choice.py measured fastest for the fused block from its row
                count on ("int8_moe", FP8 codes "fp8_moe": set_moe_big), the FMA kernel below it;
                unmeasured, AMX from AMX_MIN_ROWS rows where it runs.
  VNNI          w8a8 only (below): int8 activations times int8 codes with AVX-512 VNNI dot products
                (vpdpbusd, 4 products per int32 lane), exact int32 sums, no dequantisation.
The AVX-512, VNNI and AMX kernels are compiled with target attributes and run where /proc/cpuinfo lists
their ISA (AMX also needs the kernel's permission for the tile state, asked once). Where the native
library cannot run (no AVX2, no compiler, a failed build, SHUTTLE_NATIVE_KERNELS=0) int8_linear is
the torch reference.

The fused MoE block (kernels/csrc/moe_int8.c, the same kernels):
- `Int8ExpertPanels(w, gate_up, inter)`: one expert weight for it, as cpu_linear.ExpertPanels is for
  the bf16 block: w13 (2I, D) quantised with its rows reordered so that panels 2u and 2u + 1 hold 16
  gate rows and the same 16 up rows (each half zero-padded to I16 rows; the codes and scales of every
  row are those quantize_int8 gives w13 itself), or w2 (D, I) as it is. `Int8Experts`: a layer's E
  experts and the table of addresses the kernel reads.
- `fused_moe_int8(x, ids, weights, experts)`: kernels/moe.fused_moe_packed on these weights (SiLU
  experts without biases) in one native call: the pairs sorted by expert, the gate/up GEMM with
  silu(gate) * up in its epilogue, the down GEMM adding each token's weighted rows in ascending expert
  id; bf16 rounded where fused_moe_packed's ops round. The torch path (`fused_moe_int8_reference`,
  fused_moe_packed's ops on int8_linear) where the kernels are unavailable.

w8a8 (`--quantization w8a8_int8`, SGLang's name): the same experts with `Int8Experts(act_int8=True)`.
The block quantises each row of its inputs to int8 as well, dynamically per token (`quantize_rows`:
scale max |x| / 127), both x and the intermediate h, and sums int8 x int8 exactly in int32 (the VNNI
kernel; sum * row scale * channel scale in float32 after). That changes the numbers (8-bit activations;
`w8a8_linear_reference` is its torch reference, and the torch path where VNNI does not run here), so
it is a quantisation of its own; in exchange it does no dequantisation and twice BF16's products per
instruction. Weight-only int8 experts take the same VNNI arithmetic only for an expert with at least
`set_moe_vnni`'s rows in a call, where kernels/choice.py measured it faster than every weight-only
kernel by more than NUMERICS_MARGIN (as the quantisation issue asks: int8 x int8 "chosen only where
measured faster"; on a Zen 5 EPYC from 5 rows of 1024 x 2048 experts, 1.6x BF16DOT's speed at 16):
such an expert's rows then round as w8a8's do. `SHUTTLE_KERNEL_CHOICE=int8_moe=bf16dot` (or fma) keeps
weight-only arithmetic at every row count.

kernels/fp8_weights.py runs FP8 block-scaled checkpoint weights on the same panels, kernels and fused
block (`PanelExperts`, `to_panels`, `interleave_gate_up` are shared; int8_panels.h's codes_fmt).

Legend: T rows (tokens), I input features, O output features, P panels of PANEL outputs, Ip I rounded
up to even; in the MoE block D hidden, I intermediate, I16 I rounded up to 16, K experts per token,
E experts, N = T*K pairs.
"""
import ctypes
import functools
import logging

import torch

from kernels import native

log = logging.getLogger("shuttle")
PANEL = 16  # output channels per weight panel
AVX2, AVX512, BF16DOT, AMX, VNNI = 0, 1, 2, 3, 4  # the C kernel's `kernel` argument
_KERNEL_FLAGS = {AVX2: {"avx2", "fma"}, AVX512: {"avx512f", "avx512bw", "avx512vl"},
                 BF16DOT: {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi"},
                 AMX: {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"},
                 VNNI: {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}}
# Rows from which bf16 x takes AMX where it runs (its per-panel dequantisation is paid once per block
# of rows, the FMA kernel's widening once per tile of 8 rows). On the 2-core AMX Xeon
# (bench/results/int8_cpu.json) AVX512 was faster at 1-6 rows, AMX at 12 and more; at 8 it depended
# on the shape (1024 x 2048: AMX 1.6x faster; 4096 x 14336: AVX512 1.4x). BF16DOT was slower than
# AVX512 at every row count there, so it runs only when asked (a candidate for AVX-512 BF16 CPUs
# without AMX).
AMX_MIN_ROWS = 8
VNNI_MAX_K = 66000  # the most inputs VNNI's int32 sums hold (moe_int8.c refuses more)


class Int8Weight:
    """A weight (O, I) as int8 codes and float32 per-output-channel scales, w ~= q * scale[:, None].

    panels: int8 (P, Ip / 2, PANEL, 2), P = ceil(O / PANEL): output channels in panels of PANEL,
    inputs in pairs, element [p, j, o, k] = q[p * PANEL + o, 2j + k]; channels past O and the input
    past an odd I are zero. scales: float32 (P * PANEL,), 1 past O."""

    __slots__ = ("panels", "scales", "out_features", "in_features")

    def __init__(self, panels: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int):
        self.panels, self.scales = panels, scales
        self.out_features, self.in_features = out_features, in_features

    @property
    def scale(self) -> torch.Tensor:
        """The O output channels' scales, float32."""
        return self.scales[:self.out_features]

    def codes(self) -> torch.Tensor:
        """The int8 codes q (O, I)."""
        return from_panels(self.panels, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """q * scale (O, I) in float32."""
        return self.codes().float() * self.scale[:, None]

    @property
    def nbytes(self) -> int:
        return self.panels.numel() + self.scales.numel() * 4

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """int8_linear(x, self, bias)."""
        return int8_linear(x, self, bias)


def to_panels(codes_OI: torch.Tensor) -> torch.Tensor:
    """One-byte codes (O, I) (int8, uint8) as the kernels' panels (P, Ip / 2, PANEL, 2), bit for bit,
    zero past O and past an odd I."""
    O, I = codes_OI.shape
    P, Ip = -(-O // PANEL), I + I % 2
    padded = codes_OI.new_zeros(P * PANEL, Ip)
    padded[:O, :I] = codes_OI
    return padded.view(P, PANEL, Ip // 2, 2).permute(0, 2, 1, 3).contiguous()


def from_panels(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The codes (O, I) that to_panels packed (a copy); any panel width, so also the bf16 weight that
    native.pack_panels32 packed."""
    P, pairs, width = panels.shape[:3]
    return panels.permute(0, 2, 1, 3).reshape(P * width, pairs * 2)[:out_features, :in_features]


def quantize_int8(w_OI: torch.Tensor, rows_per_chunk: int = 4096) -> Int8Weight:
    """Symmetric per-output-channel int8 codes of w (O, I) (any float dtype, on the CPU): scale =
    max |w[o]| / 127 in float32, q = round(w / scale) (to nearest even) in [-127, 127]; a row of zeros
    gets scale 1 and codes 0. Packed into panels (Int8Weight); float32 temporaries of at most
    rows_per_chunk rows at a time."""
    w_OI = w_OI.detach()
    if w_OI.dim() != 2 or not w_OI.is_floating_point():
        raise ValueError(f"quantize_int8 takes a floating-point (O, I) weight; got {w_OI.dtype} {tuple(w_OI.shape)}")
    O, I = w_OI.shape
    P, Ip = -(-O // PANEL), I + I % 2
    q = torch.zeros(P * PANEL, Ip, dtype=torch.int8)
    scales = torch.ones(P * PANEL, dtype=torch.float32)
    for o0 in range(0, O, rows_per_chunk):
        w = w_OI[o0:o0 + rows_per_chunk].float()
        absmax = w.abs().amax(dim=1)
        scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
        q[o0:o0 + w.shape[0], :I] = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[o0:o0 + w.shape[0]] = scale
    panels = q.view(P, PANEL, Ip // 2, 2).permute(0, 2, 1, 3).contiguous()
    return Int8Weight(panels, scales, O, I)


def int8_linear_reference(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path: x.float() @ (q * scale)^T (+ bias) in float32, returned in x's dtype (any weight
    with a float32 `dequantize()`: kernels/fp8_weights.py's too)."""
    y = x.float() @ w.dequantize().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row (per-token) int8 codes of x (..., I), as the VNNI kernel quantises its rows, bit
    for bit: (codes int8 (..., I), scales float32 (..., 1)) with scale = max |x| / 127 and codes =
    round(x * (127 / max |x|)) to nearest even in [-127, 127]; a row of zeros: codes 0, scale 0."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(x32 * inv).clamp_(-127, 127).to(torch.int8), amax / 127


def w8a8_linear_reference(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """y = x (q scale)^T with x quantised per row (quantize_rows) first, as w8a8 experts compute: the
    integer sums exact (float64), then (sum * row scale) * channel scale in float32, returned in x's
    dtype."""
    q, s = quantize_rows(x)
    acc = q.double() @ w.codes().double().t()
    return (acc.float() * s * w.scale).to(x.dtype)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The native library (kernels/native.py) with the int8 kernels' signatures set, or None where
    it cannot run here (native says why, once)."""
    lib = native._library()
    if lib is None:
        return None
    for name in ("shuttle_int8_kernels", "shuttle_int8_amx_init"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = ctypes.c_int, []
    fn = lib.shuttle_int8_linear
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3
                   + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int])
    fn = lib.shuttle_fused_moe_int8
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
                   + [ctypes.c_int] * 3 + [ctypes.c_int64] * 2)
    return lib


def available() -> bool:
    """Whether the int8 kernels run here (builds them on the first call)."""
    return _library() is not None


@functools.cache
def _kernels_here(lib: ctypes.CDLL) -> frozenset[int]:
    built, flags = lib.shuttle_int8_kernels(), native.cpu_flags()
    here = {k for k, need in _KERNEL_FLAGS.items() if built >> k & 1 and need <= flags}
    if AMX in here and not lib.shuttle_int8_amx_init():
        log.info("int8 AMX kernel unavailable: the kernel refused this process the tile state (arch_prctl)")
        here.discard(AMX)
    return frozenset(here)


def kernels() -> frozenset[int]:
    """The kernels that run here: built into the library and the CPU lists their ISA (empty where
    the library is unavailable)."""
    lib = _library()
    return frozenset() if lib is None else _kernels_here(lib)


def avx512() -> bool:
    """Whether the AVX-512 FMA kernel runs here (float32 x; bf16 x below the measured big kernel's rows)."""
    return AVX512 in kernels()


def check_kernel(kernel: int, here: frozenset[int], x_dtype: torch.dtype, name: str) -> int:
    """`kernel` where it runs here for x_dtype rows (BF16DOT and AMX: bf16 only; VNNI only for int8
    activations, fused_moe_int8's), else ValueError naming `name`."""
    if kernel not in here or kernel in (BF16DOT, AMX) and x_dtype != torch.bfloat16 or kernel == VNNI:
        raise ValueError(f"{name}: kernel {kernel} does not run here for {x_dtype} x (here: {sorted(here)})")
    return kernel


def _default_kernel(x_dtype: torch.dtype, rows: int, here: frozenset[int], codes: str = "int8") -> int:
    """The kernel int8_linear (codes "int8") and fp8_linear ("fp8") take for `rows` rows of x_dtype by
    default: for bf16 rows the fused block's measured big kernel for those codes from its row count on
    (the same panels and kernels; see set_moe_big; unmeasured: AMX from AMX_MIN_ROWS where it runs),
    else the FMA kernel."""
    small = AVX512 if AVX512 in here else AVX2
    if x_dtype != torch.bfloat16:
        return small
    _, big, big_rows = _default_moe_kernels(x_dtype, here, codes)
    return big if rows >= big_rows else small


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None,
                kernel: int | None = None) -> torch.Tensor:
    """y = x (q scale)^T (+ bias) in x's dtype (bfloat16 or float32), float32 accumulation, rounded
    once: x (..., I) on the CPU, bias (O,) of any float dtype. kernel: AVX2, AVX512, BF16DOT or AMX
    (these two bf16 x only), one of kernels(); by default _default_kernel's (bf16 x: the measured big
    kernel from its rows on), else AVX512 where it runs, else AVX2. The torch reference where the
    kernels are unavailable, for other dtypes, and where autograd or torch.compile needs it."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"int8_linear: x has {x.shape[-1]} input features, the weight {w.in_features}")
    if x.dtype not in (torch.bfloat16, torch.float32) or not _eager_cpu(x, bias):
        return int8_linear_reference(x, w, bias)
    lead, I, O = x.shape[:-1], w.in_features, w.out_features
    x_TI = x.reshape(-1, I).contiguous()
    T = x_TI.shape[0]
    here = _kernels_here(_library())
    kernel = _default_kernel(x.dtype, T, here) if kernel is None else check_kernel(kernel, here, x.dtype, "int8_linear")
    y_TO = torch.empty(T, O, dtype=x.dtype)
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    bf16 = int(x.dtype == torch.bfloat16)
    rc = _library().shuttle_int8_linear(x_TI.data_ptr(), bf16, T, I, w.panels.data_ptr(), w.scales.data_ptr(),
                                        0 if b is None else b.data_ptr(), O, y_TO.data_ptr(), bf16, native.threads(),
                                        kernel)
    if rc != 0:
        raise MemoryError(f"int8_linear: out of memory for the buffers of {T} x {I} activations")
    return y_TO.view(*lead, O)


def _eager_cpu(*tensors: torch.Tensor | None) -> bool:
    """What native.eager_cpu checks, for this library: CPU tensors (Nones skipped), no gradient wanted,
    not traced by torch.compile, the kernels available."""
    tensors = [t for t in tensors if t is not None]
    return (all(t.device.type == "cpu" for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and not torch.compiler.is_compiling() and available())


def interleave_gate_up(w_2ID: torch.Tensor, inter: int) -> torch.Tensor:
    """w13 (2I, D) (gate rows, then up rows; any dtype) with its rows in the fused kernels' order:
    gate rows 16u..16u+15, then the same up rows, for each u, each half zero-padded to I16 rows:
    (2 * I16, D). Row r of w13 lands at gate_up_order(inter)[r]."""
    I16, D = -(-inter // PANEL) * PANEL, w_2ID.shape[1]
    halves = w_2ID.new_zeros(2, I16, D)  # (gate/up, row, input)
    halves[:, :inter] = w_2ID.reshape(2, inter, D)
    return halves.view(2, I16 // PANEL, PANEL, D).transpose(0, 1).reshape(2 * I16, D)


def gate_up_order(inter: int) -> torch.Tensor:
    """(2I,) int64: where interleave_gate_up puts each row of w13."""
    i = torch.arange(inter)
    within = i // PANEL * 2 * PANEL + i % PANEL
    return torch.cat((within, within + PANEL))


class Int8ExpertPanels:
    """One expert weight for fused_moe_int8, in place of a CpuWeight (as cpu_linear.ExpertPanels is for
    the bf16 block). gate_up=True: w (2I, D) holds the gate rows then the up rows; they are quantised
    in the order gate rows 16u..16u+15, then the same up rows, for each u (each half zero-padded to
    I16 rows), so panels 2u and 2u + 1 are one block of h's columns for the kernel's epilogue. Each
    row's codes and scale are quantize_int8(w)'s (quantisation is per row); `order` (2I,) gives each
    row of w its output in `int8`. Else w is the down projection (D, I), quantised as it is."""

    __slots__ = ("int8", "order", "out_features", "in_features", "inter", "inter_padded")
    half = panels = packed = None  # (no bf16 copy, bf16 panels or oneDNN packing: only int8 codes)

    def __init__(self, w: torch.Tensor, gate_up: bool, inter: int):
        w = w.detach()
        self.out_features, self.in_features = w.shape
        self.inter, self.inter_padded = inter, -(-inter // PANEL) * PANEL
        if gate_up:
            if self.out_features != 2 * inter:
                raise ValueError(f"Int8ExpertPanels: a gate/up weight has 2 * {inter} rows, got {self.out_features}")
            self.int8, self.order = quantize_int8(interleave_gate_up(w, inter)), gate_up_order(inter)
        else:
            if self.in_features != inter:
                raise ValueError(f"Int8ExpertPanels: a down weight has {inter} inputs, got {self.in_features}")
            self.int8, self.order = quantize_int8(w), None

    @property
    def weight(self) -> Int8Weight:
        """The panels the kernels read."""
        return self.int8

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T with the rows of w in their own order (gate then up): int8_linear on the panels."""
        y = int8_linear(x, self.int8)
        return y if self.order is None else y.index_select(-1, self.order)

    def linear_w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """linear with x quantised per row first (w8a8_linear_reference)."""
        y = w8a8_linear_reference(x, self.int8)
        return y if self.order is None else y.index_select(-1, self.order)


class PanelExperts:
    """One layer's E experts for a fused block on panels (fused_moe_int8; kernels/fp8_weights.py's
    fused_moe_fp8): w13_E, w2_E lists of expert panels (Int8ExpertPanels or Fp8ExpertPanels: gate/up,
    down), and `table` (4, E) int64, the addresses of every expert's gate/up codes and scales and down
    codes and scales that the kernel reads (the lists keep those tensors alive)."""

    __slots__ = ("w13_E", "w2_E", "hidden", "inter", "table")

    def __init__(self, w13_E: list, w2_E: list):
        name = type(self).__name__
        if not w13_E or len(w13_E) != len(w2_E):
            raise ValueError(f"{name}: {len(w13_E)} gate/up and {len(w2_E)} down weights")
        self.w13_E, self.w2_E = list(w13_E), list(w2_E)
        self.hidden, self.inter = w13_E[0].in_features, w13_E[0].inter
        if any(w.order is None or (w.in_features, w.inter) != (self.hidden, self.inter) for w in self.w13_E) or any(
                w.order is not None or (w.out_features, w.in_features) != (self.hidden, self.inter) for w in self.w2_E):
            raise ValueError(f"{name}: every expert needs a gate/up weight (2I, D) and a down weight (D, I) of "
                             "one D and I")
        self.table = torch.tensor([[w.weight.panels.data_ptr() for w in self.w13_E],
                                   [w.weight.scales.data_ptr() for w in self.w13_E],
                                   [w.weight.panels.data_ptr() for w in self.w2_E],
                                   [w.weight.scales.data_ptr() for w in self.w2_E]], dtype=torch.int64)

    @property
    def num_experts(self) -> int:
        return len(self.w13_E)


class Int8Experts(PanelExperts):
    """One layer's E experts for fused_moe_int8 (PanelExperts of Int8ExpertPanels). act_int8 (w8a8):
    the block quantises its activations per row too, x and h (quantize_rows), and multiplies int8 by
    int8 (the VNNI kernel; w8a8_linear_reference where it does not run)."""

    __slots__ = ("act_int8",)

    def __init__(self, w13_E: list, w2_E: list, act_int8: bool = False):
        super().__init__(w13_E, w2_E)
        self.act_int8 = act_int8

    @classmethod
    def quantize(cls, w13_EID2: torch.Tensor | list[torch.Tensor], w2_EDI: torch.Tensor | list[torch.Tensor],
                 act_int8: bool = False) -> "Int8Experts":
        """The experts of float weights w13 (E, 2I, D) and w2 (E, D, I) (or per-expert lists), quantised."""
        inter = w2_EDI[0].shape[1]
        return cls([Int8ExpertPanels(w, True, inter) for w in w13_EID2],
                   [Int8ExpertPanels(w, False, inter) for w in w2_EDI], act_int8)


def fused_moe_int8_reference(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                             experts: PanelExperts) -> torch.Tensor:
    """The torch path: kernels/moe.fused_moe_packed's ops (the one-token path for T = 1; else permute,
    grouped_swiglu, unpermute) with each expert panels' linear (int8_linear; fp8_linear for FP8
    experts; linear_w8a8 for w8a8 experts); pairs whose id is outside [0, E) are left out, as the
    kernel skips them."""
    from kernels.moe import SILU, Permutation, _one_token_moe, grouped_swiglu, unpermute

    E, (T, K) = experts.num_experts, topk_ids_TK.shape
    if getattr(experts, "act_int8", False):
        linear = lambda x, w, bias=None: w.linear_w8a8(x)  # noqa: E731
    else:
        linear = lambda x, w, bias=None: w.linear(x)  # noqa: E731 (no biases: SiLU experts)
    keep_TK = (topk_ids_TK >= 0) & (topk_ids_TK < E)
    if T == 1:
        keep = keep_TK[0]
        return _one_token_moe(x_TD, experts.w13_E, experts.w2_E, topk_weights_TK[:, keep], topk_ids_TK[:, keep],
                              linear, None, None, SILU)
    flat_ids_N = torch.where(keep_TK, topk_ids_TK, E).reshape(-1)
    pair_idx_N = torch.argsort(flat_ids_N, stable=True)[:int(keep_TK.sum())]
    token_idx_N = torch.div(pair_idx_N, K, rounding_mode="floor")
    counts_E = torch.bincount(flat_ids_N, minlength=E + 1)[:E].tolist()
    perm = Permutation(token_idx_N, pair_idx_N, counts_E, T)
    y_ND = grouped_swiglu(x_TD.index_select(0, token_idx_N), counts_E, experts.w13_E, experts.w2_E, linear=linear)
    return unpermute(y_ND, perm, topk_weights_TK)


# The kernel an expert's bf16 rows take in the fused blocks from a row count on, per code format ("int8",
# "fp8": their codes decode at different costs, so each is measured on its own codes by kernels/choice.py,
# ops "int8_moe" and "fp8_moe"): (kernel, rows), kernel BF16DOT or AMX, or None (the FMA kernel at every
# count); None: not measured, AMX from AMX_MIN_ROWS where it runs. Dense linears of a format take its entry.
_moe_big: dict[str, tuple[int | None, int] | None] = {"int8": None, "fp8": None}


def set_moe_big(kernel: int | None, rows: int = 1, codes: str = "int8") -> None:
    """The measured choice (kernels/choice.py) for experts and linears of `codes` ("int8" or "fp8"): bf16
    rows take `kernel` (BF16DOT or AMX) from `rows` rows on; None: the FMA kernel at every count."""
    _moe_big[codes] = (kernel, rows)


def _default_moe_kernels(x_dtype: torch.dtype, here: frozenset[int], codes: str = "int8") -> tuple[int, int, int]:
    """(kernel, big_kernel, big_rows) for `codes` ("int8" or "fp8"): an expert's rows take the FMA kernel
    (AVX-512, else AVX2), and bf16 rows the measured big kernel from its row count on (unmeasured: AMX
    from AMX_MIN_ROWS where it runs)."""
    small = AVX512 if AVX512 in here else AVX2
    if x_dtype != torch.bfloat16:
        return small, small, 0
    if _moe_big[codes] is None:
        return (small, AMX, AMX_MIN_ROWS) if AMX in here else (small, small, 0)
    kernel, rows = _moe_big[codes]
    return (small, kernel, rows) if kernel in here else (small, small, 0)


# Rows from which a weight-only int8 expert of the fused block runs VNNI on per-token int8 activations
# (w8a8's arithmetic), as kernels/choice.py measured for bf16 rows ("int8_moe"'s vnni); 0: never.
_moe_vnni: list[int] = [0]


def set_moe_vnni(rows: int) -> None:
    """The measured choice (kernels/choice.py): a weight-only int8 expert with at least `rows` bf16 rows in
    a call of the fused block takes VNNI; 0: none does."""
    _moe_vnni[0] = rows


def moe_kernels(experts: Int8Experts, x_dtype: torch.dtype) -> tuple[int, int, int, int] | None:
    """(kernel, big_kernel, big_rows, vnni_rows) that fused_moe_int8 runs `experts` with by default for
    x_dtype rows here (vnni_rows: experts with that many rows take VNNI, set_moe_vnni; 0: none); None
    where the library cannot (unavailable; w8a8 experts without VNNI here, or wider than VNNI_MAX_K):
    then the torch path runs them."""
    if not available():
        return None
    here = _kernels_here(_library())
    fits = VNNI in here and max(experts.hidden, experts.inter) <= VNNI_MAX_K
    if experts.act_int8:
        return (VNNI, VNNI, 0, 0) if fits else None
    vnni_rows = _moe_vnni[0] if fits and x_dtype == torch.bfloat16 else 0
    return (*_default_moe_kernels(x_dtype, here), vnni_rows)


def check_moe_args(name: str, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                   hidden: int) -> None:
    """ValueError naming `name` unless x is (T, hidden) and the ids and weights are (T, K) alike (the fused
    int8, FP8 and MXFP4 blocks' arguments)."""
    T, D = x_TD.shape
    if D != hidden or topk_ids_TK.shape[0] != T or topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"{name} takes x (T, {hidden}) and (T, K) ids and weights; got x {tuple(x_TD.shape)}, "
                         f"ids {tuple(topk_ids_TK.shape)}, weights {tuple(topk_weights_TK.shape)}")


def fused_moe_int8(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                   experts: Int8Experts, kernel: int | None = None) -> torch.Tensor:
    """y_TD (x's dtype) = sum over each token's top-k experts of weight * SiLU-MLP(x) on int8 experts, in
    one native call (kernels/csrc/moe_int8.c). x: bf16 or float32 (T, D); ids (T, K) integers (ids
    outside [0, E) are skipped); weights (T, K) float32 or bf16. kernel: AVX2, AVX512, BF16DOT or AMX
    (these two bf16 x only), one of kernels(), for every expert; by default each expert as
    int8_linear's default takes its rows (moe_kernels: bf16 rows the measured big kernel from its row
    count, else AVX512 where it runs, else AVX2; an expert with moe_kernels' vnni_rows rows VNNI).
    w8a8 experts (experts.act_int8) take VNNI, the kernel that quantises activations, at every count.
    fused_moe_int8_reference where the kernels are unavailable (for w8a8: VNNI does not run here), for
    other dtypes, and where autograd or torch.compile needs it."""
    T, D = x_TD.shape
    check_moe_args("fused_moe_int8", x_TD, topk_ids_TK, topk_weights_TK, experts.hidden)
    if x_TD.dtype not in (torch.bfloat16, torch.float32) or not _eager_cpu(x_TD, topk_weights_TK):
        return fused_moe_int8_reference(x_TD, topk_ids_TK, topk_weights_TK, experts)
    here = _kernels_here(_library())
    if experts.act_int8 and kernel not in (None, VNNI):
        raise ValueError(f"fused_moe_int8: w8a8 experts run kernel {VNNI} (VNNI) only, got {kernel}")
    if kernel is None or experts.act_int8:
        chosen = moe_kernels(experts, x_TD.dtype)
        if chosen is None:
            return fused_moe_int8_reference(x_TD, topk_ids_TK, topk_weights_TK, experts)
        small, big, big_rows, vnni_rows = chosen
    else:
        small = big = check_kernel(kernel, here, x_TD.dtype, "fused_moe_int8")
        big_rows = vnni_rows = 0
    x_TD = x_TD.contiguous()
    ids_TK = topk_ids_TK.to(torch.int64).contiguous()
    wk_TK = topk_weights_TK.to(torch.float32).contiguous()
    y_TD = torch.zeros(T, D, dtype=x_TD.dtype)
    rc = _library().shuttle_fused_moe_int8(
        x_TD.data_ptr(), int(x_TD.dtype == torch.bfloat16), T, D, ids_TK.data_ptr(), wk_TK.data_ptr(), ids_TK.shape[1],
        *(experts.table[i].data_ptr() for i in range(4)), experts.num_experts, experts.inter, y_TD.data_ptr(),
        native.threads(), small, big, big_rows, vnni_rows)
    if rc == -1:
        raise MemoryError(f"fused_moe_int8: out of memory for {T} tokens x {ids_TK.shape[1]} experts")
    if rc != 0:
        raise RuntimeError(f"fused_moe_int8: the library cannot run kernels {small}/{big} ({rc})")
    return y_TD
