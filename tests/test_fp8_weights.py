"""FP8 block-quantised weights at rest (kernels/fp8_weights.py on int8_panels.h's loops): the E4M3 decode
exhaustively, the codes copied bit for bit, fp8_linear's kernels (AVX2, AVX-512, AVX-512 BF16, AMX)
against the torch reference at odd shapes with partial edge blocks, bf16 and float32, with and without
bias (AVX-512 BF16 from FOLD_ROWS rows against the weights rounded to bf16, which it computes then);
the fused MoE block (fused_moe_fp8) with each kernel against its torch path; the torch paths where the
library is unavailable."""
import ctypes
import functools
import logging

import pytest
import torch

import kernels.fp8_weights as fp8
from kernels import int8
from kernels.quant import dequantize_fp8_blocks, quantize_fp8_blocks
from tests.test_int8 import same_on_threads, threads_case

E4M3 = torch.float8_e4m3fn
NEEDS_FP8 = pytest.mark.skipif(not fp8.available(), reason="FP8 kernels unavailable here (no AVX2 or no cc)")
KERNELS = [pytest.param(k, id=name, marks=pytest.mark.skipif(k not in fp8.kernels(), reason=f"no {name} here"))
           for k, name in ((fp8.AVX2, "avx2"), (fp8.AVX512, "avx512"), (fp8.BF16DOT, "bf16dot"), (fp8.AMX, "amx"))]
BF16_ONLY = (fp8.BF16DOT, fp8.AMX)
BLOCK = (128, 128)


def _clear() -> None:
    fp8._library.cache_clear(), int8._library.cache_clear(), fp8.native._library.cache_clear()


def _checkpoint(O: int, I: int, seed: int, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's (E4M3 codes, scale_inv) with blocks of very different magnitudes, a zero block row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(O, I, generator=g) * torch.logspace(-3, 1, I)[None, :] * torch.linspace(0.01, 3, O)[:, None]
    w[:min(O, 5)] = 0
    return quantize_fp8_blocks(w, block)


@functools.cache
def _weight(O: int, I: int, seed: int = 0) -> fp8.Fp8Weight:
    return fp8.Fp8Weight.from_checkpoint(*_checkpoint(O, I, seed), BLOCK)


def _reference(x: torch.Tensor, w: fp8.Fp8Weight, bias: torch.Tensor | None = None,
               kernel: int | None = None) -> torch.Tensor:
    """fp8_linear_reference as the kernel fp8_linear runs computes it: folded for BF16DOT from FOLD_ROWS rows."""
    rows = x.numel() // w.in_features
    k = fp8._kernel(x.dtype, rows, kernel, fp8._here_for(w.block_in), "test")
    return fp8.fp8_linear_reference(x, w, bias, folded=k == fp8.BF16DOT and rows >= fp8.FOLD_ROWS)


def _close(got: torch.Tensor, want: torch.Tensor, I: int) -> None:
    """float32: summation order only; bf16: also one rounding of y (each side may round a tie apart)."""
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)
    else:
        scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * I ** 0.5 * scale)


def test_the_e4m3_decode_is_exact_for_every_finite_code():
    """The kernels' decode (byte b as the IEEE half ((b & 0x80) << 8) | ((b & 0x7F) << 7), times 2^8)
    against torch's float8_e4m3fn -> float32 on all 254 finite codes, normals and subnormals; the
    two NaN codes are the ones it gets wrong (the checkpoint check refuses them)."""
    b = torch.arange(256, dtype=torch.int32)
    half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(torch.int16).view(torch.float16)
    got, want = half.float() * 256, b.to(torch.uint8).view(E4M3).float()
    finite = (b & 0x7F) != 0x7F
    assert finite.sum() == 254 and want[finite].isfinite().all() and want[~finite].isnan().all()
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # -0.0 too
    # and in the kernels: a weight holding every finite code once, times x = 1 at each column
    if fp8.available():
        codes = b[finite].to(torch.uint8).view(E4M3).reshape(2, 127)
        w = fp8.Fp8Weight.from_checkpoint(codes, torch.ones(1, 1), BLOCK)
        for k in fp8.kernels():
            x = torch.eye(127, dtype=torch.bfloat16 if k in BF16_ONLY else torch.float32)
            assert torch.equal(fp8.fp8_linear(x, w, kernel=k).float().t(), codes.float()), k


