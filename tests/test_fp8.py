"""FP8 rows (kernels/fp8.py): the native loops (kernels/csrc/fp8.c), AVX2 and AVX-512, one thread and
rows split over threads, give torch's bits exactly, quantize and dequantize, on odd shapes and on the
values where e4m3 rounds, saturates or goes subnormal; and the rows come back within e4m3's step."""
import pytest
import torch

from kernels import native
from kernels.fp8 import FP8, dequantize_fp8, dequantize_fp8_torch, quantize_fp8, quantize_fp8_torch

needs_native = pytest.mark.skipif(not native.available(), reason="the native CPU kernels are not available here "
                                                                  "(no AVX2 or no C compiler)")


def _rows(T: int, D: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g) * torch.logspace(-8, 4, T)[:, None]  # rows from tiny to large
    if T > 2:
        x[1] = 0  # an all-zero row
        # where e4m3 rounds to even, goes subnormal (below 2^-6 of the scale) and saturates
        x[2, : min(D, 6)] = torch.tensor([448.0, -448.0, 2 ** -7 * 448 / 448, 3 * 2 ** -10, 1.0625, 1.1875])[: min(D, 6)]
    return x.to(dtype)


@needs_native
@pytest.mark.parametrize("avx512", [False, True], ids=["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,D", [(1, 8), (3, 5), (17, 33), (64, 2048), (0, 16), (700, 37), (521, 2017)])
def test_native_bits_are_torchs(dtype, T, D, avx512):
    if avx512 and not native.fp8_avx512():
        pytest.skip("no AVX-512 F/BW/VL here")
    x = _rows(T, D, dtype, T * 1000 + D)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # from (700, 37) rows split over both threads; (521, 2017) also with passive waits
        q, scale = native.fp8_quantize(x, avx512)
        back = native.fp8_dequantize(q, scale, avx512)
    finally:
        torch.set_num_threads(threads)
    q_ref, scale_ref = quantize_fp8_torch(x)
    assert q.dtype == FP8 and scale.dtype == dtype and scale.shape == (T, 1)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(back, dequantize_fp8_torch(q, scale))
    every = torch.arange(256, dtype=torch.uint8).view(FP8)[None].repeat(2, 1)  # every code but the NaNs
    every = every[:, (torch.arange(256) & 0x7F) != 0x7F]
    s = torch.tensor([[1.0], [0.3]], dtype=dtype)
    assert torch.equal(native.fp8_dequantize(every, s, avx512), dequantize_fp8_torch(every, s))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_come_back_within_e4m3s_step(dtype):
    x = _rows(9, 70, dtype, 5)
    q, scale = quantize_fp8(x)
    y = dequantize_fp8(q, scale)
    assert y.dtype == dtype and y.shape == x.shape and bool((y[1] == 0).all())
    err = (y.float() - x.float()).abs().amax(dim=1)
    assert bool((err <= x.float().abs().amax(dim=1) / 16 + 1e-30).all()), err  # half of a 3-bit mantissa step


def test_wrong_inputs_are_refused():
    if not native.available():
        pytest.skip("the native CPU kernels are not available here")
    with pytest.raises(ValueError, match="bf16 or float32"):
        native.fp8_quantize(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="scales"):
        native.fp8_dequantize(torch.zeros(2, 3).to(FP8), torch.ones(3, 1))
