"""The native kernels (kernels/native.py): the bf16 GEMM for few rows (kernels/csrc/skinny_gemm.c)
against torch's float32 matmul, where cpu_linear uses it, and the fallback where it cannot run; the
paged decode attention (kernels/csrc/paged_attention.c) against the reference and the flash path; the
argmax of greedy sampling (kernels/csrc/argmax.c) against torch's."""
import logging

import pytest
import torch

import kernels.cpu_linear as cpu_linear
import kernels.native as native
import kernels.sampling as S
from server import LLM, SamplingParams
from tests.test_cpu_attention import paged

NEEDS_NATIVE = pytest.mark.skipif(not native.available(), reason="native kernels unavailable here (no AVX2 or no cc)")
NEEDS_AVX512_BF16 = pytest.mark.skipif(not native.avx512_bf16(), reason="this CPU has no AVX-512 BF16")


@NEEDS_NATIVE
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("T,I,O", [(1, 1024, 4096), (2, 64, 4), (3, 37, 13), (16, 1000, 7), (17, 8, 5), (5, 1, 1),
                                   (1, 15, 1), (7, 129, 250)])
def test_gemm_bf16_equals_float32_matmul(T, I, O, threads):
    """Odd sizes: I not a multiple of 8 (scalar tail), O not a multiple of 4, T odd."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(T * 1000 + I + O)
        x, w = torch.randn(T, I, generator=g), torch.randn(O, I, generator=g).bfloat16()
        want = x.double() @ w.double().t()
        got = native.gemm_bf16(x, w)
        assert got.dtype == torch.float32 and got.shape == (T, O)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * I ** 0.5)
        # A non-contiguous x (a column slice) is made contiguous, not misread.
        wide = torch.randn(T, I + 3, generator=g)
        torch.testing.assert_close(native.gemm_bf16(wide[:, 3:], w).double(), wide[:, 3:].double() @ w.double().t(),
                                   rtol=1e-5, atol=1e-5 * I ** 0.5)
    finally:
        torch.set_num_threads(old)


@NEEDS_NATIVE
def test_gemm_bf16_rejects_other_dtypes_and_shapes():
    with pytest.raises(ValueError, match="bfloat16 w"):
        native.gemm_bf16(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"\(2, 7\)"):
        native.gemm_bf16(torch.randn(2, 7), torch.randn(4, 8).bfloat16())


@NEEDS_NATIVE
def test_cpu_linear_uses_the_bf16_copy_only_for_few_rows_of_bf16_exact_weights():
    exact = torch.randn(48, 40).bfloat16().float()
    w = cpu_linear.CpuWeight(exact)
    assert w.half is not None and torch.equal(w.half.float(), exact)
    assert cpu_linear.CpuWeight(torch.randn(48, 40)).half is None  # float32 values: no lossy copy
    bias = torch.randn(48)
    for rows in (1, cpu_linear.SKINNY_MAX_ROWS, cpu_linear.SKINNY_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(cpu_linear.cpu_linear(x, w, bias), x @ exact.t() + bias, rtol=1e-5, atol=1e-4)


def test_without_native_kernels_everything_takes_onednn(monkeypatch, caplog):
    """SHUTTLE_NATIVE_KERNELS=0 (or no compiler, or no AVX2): one INFO line, no bf16 copies."""
    monkeypatch.setenv(native.ENV_VAR, "0")
    native._library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="shuttle"):
            assert not native.available()
        assert any(f"{native.ENV_VAR}=0" in r.getMessage() for r in caplog.records)
        exact = torch.randn(8, 16).bfloat16().float()
        w = cpu_linear.CpuWeight(exact)
        assert w.half is None
        x = torch.randn(1, 16)
        torch.testing.assert_close(cpu_linear.cpu_linear(x, w), x @ exact.t(), rtol=1e-5, atol=1e-5)
        monkeypatch.setenv(native.ENV_VAR, "1")
        monkeypatch.setattr(native.shutil, "which", lambda name: None)
        monkeypatch.delenv("CC", raising=False)
        native._library.cache_clear()
        with caplog.at_level(logging.INFO, logger="shuttle"):
            assert not native.available()
        assert any("no C compiler" in r.getMessage() for r in caplog.records)
    finally:
        native._library.cache_clear()


@pytest.mark.parametrize("dtype", [
    pytest.param("float32", marks=NEEDS_NATIVE, id="float32-skinny-gemm"),
    pytest.param("bfloat16", marks=NEEDS_AVX512_BF16, id="bf16-fused-moe"),
])
def test_bf16_checkpoint_with_and_without_the_native_kernels(dtype, make_checkpoint, monkeypatch):
    """A bf16 checkpoint served with the native kernels gives the greedy ids of the path without them
    (SHUTTLE_NATIVE_KERNELS=0), colocated and through the pools' expert worker: in float32 the bf16
    GEMM for few rows, in bf16 (on AVX-512 BF16) the panel GEMMs and the one-call MoE block; the
    paged decode attention and RMSNorm in both."""
    ckpt = make_checkpoint("mixtral", dtype="bfloat16")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 14, 3], [7, 7, 2], [1, 2, 3, 4, 5, 6]]

    def ids(**kw) -> list[list[int]]:
        llm = LLM(ckpt, dtype=dtype, device="cpu", num_kv_blocks=16, **kw)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()

    native_ids, pools_ids = ids(), ids(colocated=False, torch_threads=1)
    monkeypatch.setenv(native.ENV_VAR, "0")
    native._library.cache_clear()
    try:
        without_ids = ids()
    finally:
        native._library.cache_clear()
    assert native_ids == without_ids == pools_ids


@NEEDS_NATIVE
@pytest.mark.parametrize("wide", [True, False], ids=["avx512", "avx2"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,K,H,S,lens,window", [
    (6, 2, 20, 5, [1, 4, 5, 6, 23, 11], None),  # G = 3, H with a scalar tail, pages of 5
    (5, 1, 24, 3, [2, 7, 30], 4),  # G = 5 (a group of 4, then 1), window shorter than a page run
    (16, 4, 64, 16, [1, 16, 17, 100, 37], 33),  # the Mixtral-like 16/4 heads
    (4, 4, 8, 128, [300, 129, 64, 65], None),  # G = 1, pages longer than the kernel's 64-slot block
    (2, 1, 128, 16, [1], None),  # batch 1, one token
])
def test_native_paged_decode_attention(N, K, H, S, lens, window, dtype, threads, wide):
    """The in-place kernel (kernels/csrc/paged_attention.c) is what paged_decode_attention runs here,
    and equals the float64 reference and the torch flash path over gathered pages, with and without
    sinks (which use its log-sum-exp), in its AVX-512 loops (H = 64, 128 where the CPU has them) and
    its AVX2 ones."""
    from kernels import attention

    args = paged(lens, K, H, S, dtype, seed=len(lens) + H)
    q = torch.randn(len(lens), H, N).to(dtype).transpose(1, 2)  # strided, as the model's views are
    calls = []
    real, threads_before = native.paged_decode_attention, torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for sinks in (None, torch.randn(N)):
            native.paged_decode_attention = lambda *a, **kw: calls.append(1) or real(*a, **kw, wide=wide)
            got = attention.paged_decode_attention(q, **args, scale=H ** -0.5, sliding_window=window, sinks_N=sinks)
            native.paged_decode_attention = real
            flash = attention._paged_flash(q, *args.values(), H ** -0.5, window, sinks).to(dtype)
            args64 = {k: v.double() if v.is_floating_point() else v for k, v in args.items()}
            ref = attention.paged_decode_attention_reference(q.double(), **args64, scale=H ** -0.5, sliding_window=window,
                                                             sinks_N=sinks).to(dtype)
            assert got.dtype == dtype and got.shape == (len(lens), N, H)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(got, ref, **tol)
            torch.testing.assert_close(got, flash, **(tol if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)))
    finally:
        native.paged_decode_attention = real
        torch.set_num_threads(threads_before)
    assert len(calls) == 2


@NEEDS_NATIVE
@pytest.mark.parametrize("wide", [True, False], ids=["avx512", "avx2"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N,K,H,V,S", [(6, 2, 48, 32, 5), (5, 1, 40, 24, 3), (4, 2, 192, 128, 16), (3, 3, 16, 8, 4)])
def test_native_decode_with_narrow_values_from_given_starts(N, K, H, V, S, threads, wide):
    """Values narrower than keys (MiMo-V2-Flash's 192/128 among them) from per-sequence first visible
    keys (Llama 4's chunk starts, any chunk size): the kernel equals the float64 reference within
    float32 rounding, in its AVX-512 loops (H, V multiples of 16) and its AVX2 ones (scalar tails)."""
    from kernels.attention import paged_decode_attention_reference

    lens = [1, 9, 70, 33, 130]
    args = paged(lens, K, H, S, torch.float32, seed=H + V, V=V)
    table, len_B = args["block_table_BM"].long(), args["seq_lens_B"].long()
    start_B = torch.tensor([0, 5, 66, 0, 77])  # the start of a chunk of 11 (or of 65, crossing a block)
    q = torch.randn(len(lens), N, H)
    ref = paged_decode_attention_reference(q.double(), args["k_cache_PSKH"].double(), args["v_cache_PSKH"].double(),
                                           table, len_B, 0.3, start_B=start_B).float()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o, lse = native.paged_decode_attention(q.view(len(lens), K, N // K, H), args["k_cache_PSKH"],
                                               args["v_cache_PSKH"], table, start_B, len_B, 0.3, wide=wide)
    finally:
        torch.set_num_threads(before)
    assert o.shape == (len(lens), K, N // K, V) and lse.shape == (len(lens), K, N // K)
    torch.testing.assert_close(o.view(len(lens), N, V), ref, rtol=1e-5, atol=1e-5)


@NEEDS_NATIVE
def test_native_paged_decode_attention_rejects_what_it_cannot_read():
    args = paged([3, 5], 2, 8, 4, torch.bfloat16)
    table, lens = args["block_table_BM"].long(), args["seq_lens_B"].long()
    q = torch.randn(2, 2, 1, 8)
    with pytest.raises(ValueError, match="float32/bf16 contiguous q"):
        native.paged_decode_attention(q.half(), args["k_cache_PSKH"], args["v_cache_PSKH"], table,
                                      torch.zeros_like(lens), lens, 1.0)
    with pytest.raises(ValueError, match="float32/bf16 contiguous q"):
        native.paged_decode_attention(q.transpose(0, 1), args["k_cache_PSKH"], args["v_cache_PSKH"], table,
                                      torch.zeros_like(lens), lens, 1.0)
    with pytest.raises(ValueError, match="int64 tables"):
        native.paged_decode_attention(q, args["k_cache_PSKH"], args["v_cache_PSKH"], table.int(),
                                      torch.zeros_like(lens), lens, 1.0)
    with pytest.raises(ValueError, match="caches"):
        native.paged_decode_attention(q, args["k_cache_PSKH"].half(), args["v_cache_PSKH"].half(), table,
                                      torch.zeros_like(lens), lens, 1.0)
    with pytest.raises(ValueError, match="caches"):  # values of other kv heads than the keys
        native.paged_decode_attention(q, args["k_cache_PSKH"], args["v_cache_PSKH"][:, :, :1], table,
                                      torch.zeros_like(lens), lens, 1.0)



@NEEDS_NATIVE
@pytest.mark.parametrize("wide", [True, False], ids=["avx512", "avx2"])
@pytest.mark.parametrize("H", [64, 40])
def test_native_paged_decode_attention_reads_and_writes_bf16_as_the_casts_would(H, wide):
    """A bf16 query read as it is and a bf16 output written by the kernel give the bits of widening the
    query with torch, running in float32 and casting the output with torch (nearest even): the casts
    around the call are gone, not changed. The log-sum-exp stays float32."""
    args = paged([3, 17, 40], 2, H, 4, torch.bfloat16)
    table, lens = args["block_table_BM"].long(), args["seq_lens_B"].long()
    q = torch.randn(3, 2, 3, H).bfloat16()
    kw = dict(wide=wide)
    o32, lse32 = native.paged_decode_attention(q.float(), args["k_cache_PSKH"], args["v_cache_PSKH"], table,
                                               torch.zeros_like(lens), lens, 0.3, **kw)
    o16, lse16 = native.paged_decode_attention(q, args["k_cache_PSKH"], args["v_cache_PSKH"], table,
                                               torch.zeros_like(lens), lens, 0.3, **kw)
    assert o16.dtype == torch.bfloat16 and lse16.dtype == torch.float32
    assert torch.equal(o16, o32.bfloat16()) and torch.equal(lse16, lse32)
    o_f, _ = native.paged_decode_attention(q, args["k_cache_PSKH"], args["v_cache_PSKH"], table,
                                           torch.zeros_like(lens), lens, 0.3, out_dtype=torch.float32, **kw)
    assert torch.equal(o_f, o32)


@NEEDS_AVX512_BF16
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("T,E,K,D,I", [(1, 4, 2, 64, 32), (3, 5, 3, 40, 24), (17, 8, 2, 66, 50), (130, 3, 2, 32, 16),
                                       (9, 6, 1, 2, 7)])
def test_fused_moe_bf16_equals_the_torch_path(T, E, K, D, I, threads):
    """The whole-block kernel (kernels/csrc/moe_avx512bf16.c) against fused_moe_packed on oneDNN's bf16
    GEMMs, which rounds to bf16 at the same places, and both against the block in float64: the
    kernel's error is the torch path's (within 1.5x). Odd sizes (D not a multiple of 32, I not of 16),
    an expert with more rows than one work item (130 tokens on 3 experts), top-1 and top-3, and ids
    of other workers (-1) skipped as run_local_experts' callers need."""
    from kernels.moe import fused_moe_packed

    experts, packed, x, ids, weights, exact = moe_case(T, E, K, D, I)
    assert packed.native is not None
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = packed(x, ids, weights)
        keep = ids >= 0
        ref = fused_moe_packed(x, [CpuWeightBf16(w) for w in experts.w13.detach()],
                               [CpuWeightBf16(w) for w in experts.w2.detach()], weights * keep,
                               ids.clamp(min=0))
    finally:
        torch.set_num_threads(threads_before)
    assert got.dtype == torch.bfloat16 and got.shape == (T, D)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    err, ref_err = (got.double() - exact).abs().mean(), (ref.double() - exact).abs().mean()
    assert err <= 1.5 * ref_err + 1e-6, (err, ref_err)


@NEEDS_AVX512_BF16
@pytest.mark.parametrize("T", [1, 40])  # (40 rows: an expert's rows may go to AMX tiles where the table says so)
def test_fused_moe_bf16_clamps_as_the_torch_path(T):
    """DeepSeek-V4's clamped SwiGLU (silu(min(gate, limit)) * clamp(up, -limit, limit)) in the native
    block's epilogue: a limit low enough to clamp most values gives the torch path's result (the same
    roundings), and what the unclamped block gives differs."""
    from kernels.moe import SwiGLU, fused_moe_packed
    from models.cpu_inference import PackedExperts

    experts, _, x, ids, weights, _ = moe_case(T, 5, 2, 64, 48)
    experts.act = SwiGLU(1.0, 0.4, 0.0)
    packed = PackedExperts(experts)
    assert packed.native is not None and packed.act.limit == 0.4
    keep = ids >= 0
    got = packed(x, ids, weights)
    ref = fused_moe_packed(x, [CpuWeightBf16(w) for w in experts.w13.detach()],
                           [CpuWeightBf16(w) for w in experts.w2.detach()], weights * keep, ids.clamp(min=0),
                           act=experts.act)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    experts.act = SwiGLU()
    assert (PackedExperts(experts)(x, ids, weights).float() - got.float()).abs().max() > 0.05


def moe_case(T: int, E: int, K: int, D: int, I: int):
    """A bf16 MoE block of E experts packed for the CPU, T tokens' rows, top-K ids (every fourth token's
    first id -1, another worker's, when T > 3) and weights, and the block in float64:
    (experts, packed, x, ids, weights, exact)."""
    from kernels.moe import fused_moe
    from kernels.ops import torch_ops
    from models.cpu_inference import PackedExperts
    from models.moe_decoder import Experts

    g = torch.Generator().manual_seed(T * 31 + D)
    experts = Experts(E, D, I, torch_ops())
    with torch.no_grad():
        experts.w13.copy_(torch.randn(E, 2 * I, D, generator=g) / D ** 0.5)
        experts.w2.copy_(torch.randn(E, D, I, generator=g) / I ** 0.5)
    experts = experts.to(torch.bfloat16)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    if T > 3:
        ids[::4, 0] = -1
    keep = ids >= 0
    exact = fused_moe(x.double(), experts.w13.detach().double(), experts.w2.detach().double(),
                      (weights * keep).double(), ids.clamp(min=0))
    return experts, PackedExperts(experts), x, ids, weights, exact


def CpuWeightBf16(w: torch.Tensor) -> cpu_linear.CpuWeight:
    return cpu_linear.CpuWeight(w.bfloat16())


@NEEDS_AVX512_BF16
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("T,I,O", [(1, 1024, 1536), (3, 64, 33), (17, 2, 5), (130, 96, 64), (9, 40, 100)])
def test_bf16_panels_gemm_equals_onednn(T, I, O, threads):
    """bf16 weights on an AVX-512 BF16 CPU are our panels (no oneDNN packing): cpu_linear's result at
    odd sizes (O not a multiple of 32, more rows than one block, tails of 1-7 rows), with a bias,
    against oneDNN's packed bf16 GEMM and float64."""
    g = torch.Generator().manual_seed(T + I + O)
    w, x, b = (torch.randn(O, I, generator=g) / I ** 0.5).bfloat16(), torch.randn(T, I, generator=g).bfloat16(), \
        torch.randn(O, generator=g).bfloat16()
    cw = cpu_linear.CpuWeight(w)
    assert cw.panels is not None and cw.packed is None
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_linear.cpu_linear(x, cw, b)
        ref = cpu_linear.packed_linear(x, cpu_linear.pack_weight(w), b)
    finally:
        torch.set_num_threads(threads_before)
    exact = x.double() @ w.double().t() + b.double()
    assert got.dtype == torch.bfloat16 and got.shape == (T, O)
    torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="gemm_bf16_panels"):
        native.gemm_bf16_panels(x.float(), cw.panels, O)


@NEEDS_NATIVE
@pytest.mark.parametrize("T,D", [(1, 1024), (16, 1024), (64, 1024), (3, 37), (5, 2), (7, 100)])
def test_native_rms_norm_rounds_as_the_torch_ops(T, D):
    """kernels/csrc/rmsnorm.c (what kernels.rmsnorm runs on the CPU outside autograd): bitwise the torch
    ops in bf16 (the add, the normalised value and the weight product rounded where they round; 64
    rows of 1024 also split over threads), within float32 rounding in float32; autograd keeps the ops."""
    import kernels.rmsnorm as R

    def ops(x, w, res=None):
        r = x if res is None else x + res
        x32 = r.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(r.dtype), r

    g = torch.Generator().manual_seed(T * D)
    for dtype in (torch.bfloat16, torch.float32):
        x, res, w = (torch.randn(*shape, generator=g).to(dtype) for shape in ((T, D), (T, D), (D,)))
        y, r = R.fused_add_rms_norm(x, res, w, 1e-6)
        y_ref, r_ref = ops(x, w, res)
        assert torch.equal(r, r_ref)
        if dtype == torch.bfloat16:
            assert torch.equal(y, y_ref) and torch.equal(R.rms_norm(x, w, 1e-6), ops(x, w)[0])
        else:
            torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    wg = torch.randn(D, requires_grad=True)
    xg = torch.randn(T, D)
    y = R.rms_norm(xg, wg, 1e-6)
    assert y.grad_fn is not None  # the torch ops, which autograd differentiates
    with pytest.raises(ValueError, match="add_rms_norm"):
        native.add_rms_norm(xg.bfloat16(), None, wg.detach(), 1e-6)


@NEEDS_NATIVE
@pytest.mark.parametrize("B,V", [(1, 4096), (4, 4097), (3, 31), (2, 32), (5, 1), (64, 1000)])
def test_native_argmax_gives_torchs_index(B, V):
    """kernels/csrc/argmax.c (kernels.sampling.greedy): torch.argmax's index on ties (the first), on
    rows all -inf or all zeros of either sign, on a NaN anywhere (the first NaN), in the scalar tail
    and the first vector, and on rows that are a slice of wider ones."""
    g = torch.Generator().manual_seed(B * V)
    wide = torch.randn(B, V + 5, generator=g)
    cases = [wide[:, :V].contiguous(), wide[:, 5:], torch.randint(0, 3, (B, V), generator=g).float(),
             torch.full((B, V), float("-inf")), torch.where(torch.rand(B, V, generator=g) < 0.5, -0.0, 0.0)]
    for at in {0, V // 2, V - 1}:
        x = torch.randn(B, V, generator=g)
        x[:, at] = float("nan")
        x[:, min(V - 1, at + 1)] = float("nan")
        cases.append(x)
        top = torch.randn(B, V, generator=g)
        top[:, at] = top.max() + 1
        cases.append(top)
    for x in cases:
        assert torch.equal(native.argmax_rows(x), x.argmax(dim=-1))
        assert torch.equal(S.greedy(x), x.argmax(dim=-1))
    assert torch.equal(S.greedy(wide[:, :V].bfloat16()), wide[:, :V].bfloat16().argmax(dim=-1))  # (torch's)
    with pytest.raises(ValueError, match="argmax_rows"):
        native.argmax_rows(wide.t())


@NEEDS_AVX512_BF16
def test_fused_moe_bf16_is_the_same_on_any_thread_count():
    """Threads split the work differently (chunks of up items claimed as they go, output panels per
    thread, each prefetching the panel it takes next), but every output value is one thread's, summed
    in one order: 1, 2 and 3 threads give the same bits. 70 tokens on 5 experts: several row tiles
    per panel, an expert with no rows, ids of other workers."""
    from kernels import native
    from kernels.cpu_linear import ExpertPanels

    g = torch.Generator().manual_seed(5)
    E, D, I, T = 5, 96, 80, 70
    w13 = [ExpertPanels(torch.randn(2 * I, D, generator=g) / D ** 0.5, True, I) for _ in range(E)]
    w2 = [ExpertPanels(torch.randn(D, I, generator=g) / I ** 0.5, False, I) for _ in range(E)]
    p13, p2 = (torch.tensor([p.panels.data_ptr() for p in ws]) for ws in (w13, w2))
    x = torch.randn(T, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:2] for _ in range(T)])  # expert E-1 gets none
    ids[::7, 1] = -1
    weights = torch.rand(T, 2, generator=g)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(native.fused_moe_bf16(x, ids, weights, p13, p2, w13[0].inter_padded))
    finally:
        torch.set_num_threads(before)
    assert outs[0].abs().sum() > 0
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@NEEDS_NATIVE
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,N,K,H,R", [(1, 16, 4, 64, 64), (300, 4, 2, 64, 64), (5, 3, 1, 40, 20), (7, 2, 2, 32, 16)])
def test_native_rotary_gives_the_torch_ops_bits(T, N, K, H, R, dtype, threads):
    """kernels/csrc/rotary.c, which apply_rotary_ runs here, rotates q and k in place to the very bits
    of the torch ops (bf16: each product and the sum rounded; float32: products not fused into the
    add): q and k strided views of one fused projection, partial rotary (R < H: the first R dims of
    each head, a strided view), half widths with a scalar tail (10, 8 + 2), and 300 tokens (threads)."""
    from kernels import rotary

    g = torch.Generator().manual_seed(T + R)
    qkv = torch.randn(T, (N + 2 * K) * H, generator=g).to(dtype)
    q, k = qkv[:, :N * H].view(T, N, H)[..., :R], qkv[:, N * H:(N + K) * H].view(T, K, H)[..., :R]
    angle = torch.rand(T, R, generator=g) * 100
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    want_q, want_k = rotary.apply_rotary(q, k, cos, sin)
    before_qkv = qkv.clone()
    calls, real = [], native.rotary_
    native.rotary_ = lambda *a: calls.append(1) or real(*a)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got_q, got_k = rotary.apply_rotary_(q, k, cos, sin)
    finally:
        native.rotary_ = real
        torch.set_num_threads(threads_before)
    assert calls and got_q.data_ptr() == q.data_ptr()
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    untouched = torch.ones_like(qkv, dtype=torch.bool)
    untouched.view(T, N + 2 * K, H)[:, :N + K, :R] = False  # only the rotated dims of q and k change
    assert torch.equal(qkv[untouched], before_qkv[untouched])


