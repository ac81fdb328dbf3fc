"""The CPU attention paths (kernels/attention.py: flash-kernel decode over gathered pages, the prefill
path) against the plain references, on odd shapes: contexts that are not multiples of the page size,
batch 1, head counts that are not powers of two, windows shorter and longer than a page, sinks, MLA
latent rows, values narrower than keys, per-sequence first visible keys (chunk starts), bf16 and
float32, and the chunked path for large batches."""
import math

import pytest
import torch

from kernels import native
from kernels.attention import (_decode_attention_reference, _paged_flash, _paged_native, cached_attention,
                               cached_attention_reference,
                               paged_decode_attention, paged_decode_attention_reference,
                               paged_latent_decode_attention, paged_latent_decode_attention_reference)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def paged(lens: list[int], K: int, H: int, S: int, dtype: torch.dtype, seed: int = 0, V: int | None = None) -> dict:
    """A shuffled paged cache of `lens` tokens per sequence (table padded with -1 past each end,
    pages of different sequences interleaved, stale values in unused slots); values of V entries
    (None: H)."""
    g = torch.Generator().manual_seed(seed)
    npages = [math.ceil(n / S) for n in lens]
    P, M = sum(npages) + 2, max(npages) + 1
    order = torch.randperm(P, generator=g).tolist()
    table = torch.full((len(lens), M), -1, dtype=torch.int32)
    for b, pages in enumerate(npages):
        table[b, :pages] = torch.tensor([order.pop() for _ in range(pages)], dtype=torch.int32)
    k, v = (torch.randn(P, S, K, width, generator=g).to(dtype) for width in (H, V or H))
    return dict(k_cache_PSKH=k, v_cache_PSKH=v, block_table_BM=table, seq_lens_B=torch.tensor(lens))


# (N, K, H, S, lens): G = 3 with 6 heads, N = K = 3 (G = 1), G = 4 at the Mixtral-like 16/4, batch 1
CASES = [(6, 2, 20, 5, [1, 4, 5, 6, 23, 11]), (3, 3, 16, 4, [9]), (16, 4, 64, 16, [1, 16, 17, 100, 37]),
         (5, 1, 24, 3, [2, 7, 30])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 3, 17])
@pytest.mark.parametrize("N,K,H,S,lens", CASES)
def test_paged_decode_matches_reference(N, K, H, S, lens, window, dtype):
    args = paged(lens, K, H, S, dtype)
    q = torch.randn(len(lens), H, N).to(dtype).transpose(1, 2)  # a strided query, as the model's views are
    got = paged_decode_attention(q, **args, scale=H ** -0.5, sliding_window=window)
    ref = paged_decode_attention_reference(q, **args, scale=H ** -0.5, sliding_window=window)
    assert got.dtype == dtype and got.shape == (len(lens), N, H)
    if dtype == torch.float32:  # the reference in float64: bf16's reference rounds its scores to bf16
        ref = paged_decode_attention_reference(q.double(), **{k: v.double() if v.is_floating_point() else v
                                                              for k, v in args.items()},
                                               scale=H ** -0.5, sliding_window=window).float()
    torch.testing.assert_close(got, ref, **TOL[dtype])


def _float64(args: dict) -> dict:
    return {k: v.double() if v.is_floating_point() else v for k, v in args.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [1, 3, 17])
