"""Weight-only INT8 (kernels/int8.py, kernels/csrc/int8_gemm.c): the codes and scales of
quantize_int8, and int8_linear's kernels (AVX2, AVX-512, AVX-512 BF16) against the torch reference at
odd shapes, bf16 and float32, with and without bias; the torch path where the library is unavailable."""
import logging

import pytest
import torch

import kernels.int8 as int8

NEEDS_INT8 = pytest.mark.skipif(not int8.available(), reason="int8 kernels unavailable here (no AVX2 or no cc)")
KERNELS = [pytest.param(k, id=name, marks=pytest.mark.skipif(k not in int8.kernels(), reason=f"no {name} here"))
           for k, name in ((int8.AVX2, "avx2"), (int8.AVX512, "avx512"), (int8.BF16DOT, "bf16dot"), (int8.AMX, "amx"))]
BF16_ONLY = (int8.BF16DOT, int8.AMX)


def _weight(O: int, I: int, seed: int, zero_rows: tuple[int, ...] = ()) -> torch.Tensor:
    w = torch.randn(O, I, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.01, 3, O)[:, None]
    w[list(zero_rows)] = 0
    return w


def _close(got: torch.Tensor, want: torch.Tensor, I: int) -> None:
    """float32: summation order only; bf16: also one rounding of y (each side may round a tie apart)."""
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)
    else:
        scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * I ** 0.5 * scale)


def test_quantize_int8_codes_scales_and_zero_rows():
    w = _weight(77, 1000, 0, zero_rows=(3, 76))
    q = int8.quantize_int8(w)
    assert q.panels.dtype == torch.int8 and q.panels.shape == (5, 500, int8.PANEL, 2)
    assert q.scales.dtype == torch.float32 and q.scales.shape == (80,)
    absmax = w.abs().amax(dim=1)
    want_scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    assert torch.equal(q.scale, want_scale)
    assert torch.equal(q.codes(), torch.round(w / want_scale[:, None]).clamp(-127, 127).to(torch.int8))
    assert q.scale[3] == 1 and q.scale[76] == 1 and not q.codes()[[3, 76]].any()
    assert torch.equal(q.codes().abs().amax(dim=1)[[0, 1, 50]], torch.full((3,), 127, dtype=torch.int8))
    assert q.scales[77:].eq(1).all() and not q.panels[4, :, 13:].any()  # channels 77-79 of the last panel
    # (de)quantisation error: at most half a step per element
    assert ((q.dequantize() - w).abs() <= q.scale[:, None] / 2 * (1 + 1e-6)).all()
    assert q.nbytes == 5 * 1000 * int8.PANEL + 80 * 4
    # odd I: the padded input of each pair is zero; bf16 weights quantise from their float32 values
    q_odd = int8.quantize_int8(w[:, :999].bfloat16())
    assert q_odd.panels.shape == (5, 500, int8.PANEL, 2) and not q_odd.panels[:, -1, :, 1].any()
    assert torch.equal(q_odd.codes(), int8.quantize_int8(w[:, :999].bfloat16().float()).codes())


@NEEDS_INT8
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 3, 17, 255])
@pytest.mark.parametrize("I,O", [(1000, 77), (999, 16), (1, 3), (64, 1)])
def test_int8_linear_equals_the_reference(I, O, T, dtype, kernel):
    w = int8.quantize_int8(_weight(O, I, I + O, zero_rows=(O - 1,)))
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, I, generator=g).to(dtype)
    if kernel in BF16_ONLY and dtype == torch.float32:
        with pytest.raises(ValueError, match="does not run"):
            int8.int8_linear(x, w, kernel=kernel)
        return
    for bias in (None, torch.randn(O, generator=g).to(dtype)):
        got = int8.int8_linear(x, w, bias, kernel=kernel)
        assert got.dtype == dtype and got.shape == (T, O)
        _close(got, int8.int8_linear_reference(x, w, bias), I)
        zero_row_out = torch.zeros(T, dtype=dtype) if bias is None else bias[O - 1].expand(T)
        assert torch.equal(got[:, O - 1], zero_row_out)  # a zero row gives exactly its bias