def test_fp8_weight_from_a_checkpoint_keeps_the_codes_bit_for_bit():
    q, s = _checkpoint(130, 999, 1)
    w = fp8.Fp8Weight.from_checkpoint(q, s, BLOCK)
    assert w.panels.dtype == torch.uint8 and w.panels.shape == (9, 500, fp8.PANEL, 2)
    assert w.scales.dtype == torch.float32 and w.scales.shape == (9, 8)
    assert torch.equal(w.codes().view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(w.scales[:8], s[0].expand(8, -1)) and torch.equal(w.scales[8], s[1])  # panel 8: rows 128+
    assert torch.equal(w.dequantize(), dequantize_fp8_blocks(q, s, BLOCK))  # bitwise
    assert not w.panels[8, :, 2:].any() and not w.panels[:, -1, :, 1].any()  # rows past O, the input past odd I
    assert w.nbytes == 9 * 1000 * fp8.PANEL + 9 * 8 * 4
    # quantize: quantize_fp8_blocks' codes; blocks of 64 x 32, bf16 weights quantised from their values
    x = torch.randn(70, 100).bfloat16()
    wq = fp8.Fp8Weight.quantize(x, (64, 32))
    q2, s2 = quantize_fp8_blocks(x, (64, 32))
    assert torch.equal(wq.codes().view(torch.uint8), q2.view(torch.uint8)) and wq.scales.shape == (5, 4)
    assert torch.equal(wq.dequantize(), dequantize_fp8_blocks(q2, s2, (64, 32)))


def test_fp8_weight_refuses_what_the_kernels_cannot_take():
    q, s = _checkpoint(40, 50, 2)
    with pytest.raises(ValueError, match="scale_inv of shape"):
        fp8.Fp8Weight.from_checkpoint(q, s[:, :0], BLOCK)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.Fp8Weight.from_checkpoint(q.float(), s, BLOCK)
    with pytest.raises(ValueError, match="one scale per input block"):  # blocks of 8 rows: 2 per panel
        fp8.Fp8Weight.quantize(torch.randn(40, 50), (8, 16))
    with pytest.raises(ValueError, match="even number of inputs"):
        fp8.Fp8Weight.quantize(torch.randn(40, 50), (16, 15))
    nan = q.clone()
    nan.view(torch.uint8)[3, 7] = 0xFF
    with pytest.raises(ValueError, match="NaN codes"):
        fp8.Fp8Weight.from_checkpoint(nan, s, BLOCK)


@NEEDS_FP8
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [0, 1, 3, 17, 255])
@pytest.mark.parametrize("I,O", [(1000, 77), (999, 16), (129, 3), (1, 130)])
def test_fp8_linear_equals_the_reference(I, O, T, dtype, kernel):
    w = _weight(O, I)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, I, generator=g).to(dtype)
    if kernel in BF16_ONLY and dtype == torch.float32:
        with pytest.raises(ValueError, match="does not run"):
            fp8.fp8_linear(x, w, kernel=kernel)
        return
    for bias in (None, torch.randn(O, generator=g).to(dtype)):
        got = fp8.fp8_linear(x, w, bias, kernel=kernel)
        assert got.dtype == dtype and got.shape == (T, O)
        _close(got, _reference(x, w, bias, kernel), I)
        zero_row_out = torch.zeros(T, dtype=dtype) if bias is None else bias[0].expand(T)
        assert torch.equal(got[:, 0], zero_row_out)  # a zero row gives exactly its bias


