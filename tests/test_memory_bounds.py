"""Memory that must not grow with the load: oneDNN (and torch's cache in front of it) compile and keep
a GEMM per weight shape and row count, ~0.55 MiB each, so a packed float32 GEMM that saw every row
count grew a serving worker by hundreds of MiB (issue 44). kernels.cpu_linear.packed_linear pads the
rows to packed_rows' buckets in chunks of at most PACKED_MAX_ROWS: the row counts reaching oneDNN are
bounded whatever the load, and the results are those of the unpadded GEMM."""
import ctypes
import ctypes.util

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_linear import PACKED_MAX_ROWS, pack_weight, packed_linear, packed_rows, packing_available
from kernels.native import BUCKET_ROWS


def test_packed_rows_buckets() -> None:
    rows = range(1, PACKED_MAX_ROWS + 1)
    assert all(packed_rows(r) == r for r in range(17))  # decode's few rows as they are
    assert all(r <= packed_rows(r) < r * 9 / 8 for r in rows)  # under 1/8 more work
    assert all(packed_rows(packed_rows(r)) == packed_rows(r) for r in rows)
    assert all(packed_rows(r) == r for r in BUCKET_ROWS if r <= PACKED_MAX_ROWS)  # kernels/choice.py times these
    assert len({packed_rows(r) for r in rows}) == 16 + 8 * 4  # 17-32, ..., 129-256
    with pytest.raises(ValueError, match="at most"):
        packed_rows(PACKED_MAX_ROWS + 1)


@pytest.fixture
def onednn_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every GEMM that reaches oneDNN's packed linear."""
    seen, op = [], torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: (seen.append(x.shape[0]), op(x, *a))[1])
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_give_the_unpadded_result(dtype: torch.dtype, onednn_rows: list[int]) -> None:
    if not packing_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    torch.manual_seed(0)
    w, b = torch.randn(45, 67).to(dtype), torch.randn(45).to(dtype)
    packed = pack_weight(w)
    for rows in (17, 19, 33, 71, 127, 129, 255, 257, 301, 1025):
        x = torch.randn(rows, 67).to(dtype)
        y = packed_linear(x, packed, b)
        last = rows % PACKED_MAX_ROWS  # the last chunk's rows
        assert y.shape == (rows, 45) and y.is_contiguous() and onednn_rows[-1] == packed_rows(last)
        assert onednn_rows[-1 - rows // PACKED_MAX_ROWS:-1] == [PACKED_MAX_ROWS] * (rows // PACKED_MAX_ROWS)
        # the same op on the unpadded, unchunked rows; bitwise equal on oneDNN's brgemm kernels
        # (AVX-512), within summation order wherever oneDNN blocks the inputs by the row count
        unpadded = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        torch.testing.assert_close(y, unpadded, **({} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}))
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(y.double(), F.linear(x.double(), w.double(), b.double()), atol=tol, rtol=tol)


def test_row_counts_reaching_onednn_are_bounded(onednn_rows: list[int]) -> None:
    if not packing_available(torch.float32):
        pytest.skip("oneDNN cannot pack float32 on this CPU")
    packed = pack_weight(torch.randn(24, 40))
    x = torch.randn(2048, 40)
    for rows in range(1, 2049):
        packed_linear(x[:rows], packed)
    assert len(set(onednn_rows)) == 48 and max(onednn_rows) == PACKED_MAX_ROWS


def _heap_in_use() -> int | None:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2), or None elsewhere."""
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def test_every_row_count_keeps_memory_bounded() -> None:
    """Every row count from 1 to 1024 through one float32 weight shape: 48 compiled GEMMs, ~26 MiB
    (unpadded: 1,024, ~320 MiB with the caches' default caps; torch 2.13, oneDNN 3.12)."""
    if not packing_available(torch.float32) or _heap_in_use() is None:
        pytest.skip("needs oneDNN's float32 packing and glibc's mallinfo2")
    packed = pack_weight(torch.randn(72, 56))  # a shape no other test uses
    x = torch.randn(1024, 56)
    before = _heap_in_use()
    for rows in range(1, 1025):
        packed_linear(x[:rows], packed)
    grown_mib = (_heap_in_use() - before) / 2 ** 20
    assert grown_mib < 100, f"{grown_mib:.0f} MiB for {len({packed_rows(r) for r in range(1, 1025)})} row buckets"


def test_compiled_at_start_nothing_grows_later(onednn_rows: list[int]) -> None:
    """compile_expert_gemms runs each expert weight shape (w13, w2) at all 48 row counts once; after
    it, every row count through those shapes compiles nothing new: the heap stays within a few MiB
    (the 48 GEMMs themselves took ~26 MiB above)."""
    from models.cpu_inference import PackedExperts, compile_expert_gemms
    from models.moe_decoder import Experts
    from kernels.cpu_linear import PACKED_ROW_COUNTS, cpu_linear
    from kernels.ops import select_ops

    if not packing_available(torch.float32) or _heap_in_use() is None:
        pytest.skip("needs oneDNN's float32 packing and glibc's mallinfo2")
    torch.manual_seed(0)
    experts = Experts(3, 52, 44, select_ops(torch.device("cpu")))  # shapes no other test uses
    torch.nn.init.normal_(experts.w13)
    torch.nn.init.normal_(experts.w2)
    packed = PackedExperts(experts)
    assert compile_expert_gemms(packed) == 2 * len(PACKED_ROW_COUNTS) == 96
    assert sorted(onednn_rows) == sorted(2 * PACKED_ROW_COUNTS)
    x13, x2 = torch.randn(PACKED_MAX_ROWS, 52), torch.randn(PACKED_MAX_ROWS, 44)
    cpu_linear(x13, packed.w13_packed[1]), cpu_linear(x2, packed.w2_packed[2])  # the allocator's first use
    before = _heap_in_use()
    for rows in range(1, PACKED_MAX_ROWS + 1):
        cpu_linear(x13[:rows], packed.w13_packed[rows % 3]), cpu_linear(x2[:rows], packed.w2_packed[rows % 3])
    grown_mib = (_heap_in_use() - before) / 2 ** 20
    assert grown_mib < 4, f"{grown_mib:.1f} MiB after compiling every row count first"
