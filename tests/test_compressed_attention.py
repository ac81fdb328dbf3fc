"""DeepSeek-V4's decode attention (kernels/compressed_attention.py): the torch reference against a
float64 loop over sequences written out here, and the Triton twin (kernels/compressed_attention_triton.py)
against the reference, interpreted on the CPU (float32, fp16: bf16 is wrong under the interpreter),
compiled on CUDA.

Every ring row outside a sequence's window (stale rows, other slots) and every compressed entry no
used column chooses holds NaN: neither implementation may let it reach the output.
"""
import math

import pytest
import torch

from kernels import compressed_attention
from kernels.compressed_attention import compressed_decode_attention as reference
from tests.conftest import TRITON_DEVICE

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def make_inputs(lens: list[int], valid: list[int], N: int, H: int, W: int, rate: int, block_size: int, K: int,
                dtype: torch.dtype, sinks: bool, device="cpu") -> tuple:
    """The op's arguments for sequences of lengths `lens` choosing valid[b] entries each (of the
    lens[b] // rate + 1 it may choose) in K columns, the rest -1 at random places; q is a strided view."""
    B, E = len(lens), max(1, block_size // rate)
    S = B + 2
    slot = torch.randperm(S)[:B]
    ring = torch.randn(S, W, H)
    in_window = torch.zeros(S, W, dtype=torch.bool)
    for b, n in enumerate(lens):
        in_window[slot[b], [j % W for j in range(max(0, n - W), n)]] = True
    ring[~in_window] = float("nan")
    entries = [lens[b] // rate + 1 for b in range(B)]
    M = max((e * rate - 1) // block_size + 1 for e in entries) + 1
    columns = [sorted({w * rate // block_size for w in range(e)}) for e in entries]
    P = sum(len(c) for c in columns) + 2
    order = torch.randperm(P).tolist()
    table = torch.full((B, M), -1, dtype=torch.int32)
    for b, cols in enumerate(columns):
        table[b, cols] = torch.tensor([order.pop() for _ in cols], dtype=torch.int32)
    pages = torch.randn(P, E, H)
    chosen = torch.zeros(P, E, dtype=torch.bool)
    idx = torch.full((B, K), -1, dtype=torch.int64)
    for b, v in enumerate(valid):
        assert v <= min(K, entries[b])
        ids = torch.randperm(entries[b])[:v]
        idx[b, torch.randperm(K)[:v]] = ids
        for w in ids.tolist():
            chosen[table[b, w * rate // block_size], (w * rate % block_size) // rate] = True
    pages[~chosen] = float("nan")
    q = torch.randn(B, N, H + 3)[..., :H]
    sinks_N = torch.randn(N) * 2 if sinks else None
    dev = device
    return (q.to(dev, dtype), ring.to(dev, dtype), slot.to(dev), torch.tensor(lens, device=dev), pages.to(dev, dtype),
            table.to(dev), idx.to(dev), rate, block_size, None if sinks_N is None else sinks_N.to(dev),
            1 / math.sqrt(H))


def naive(q, ring, slot, lens, pages, table, idx, rate, block_size, sinks, scale) -> torch.Tensor:
    """float64, one sequence at a time: the window's rows and the chosen entries' rows, one softmax
    with the sink column, the sink's probability dropped."""
    W, out = ring.shape[1], []
    for b in range(q.shape[0]):
        p = int(lens[b]) - 1
        rows = [ring[slot[b], j % W] for j in range(max(0, p - W + 1), p + 1)]
        rows += [pages[table[b, w * rate // block_size], (w * rate % block_size) // rate]
                 for w in idx[b].tolist() if w >= 0]
        kv = torch.stack(rows).double()
        logits = q[b].double() @ kv.T * scale
        if sinks is not None:
            logits = torch.cat((logits, sinks.double()[:, None]), dim=1)
        out.append(logits.softmax(-1)[:, :kv.shape[0]] @ kv)
    return torch.stack(out)


# (lens, valid entries per sequence, N, H, W, rate, block_size, K): sequences shorter than W, rows
# with no valid entry, rate < block_size (several entries per page) and rate > block_size (one).
CASES = [([1, 5, 9], [0, 2, 3], 3, 24, 4, 2, 4, 4),
         ([3, 1, 12, 2], [1, 0, 4, 1], 5, 40, 7, 4, 16, 5),
         ([6, 17], [1, 3], 1, 24, 1, 8, 4, 3),
         ([2, 40, 8], [1, 6, 0], 5, 24, 7, 8, 16, 7),
         ([11, 4], [2, 1], 3, 40, 4, 4, 4, 3),
         ([20, 1, 7], [5, 0, 2], 1, 40, 4, 2, 16, 6),
         ([4, 2], [0, 0], 3, 24, 7, 2, 4, 0)]  # no entry columns at all


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_reference_equals_a_loop_over_sequences(case, dtype, sinks):
    torch.manual_seed(len(case[0]) * 13 + case[2])
    args = make_inputs(*case, dtype, sinks)
    got = reference(*args)
    assert got.shape == args[0].shape and got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.double(), naive(*args), **TOL[dtype])


def test_reference_chunks_the_batch(monkeypatch):
    torch.manual_seed(1)
    args = make_inputs([3, 9, 1, 14, 6], [1, 2, 0, 3, 2], 3, 24, 4, 4, 16, 4, torch.float32, True)
    whole = reference(*args)
    monkeypatch.setattr(compressed_attention, "GATHERED_PER_CHUNK", 2 * (4 + 4) * 24)  # two sequences a chunk
    torch.testing.assert_close(reference(*args), whole, rtol=0, atol=0)


def test_rejects_bad_arguments():
    q, ring, slot, lens, pages, table, idx, rate, block_size, sinks, scale = make_inputs(
        [3], [1], 2, 24, 4, 2, 4, 2, torch.float32, False)
    with pytest.raises(ValueError, match="entries each"):
        reference(q, ring, slot, lens, pages, table, idx, 4, block_size, sinks, scale)
    with pytest.raises(ValueError, match="powers of two"):
        reference(q, ring, slot, lens, pages, table, idx, 3, block_size, sinks, scale)
    with pytest.raises(ValueError, match="share H"):
        reference(q[..., :20], ring, slot, lens, pages, table, idx, rate, block_size, sinks, scale)


def test_registered_in_the_op_table():
    from kernels.ops import torch_ops

    assert torch_ops().compressed_decode_attention is reference


TRITON_CASES = [([1, 5, 9], [0, 2, 3], 3, 24, 4, 2, 4, 4),  # (N, H, W, rate, block_size, K odd as above)
                ([3, 40], [1, 6], 5, 40, 7, 8, 4, 35),  # more than one tile of entries, -1 mid-row
                ([6, 1], [2, 0], 1, 40, 1, 4, 16, 3),
                ([4, 2], [0, 0], 3, 24, 7, 2, 4, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16]
                         + ([torch.bfloat16] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("case,sinks", [(TRITON_CASES[0], True), (TRITON_CASES[1], False), (TRITON_CASES[2], True),
                                        (TRITON_CASES[3], False)])
def test_triton_equals_reference(case, sinks, dtype):
    from kernels.compressed_attention_triton import compressed_decode_attention

    torch.manual_seed(len(case[0]) * 7 + case[2])
    args = make_inputs(*case, dtype, sinks, TRITON_DEVICE)
    got = compressed_decode_attention(*args)
    assert got.shape == args[0].shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), reference(*args).float(), **TOL[dtype])