@NEEDS_AVX512_BF16
def test_expert_worker_runs_its_rows_through_the_native_block_as_they_are():
    """run_local_experts hands an expert worker's rows straight to the native block (ids of other
    workers' experts are -1): the same bits as running its (row, expert) pairs as one-expert tokens
    and adding them per row, which is what it does for every other module; a row with no local
    expert gets zeros."""
    from m2n_comm.m2n import ExpertBatch, run_local_experts
    from models.cpu_inference import PackedExperts
    from models.moe_decoder import Experts
    from kernels.ops import torch_ops

    g = torch.Generator().manual_seed(3)
    E, D, I, R = 4, 64, 48, 9
    experts = Experts(E, D, I, torch_ops())
    with torch.no_grad():
        experts.w13.copy_(torch.randn(E, 2 * I, D, generator=g) / D ** 0.5)
        experts.w2.copy_(torch.randn(E, D, I, generator=g) / I ** 0.5)
    packed = PackedExperts(experts.to(torch.bfloat16))
    assert packed.native is not None
    x = torch.randn(R, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(R)])
    ids[ids >= 3] = -1  # expert 3 lives on another worker
    ids[0] = -1  # so does all of row 0's
    w = torch.rand(R, 2, generator=g)
    got = run_local_experts(packed, ExpertBatch(0, 0, 0, x, ids, w, [R], 0))
    pairs = (ids.reshape(-1) >= 0).nonzero().squeeze(1)
    rows = pairs // 2
    y = packed(x[rows], ids.reshape(-1)[pairs][:, None], w.reshape(-1)[pairs][:, None])
    want = torch.zeros_like(x).index_add_(0, rows, y)
    assert torch.equal(got, want) and not got[0].any() and got[1:].abs().sum() > 0


