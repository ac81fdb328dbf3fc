"""Triton MLA latent decode attention (kernels/mla_triton.py) against the torch reference, which is
itself checked against per-head attention over the expanded rows. Interpreted on CPU (float32,
fp16: bf16 is wrong under the interpreter), compiled on CUDA.

Unused pages and slots past a sequence's end hold NaN: a correct kernel never reads them (the
reference gets the same cache with those NaNs zeroed).
"""
import math

import pytest
import torch

from kernels.attention import paged_latent_decode_attention as reference
from tests.conftest import TRITON_DEVICE

pytestmark = pytest.mark.gpu
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def latent_inputs(lens: list[int], N: int, W: int, S: int, dtype: torch.dtype) -> tuple:
    """(q_BNW strided, cache with NaN where nothing may be read, the same cache zeroed there, table, lens)."""
    npages = [math.ceil(n / S) for n in lens]
    P, M = sum(npages) + 2, max(npages) + 1
    order = torch.randperm(P).tolist()
    table = torch.full((len(lens), M), -1, dtype=torch.int32)
    used = torch.zeros(P, S, dtype=torch.bool)
    for b, (n, pages) in enumerate(zip(lens, npages)):
        ids = [order.pop() for _ in range(pages)]
        table[b, :pages] = torch.tensor(ids, dtype=torch.int32)
        used[ids] = torch.arange(pages * S).view(pages, S) < n
    cache = torch.randn(P, S, W)
    cache[~used] = float("nan")
    clean = cache.nan_to_num(0.0)
    q = torch.randn(len(lens), N, W + 3)[..., :W]  # a strided view
    dev = TRITON_DEVICE
    return (q.to(dev, dtype), cache.to(dev, dtype), clean.to(dev, dtype), table.to(dev),
            torch.tensor(lens, dtype=torch.int32, device=dev))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("lens,N,C,R,S", [([1, 7, 40], 4, 20, 6, 4), ([33], 16, 48, 16, 16), ([5, 2], 20, 12, 4, 3),
                                          ([70, 9, 1], 3, 64, 8, 8)])
def test_triton_equals_reference(lens, N, C, R, S, dtype):
    from kernels.mla_triton import paged_latent_decode_attention

    torch.manual_seed(len(lens) * 7 + N)
    q, cache, clean, table, seq_lens = latent_inputs(lens, N, C + R, S, dtype)
    got = paged_latent_decode_attention(q, cache, table, seq_lens, 0.3, C)
    want = reference(q, clean, table, seq_lens, 0.3, C)
    assert got.shape == (len(lens), N, C) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_reference_equals_attention_over_rows():
    """Keys are whole rows, values their first C entries, one kv head for all query heads."""
    torch.manual_seed(0)
    q, cache, clean, table, seq_lens = latent_inputs([6, 3], 5, 14, 4, torch.float32)
    got = reference(q, clean, table, seq_lens, 0.5, 10)
    for b, n in enumerate(seq_lens.tolist()):
        rows = torch.stack([clean[table[b, j // 4], j % 4] for j in range(n)])  # (n, W)
        probs = (q[b] @ rows.T * 0.5).softmax(-1)
        torch.testing.assert_close(got[b], probs @ rows[:, :10])


def test_rejects_bad_arguments():
    from kernels.mla_triton import paged_latent_decode_attention

    q, cache, _, table, seq_lens = latent_inputs([3], 2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="same W"):
        paged_latent_decode_attention(q[..., :6], cache, table, seq_lens, 1.0, 4)
    with pytest.raises(ValueError, match="latent_dim"):
        paged_latent_decode_attention(q, cache, table, seq_lens, 1.0, 9)
