"""Triton RMSNorm (plain and residual-fused), rotary and routing kernels against the torch references.

Interpreted on the CPU (TRITON_INTERPRET=1, set in conftest), compiled on CUDA. Fresh random
inputs every run; outputs are poisoned so that an unwritten element fails.
"""
import pytest
import torch

from kernels.rmsnorm import fused_add_rms_norm, rms_norm
from kernels.rotary import RopeConfig, RotaryEmbedding, apply_rotary_
from kernels.routing import topk_route
from tests.conftest import TRITON_DEVICE

pytestmark = pytest.mark.gpu
DEV = TRITON_DEVICE
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2),
       torch.bfloat16: dict(rtol=1e-2, atol=2e-2)}


def dtypes():
    cuda = torch.cuda.is_available()
    return [torch.float32, torch.float16,
            pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not cuda, reason="the Triton interpreter "
                                                                                     "mishandles bf16; CUDA only"))]


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (33, 100), (3, 5, 24), (130, 1024)])
def test_rms_norm(poison, shape, dtype):
    from kernels import rmsnorm_triton

    x = torch.randn(shape, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEV)).to(dtype)
    torch.testing.assert_close(rmsnorm_triton.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("T,D", [(1, 16), (9, 72), (65, 384)])
def test_fused_add_rms_norm(poison, T, D, dtype):
    from kernels import rmsnorm_triton

    x, res = torch.randn(T, D, device=DEV).to(dtype), torch.randn(T, D, device=DEV).to(dtype)
    w = torch.randn(D, device=DEV).to(dtype)
    y, r = rmsnorm_triton.fused_add_rms_norm(x, res, w, 1e-5)
    y_ref, r_ref = fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(r, r_ref, rtol=0, atol=0)  # one rounding of the same sum
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


def test_rms_norm_rejects_bad_weight():
    from kernels import rmsnorm_triton

    with pytest.raises(ValueError, match="weight has shape"):
        rmsnorm_triton.rms_norm(torch.randn(2, 8, device=DEV), torch.ones(7, device=DEV), 1e-6)


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("T,N,K,H", [(1, 4, 2, 16), (5, 3, 1, 24), (17, 8, 8, 64), (9, 6, 2, 40), (2, 32, 4, 128)])
def test_rotary_in_place(T, N, K, H, dtype):
    from kernels import rotary_triton

    rope = RotaryEmbedding(RopeConfig(theta=10000.0), H, DEV)
    cos, sin = rope(torch.randint(0, 300, (T,), device=DEV), dtype)
    # q and k as strided views of one fused projection, as a qkv matmul would produce them
    qkv = torch.randn(T, (N + 2 * K) * H, device=DEV).to(dtype)
    q, k = qkv[:, :N * H].view(T, N, H), qkv[:, N * H:(N + K) * H].view(T, K, H)
    q_ref, k_ref = apply_rotary_(q.clone(), k.clone(), cos, sin)
    v_before = qkv[:, (N + K) * H:].clone()
    q_out, k_out = rotary_triton.apply_rotary_(q, k, cos, sin)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])
    assert torch.equal(qkv[:, (N + K) * H:], v_before), "rotary wrote outside q and k"


@pytest.mark.parametrize("scoring,renormalize", [("softmax", False), ("softmax", True), ("sigmoid", True),
                                                 ("sigmoid", False), ("sqrtsoftplus", True)])
@pytest.mark.parametrize("T,E,K", [(1, 4, 1), (7, 5, 2), (33, 60, 8), (130, 8, 2), (3, 128, 8), (20, 128, 1)])
def test_topk_route(poison, T, E, K, scoring, renormalize):
    from kernels import routing_triton

    logits = torch.randn(T, E, device=DEV)
    w, ids = routing_triton.topk_route(logits, K, scoring, renormalize)
    w_ref, ids_ref = topk_route(logits, K, scoring, renormalize)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref), f"seed {torch.initial_seed()}"
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_topk_route_low_precision_logits_and_ties(poison, dtype):
    from kernels import routing_triton

    # Distinct quarter steps per row (exact in float16; random float16 draws tie now and then, and
    # among ties torch.topk's order is unspecified), then one row all tied: the kernel takes the lowest ids.
    logits = ((torch.rand(19, 16).argsort(dim=-1) - 8) / 4).to(device=DEV, dtype=dtype)
    logits[3] = 0.0
    w, ids = routing_triton.topk_route(logits, 4, "softmax", True)
    w_ref, ids_ref = topk_route(logits, 4, "softmax", True)
    untied = torch.arange(19, device=DEV) != 3
    assert torch.equal(ids[untied], ids_ref[untied]) and ids[3].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


def test_topk_route_rejects_bad_arguments():
    from kernels import routing_triton

    with pytest.raises(ValueError, match="top_k"):
        routing_triton.topk_route(torch.randn(2, 4, device=DEV), 5)
    with pytest.raises(ValueError, match="scoring"):
        routing_triton.topk_route(torch.randn(2, 4, device=DEV), 2, "relu")


def test_rms_norm_float32_weight_promotes_like_the_reference(poison):
    from kernels import rmsnorm_triton

    x, w = torch.randn(5, 40, device=DEV).to(torch.float16), torch.randn(40, device=DEV)
    got, want = rmsnorm_triton.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scoring,group_score,renormalize,scaling", [
    ("sigmoid", "top2_sum", True, 2.5),  # DeepSeek-V3 / Kimi K2
    ("softmax", "max", False, 1.0),  # DeepSeek-V2 group_limited_greedy
    ("sigmoid", "max", False, 0.5),
])
@pytest.mark.parametrize("T,E,K,G,TG", [(1, 8, 2, 4, 2), (9, 12, 3, 3, 1), (33, 64, 6, 8, 3), (5, 6, 2, 1, 1)])
def test_topk_route_grouped_with_correction_bias(poison, T, E, K, G, TG, scoring, group_score, renormalize, scaling):
    from kernels import routing_triton

    logits, bias = torch.randn(T, E, device=DEV), torch.randn(E, device=DEV) * 0.3
    kw = dict(correction_bias_E=bias, num_groups=G, topk_groups=TG, group_score=group_score, scaling=scaling)
    w, ids = routing_triton.topk_route(logits, K, scoring, renormalize, **kw)
    w_ref, ids_ref = topk_route(logits, K, scoring, renormalize, **kw)
    assert torch.equal(ids, ids_ref), f"seed {torch.initial_seed()}"
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