@NEEDS_FP8
@pytest.mark.parametrize("T", [16, 17, 40])
@pytest.mark.parametrize("kernel", KERNELS)
def test_fp8_linear_kernels_multiply_by_their_weights_exactly(kernel, T):
    """Float32 output of bf16-exact x, so only float32 summation order is left, for every kernel: each
    product is exact (BF16DOT and AMX: codes in bf16, each block's sums scaled in float32; BF16DOT from
    FOLD_ROWS rows: code * scale rounded to bf16, then exact), and bf16 y is the float32 result rounded
    once."""
    w = _weight(77, 1000)
    x = torch.randn(T, 1000).bfloat16()
    want = fp8.fp8_linear_reference(x.float(), w, folded=kernel == fp8.BF16DOT and T >= fp8.FOLD_ROWS)
    got = torch.empty(T, 77)  # bf16 x, float32 y: the C entry point itself (fp8_linear returns x's dtype)
    assert fp8._library().shuttle_fp8_linear(x.data_ptr(), 1, T, 1000, w.panels.data_ptr(), w.scales.data_ptr(), 64,
                                             None, 77, got.data_ptr(), 0, 1, kernel) == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    assert torch.equal(fp8.fp8_linear(x, w, kernel=kernel), got.bfloat16())
    if kernel not in BF16_ONLY:
        assert torch.equal(fp8.fp8_linear(x.float(), w, kernel=kernel), got)


@pytest.mark.skipif(fp8.BF16DOT not in fp8.kernels(), reason="no BF16DOT here")
def test_folded_tables_are_each_code_times_its_scale_rounded_to_bf16():
    """The table BF16DOT decodes a folded block with (scaled_lut: from a few mantissas' products and exponent
    offsets where every product is normal, else one product per code) holds bf16(float32(code * scale)) of
    each of the 128 E4M3 magnitudes, as torch rounds them, bit for bit: scales at both ends of that range,
    negative ones, powers of two and random ones."""
    lib = fp8._library()
    lib.shuttle_fp8_scaled_lut.argtypes = [ctypes.c_float, ctypes.c_void_p]
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # (127: a NaN code)
    g = torch.Generator().manual_seed(0)
    scales = [2.0 ** -117, 2.0 ** -116 * 1.37, 2.0 ** 117, 2.0 ** 116 * 1.9, 1.0, 0.5, -2.0 ** -3, 3e-4, -7.1e-3,
              *(torch.rand(200, generator=g) * 2 - 1).mul(torch.logspace(-6, 3, 200)).tolist()]
    for s in scales:
        s = torch.tensor(s, dtype=torch.float32)
        lut = torch.zeros(256 + 64, dtype=torch.uint8)
        at = (-lut.data_ptr()) % 64  # 64-byte aligned, as the kernel keeps its tables
        assert lib.shuttle_fp8_scaled_lut(float(s * 256), lut.data_ptr() + at) == 0
        got = lut[at:at + 256]
        want = (codes * s).bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF
        assert torch.equal(got[:127].to(torch.int32), want & 0xFF), float(s)
        assert torch.equal(got[128:255].to(torch.int32), want >> 8), float(s)


@NEEDS_FP8
@pytest.mark.parametrize("block", [(48, 16), (16, 48), (128, 2)])
def test_fp8_linear_on_other_blocks(block):
    """Blocks other than 128 x 128: every kernel but AMX (whose blocks are whole k-steps, 32 inputs) by
    name; by default bf16 rows AVX512 there."""
    w = fp8.Fp8Weight.from_checkpoint(*_checkpoint(100, 203, 4, block), block)
    for T, dtype in ((3, torch.float32), (40, torch.bfloat16)):
        x = torch.randn(T, 203).to(dtype)
        _close(fp8.fp8_linear(x, w), _reference(x, w), 203)
        for k in fp8.kernels() - {fp8.AMX}:
            if dtype == torch.bfloat16 or k not in BF16_ONLY:
                _close(fp8.fp8_linear(x, w, kernel=k), _reference(x, w, kernel=k), 203)
    if fp8.AMX in fp8.kernels():
        with pytest.raises(ValueError, match="does not run"):
            fp8.fp8_linear(x, w, kernel=fp8.AMX)


