"""Kernels chosen by measurement (kernels/choice.py) and the AMX kernels on our panels
(kernels/csrc/amx_bf16.c): every candidate against the float64 reference at odd shapes, the C table
against the Python buckets, the chooser's cache, forcing and fallbacks."""
import json
import logging

import pytest
import torch

import kernels.choice as choice
import kernels.native as native

NEEDS_AVX512_BF16 = pytest.mark.skipif(not native.avx512_bf16(), reason="this CPU has no AVX-512 BF16")
NEEDS_AMX = pytest.mark.skipif(not native.amx(), reason="no AMX here (needs amx_bf16 and amx_tile, and the "
                                                         "kernel's permission for the tile state)")
PANEL_KERNELS = [pytest.param("avx512", marks=NEEDS_AVX512_BF16), pytest.param("amx", marks=NEEDS_AMX)]


@pytest.fixture
def table():
    """Set every bucket of an op to one candidate; the process's table is put back after."""
    ops = (native.GEMM, native.MOE)
    saved = {op: [native.uses_amx(op, rows) for rows in choice.BUCKET_ROWS] for op in ops} \
        if native.avx512_bf16() else {}

    def force(op: int, which: str):
        for b in range(len(choice.BUCKET_ROWS)):
            native.set_kernel_choice(op, b, native.AMX if which == "amx" else native.AVX512)

    yield force
    for op, amx in saved.items():  # straight to the library: a test may have patched native.amx meanwhile
        for b, on in enumerate(amx):
            native._library().shuttle_set_kernel_choice(op, b, int(on))