@NEEDS_NATIVE
def test_native_rotary_tells_autograd_it_wrote_in_place():
    """The native rotary writes q and k through their data pointers; like the torch path's copy_, it
    bumps their version counters, so a backward that saved q before the rotation refuses to run
    instead of computing gradients from the rotated values."""
    from kernels import rotary

    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    cos, sin = torch.ones(3, 8), torch.zeros(3, 8)
    w = torch.randn(8, 4, requires_grad=True)
    y = (q @ w).sum()  # saves q for w's gradient
    calls, real = [], native.rotary_
    native.rotary_ = lambda *a: calls.append(1) or real(*a)
    try:
        rotary.apply_rotary_(q, k, cos, sin)
    finally:
        native.rotary_ = real
    assert calls
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_native_parallel_only_keeps_torch_on_one_thread_and_the_kernels_on_all():
    """Inside native_parallel_only torch's own ops get one thread and the native kernels the count
    torch had; torch_parallel gives torch its threads back within; both restore on exit (also on an
    error), nest, keep the native count per thread, and do nothing when off or at one thread."""
    import threading

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with native.native_parallel_only():
            assert (torch.get_num_threads(), native.threads()) == (1, 2)
            with native.torch_parallel():
                assert (torch.get_num_threads(), native.threads()) == (2, 2)
            with native.native_parallel_only():  # nested: still the outer count for the kernels
                assert (torch.get_num_threads(), native.threads()) == (1, 2)
            assert (torch.get_num_threads(), native.threads()) == (1, 2)
            seen = []
            other = threading.Thread(target=lambda: seen.append(native.threads() == torch.get_num_threads()))
            other.start(), other.join()
            assert seen == [True]  # another thread's native count follows its own torch count
        assert (torch.get_num_threads(), native.threads()) == (2, 2)
        with pytest.raises(RuntimeError):
            with native.native_parallel_only():
                raise RuntimeError("boom")
        assert (torch.get_num_threads(), native.threads()) == (2, 2)
        with native.native_parallel_only(on=False):
            assert (torch.get_num_threads(), native.threads()) == (2, 2)
        with native.torch_parallel():  # outside: nothing to undo
            assert (torch.get_num_threads(), native.threads()) == (2, 2)
        torch.set_num_threads(1)
        with native.native_parallel_only():
            assert (torch.get_num_threads(), native.threads()) == (1, 1)
    finally:
        torch.set_num_threads(before)


