"""oneDNN-packed linears and experts (CPU inference) equal the plain torch ops, and are skipped, not
crashed on, where this CPU cannot pack a dtype (bf16 without AVX-512 BF16/AMX)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_linear import CpuWeight, PackedLinear, cpu_linear, packing_available
from kernels.moe import SwiGLU, fused_moe, fused_moe_packed, grouped_swiglu, permute, unpermute


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_packed_linear_equals_f_linear(dtype: torch.dtype, rows: int) -> None:
    if not packing_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    torch.manual_seed(0)
    lin = nn.Linear(67, 45, bias=True).to(dtype)
    x = torch.randn(rows, 67).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(PackedLinear(lin)(x), F.linear(x, lin.weight, lin.bias), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_equal_fused_moe(dtype: torch.dtype) -> None:
    if not packing_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    torch.manual_seed(0)
    E, D, I, T, K = 5, 24, 40, 11, 2
    w13, w2 = torch.randn(E, 2 * I, D).to(dtype) / 5, torch.randn(E, D, I).to(dtype) / 5
    x = torch.randn(T, D).to(dtype)
    ids = torch.randint(0, E, (T, K))
    weights = torch.rand(T, K)
    packed = fused_moe_packed(x, [CpuWeight(w) for w in w13], [CpuWeight(w) for w in w2], weights, ids)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(packed, fused_moe(x, w13, w2, weights, ids), atol=tol, rtol=tol)


@pytest.mark.parametrize("K,bias,bf16_exact", [(2, False, False), (4, True, False), (2, False, True)])
def test_one_token_packed_moe_is_bitwise_the_sorted_path(K: int, bias: bool, bf16_exact: bool) -> None:
    """fused_moe_packed's 1-row shortcut (no sort/gather/scatter) sums in the general path's order
    (bf16_exact: weights a bf16 checkpoint upcast, which the native kernel streams where it runs)."""
    if not packing_available(torch.float32):
        pytest.skip("oneDNN cannot pack float32 here")
    torch.manual_seed(1)
    E, D, I = 6, 32, 48
    cast = (lambda w: w.bfloat16().float()) if bf16_exact else (lambda w: w)
    w13 = [CpuWeight(cast(w)) for w in torch.randn(E, 2 * I, D) / 5]
    w2 = [CpuWeight(cast(w)) for w in torch.randn(E, D, I) / 5]
    b13, b2 = (torch.randn(E, 2 * I), torch.randn(E, D)) if bias else (None, None)
    act = SwiGLU(1.702, 7.0, 1.0) if bias else SwiGLU()
    for _ in range(4):
        x, ids, weights = torch.randn(1, D), torch.randperm(E)[:K][None], torch.rand(1, K)
        x_ND, perm = permute(x, ids, E)
        want = unpermute(grouped_swiglu(x_ND, perm.counts_E, w13, w2, linear=cpu_linear, b13_EI2=b13, b2_ED=b2,
                                        act=act), perm, weights)
        assert torch.equal(fused_moe_packed(x, w13, w2, weights, ids, b13_EI2=b13, b2_ED=b2, act=act), want)


def test_bf16_packing_matches_the_cpu() -> None:
    """bf16 packing is offered exactly where oneDNN has a bf16 path (else the reorder raises)."""
    assert packing_available(torch.float32) == torch.backends.mkldnn.is_available()
    assert packing_available(torch.bfloat16) == (torch.backends.mkldnn.is_available()
                                                 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not packing_available(torch.float16)
