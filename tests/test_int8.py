"""Weight-only INT8 (kernels/int8.py, kernels/csrc/int8_gemm.c, moe_int8.c): the codes and scales of
quantize_int8, and int8_linear's kernels (AVX2, AVX-512, AVX-512 BF16, AMX) against the torch reference
at odd shapes, bf16 and float32, with and without bias; the fused MoE block (fused_moe_int8) with each
kernel against fused_moe_packed on CpuWeight.quantized(quantize_int8(w)); the torch paths where the library is
unavailable."""
import functools
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


def test_the_default_kernel(monkeypatch):
    """Unmeasured, bf16 rows take AMX from AMX_MIN_ROWS where it runs; measured, the fused block's big
    kernel from its row count (the same panels); float32 rows the FMA kernel."""
    monkeypatch.setattr(int8, "_moe_big", {"int8": None, "fp8": None})  # whatever an earlier test's model measured
    every = frozenset((int8.AVX2, int8.AVX512, int8.BF16DOT, int8.AMX))
    assert int8._default_kernel(torch.bfloat16, int8.AMX_MIN_ROWS, every) == int8.AMX
    assert int8._default_kernel(torch.bfloat16, int8.AMX_MIN_ROWS, every - {int8.AMX}) == int8.AVX512
    assert int8._default_kernel(torch.bfloat16, int8.AMX_MIN_ROWS - 1, every) == int8.AVX512
    assert int8._default_kernel(torch.float32, 256, every) == int8.AVX512
    assert int8._default_kernel(torch.bfloat16, 256, frozenset((int8.AVX2,))) == int8.AVX2
    int8.set_moe_big(int8.BF16DOT, 5)
    assert int8._default_kernel(torch.bfloat16, 5, every) == int8.BF16DOT
    assert int8._default_kernel(torch.bfloat16, 4, every) == int8.AVX512
    assert int8._default_kernel(torch.float32, 5, every) == int8.AVX512
    assert int8._default_kernel(torch.bfloat16, 5, every - {int8.BF16DOT}) == int8.AVX512


def test_the_default_moe_kernels(monkeypatch):
    """Each expert of the fused block takes int8_linear's default kernel for few rows, and bf16 rows the
    measured big kernel from its threshold (unmeasured: AMX from AMX_MIN_ROWS where it runs); float32
    rows and kernels that do not run here fall back to the small one."""
    monkeypatch.setattr(int8, "_moe_big", {"int8": None, "fp8": None})  # whatever an earlier test's model measured
    every = frozenset((int8.AVX2, int8.AVX512, int8.BF16DOT, int8.AMX))
    assert int8._default_moe_kernels(torch.bfloat16, every) == (int8.AVX512, int8.AMX, int8.AMX_MIN_ROWS)
    assert int8._default_moe_kernels(torch.bfloat16, every - {int8.AMX})[:2] == (int8.AVX512, int8.AVX512)
    assert int8._default_moe_kernels(torch.float32, every)[:2] == (int8.AVX512, int8.AVX512)
    assert int8._default_moe_kernels(torch.bfloat16, frozenset((int8.AVX2,)))[:2] == (int8.AVX2, int8.AVX2)
    int8.set_moe_big(int8.BF16DOT, 33)
    assert int8._default_moe_kernels(torch.bfloat16, every) == (int8.AVX512, int8.BF16DOT, 33)
    assert int8._default_moe_kernels(torch.float32, every)[:2] == (int8.AVX512, int8.AVX512)
    assert int8._default_moe_kernels(torch.bfloat16, every - {int8.BF16DOT})[:2] == (int8.AVX512, int8.AVX512)
    int8.set_moe_big(None)
    assert int8._default_moe_kernels(torch.bfloat16, every)[:2] == (int8.AVX512, int8.AVX512)


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


# The fused int8 MoE block (kernels/csrc/moe_int8.c)

MOE_KERNELS = [pytest.param(None, id="default"), *KERNELS]


