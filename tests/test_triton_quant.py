"""Triton GEMMs and fused MoE over quantised weights (kernels/quant_triton.py) against the torch
references: dequantise with kernels/quant.py, then F.linear or kernels/moe.py::fused_moe.

Interpreted on the CPU (TRITON_INTERPRET=1, set by conftest), compiled on CUDA. Fresh random inputs
every run (a failure message carries the seed); outputs are poisoned so an unwritten element fails.
Shapes are odd on purpose: O and I not multiples of the scale blocks (partial edge blocks), T = 1, 3,
17, experts without tokens.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.moe import SILU, SwiGLU
from kernels.moe import fused_moe as reference_moe
from kernels.moe_triton import MoEConfig
from kernels.quant import dequantize_fp8_blocks, dequantize_mxfp4, quantize_fp8_blocks, quantize_mxfp4
from kernels.quant_triton import fp8_block_linear, fused_moe_fp8, fused_moe_mxfp4, mxfp4_linear_triton
from tests.conftest import TRITON_DEVICE

pytestmark = pytest.mark.gpu

DEV = TRITON_DEVICE
SMALL = MoEConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1)
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}  # rtol, and atol relative to max |ref|
DTYPES = list(TOL)
GPT_OSS = SwiGLU(alpha=1.702, limit=0.6, up_offset=1.0)  # gpt-oss's activation, a limit low enough to clamp


@pytest.fixture(autouse=True)
def fresh_seed() -> int:
    return torch.seed()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == dtype
    tol, scale = TOL[dtype], ref.float().abs().max().item() or 1.0
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{m}\nreplay with torch.manual_seed({torch.initial_seed()})")


def fp8_weight(O: int, I: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of a random weight whose blocks differ in scale (so a wrong block shows)."""
    w = torch.randn(O, I, device=DEV) / I ** 0.5
    w *= torch.rand(O, 1, device=DEV) + 0.5
    return quantize_fp8_blocks(w * (torch.rand(1, I, device=DEV) + 0.5), block)