@NEEDS_FP8
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kernel", KERNELS)
def test_fp8_linear_threads_leading_dims_and_strided_x(kernel, threads):
    """Rows split among threads where panels are fewer (O = 16: one panel); a (B, S, I) x; a column
    slice. (Not bitwise across counts: a thread's share of rows sets its tiles, and a tile's row count
    its order of summation.)"""
    old = torch.get_num_threads()
    dtype = torch.bfloat16 if kernel in BF16_ONLY else torch.float32
    try:
        g = torch.Generator().manual_seed(3)
        for O, T in ((16, 40), (300, 9)):
            w = _weight(O, 260, O)
            x = torch.randn(T, 263, generator=g).to(dtype)[:, 3:]
            torch.set_num_threads(threads)
            _close(fp8.fp8_linear(x, w, kernel=kernel), _reference(x, w, kernel=kernel), 260)
            x3 = torch.randn(2, T, 260, generator=g).bfloat16()
            got = fp8.fp8_linear(x3, w, kernel=kernel)
            assert got.shape == (2, T, O)
            _close(got, _reference(x3, w, kernel=kernel), 260)
    finally:
        torch.set_num_threads(old)


def test_without_the_library_fp8_linear_is_the_torch_reference(monkeypatch, caplog):
    w = _weight(77, 1000)
    x, bias = torch.randn(3, 1000).bfloat16(), torch.randn(77)
    monkeypatch.setenv(fp8.native.ENV_VAR, "0")
    _clear()
    try:
        with caplog.at_level(logging.INFO, logger="shuttle"):
            assert not fp8.available() and not fp8.kernels()
        assert "native CPU kernels off" in caplog.text
        assert torch.equal(fp8.fp8_linear(x, w, bias), fp8.fp8_linear_reference(x, w, bias))
        assert fp8.fp8_linear(x[:0], w).shape == (0, 77)
    finally:
        monkeypatch.undo()
        _clear()
    # an AVX2 CPU without F16C (none is known): no FP8 kernel, the reference
    if not int8.available():
        return
    monkeypatch.setattr(fp8.int8, "_kernels_here", lambda lib: frozenset({fp8.AVX2}))
    for flags, here in (({"avx2", "fma"}, frozenset()), ({"avx2", "fma", "f16c"}, frozenset({fp8.AVX2}))):
        monkeypatch.setattr(fp8.native, "cpu_flags", lambda flags=flags: frozenset(flags))
        fp8._kernels_here.cache_clear()
        try:
            assert fp8.kernels() == here and fp8.available() == bool(here)
            got = fp8.fp8_linear(x.float(), w)
            if not here:
                assert torch.equal(got, fp8.fp8_linear_reference(x.float(), w))
            _close(got, fp8.fp8_linear_reference(x.float(), w), 1000)
        finally:
            fp8._kernels_here.cache_clear()
    monkeypatch.undo()


@NEEDS_FP8
def test_fp8_linear_with_autograd_takes_the_reference_and_rejects_a_wrong_width():
    w = _weight(20, 30)
    x = torch.randn(4, 30, requires_grad=True)
    fp8.fp8_linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.dequantize().sum(dim=0).expand(4, -1))
    with pytest.raises(ValueError, match="input features"):
        fp8.fp8_linear(torch.randn(2, 7), w)


# The fused FP8 MoE block (kernels/csrc/moe_int8.c on FP8 panels)

MOE_KERNELS = [pytest.param(None, id="default"), *KERNELS]


def _moe_weights(E: int, D: int, I: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, D, generator=g) / D ** 0.5, torch.randn(E, D, I, generator=g) / I ** 0.5


