"""The native bf16 GEMM for few rows (kernels/native.py, kernels/csrc/skinny_gemm.c) against torch's
float32 matmul, where cpu_linear uses it, and the fallback where it cannot run."""
import logging

import pytest
import torch

import kernels.cpu_linear as cpu_linear
import kernels.native as native
from server import LLM, SamplingParams

NEEDS_NATIVE = pytest.mark.skipif(not native.available(), reason="native kernels unavailable here (no AVX2 or no cc)")


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


@NEEDS_NATIVE
def test_bf16_checkpoint_served_in_float32_with_and_without_the_kernel(make_checkpoint, monkeypatch):
    """The decoder with the native kernel (batch 1 and a few rows per expert) gives the greedy ids of
    the oneDNN-only path, colocated and through the pools' expert worker (the same kernels/moe.py)."""
    ckpt = make_checkpoint("mixtral", dtype="bfloat16")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 14, 3], [7, 7, 2], [1, 2, 3, 4, 5, 6]]

    def ids(**kw) -> list[list[int]]:
        llm = LLM(ckpt, dtype="float32", device="cpu", num_kv_blocks=16, **kw)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()

    native_ids, pools_ids = ids(), ids(colocated=False, torch_threads=1)
    monkeypatch.setenv(native.ENV_VAR, "0")
    native._library.cache_clear()
    try:
        onednn_ids = ids()
    finally:
        native._library.cache_clear()
    assert native_ids == onednn_ids == pools_ids