def _moe_weights(E: int, D: int, I: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, D, generator=g) / D ** 0.5, torch.randn(E, D, I, generator=g) / I ** 0.5


@functools.cache
def _moe_experts(E: int, D: int, I: int) -> tuple:
    """E experts' weights quantised for fused_moe_int8 and as CpuWeight.quantized lists."""
    from kernels.cpu_linear import CpuWeight

    w13, w2 = _moe_weights(E, D, I, E * D + I)
    return (int8.Int8Experts.quantize(w13, w2), [CpuWeight.quantized(int8.quantize_int8(w)) for w in w13],
            [CpuWeight.quantized(int8.quantize_int8(w)) for w in w2])


@functools.cache
def _moe_case(E: int, D: int, I: int, T: int, K: int, dtype: torch.dtype):
    """E experts (the last gets no pair), T tokens' x, top-K ids and weights (every fourth token's first
    id -1, another worker's, when T > 3), and fused_moe_packed's result on CpuWeight.quantized(quantize_int8(w)) with
    those pairs' weights 0: (experts, x, ids, weights, want)."""
    from kernels.moe import fused_moe_packed

    experts, c13, c2 = _moe_experts(E, D, I)
    g = torch.Generator().manual_seed(T * 7 + K)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    if T > 3:
        ids[::4, 0] = -1
    keep = ids >= 0
    return experts, x, ids, weights, fused_moe_packed(x, c13, c2, weights * keep, ids.clamp(min=0))


def threads_case(E: int, D: int, T: int, K: int, dtype: torch.dtype) -> tuple:
    """The thread-count tests' x (T, D) in dtype, top-K ids among the first E - 1 experts, weights."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=g)


def same_on_threads(run) -> torch.Tensor:
    """run() on 1, 2 and 3 torch threads: the three results are one, bit for bit, and not all zero."""
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(run())
    finally:
        torch.set_num_threads(before)
    assert outs[0].abs().sum() > 0
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    return outs[0]


def _moe_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: summation order (and exp's last bits); bf16: roundings of the block's intermediates too."""
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


def test_int8_expert_panels_quantise_each_row_as_quantize_int8():
    """Reordered gate/up rows (16 gate, the same 16 up, each half padded to I16) get the codes and scales
    quantize_int8 gives w13 itself, bitwise; padded rows are zero with scale 1; w2 is quantised as is."""
    E, D, I = 2, 37, 41
    w13, w2 = _moe_weights(E, D, I, 0)
    experts = int8.Int8Experts.quantize(w13.bfloat16(), w2.bfloat16())
    for e in range(E):
        p, want = experts.w13_E[e], int8.quantize_int8(w13[e].bfloat16())
        assert p.inter_padded == 48 and p.int8.out_features == 96 and p.int8.panels.shape == (6, 19, int8.PANEL, 2)
        assert torch.equal(p.int8.codes()[p.order], want.codes()) and torch.equal(p.int8.scale[p.order], want.scale)
        assert torch.equal(p.order[[0, 15, 16, 40, 41, 57, 81]], torch.tensor([0, 15, 32, 72, 16, 48, 88]))
        padded = torch.ones(96, dtype=torch.bool)
        padded[p.order] = False
        assert padded.sum() == 14 and not p.int8.codes()[padded].any() and p.int8.scale[padded].eq(1).all()
        assert torch.equal(experts.w2_E[e].int8.codes(), int8.quantize_int8(w2[e].bfloat16()).codes())
        x = torch.randn(3, D)
        torch.testing.assert_close(p.linear(x), int8.int8_linear(x, want))
    assert experts.table.shape == (4, E) and experts.table[0, 1] == experts.w13_E[1].int8.panels.data_ptr()
    assert experts.table[3, 0] == experts.w2_E[0].int8.scales.data_ptr()
    with pytest.raises(ValueError, match="2 \\* 41 rows"):
        int8.Int8ExpertPanels(w13[0][:80], True, I)
    with pytest.raises(ValueError, match="one D and I"):
        int8.Int8Experts(experts.w13_E, [int8.Int8ExpertPanels(w2[0][:, :40], False, 40)] * E)