@functools.cache
def _moe_case(E: int, D: int, I: int, T: int, K: int, dtype: torch.dtype):
    """E experts in blocks of 32 x 32 (several per dim, partial at the edges; the last expert gets no
    pair), T tokens' x, top-K ids and weights (every fourth token's first id -1 when T > 3), and the
    torch path's result: (experts, x, ids, weights, want)."""
    experts = fp8.Fp8Experts.quantize(*_moe_weights(E, D, I, E * D + I), block=(32, 32))
    g = torch.Generator().manual_seed(T * 7 + K)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    if T > 3:
        ids[::4, 0] = -1
    with torch.no_grad():
        want = _reference_moe(x, ids, weights, experts)
    return experts, x, ids, weights, want


def _reference_moe(x, ids, weights, experts, kernel=None):
    """fused_moe_fp8_reference with every fp8_linear the torch reference (the library off), folded for an
    expert whose rows the kernel (by default: fp8_linear's at those rows) folds (BF16DOT, FOLD_ROWS rows
    or more: kernels/csrc/moe_int8.c folds an expert's block of rows by its rows)."""
    here, reference = fp8.kernels(), fp8.fp8_linear_reference

    def by_kernel(x, w, bias=None):
        rows = x.numel() // w.in_features
        k = fp8._kernel(x.dtype, rows, kernel, here, "test")
        return reference(x, w, bias, folded=k == fp8.BF16DOT and rows >= fp8.FOLD_ROWS)

    mp = pytest.MonkeyPatch()
    mp.setattr(fp8, "fp8_linear_reference", by_kernel)
    mp.setattr(fp8, "available", lambda: False)
    try:
        return fp8.fused_moe_fp8_reference(x, ids, weights, experts)
    finally:
        mp.undo()


def _moe_close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


def test_fp8_expert_panels_keep_each_rows_codes_and_scales():
    """Gate and up rows interleaved as Int8ExpertPanels interleaves them, each with its own blocks'
    codes and scales (I = 41: up rows start inside a block of w13); padding rows are code 0."""
    E, D, I = 2, 37, 41
    w13, w2 = _moe_weights(E, D, I, 0)
    experts = fp8.Fp8Experts.quantize(w13, w2, block=(16, 16))
    for e in range(E):
        p = experts.w13_E[e]
        (q1, s1), (q3, s3) = (quantize_fp8_blocks(h, (16, 16)) for h in w13[e].chunk(2))
        want = torch.cat((dequantize_fp8_blocks(q1, s1, (16, 16)), dequantize_fp8_blocks(q3, s3, (16, 16))))
        assert p.fp8.out_features == 96 and p.fp8.panels.shape == (6, 19, fp8.PANEL, 2) and p.fp8.scales.shape == (6, 3)
        assert torch.equal(p.fp8.dequantize()[p.order], want) and torch.equal(p.order, int8.gate_up_order(I))
        padded = torch.ones(96, dtype=torch.bool)
        padded[p.order] = False
        assert padded.sum() == 14 and not p.fp8.codes().view(torch.uint8)[padded].any()
        q2, s2 = quantize_fp8_blocks(w2[e], (16, 16))
        assert torch.equal(experts.w2_E[e].fp8.dequantize(), dequantize_fp8_blocks(q2, s2, (16, 16)))
        x = torch.randn(3, D)
        torch.testing.assert_close(p.linear(x), x @ want.t(), rtol=1e-5, atol=1e-5)
    assert experts.table.shape == (4, E) and experts.table[0, 1] == experts.w13_E[1].fp8.panels.data_ptr()
    assert experts.table[3, 0] == experts.w2_E[0].fp8.scales.data_ptr()
    assert (experts.block13, experts.block2) == (16, 16)
    with pytest.raises(ValueError, match="2 \\* 41 rows"):
        fp8.Fp8ExpertPanels.quantize(w13[0][:80], True, I)
    with pytest.raises(ValueError, match="one D and I"):
        fp8.Fp8Experts(experts.w13_E, [fp8.Fp8ExpertPanels.quantize(w2[0][:, :40], False, 40)] * E)
    with pytest.raises(ValueError, match="one input block size"):
        fp8.Fp8Experts(experts.w13_E, [experts.w2_E[0], fp8.Fp8ExpertPanels.quantize(w2[1], False, I, (16, 32))])