def mxfp4_weight(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(*shape, device=DEV) / shape[-1] ** 0.5
    return quantize_mxfp4(w * (torch.rand(*shape[:-1], 1, device=DEV) * 4 + 0.1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,O,I,block,bias", [(1, 37, 160, (128, 128), False), (3, 37, 160, (128, 128), True),
                                              (17, 70, 100, (24, 48), True)])  # 48: K-tiles of 16
def test_fp8_block_linear(poison, dtype: torch.dtype, T: int, O: int, I: int, block: tuple[int, int],
                          bias: bool) -> None:
    q, s = fp8_weight(O, I, block)
    x = torch.randn(T, I, device=DEV).to(dtype)
    b = torch.randn(O, device=DEV).to(dtype) if bias else None
    out = fp8_block_linear(x, q, s, block, bias=b, config=SMALL)
    assert_close(out, F.linear(x, dequantize_fp8_blocks(q, s, block, dtype), b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,O,I,bias", [(1, 37, 96, True), (3, 37, 96, False), (17, 40, 64, True)])
def test_mxfp4_linear(poison, dtype: torch.dtype, T: int, O: int, I: int, bias: bool) -> None:
    blocks, scales = mxfp4_weight(O, I)
    x = torch.randn(T, I, device=DEV).to(dtype)
    b = torch.randn(O, device=DEV).to(dtype) if bias else None
    out = mxfp4_linear_triton(x, blocks, scales, bias=b, config=SMALL)
    assert_close(out, F.linear(x, dequantize_mxfp4(blocks, scales, dtype), b), dtype)
    flat = mxfp4_linear_triton(x, blocks.flatten(-2), scales, bias=b, config=SMALL)  # (O, I / 2) bytes
    assert torch.equal(flat, out)


def test_linear_defaults_strides_and_raw_bytes(poison) -> None:
    """Default tiles; x and the codes (as their uint8 bits) column slices of wider tensors whose other
    columns are NaN, so reading past I (the last K-tile is partial) fails. (The interpreter converts
    E4M3's NaN byte to 480, so there only x's NaNs can show a missing mask; compiled, both do.)"""
    x_wide = torch.full((5, 200), float("nan"), device=DEV)
    x = x_wide[:, 20:170]
    x.copy_(torch.randn(5, 150, device=DEV))
    q, s = fp8_weight(37, 150, (128, 128))
    bits = torch.full((37, 176), 0x7F, dtype=torch.uint8, device=DEV)  # 0x7F: E4M3's NaN
    bits[:, 8:158] = q.view(torch.uint8)
    ref = F.linear(x, dequantize_fp8_blocks(q, s, (128, 128)))
    assert_close(fp8_block_linear(x, bits[:, 8:158], s), ref, torch.float32)
    blocks, scales = mxfp4_weight(37, 96)
    assert_close(mxfp4_linear_triton(x[:, 30:126], blocks, scales),
                 F.linear(x[:, 30:126], dequantize_mxfp4(blocks, scales)), torch.float32)


def routing(T: int, E: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-K router weights and ids; from 3 tokens on, expert 1 is never chosen."""
    logits = torch.randn(T, E, device=DEV)
    if T >= 3:
        logits[:, 1] = float("-inf")
    weights, ids = logits.softmax(-1).topk(K, dim=-1)
    return weights, ids


def moe_biases(E: int, D: int, I: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(E, 2 * I, device=DEV).to(dtype) * 0.5, torch.randn(E, D, device=DEV).to(dtype) * 0.5


def check_moe(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, biases: tuple | None, act: SwiGLU) -> None:
    b13, b2 = biases or (None, None)
    ref = reference_moe(x, w13, w2, weights, ids, b13_EI2=b13, b2_ED=b2, act=act, upcast_min_rows=None)
    assert_close(out, ref, x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D,I,block,apart,bias_act", [
    (1, 160, 40, (128, 128), False, False),  # one partial block along 2I and I, two along D
    (3, 160, 40, (128, 128), True, True),  # gate and up quantised apart; biases, clamped SwiGLU
    (17, 72, 40, (32, 48), True, False),  # scale blocks inside the tiles: bo=32 does not divide I=40
    (17, 72, 40, (32, 48), False, True),
    (3, 72, 24, (32, 48), True, False),  # I mod bo > bo / 2: both layouts have 2 scale rows, read apart
    (3, 72, 24, (32, 48), False, False),
])
def test_fused_moe_fp8(poison, dtype: torch.dtype, T: int, D: int, I: int, block: tuple[int, int], apart: bool,
                       bias_act: bool) -> None:
    E, K = 3, 2
    if apart:  # w1 and w3 quantised as separate matrices, codes and scales concatenated along rows
        qs, ss = zip(*(fp8_weight(I, D, block) for _ in range(2 * E)))  # w1 of each expert, then w3
        q13 = torch.stack([torch.cat((qs[e], qs[E + e])) for e in range(E)])
        s13 = torch.stack([torch.cat((ss[e], ss[E + e])) for e in range(E)])
    else:
        q13, s13 = (torch.stack(t) for t in zip(*(fp8_weight(2 * I, D, block) for _ in range(E))))
    q2, s2 = (torch.stack(t) for t in zip(*(fp8_weight(D, I, block) for _ in range(E))))
    x = torch.randn(T, D, device=DEV).to(dtype)
    weights, ids = routing(T, E, K)
    biases, act = (moe_biases(E, D, I, dtype), GPT_OSS) if bias_act else (None, SILU)
    ambiguous = I % block[0] > block[0] // 2  # (the scales' shape does not tell the layouts apart)
    if ambiguous:
        with pytest.raises(ValueError, match="say which with gate_up_apart"):
            fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, block=block, config=SMALL)
    out = fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, block=block, b13_EI2=biases and biases[0],
                        b2_ED=biases and biases[1], act=act, gate_up_apart=apart if ambiguous else None, config=SMALL)
    if apart:
        w13 = torch.stack([torch.cat((dequantize_fp8_blocks(q13[e, :I], s13[e, :s13.shape[1] // 2], block, dtype),
                                      dequantize_fp8_blocks(q13[e, I:], s13[e, s13.shape[1] // 2:], block, dtype)))
                           for e in range(E)])
    else:
        w13 = torch.stack([dequantize_fp8_blocks(q13[e], s13[e], block, dtype) for e in range(E)])
    w2 = torch.stack([dequantize_fp8_blocks(q2[e], s2[e], block, dtype) for e in range(E)])
    check_moe(out, x, w13, w2, weights, ids, biases, act)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,bias_act", [(1, True), (3, False), (17, True)])
def test_fused_moe_mxfp4(poison, dtype: torch.dtype, T: int, bias_act: bool) -> None:
    """gpt-oss's experts: biases and the clamped SwiGLU, D = 64, I = 96 (3 scale groups)."""
    E, K, D, I = 3, 2, 64, 96
    blocks13, scales13 = mxfp4_weight(E, 2 * I, D)
    blocks2, scales2 = mxfp4_weight(E, D, I)
    x = torch.randn(T, D, device=DEV).to(dtype)
    weights, ids = routing(T, E, K)
    biases, act = (moe_biases(E, D, I, dtype), GPT_OSS) if bias_act else (None, SILU)
    out = fused_moe_mxfp4(x, blocks13, scales13, blocks2, scales2, weights, ids, b13_EI2=biases and biases[0],
                          b2_ED=biases and biases[1], act=act, config=SMALL)
    check_moe(out, x, dequantize_mxfp4(blocks13, scales13, dtype), dequantize_mxfp4(blocks2, scales2, dtype),
              weights, ids, biases, act)


class FloatAllocations(TorchDispatchMode):
    """Records the largest floating-point tensor any torch op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() > 1:
                self.largest = max(self.largest, t.numel())
        return out


def test_weights_never_dequantised(poison) -> None:
    """The kernels take the codes (float8/uint8) as they are: no op of a call makes a float tensor as
    large as a weight (x, y and h are far smaller), and quant.py's dequantisers are never called."""
    import kernels.quant

    T, E, K, D, I = 2, 3, 2, 256, 128
    q13, s13 = (torch.stack(t) for t in zip(*(fp8_weight(2 * I, D, (128, 128)) for _ in range(E))))
    q2, s2 = (torch.stack(t) for t in zip(*(fp8_weight(D, I, (128, 128)) for _ in range(E))))
    blocks13, scales13 = mxfp4_weight(E, 2 * I, D)
    blocks2, scales2 = mxfp4_weight(E, D, I)
    x = torch.randn(T, D, device=DEV)
    weights, ids = routing(T, E, K)
    calls = [lambda: fp8_block_linear(x, q13[0], s13[0]), lambda: mxfp4_linear_triton(x, blocks13[0], scales13[0]),
             lambda: fused_moe_fp8(x, q13, s13, q2, s2, weights, ids),
             lambda: fused_moe_mxfp4(x, blocks13, scales13, blocks2, scales2, weights, ids)]
    mp = pytest.MonkeyPatch()
    for name in ("dequantize_fp8_blocks", "dequantize_mxfp4", "dequantize_fp4_packed", "decode_scales"):
        mp.setattr(kernels.quant, name, lambda *a, **k: pytest.fail("a weight was dequantised"))
    try:
        for call in calls:
            with FloatAllocations() as mode:
                call()
            assert 0 < mode.largest < I * D, "a float tensor the size of a weight was made"
    finally:
        mp.undo()


def test_zero_tokens_and_wrong_arguments() -> None:
    x = torch.randn(0, 64, device=DEV)
    q, s = fp8_weight(40, 64, (128, 128))
    assert fp8_block_linear(x, q, s).shape == (0, 40)
    blocks, scales = mxfp4_weight(3, 2 * 32, 64)
    blocks2, scales2 = mxfp4_weight(3, 64, 32)
    weights, ids = routing(0, 3, 2)
    assert fused_moe_mxfp4(x, blocks, scales, blocks2, scales2, weights, ids).shape == (0, 64)
    x = torch.randn(2, 64, device=DEV)
    weights, ids = routing(2, 3, 2)
    bad = [
        lambda: fp8_block_linear(x, q.float(), s),  # a float weight is not codes
        lambda: fp8_block_linear(x, q, s[:, :0]),  # scale shape
        lambda: fp8_block_linear(x, q, s, block=(128, 8)),  # K-tiles under 16
        lambda: fp8_block_linear(x[:, :48], q, s),  # I mismatch
        lambda: mxfp4_linear_triton(x, blocks[0], scales[0].int()),  # scales dtype
        lambda: mxfp4_linear_triton(x[:, :48], blocks[0], scales[0]),  # I not 2 x bytes
        lambda: fused_moe_mxfp4(x, blocks, scales, blocks2[:2], scales2[:2], weights, ids),  # E mismatch
        lambda: fused_moe_mxfp4(x, blocks, scales, blocks2, scales2, weights, ids, b13_EI2=torch.zeros(3, 64)),
        lambda: fused_moe_mxfp4(x.long(), blocks, scales, blocks2, scales2, weights, ids),
        lambda: fused_moe_fp8(x, q[None], s[None], q[None], s[None], weights, ids),  # w2 not (E, D, I)
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()