@pytest.mark.parametrize("which", PANEL_KERNELS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("T,I,O", [(1, 1024, 1536), (3, 70, 100), (17, 1030, 33), (255, 96, 64), (64, 2, 5),
                                   (40, 512, 8)])
def test_panel_gemm_candidates_equal_float64(T, I, O, which, threads, table):
    """Both kernels of the gemm op at odd sizes: inputs not a multiple of 32 (the AMX tail by AVX-512),
    outputs not a multiple of 32, rows past one or several 32-row blocks and tails of 1-31 rows. Each
    within bf16's rounding of the exact product (one rounding of a float32 sum)."""
    table(native.GEMM, which)
    g = torch.Generator().manual_seed(T * 7 + I + O)
    w, x = (torch.randn(O, I, generator=g) / I ** 0.5).bfloat16(), torch.randn(T, I, generator=g).bfloat16()
    panels = native.pack_panels32(w, I)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.gemm_bf16_panels(x, panels, O)
    finally:
        torch.set_num_threads(before)
    exact = x.double() @ w.double().t()
    assert got.dtype == torch.bfloat16 and got.shape == (T, O)
    torch.testing.assert_close(got.double(), exact, rtol=8e-3, atol=1e-3 * I ** 0.5)


@pytest.mark.parametrize("which", PANEL_KERNELS)
@pytest.mark.parametrize("T,E,K,D,I", [(1, 4, 2, 64, 32), (3, 5, 3, 70, 24), (17, 6, 2, 1030, 50), (255, 3, 2, 96, 520),
                                       (130, 2, 1, 40, 16)])
def test_fused_moe_candidates_equal_each_other_and_float64(T, E, K, D, I, which, table):
    """The MoE block with every expert on one kernel: D not a multiple of 32, I not of 16 or 32 (the
    down projection's AMX tail), experts of 1 to 255 rows, top-1 to top-3, ids of other workers (-1)
    skipped. Error against float64 no worse than 1.5x the AVX-512 kernel's (the reference the suite
    already holds to the torch path)."""
    from tests.test_native_kernels import moe_case

    _, packed, x, ids, weights, exact = moe_case(T, E, K, D, I)
    table(native.MOE, "avx512")
    base = packed(x, ids, weights)
    table(native.MOE, which)
    got = packed(x, ids, weights)
    assert got.dtype == torch.bfloat16 and got.shape == (T, D)
    torch.testing.assert_close(got.float(), base.float(), rtol=2e-2, atol=2e-2)
    err, base_err = (got.double() - exact).abs().mean(), (base.double() - exact).abs().mean()
    assert err <= 1.5 * base_err + 1e-6, (err, base_err)


@NEEDS_AMX
def test_the_c_table_buckets_rows_as_choice_does(table):
    """Each bucket of the C table holds exactly the row counts choice.bucket gives it."""
    assert native.kernel_buckets() == len(choice.BUCKET_ROWS)
    table(native.GEMM, "avx512")
    for b in range(len(choice.BUCKET_ROWS)):
        native.set_kernel_choice(native.GEMM, b, native.AMX)
        for rows in (*range(1, 70), 127, 128, 129, 1024, 1025, 2048, 5000):
            assert native.uses_amx(native.GEMM, rows) == (choice.bucket(rows) == b), (b, rows)
        native.set_kernel_choice(native.GEMM, b, native.AVX512)


def test_runs_name_the_row_ranges():
    c = choice.Choice("gemm", [(8, 8)], ["avx512", "avx512", "amx"] + ["amx"] * 8 + ["avx512"])
    assert c.runs() == "1-2 avx512, 3-1024 amx, 1025+ avx512"
    assert choice.Choice("moe", [], ["amx"] + ["avx512"] * 11).runs() == "1 amx, 2+ avx512"
    assert [choice.bucket(r) for r in (1, 2, 3, 4, 5, 1024, 1025, 10 ** 6)] == [0, 1, 2, 2, 3, 10, 11, 11]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(choice.ENV_VAR, raising=False)
    monkeypatch.setattr(choice, "_chosen", {})
    yield tmp_path / "shuttle" / "kernel_choices.json"


@NEEDS_AVX512_BF16
def test_measured_once_then_cached_and_logged(cache, table, caplog):
    """A first process measures and writes the table; the next reads it. Every pick is a choosable
    candidate that was timed at that bucket, and the table says which CPU and ISA it is for."""
    caplog.set_level(logging.INFO, logger="shuttle")
    first = choice.configure("moe", [(64, 48)])
    assert first.source == "measured" and len(first.picks) == len(choice.BUCKET_ROWS)
    for b, pick in enumerate(first.picks):
        assert pick in choice.CHOOSABLE["moe"] and first.times_us[pick][b] is not None
    stored = json.loads(cache.read_text())
    (entry,) = stored.values()
    assert entry["picks"] == first.picks and entry["host"]["isa"] == choice.host()["isa"]
    again = choice.configure("moe", [(64, 48)])
    assert again.source == "cached" and again.picks == first.picks
    assert sum("kernels for moe" in r.message for r in caplog.records) == 1  # logged once: the table did not change
    assert choice.chosen()["moe"]["runs"] == first.runs()


@NEEDS_AVX512_BF16
def test_forcing_and_bad_values(cache, table, monkeypatch):
    monkeypatch.setenv(choice.ENV_VAR, "avx512")
    forced = choice.configure("gemm", [(40, 64)])
    assert forced.source == "forced" and set(forced.picks) == {"avx512"}
    assert not any(native.uses_amx(native.GEMM, r) for r in choice.BUCKET_ROWS)
    assert not cache.exists()  # nothing measured
    monkeypatch.setenv(choice.ENV_VAR, "gemm=onednn")  # timed for the table, never chosen
    with pytest.raises(ValueError, match="op=candidate"):
        choice.configure("gemm", [(40, 64)])
    monkeypatch.setenv(choice.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="expected auto, measure"):
        choice.configure("gemm", [(40, 64)])


@NEEDS_AVX512_BF16
def test_without_amx_the_choice_falls_back_to_what_runs(cache, table, monkeypatch):
    """Where AMX is missing (or its tile state refused), it is not a candidate: the table is measured
    with the AVX-512 kernel alone, and a cached table that picked AMX on this key is measured again
    rather than trusted."""
    monkeypatch.setattr(native, "amx", lambda: False)
    got = choice.configure("gemm", [(40, 64)])
    assert set(got.picks) == {"avx512"} and "amx" not in got.times_us
    key = next(iter(json.loads(cache.read_text())))
    entries = json.loads(cache.read_text())
    entries[key]["picks"] = ["amx"] * len(choice.BUCKET_ROWS)
    cache.write_text(json.dumps(entries))
    again = choice.configure("gemm", [(40, 64)])
    assert again.source == "measured" and set(again.picks) == {"avx512"}


def test_skinny_float32_linears_follow_their_table(monkeypatch):
    """A float32 linear with a bf16 copy of its weights runs the bf16 kernel where skinny's table says
    so, else oneDNN's float32 GEMM; both give the product (up to summation order)."""
    import kernels.cpu_linear as cpu_linear

    if not native.available():
        pytest.skip("native kernels unavailable here (no AVX2 or no cc)")
    exact = torch.randn(48, 40).bfloat16().float()
    w = cpu_linear.CpuWeight(exact)
    assert w.half is not None
    for natively in (True, False):
        monkeypatch.setattr(cpu_linear, "_SKINNY_NATIVE", [natively] * len(choice.BUCKET_ROWS))
        calls = []
        real = native.gemm_bf16
        monkeypatch.setattr(native, "gemm_bf16", lambda *a: calls.append(1) or real(*a))
        for rows in (1, 17, 300):
            x = torch.randn(rows, 40)
            torch.testing.assert_close(cpu_linear.cpu_linear(x, w), x @ exact.t(), rtol=1e-5, atol=1e-4)
        assert bool(calls) == natively


@NEEDS_AMX
def test_a_candidate_that_fails_is_dropped_not_fatal(cache, table, monkeypatch, caplog):
    """A candidate whose kernel raises when first run (a build without it, an unsupported shape) is left
    out with one log line; the others are still measured and chosen."""
    real = choice._RUNNERS["gemm"]

    def broken_amx(shape):
        setup = real(shape)
        setup["runners"]["amx"] = lambda x: (lambda: (_ for _ in ()).throw(OSError("no tiles")))
        return setup

    monkeypatch.setitem(choice._RUNNERS, "gemm", broken_amx)
    caplog.set_level(logging.INFO, logger="shuttle")
    got = choice.configure("gemm", [(40, 64)])
    assert set(got.picks) == {"avx512"} and all(t is None for t in got.times_us["amx"])
    assert any("candidate amx for gemm dropped: OSError: no tiles" in r.message for r in caplog.records)


def test_picks_prune_and_ties_on_given_times(monkeypatch):
    """measure() on times it is handed: per bucket the fastest choosable kernel; a bucket within 5% of
    the previous bucket's kernel keeps it; oneDNN is timed but never picked; a kernel losing by over
    2x, more each time, in two buckets in a row is not timed at larger counts; one that loses by
    over 2x at small counts but gains on the best is still timed (and wins where it is faster)."""
    times = {}  # candidate -> microseconds as a function of rows

    def runners(shape):
        def make(cand):
            def run(x):
                fn = lambda: None  # noqa: E731
                fn.us = times[cand](x.shape[0])
                return fn
            return run
        return {"make_x": lambda T: torch.zeros(T, 1), "runners": {c: make(c) for c in ("avx512", "amx", "onednn")}}

    monkeypatch.setitem(choice._RUNNERS, "gemm", runners)
    monkeypatch.setattr(choice, "time_us", lambda fn: fn.us)
    times.update(avx512=lambda r: 10.0 * r, amx=lambda r: 100.0 + r, onednn=lambda r: 1.0 + r)
    got = choice.measure("gemm", [(1, 1)])
    # avx512 10-160 against amx 101-116 at 1-16 rows: amx from 16 rows on (at 8: 80 against 108)
    assert got.picks == ["avx512"] * 4 + ["amx"] * 8
    # avx512 loses by >2x at 32 rows (320 vs 132) and 64 (640 vs 164, by more): not timed after
    assert got.times_us["avx512"][5:7] == [320.0, 640.0] and got.times_us["avx512"][7:] == [None] * 5
    assert got.times_us["amx"][-1] == 2148.0  # lost by 10x at 1 row, but gained: timed throughout
    assert got.times_us["onednn"][0] == 2.0  # timed beside, never picked
    # ties: amx 2% faster than avx512 from 2 rows on keeps avx512 (picked at 1 row); 10% takes over
    for factor, want in ((0.98, ["avx512"] * 12), (0.9, ["avx512"] + ["amx"] * 11)):
        times.update(amx=lambda r, f=factor: 20.0 if r == 1 else 10.0 * r * f, onednn=lambda r: 1e9)
        assert choice.measure("gemm", [(1, 1)]).picks == want


@pytest.mark.skipif(not native.amx(), reason="int8_moe has one candidate without AMX")
def test_int8_moe_threshold_follows_its_table(cache, monkeypatch):
    """The int8 block takes one row threshold: AMX from the first bucket after which it always won;
    measured on the model's shapes (here forced and given), and the native decode step takes the same."""
    from kernels import int8
    from models.native_decode import int8_moe_kernels

    monkeypatch.setattr(int8, "_moe_amx_rows", [None])
    for picks, rows in ((["fma"] * 4 + ["amx"] * 8, 9), (["amx"] * 12, 1), (["fma"] * 12, 1 << 62),
                        (["fma", "amx", "fma"] + ["amx"] * 9, 5)):
        choice._apply(choice.Choice("int8_moe", [(64, 32)], picks))
        assert int8._default_moe_kernels(torch.bfloat16, int8.kernels()) == (int8.AVX512, int8.AMX, rows)
        assert int8_moe_kernels() == (int8.AVX512, int8.AMX, rows)
    monkeypatch.setenv(choice.ENV_VAR, "int8_moe=fma")
    assert choice.configure("int8_moe", [(64, 32)]).source == "forced" and int8._moe_amx_rows[0] == 1 << 62
    monkeypatch.setenv(choice.ENV_VAR, "measure")
    c = choice.configure("int8_moe", [(64, 32)])
    assert c.source == "measured" and set(c.picks) <= {"fma", "amx"}