@NEEDS_FP8
@pytest.mark.parametrize("kernel", MOE_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,K", [(1, 1), (1, 4), (3, 2), (17, 4), (64, 2), (300, 4)])
@pytest.mark.parametrize("E,D,I", [(6, 100, 72), (7, 57, 41)])
def test_fused_moe_fp8_equals_the_torch_path(E, D, I, T, K, dtype, kernel):
    """One native call per block against fused_moe_packed's ops on the torch reference: D and I not
    multiples of 16 or of the blocks (57 and 41 odd), one token to 300, top-1 to top-4, an expert with
    no pairs, ids -1 skipped."""
    experts, x, ids, weights, want = _moe_case(E, D, I, T, K, dtype)
    if kernel in BF16_ONLY and dtype == torch.float32:
        with pytest.raises(ValueError, match="does not run"):
            fp8.fused_moe_fp8(x, ids, weights, experts, kernel=kernel)
        return
    got = fp8.fused_moe_fp8(x, ids, weights, experts, kernel=kernel)
    assert got.dtype == dtype and got.shape == (T, D)
    _moe_close(got, want)


@NEEDS_FP8
@pytest.mark.parametrize("kernel", MOE_KERNELS)
@pytest.mark.parametrize("D,I", [(64, 2000), (2000, 48)])
def test_fused_moe_fp8_is_the_same_on_any_thread_count(D, I, kernel):
    """1, 2 and 3 threads give the same bits (each output value is one thread's, in one order), with
    several blocks of rows per expert in the up or the down GEMM."""
    E, T, K = 3, 140, 2
    experts = fp8.Fp8Experts.quantize(*_moe_weights(E, D, I, D + I))
    x, ids, weights = threads_case(E, D, T, K, torch.float32 if kernel in (fp8.AVX2, fp8.AVX512) else torch.bfloat16)
    got = same_on_threads(lambda: fp8.fused_moe_fp8(x, ids, weights, experts, kernel=kernel))
    _moe_close(got, _reference_moe(x, ids, weights, experts, kernel))


def test_without_the_library_fused_moe_fp8_is_the_torch_path(monkeypatch):
    experts, x, ids, weights, want = _moe_case(6, 100, 72, 17, 4, torch.bfloat16)
    monkeypatch.setenv(fp8.native.ENV_VAR, "0")
    _clear()
    try:
        assert not fp8.available()
        got = fp8.fused_moe_fp8(x, ids, weights, experts)
        assert torch.equal(got, want)
        assert torch.equal(fp8.fused_moe_fp8(x[:1], ids[:1], weights[:1], experts),
                           _reference_moe(x[:1], ids[:1], weights[:1], experts))
    finally:
        monkeypatch.undo()
        _clear()
    y = fp8.fused_moe_fp8(x.float().requires_grad_(), ids, weights, experts)
    assert y.grad_fn is not None
    with pytest.raises(ValueError, match="fused_moe_fp8 takes"):
        fp8.fused_moe_fp8(x[:, :99], ids, weights, experts)


def test_the_c_entry_points_refuse_bad_blocks():
    if not fp8.available():
        pytest.skip("no library")
    lib = fp8._library()
    assert lib.shuttle_fp8_linear(None, 0, 1, 4, None, None, 0, None, 4, None, 0, 1, fp8.AVX2) == -2
    z = ctypes.c_void_p(0)
    assert lib.shuttle_fused_moe_fp8(z, 0, 1, 4, z, z, 1, z, z, z, z, 1, 4, 0, 1, z, 1, 0, 0, 0) == -2