@NEEDS_INT8
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_linear_threads_leading_dims_and_strided_x(kernel, threads):
    """Rows split among threads where panels are fewer (O = 16: one panel); a (B, S, I) x; a column slice."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        for O, T in ((16, 40), (300, 9)):
            w = int8.quantize_int8(_weight(O, 130, O))
            x = torch.randn(T, 133, generator=g).to(torch.bfloat16 if kernel in BF16_ONLY else torch.float32)[:, 3:]
            _close(int8.int8_linear(x, w, kernel=kernel), int8.int8_linear_reference(x, w), 130)
            x3 = torch.randn(2, T, 130, generator=g).bfloat16()
            got = int8.int8_linear(x3, w, kernel=kernel)
            assert got.shape == (2, T, O)
            _close(got, int8.int8_linear_reference(x3, w), 130)
    finally:
        torch.set_num_threads(old)


@NEEDS_INT8
@pytest.mark.parametrize("kernel", KERNELS[:2])
def test_int8_linear_bf16_output_is_the_rounded_float32_result(kernel):
    """bf16 y is float32 y rounded to nearest even once: the kernel's float32 result for bf16-exact x."""
    w = int8.quantize_int8(_weight(77, 1000, 5))
    x = torch.randn(17, 1000).bfloat16()
    y32 = int8.int8_linear(x.float(), w, kernel=kernel)
    y16 = int8.int8_linear(x, w, kernel=kernel)
    assert torch.equal(y16, y32.bfloat16())


def test_the_default_kernel():
    every = frozenset((int8.AVX2, int8.AVX512, int8.BF16DOT, int8.AMX))
    assert int8._default_kernel(torch.bfloat16, int8.AMX_MIN_ROWS, every) == int8.AMX
    assert int8._default_kernel(torch.bfloat16, int8.AMX_MIN_ROWS, every - {int8.AMX}) == int8.AVX512
    assert int8._default_kernel(torch.bfloat16, int8.AMX_MIN_ROWS - 1, every) == int8.AVX512
    assert int8._default_kernel(torch.float32, 256, every) == int8.AVX512
    assert int8._default_kernel(torch.bfloat16, 256, frozenset((int8.AVX2,))) == int8.AVX2


def test_without_the_library_int8_linear_is_the_torch_reference(monkeypatch, caplog):
    w = int8.quantize_int8(_weight(77, 1000, 1))
    x, bias = torch.randn(3, 1000).bfloat16(), torch.randn(77)
    monkeypatch.setenv(int8.native.ENV_VAR, "0")
    clear = lambda: (int8._library.cache_clear(), int8.native._library.cache_clear())  # noqa: E731
    clear()
    try:
        with caplog.at_level(logging.INFO, logger="shuttle"):
            assert not int8.available() and not int8.avx512()
        assert "native CPU kernels off" in caplog.text
        assert torch.equal(int8.int8_linear(x, w, bias), int8.int8_linear_reference(x, w, bias))
        assert int8.int8_linear(x[:0], w).shape == (0, 77)
        monkeypatch.setenv(int8.native.ENV_VAR, "1")
        monkeypatch.setattr(int8.native.shutil, "which", lambda name: None)
        monkeypatch.delenv("CC", raising=False)
        clear()
        with caplog.at_level(logging.INFO, logger="shuttle"):
            assert not int8.available()
        assert "no C compiler" in caplog.text
        assert torch.equal(int8.int8_linear(x.float(), w), int8.int8_linear_reference(x.float(), w))
    finally:
        monkeypatch.undo()
        clear()


@NEEDS_INT8
def test_int8_linear_with_autograd_takes_the_reference():
    w = int8.quantize_int8(_weight(20, 30, 2))
    x = torch.randn(4, 30, requires_grad=True)
    y = int8.int8_linear(x, w)
    y.sum().backward()
    torch.testing.assert_close(x.grad, w.dequantize().sum(dim=0).expand(4, -1))


def test_int8_linear_rejects_a_wrong_width():
    with pytest.raises(ValueError, match="input features"):
        int8.int8_linear(torch.randn(2, 7), int8.quantize_int8(torch.randn(3, 8)))
