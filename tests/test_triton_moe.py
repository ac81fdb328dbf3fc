"""Triton fused MoE (kernels/moe_triton.py) against the torch reference kernels/moe.py::fused_moe.

Interpreted on the CPU (TRITON_INTERPRET=1, set by conftest), compiled on CUDA. Inputs are fresh
random draws every run; a failure message carries torch.initial_seed() to replay it. Dimensions are
small and blocks large so the interpreted grids stay small.
"""
import pytest
import torch

from kernels.moe import fused_moe as reference_moe
from kernels.moe_triton import MoEConfig, default_config, fused_moe, moe_align_block_size
from tests.conftest import TRITON_DEVICE

pytestmark = pytest.mark.gpu

DEV = TRITON_DEVICE
SMALL = MoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1)


@pytest.fixture(autouse=True)
def fresh_seed() -> int:
    """A new nondeterministic seed per test (torch's default seed is fixed otherwise)."""
    return torch.seed()


def seed_msg() -> str:
    return f"replay with torch.manual_seed({torch.initial_seed()})"


def make_inputs(T: int, D: int, I: int, E: int, K: int, dtype: torch.dtype,
                weight_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """x, w13, w2 scaled so outputs are O(1); softmax-top-k router weights; distinct ids per token."""
    x = torch.randn(T, D, device=DEV).to(dtype)
    w13 = (torch.randn(E, 2 * I, D, device=DEV) / D ** 0.5).to(dtype)
    w2 = (torch.randn(E, D, I, device=DEV) / I ** 0.5).to(dtype)
    weights, ids = torch.randn(T, E, device=DEV).softmax(-1).topk(K, dim=-1)
    return x, w13, w2, weights.to(weight_dtype), ids


def check_against_reference(args: tuple[torch.Tensor, ...], config: MoEConfig | None, rtol: float,
                            atol_rel: float) -> None:
    out = fused_moe(*args, config=config)
    ref = reference_moe(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = ref.float().abs().max().item() or 1.0
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol_rel * scale,
                               msg=lambda m: f"{m}\n{seed_msg()}")


@pytest.mark.parametrize("T,K,E,block_m", [(1, 1, 4, 16), (2, 8, 64, 16), (37, 2, 8, 16), (64, 4, 16, 32),
                                           (5, 3, 128, 64), (0, 2, 4, 16)])
def test_align_block_size_properties(poison, T: int, K: int, E: int, block_m: int) -> None:
    ids_TK = torch.rand(T, E, device=DEV).topk(K, dim=-1).indices
    if T > 1:
        ids_TK[T // 2:] = ids_TK[0]  # repeated experts: several pairs per expert, order must be stable
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(ids_TK, block_m, E)
    N, flat = T * K, ids_TK.reshape(-1).cpu()
    assert sorted_ids.dtype == expert_ids.dtype == num_post_padded.dtype == torch.int32
    assert num_post_padded.shape == (1,) and sorted_ids.numel() == expert_ids.numel() * block_m
    counts = torch.bincount(flat, minlength=E)
    expected_padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    total = int(num_post_padded.item())
    assert total == expected_padded and total <= sorted_ids.numel(), seed_msg()
    sorted_ids, expert_ids = sorted_ids.cpu(), expert_ids.cpu()
    real = sorted_ids[sorted_ids != N]
    assert torch.equal(real.sort().values, torch.arange(N, dtype=torch.int32)), "every pair exactly once"
    assert (sorted_ids[total:] == N).all(), "past the end: sentinel only"
    assert (expert_ids[total // block_m:] == -1).all(), "blocks past the end have expert -1"
    blocks_of = torch.zeros(E, dtype=torch.int64)
    for b, e in enumerate(expert_ids[:total // block_m].tolist()):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        pairs = rows[rows != N].long()
        assert pairs.numel() > 0, f"block {b} holds only padding"
        assert (flat[pairs] == e).all(), f"block {b} mixes experts"
        assert (rows[:pairs.numel()] == pairs.int()).all(), "padding (sentinel) only at a slice's end"
        blocks_of[e] += 1
    assert torch.equal(blocks_of, (counts + block_m - 1) // block_m), "one slice per expert, empty experts none"
    for e in range(E):
        mine = real[flat[real.long()] == e]
        assert torch.equal(mine, mine.sort().values), "stable: pair order kept within an expert"


FP32_CASES = [  # (T, D, I, E, K, config)
    (1, 48, 40, 4, 1, SMALL),  # single token, top-1, non-power-of-two D and I
    (2, 96, 72, 64, 8, SMALL),  # top-8 over 64 experts: most experts get no tokens
    (70, 100, 48, 8, 2, SMALL),  # more tokens than blocks, D=100 not a multiple of BLOCK_K
    (33, 64, 40, 128, 2, MoEConfig(16, 32, 16, GROUP_M=4)),  # E=128; several column and K blocks; grouped order
    (40, 72, 100, 4, 2, MoEConfig(32, 32, 32, GROUP_M=2)),  # 20 rows per expert, BLOCK_M=32
    (24, 100, 72, 8, 2, None),  # default_config
]


@pytest.mark.parametrize("T,D,I,E,K,config", FP32_CASES)
def test_fused_moe_float32(poison, T: int, D: int, I: int, E: int, K: int, config: MoEConfig | None) -> None:
    check_against_reference(make_inputs(T, D, I, E, K, torch.float32), config, rtol=1e-4, atol_rel=1e-4)


@pytest.mark.parametrize("T,D,I,E,K,config", [(1, 48, 40, 4, 1, SMALL), (2, 96, 72, 64, 8, SMALL),
                                              (50, 100, 48, 8, 2, MoEConfig(32, 64, 32, GROUP_M=8))])
def test_fused_moe_float16(poison, T: int, D: int, I: int, E: int, K: int, config: MoEConfig) -> None:
    check_against_reference(make_inputs(T, D, I, E, K, torch.float16), config, rtol=1e-2, atol_rel=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is silently wrong under the Triton CPU interpreter")
@pytest.mark.parametrize("T,D,I,E,K", [(1, 48, 40, 4, 1), (70, 100, 48, 8, 2), (2, 96, 72, 64, 8)])
def test_fused_moe_bfloat16(poison, T: int, D: int, I: int, E: int, K: int) -> None:
    check_against_reference(make_inputs(T, D, I, E, K, torch.bfloat16), None, rtol=2e-2, atol_rel=2e-2)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.float16, 1e-2)])
def test_router_weights_in_x_dtype(poison, dtype: torch.dtype, rtol: float) -> None:
    args = make_inputs(20, 48, 40, 8, 2, dtype, weight_dtype=dtype)
    check_against_reference(args, SMALL, rtol=rtol, atol_rel=rtol)


def test_strided_inputs(poison) -> None:
    """x a column slice of a wider tensor, weights with transposed storage: strides, not contiguity."""
    x, w13, w2, weights, ids = make_inputs(9, 40, 48, 4, 2, torch.float32)
    x_wide = torch.randn(9, 64, device=DEV)
    x_wide[:, 8:48] = x
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    out = fused_moe(x_wide[:, 8:48], w13_t, w2_t, weights.t().contiguous().t(), ids, config=SMALL)
    ref = reference_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(),
                               msg=lambda m: f"{m}\n{seed_msg()}")


def test_zero_tokens(poison) -> None:
    x, w13, w2, weights, ids = make_inputs(0, 48, 40, 4, 2, torch.float32)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.shape == (0, 48) and out.dtype == torch.float32


def _bad_args(kind: str) -> tuple[torch.Tensor, ...]:
    x, w13, w2, weights, ids = make_inputs(4, 48, 40, 4, 2, torch.float32)
    return {
        "x_3d": (x[None], w13, w2, weights, ids),
        "x_int": (x.long(), w13, w2, weights, ids),
        "w13_wrong_D": (x, w13[:, :, :32], w2, weights, ids),
        "w13_odd_rows": (x, w13[:, :79], w2, weights, ids),
        "w2_wrong_I": (x, w13, w2[:, :, :16], weights, ids),
        "w2_wrong_E": (x, w13, w2[:2], weights, ids),
        "weights_dtype_mismatch": (x, w13.half(), w2, weights, ids),
        "ids_wrong_T": (x, w13, w2, weights, ids[:3]),
        "ids_float": (x, w13, w2, weights, ids.float()),
        "topk_weights_shape": (x, w13, w2, weights[:, :1], ids),
        "topk_weights_int": (x, w13, w2, ids, ids),
    }[kind]


@pytest.mark.parametrize("kind", ["x_3d", "x_int", "w13_wrong_D", "w13_odd_rows", "w2_wrong_I", "w2_wrong_E",
                                  "weights_dtype_mismatch", "ids_wrong_T", "ids_float", "topk_weights_shape",
                                  "topk_weights_int"])
def test_wrong_arguments_raise(kind: str) -> None:
    with pytest.raises(ValueError):
        fused_moe(*_bad_args(kind))


def test_config_validation_and_default_heuristic() -> None:
    for bad in (dict(BLOCK_M=8), dict(BLOCK_N=48), dict(BLOCK_K=0), dict(GROUP_M=0), dict(num_warps=3)):
        with pytest.raises(ValueError):
            MoEConfig(**bad)
    decode = default_config(4, 8, 64, 4096, 1408, torch.bfloat16)
    prefill = default_config(4096, 8, 64, 4096, 1408, torch.bfloat16)
    assert decode.BLOCK_M == 16 and prefill.BLOCK_M >= 64
    tiny = default_config(3, 2, 4, 16, 32, torch.float32)
    assert tiny.BLOCK_N == tiny.BLOCK_K == 32, "tiles clamp to the next power of two of the dims"
    unaligned = default_config(4, 8, 64, 4000, 1400, torch.float16)
    assert unaligned.BLOCK_N == unaligned.BLOCK_K == 32, "narrow tiles when strides are not multiples of 16"
    for cfg in (decode, prefill, tiny, unaligned, default_config(1, 1, 128, 7, 5, torch.float16)):
        assert min(cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K) >= 16