@NEEDS_AVX512_BF16
def test_passive_decode_steps_run_torch_on_one_thread_and_give_the_same_ids(make_checkpoint, monkeypatch):
    """Under passive OpenMP waits (the pools on one host) a bf16 model whose decode work is all native
    runs its decode steps with torch on one thread and the native kernels on both (the LM head's cast
    on both), prefill steps as before, and greedy ids equal those of the same engine without it."""
    ckpt = make_checkpoint("mixtral", dtype="bfloat16")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 14, 3], [7, 7, 2], [1, 2, 3, 4, 5, 6]]
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    seen = []
    attend = native.paged_decode_attention

    def spy(*args, **kw):
        seen.append((torch.get_num_threads(), native.threads()))
        return attend(*args, **kw)

    monkeypatch.setattr(native, "paged_decode_attention", spy)
    before = torch.get_num_threads()
    # (the eager step, as an attention worker runs it: colocated, the native decode step would run
    # the whole step in C, tests/test_native_decode.py)
    llm = LLM(ckpt, device="cpu", num_kv_blocks=16, torch_threads=2, native_decode=False)
    try:
        runner = llm.engine.runner
        assert runner.narrow_decode
        logits = runner.model.logits
        heads = []
        monkeypatch.setattr(runner.model, "logits", lambda h: heads.append(torch.get_num_threads()) or logits(h))
        narrowed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert seen and set(seen) == {(1, 2)} and set(heads) == {2}
        runner.narrow_decode = False
        seen.clear()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == narrowed
        assert set(seen) == {(2, 2)}
    finally:
        llm.shutdown()
        torch.set_num_threads(before)