@NEEDS_INT8
@pytest.mark.parametrize("kernel", MOE_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,K", [(1, 1), (1, 4), (3, 2), (17, 4), (64, 2), (300, 1), (300, 4)])
@pytest.mark.parametrize("E,D,I", [(6, 100, 72), (7, 57, 41)])
def test_fused_moe_int8_equals_fused_moe_packed(E, D, I, T, K, dtype, kernel):
    """One native call per block against the torch path on the same codes: D and I not multiples of
    16 (57 and 41 odd), one token to 300, top-1 to top-4, an expert with no pairs, ids -1 skipped."""
    experts, x, ids, weights, want = _moe_case(E, D, I, T, K, dtype)
    if kernel in BF16_ONLY and dtype == torch.float32:
        with pytest.raises(ValueError, match="does not run"):
            int8.fused_moe_int8(x, ids, weights, experts, kernel=kernel)
        return
    got = int8.fused_moe_int8(x, ids, weights, experts, kernel=kernel)
    assert got.dtype == dtype and got.shape == (T, D)
    _moe_close(got, want)
    if T > 3:  # tokens whose every pair is skipped get zeros; bf16 weights give the same bits
        assert torch.equal(int8.fused_moe_int8(x, ids, weights.bfloat16().float(), experts, kernel=kernel),
                           int8.fused_moe_int8(x, ids, weights.bfloat16(), experts, kernel=kernel))


@NEEDS_INT8
@pytest.mark.parametrize("kernel", MOE_KERNELS)
@pytest.mark.parametrize("D,I", [(64, 4000), (4000, 48)])
def test_fused_moe_int8_is_the_same_on_any_thread_count(D, I, kernel):
    """Every output value is one thread's, summed in one order, so 1, 2 and 3 threads give the same
    bits; ~140 rows per expert: several blocks of rows in the down GEMM (D 64, h rows of 4000) or the
    up GEMM (x rows of 4000)."""
    E, T, K = 3, 140, 2
    w13, w2 = _moe_weights(E, D, I, D + I)
    experts = int8.Int8Experts.quantize(w13, w2)
    x, ids, weights = threads_case(E, D, T, K, torch.float32 if kernel in (int8.AVX2, int8.AVX512) else torch.bfloat16)
    got = same_on_threads(lambda: int8.fused_moe_int8(x, ids, weights, experts, kernel=kernel))
    _moe_close(got, int8.fused_moe_int8_reference(x, ids, weights, experts))


def test_without_the_library_fused_moe_int8_is_the_torch_path(monkeypatch):
    """SHUTTLE_NATIVE_KERNELS=0, autograd and other dtypes: fused_moe_packed's ops on int8_linear's torch
    reference, the same as on CpuWeight.quantized(...); ids outside [0, E) left out there too."""
    experts, x, ids, weights, want = _moe_case(6, 100, 72, 17, 4, torch.bfloat16)
    monkeypatch.setenv(int8.native.ENV_VAR, "0")
    clear = lambda: (int8._library.cache_clear(), int8.native._library.cache_clear())  # noqa: E731
    clear()
    try:
        assert not int8.available()
        got = int8.fused_moe_int8(x, ids, weights, experts)
        _moe_close(got, want)
        assert torch.equal(got, int8.fused_moe_int8_reference(x, ids, weights, experts))
        one = int8.fused_moe_int8(x[:1], ids[:1], weights[:1], experts)
        _moe_close(one, want[:1])
    finally:
        monkeypatch.undo()
        clear()
    xg = x.float().requires_grad_()
    y = int8.fused_moe_int8(xg, ids, weights, experts)
    assert y.grad_fn is not None
    y16 = int8.fused_moe_int8(x.half(), ids, weights, experts)
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.float(), want.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="fused_moe_int8 takes"):
        int8.fused_moe_int8(x[:, :99], ids, weights, experts)


