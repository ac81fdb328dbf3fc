"""oneDNN-packed linears and experts (CPU inference) equal the plain torch ops, and are skipped, not
crashed on, where this CPU cannot pack a dtype (bf16 without AVX-512 BF16/AMX)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_linear import PackedLinear, pack_weight, packing_available
from kernels.moe import fused_moe, fused_moe_packed


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
    packed = fused_moe_packed(x, [pack_weight(w) for w in w13], [pack_weight(w) for w in w2], weights, ids)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(packed, fused_moe(x, w13, w2, weights, ids), atol=tol, rtol=tol)


def test_bf16_packing_matches_the_cpu() -> None:
    """bf16 packing is offered exactly where oneDNN has a bf16 path (else the reorder raises)."""
    assert packing_available(torch.float32) == torch.backends.mkldnn.is_available()
    assert packing_available(torch.bfloat16) == (torch.backends.mkldnn.is_available()
                                                 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not packing_available(torch.float16)
