"""Triton paged decode attention (kernels/attention_triton.py) against the torch reference, and the
reference itself against a dense scaled_dot_product_attention. Interpreted on CPU, compiled on CUDA.

Caches are filled with NaN wherever a correct kernel must not read (unused pages, slots past a
sequence's end, the extra kv head and head-dim columns of the bigger tensor the cache is sliced
from); the reference gets the same cache with those NaNs zeroed.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TRITON_DEVICE
from kernels.attention import paged_decode_attention as reference
from kernels.attention_triton import paged_decode_attention, num_splits_heuristic

pytestmark = pytest.mark.gpu
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def paged_inputs(lens: list[int], N: int, K: int, H: int, S: int, dtype: torch.dtype = torch.float32,
                 table_dtype: torch.dtype = torch.int32, V: int | None = None) -> dict:
    """Random q and a shuffled paged cache for sequences of `lens` tokens (values of V entries, H if None).

    Returns kwargs for both implementations plus "k_clean"/"v_clean" (NaN-free copies for the
    reference). Pages of different sequences are interleaved at random; table entries past a
    sequence's last page are -1; q is a strided view and the caches are slices of bigger tensors.
    """
    dev = TRITON_DEVICE
    npages = [math.ceil(n / S) for n in lens]
    P, M = sum(npages) + 3, max(npages) + 1
    order = torch.randperm(P).tolist()
    table = torch.full((len(lens), M), -1, dtype=table_dtype)
    used = torch.zeros(P, S, dtype=torch.bool)
    for b, (n, pages) in enumerate(zip(lens, npages)):
        ids = [order.pop() for _ in range(pages)]
        table[b, :pages] = torch.tensor(ids, dtype=table_dtype)
        used[ids] = torch.arange(pages * S).view(pages, S) < n
    caches = []
    for width in (H, V or H):
        big = torch.full((P, S, K + 1, width + 5), float("nan"), dtype=dtype, device=dev)
        cache = big[:, :, 1:, :width]
        cache[used.to(dev)] = torch.randn(int(used.sum()), K, width, device=dev).to(dtype)
        caches.append(cache)
    q = torch.randn(len(lens), H, N, device=dev).to(dtype).transpose(1, 2)
    clean = [c.nan_to_num(0.0) for c in caches]
    return dict(q_BNH=q, k_cache_PSKH=caches[0], v_cache_PSKH=caches[1], block_table_BM=table.to(dev),
                seq_lens_B=torch.tensor(lens, device=dev), scale=H ** -0.5, k_clean=clean[0], v_clean=clean[1])


def check(inputs: dict, dtype: torch.dtype, sliding_window: int | None = None, num_splits: int | None = None,
          **extra) -> None:
    """The kernel against the CPU path on the NaN-free caches; extra: sinks_N, start_B."""
    args = {k: v for k, v in inputs.items() if not k.endswith("_clean")}
    out = paged_decode_attention(**args, sliding_window=sliding_window, num_splits=num_splits, **extra)
    ref_args = {**args, "k_cache_PSKH": inputs["k_clean"], "v_cache_PSKH": inputs["v_clean"]}
    expected = reference(**ref_args, sliding_window=sliding_window, **extra)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **TOL[dtype])


def mixed_lens(S: int, long: int) -> list[int]:
    """1 token, exactly one page, one page + 1, a long context (several pages and tiles), a random one."""
    return [1, S, S + 1, long, int(torch.randint(1, long + 1, ()))]


def test_reference_matches_dense_sdpa():
    """The oracle: paged reference == per-sequence SDPA on keys gathered token by token (float64)."""
    S, N, K, H, w = 4, 6, 2, 16, 5
    inputs = paged_inputs([1, 4, 5, 13], N, K, H, S, table_dtype=torch.int64)
    table, q = inputs["block_table_BM"], inputs["q_BNH"]
    for window in (None, w):
        out = reference(q, inputs["k_clean"], inputs["v_clean"], table, inputs["seq_lens_B"], inputs["scale"], window)
        for b, n in enumerate(inputs["seq_lens_B"].tolist()):
            rows = [(int(table[b, j // S]), j % S) for j in range(n)]
            keys, values = ([c[p, s] for p, s in rows] for c in (inputs["k_clean"], inputs["v_clean"]))
            k_KnH, v_KnH = (torch.stack(x, 1).double() for x in (keys, values))
            visible = torch.arange(n) > (n - 1 - window) if window else torch.ones(n, dtype=torch.bool)
            dense = F.scaled_dot_product_attention(q[b, :, None].double(), k_KnH, v_KnH, scale=inputs["scale"],
                                                   attn_mask=visible.to(q.device), enable_gqa=True)
            torch.testing.assert_close(out[b], dense[:, 0].float(), rtol=1e-5, atol=1e-6)


# (N, K, H, S, long): G = 1, 2, 4, 8, 3, 4, 2; head dims 16, 24, 64, 128, 64, 40, 256; pages 16, 8, 16, 4,
# 6 (not a power of two), 128 (bigger than a tile), 1.
SHAPES = [(4, 4, 16, 16, 150), (8, 4, 24, 8, 100), (16, 4, 64, 16, 140), (32, 4, 128, 4, 90), (3, 1, 64, 6, 200),
          (8, 2, 40, 128, 300), (4, 2, 256, 1, 70)]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("N,K,H,S,long", SHAPES)
def test_matches_reference(poison, N, K, H, S, long, dtype, num_splits):
    check(paged_inputs(mixed_lens(S, long), N, K, H, S, dtype), dtype, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [5, 17])
def test_sliding_window(poison, window, num_splits):
    S = 8
    lens = [1, 4, 8, 9, 16, 17, 40, 130, 77]  # B = 9: shorter than, equal to and past the window
    check(paged_inputs(lens, 8, 2, 64, S, table_dtype=torch.int64), torch.float32, window, num_splits)


@pytest.mark.parametrize("num_splits", [None, 8])
def test_single_long_sequence(poison, num_splits):
    """B = 1: the heuristic picks 2 splits here (M * S = 320 keys); with 8, the last ones are empty."""
    check(paged_inputs([300], 8, 2, 64, 16), torch.float32, num_splits=num_splits)


def test_more_splits_than_pages(poison):
    """Short sequences with many splits: most splits are empty and must not disturb the combine."""
    check(paged_inputs([1, 5, 17], 8, 2, 32, 8), torch.float32, num_splits=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is silently wrong under the Triton interpreter")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_bfloat16(poison, num_splits):
    check(paged_inputs(mixed_lens(16, 150), 16, 4, 128, 16, torch.bfloat16), torch.bfloat16, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("N,K,H,V,S,window", [(6, 2, 24, 16, 5, None), (3, 1, 40, 40, 4, 9), (10, 5, 48, 20, 3, 6)])
def test_narrow_values_and_first_visible_keys(poison, N, K, H, V, S, window, num_splits):
    """Values narrower than keys (MiMo-V2-Flash) and per-sequence first visible keys (Llama 4's chunk
    starts, chunks of 7 over pages of S), with and without a window and sinks; V == H as well."""
    lens = [1, 3, 7, 8, 17, 30]
    inputs = paged_inputs(lens, N, K, H, S, V=V, table_dtype=torch.int64)
    start = torch.tensor([(n - 1) // 7 * 7 for n in lens], device=inputs["q_BNH"].device)
    for extra in ({}, dict(start_B=start), dict(start_B=start.int(), sinks_N=torch.randn(N, device=start.device))):
        check(inputs, torch.float32, window, num_splits, **extra)


def test_empty_batch(poison):
    inputs = paged_inputs([3], 4, 2, 16, 4)
    q = inputs["q_BNH"][:0]
    out = paged_decode_attention(q, inputs["k_cache_PSKH"], inputs["v_cache_PSKH"], inputs["block_table_BM"][:0],
                                 inputs["seq_lens_B"][:0], 0.25)
    assert out.shape == (0, 4, 16)


def test_num_splits_heuristic():
    cpu = torch.device("cpu")  # 132 SMs assumed off CUDA
    assert num_splits_heuristic(1, 8, 32768, cpu) == 16  # one long sequence: fill the GPU
    assert num_splits_heuristic(1, 8, 200, cpu) == 1  # short context: the combine pass is not worth it
    assert num_splits_heuristic(256, 8, 32768, cpu) == 1  # batch * kv heads already fills the GPU
    assert 1 < num_splits_heuristic(8, 8, 4096, cpu) < 16


BAD = {
    "N not a multiple of K": lambda a: {**a, "q_BNH": a["q_BNH"][:, :3]},
    "head dim mismatch": lambda a: {**a, "q_BNH": a["q_BNH"][..., :8]},
    "dtype mismatch": lambda a: {**a, "q_BNH": a["q_BNH"].half()},
    "float table": lambda a: {**a, "block_table_BM": a["block_table_BM"].float()},
    "seq_lens shape": lambda a: {**a, "seq_lens_B": a["seq_lens_B"][:1]},
    "cache rank": lambda a: {**a, "k_cache_PSKH": a["k_cache_PSKH"][0]},
    "k/v shape": lambda a: {**a, "v_cache_PSKH": a["v_cache_PSKH"][:, :, :1]},
    "values wider than keys": lambda a: {**a, "v_cache_PSKH": torch.cat([a["v_cache_PSKH"]] * 2, -1)},
    "start shape": lambda a: {**a, "start_B": a["seq_lens_B"][:1]},
    "negative window": lambda a: {**a, "sliding_window": -1},
    "zero splits": lambda a: {**a, "num_splits": 0},
}


@pytest.mark.parametrize("mutate", BAD.values(), ids=BAD.keys())
def test_bad_arguments_raise(poison, mutate):
    inputs = {k: v for k, v in paged_inputs([3, 9], 4, 2, 16, 4).items() if not k.endswith("_clean")}
    with pytest.raises(ValueError):
        paged_decode_attention(**mutate(inputs))