@pytest.mark.parametrize("N,K,H,V,S,chunk,window", [
    (6, 2, 24, 16, 5, 7, None),  # V < H, chunks of 7 over pages of 5
    (10, 5, 48, 32, 4, 6, 5),  # G = 2 over 5 kv heads, V and H multiples of 16 (AVX-512 loops), a window too
    (3, 3, 20, 20, 3, 8, None),  # V == H, G = 1
    (5, 1, 40, 24, 16, 5, None),  # G = 5, chunks shorter than a page
])
def test_paged_decode_narrow_values_and_first_visible_keys(N, K, H, V, S, chunk, window, B, dtype):
    """Values narrower than keys (MiMo-V2-Flash) and each sequence seeing keys from its chunk's start
    (Llama 4, start_B), with sinks: the op, its native and its flash path against the float64 oracle."""
    g = torch.Generator().manual_seed(B * H + V)
    lens = [1, 7, 8][:B] if B < 17 else torch.randint(1, 5 * chunk, (B,), generator=g).tolist()
    args = paged(lens, K, H, S, dtype, seed=B, V=V)
    q = torch.randn(B, H, N, generator=g).to(dtype).transpose(1, 2)  # strided, as the model's views are
    start = (args["seq_lens_B"] - 1) // chunk * chunk
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for kw in (dict(start_B=start), dict(start_B=start.int(), sinks_N=torch.randn(N, generator=g)), {}):
        ref = paged_decode_attention_reference(q.double(), **_float64(args), scale=0.3, sliding_window=window,
                                               **kw).to(dtype)
        flash = _paged_flash(q, *args.values(), 0.3, window, kw.get("sinks_N"), start_B=kw.get("start_B"))
        paths = [paged_decode_attention(q, **args, scale=0.3, sliding_window=window, **kw), flash.to(dtype)]
        if native.available():
            paths.append(_paged_native(q, *args.values(), 0.3, window, kw.get("sinks_N"), kw.get("start_B")))
        for got in paths:
            assert got.dtype == dtype and got.shape == (B, N, V)
            torch.testing.assert_close(got, ref, **tol)


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,K,H,S", [(6, 2, 64, 16), (12, 2, 48, 5), (5, 1, 20, 3), (80, 2, 32, 4)])
def test_native_decode_rows_of_one_sequence_equal_each_row_alone(N, K, H, S, dtype):
    """A verify step's rows (one sequence at consecutive lengths, the same pages) are one work item per
    kv head in the native kernel, reading each key once for all of them: every row's output and
    log-sum-exp equal, bit for bit, the row's own call at batch 1, beside single rows, a run cut short
    by a window's start and a run longer than one item holds (G = 40 takes one row per item)."""
    g = torch.Generator().manual_seed(N + H)
    runs = [(70, 4), (9, 1), (130, 8), (31, 3)]  # (context before the run, its rows)
    lens, tables, P = [], [], 200
    order = torch.randperm(P, generator=g).tolist()
    for ctx, rows in runs:
        pages = [order.pop() for _ in range(math.ceil((ctx + rows) / S))]
        for r in range(rows):
            lens.append(ctx + r + 1)
            tables.append(pages)
    M = max(map(len, tables))
    table = torch.tensor([t + [-1] * (M - len(t)) for t in tables], dtype=torch.int64)
    k, v = (torch.randn(P, S, K, H, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(lens), K, N // K, H, generator=g).to(dtype)
    length = torch.tensor(lens, dtype=torch.int64)
    for start in (torch.zeros(len(lens), dtype=torch.int64), (length - 20).clamp(min=0)):  # (a window: starts differ)
        o, lse = native.paged_decode_attention(q, k, v, table, start, length, 0.125)
        for b in range(len(lens)):
            o1, lse1 = native.paged_decode_attention(q[b:b + 1].contiguous(), k, v, table[b:b + 1].contiguous(),
                                                     start[b:b + 1].contiguous(), length[b:b + 1].contiguous(), 0.125)
            assert torch.equal(o[b:b + 1], o1) and torch.equal(lse[b:b + 1], lse1), (b, lens[b])


@pytest.mark.parametrize("window", [None, 6])
def test_paged_decode_sinks_and_chunks(window):
    N, K, H, S, lens = 6, 2, 16, 4, [3, 1, 13, 8, 21]
    args = paged(lens, K, H, S, torch.float32, seed=1)
    q, sinks = torch.randn(len(lens), N, H), torch.randn(N)
    ref = paged_decode_attention_reference(q, **args, scale=0.3, sliding_window=window, sinks_N=sinks)
    got = paged_decode_attention(q, **args, scale=0.3, sliding_window=window, sinks_N=sinks)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    one_seq = 2 * 6 * S * K * H * 4  # the gathered bytes of one sequence (6 pages): chunks of 2 sequences
    chunked = _paged_flash(q, **args, scale=0.3, sliding_window=window, sinks_N=sinks, chunk_bytes=2 * one_seq)
    torch.testing.assert_close(chunked, ref, rtol=1e-5, atol=1e-5)
    empty = paged_decode_attention(q[:0], args["k_cache_PSKH"], args["v_cache_PSKH"], args["block_table_BM"][:0],
                                   args["seq_lens_B"][:0], 0.3)
    assert empty.shape == (0, N, H)


def test_decode_layout_is_reused_only_while_valid():
    """The gather layout is computed once per step (same table and lengths, every layer) and
    recomputed for other tensors, an in-place change, another window or dtype."""
    N, K, H, S, lens = 6, 2, 16, 4, [3, 9, 13]
    args = paged(lens, K, H, S, torch.float32, seed=2)
    q = torch.randn(len(lens), N, H)

    def check(window=None, **over):
        a = {**args, **over}
        ref = paged_decode_attention_reference(q, **a, scale=0.3, sliding_window=window)
        torch.testing.assert_close(paged_decode_attention(q, **a, scale=0.3, sliding_window=window), ref,
                                   rtol=1e-5, atol=1e-5)

    check(), check()  # the second call reuses the layout
    args["seq_lens_B"][1] -= 5  # in place: the cached layout no longer holds
    check()
    check(window=3)
    check(seq_lens_B=torch.tensor([3, 1, 13]))  # a new tensor
    args["block_table_BM"][2, :2] = args["block_table_BM"][2, :2].flip(0)
    check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_latent_decode_matches_reference(dtype):
    C, R, N, S, lens = 24, 8, 5, 4, [1, 9, 14]
    args = paged(lens, 1, C + R, S, dtype, seed=2)
    cache = args["k_cache_PSKH"][:, :, 0]
    q = torch.randn(len(lens), N, C + R).to(dtype)
    got = paged_latent_decode_attention(q, cache, args["block_table_BM"], args["seq_lens_B"], 0.2, C)
    ref = paged_latent_decode_attention_reference(q, cache, args["block_table_BM"], args["seq_lens_B"], 0.2, C)
    assert got.shape == (len(lens), N, C) and got.dtype == dtype
    torch.testing.assert_close(got, ref, **TOL[dtype])


@pytest.mark.parametrize("window", [None, 4])
def test_dense_decode_matches_reference(window):
    """cached_attention's one-token case (dense caches, views with any strides), with sinks."""
    B, N, K, H, S = 4, 6, 3, 8, 11
    k, v = torch.randn(B + 1, K, S, H)[1:], torch.randn(B, S, K, H).transpose(1, 2)
    q, sinks = torch.randn(B, N, H), torch.randn(N)
    seq_idx, positions = torch.arange(B), torch.tensor([0, 10, 5, 3])
    got = cached_attention(q, k, v, seq_idx, torch.zeros(B, dtype=torch.long), positions, 1, 0.4, window, sinks)
    ref = _decode_attention_reference(q, k, v, seq_idx, positions, 0.4, window, sinks)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("q_lens,ctx_lens", [([7], [0]), ([6], [5]), ([5, 1, 1, 9], [0, 12, 3, 4])],
                         ids=["prompt", "chunk-after-prefix", "mixed"])
def test_prefill_matches_reference(q_lens, ctx_lens, window, sinks, dtype):
    """Prompts from their start (the plain causal case), a chunk after a cached prefix, and a batch
    mixing both with decodes; against the reference in float64."""
    N, K, H = 6, 2, 20
    B, S = len(q_lens), max(c + n for c, n in zip(ctx_lens, q_lens)) + 2  # caches longer than any context
    k, v = (torch.randn(B, S, K, H).to(dtype).transpose(1, 2) for _ in range(2))
    seq_idx = torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens))
    tok_idx = torch.cat([torch.arange(n) for n in q_lens])
    positions = torch.tensor(ctx_lens)[seq_idx] + tok_idx
    q, sinks_N = torch.randn(len(seq_idx), N, H).to(dtype), torch.randn(N) if sinks else None
    args = (seq_idx, tok_idx, positions, max(q_lens), H ** -0.5, window)
    got = cached_attention(q, k, v, *args, sinks_N)
    ref = cached_attention_reference(q.double(), k.double(), v.double(), *args,
                                     None if sinks_N is None else sinks_N.double())
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("count", [1, 3, 8, 9, 40])
def test_padded_block_tables_pad_with_minus_one(count):
    """A step's block tables as one (B, longest) int64 array, -1 past each table's end: a few tables
    padded as lists, many by a masked store; both give the same array."""
    import numpy as np

    from models.kv_cache import _padded_table, _padded_table_np

    tables = [list(range(10 * b, 10 * b + (b * 7) % 5 + (b % 3 == 0))) for b in range(count)]
    got = _padded_table_np(tables)
    M = max(len(t) for t in tables)
    assert got.dtype == np.int64 and got.shape == (count, M)
    assert got.tolist() == [t + [-1] * (M - len(t)) for t in tables]
    assert _padded_table(tables).tolist() == got.tolist()
    assert _padded_table_np([[], []]).shape == (2, 0)