# w8a8: int8 activations too (quantize_rows; the VNNI kernel)

NEEDS_VNNI = pytest.mark.skipif(int8.VNNI not in int8.kernels(), reason="no AVX-512 VNNI here (the w8a8 kernel)")


def test_quantize_rows_codes_and_scales():
    """Per row: scale max |x| / 127, codes round(x * 127 / max |x|) to nearest even, |codes| <= 127, the
    row's largest value 127 exactly; a row of zeros: codes 0, scale 0; leading dims kept."""
    x = torch.randn(2, 3, 37, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    x[1, 2] = 0
    q, s = int8.quantize_rows(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and s.shape == (2, 3, 1)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.equal(s, amax / 127) and s[1, 2].item() == 0 and not q[1, 2].any()
    assert torch.equal(q.abs().amax(-1)[s[..., 0] > 0], torch.full((5,), 127, dtype=torch.int8))
    assert (q.float() * s - x).abs().le(s / 2 * (1 + 1e-6)).all()
    half = torch.tensor([[1.0, 0.5 / 127 * 3, 2.5 / 127]])  # codes 1.5 and 2.5 round to even: 2, 2
    assert int8.quantize_rows(half)[0].tolist() == [[127, 2, 2]]


def test_w8a8_linear_reference_is_the_integer_product():
    """(codes x . codes w) exactly, times the row's and the channel's scales: an odd shape whose sums pass
    2^24 (float32 would round them)."""
    I = 3001
    w = int8.quantize_int8(_weight(19, I, 1))
    x = torch.randn(5, I, generator=torch.Generator().manual_seed(2))
    q, s = int8.quantize_rows(x)
    want = (q.long() @ w.codes().long().t()).float() * s * w.scale
    assert torch.equal(int8.w8a8_linear_reference(x, w), want)
    assert int8.w8a8_linear_reference(x.bfloat16(), w).dtype == torch.bfloat16


def _w8a8_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal integer sums on both sides; exp's last bits may move a value of h across a rounding of bf16
    or of its int8 code, which moves outputs by a few of their ulps (bf16) or ~1e-3 (float32)."""
    scale = max(1.0, want.abs().max().item())
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)
    else:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-3 * scale)


@functools.cache
def _w8a8_case(E: int, D: int, I: int, T: int, K: int, dtype: torch.dtype):
    """_moe_case's experts as w8a8 and its pairs, with the torch path's result: (experts, x, ids, weights, want)."""
    experts, x, ids, weights, _ = _moe_case(E, D, I, T, K, dtype)
    w8a8 = int8.Int8Experts(experts.w13_E, experts.w2_E, act_int8=True)
    return w8a8, x, ids, weights, int8.fused_moe_int8_reference(x, ids, weights, w8a8)


@NEEDS_VNNI
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,K", [(1, 1), (1, 4), (3, 2), (17, 4), (64, 2), (300, 4)])
@pytest.mark.parametrize("E,D,I", [(6, 100, 72), (7, 57, 41), (5, 1030, 7)])
def test_fused_moe_w8a8_equals_the_torch_path(E, D, I, T, K, dtype):
    """The VNNI kernel against fused_moe_packed's ops on w8a8_linear_reference: every integer sum is
    exact on both sides, so they differ in exp's last bits and in the codes those may move; odd D and I
    (half quads, a partial last panel), a row past one chunk of quads (1030: 258 quads), one token to
    300, ids -1 skipped, an expert with no pairs."""
    experts, x, ids, weights, want = _w8a8_case(E, D, I, T, K, dtype)
    got = int8.fused_moe_int8(x, ids, weights, experts)
    assert got.dtype == dtype and got.shape == (T, D)
    _w8a8_close(got, want)
    assert torch.equal(got, int8.fused_moe_int8(x, ids, weights, experts, kernel=int8.VNNI))
    # w8a8 is not weight-only int8: the activations' codes move the result by more than summation order
    weight_only = int8.fused_moe_int8(x, ids, weights, int8.Int8Experts(experts.w13_E, experts.w2_E))
    assert not torch.equal(got, weight_only)
    torch.testing.assert_close(got.float(), weight_only.float(), rtol=0.1, atol=0.1 * weight_only.abs().max().item())


@NEEDS_VNNI
@pytest.mark.parametrize("D,I", [(64, 4000), (4000, 48)])
def test_fused_moe_w8a8_is_the_same_on_any_thread_count(D, I):
    """1, 2 and 3 threads give the same bits (each row's integer sums are exact; each output value one
    thread's); several blocks of rows in either GEMM."""
    E, T, K = 3, 140, 2
    w13, w2 = _moe_weights(E, D, I, D + I)
    experts = int8.Int8Experts.quantize(w13, w2, act_int8=True)
    x, ids, weights = threads_case(E, D, T, K, torch.bfloat16)
    got = same_on_threads(lambda: int8.fused_moe_int8(x, ids, weights, experts))
    _w8a8_close(got, int8.fused_moe_int8_reference(x, ids, weights, experts))


@NEEDS_VNNI
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_only_experts_take_vnni_from_the_measured_rows(dtype, monkeypatch):
    """Weight-only int8 experts with at least set_moe_vnni's rows in a call run VNNI, w8a8's arithmetic on
    the same codes; the others keep the weight-only kernels: each expert's share of the output equals
    its own reference. Only for bf16 rows (the rows the choice was timed on); float32 rows and an
    explicit kernel stay weight-only."""
    experts, x, ids, weights, _ = _moe_case(6, 100, 72, 17, 2, dtype)
    w8a8 = int8.Int8Experts(experts.w13_E, experts.w2_E, act_int8=True)
    monkeypatch.setattr(int8, "_moe_vnni", [0])
    int8.set_moe_vnni(7)
    counts = torch.bincount(ids[ids >= 0], minlength=6)
    big = (counts[ids] >= 7) & (ids >= 0)  # the pairs whose expert has 7 rows or more
    assert big.any() and (~big).any()
    mixed = (int8.fused_moe_int8_reference(x, ids, weights * big, w8a8).float()
             + int8.fused_moe_int8_reference(x, ids, weights * ~big, experts).float())
    weight_only = int8.fused_moe_int8_reference(x, ids, weights, experts)
    got = int8.fused_moe_int8(x, ids, weights, experts)
    assert int8.moe_kernels(experts, dtype)[3] == (7 if dtype == torch.bfloat16 else 0)
    if dtype == torch.bfloat16:
        _w8a8_close(got, mixed.to(dtype))
        assert not torch.equal(got, weight_only)
    else:
        _close(got, weight_only, 72)
    _close(int8.fused_moe_int8(x, ids, weights, experts, kernel=int8.AVX512), weight_only, 72)


def test_w8a8_kernel_choice_and_fallback(monkeypatch):
    """w8a8 experts take VNNI alone (another kernel asked for is refused, and VNNI is refused for
    weight-only experts); where VNNI does not run here they take the torch path, the same numbers."""
    experts, x, ids, weights, want = _w8a8_case(6, 100, 72, 17, 4, torch.bfloat16)
    weight_only = int8.Int8Experts(experts.w13_E, experts.w2_E)
    with pytest.raises(ValueError, match="VNNI"):
        int8.fused_moe_int8(x, ids, weights, experts, kernel=int8.AVX512)
    if int8.available():
        with pytest.raises(ValueError, match="does not run"):
            int8.fused_moe_int8(x, ids, weights, weight_only, kernel=int8.VNNI)
        assert int8.moe_kernels(experts, torch.bfloat16) == ((int8.VNNI,) * 2 + (0, 0) if int8.VNNI in int8.kernels()
                                                             else None)
        monkeypatch.setattr(int8, "_kernels_here", lambda lib: frozenset({int8.AVX2}))
    assert int8.moe_kernels(experts, torch.bfloat16) is None
    assert torch.equal(int8.fused_moe_int8(x, ids, weights, experts), want)
