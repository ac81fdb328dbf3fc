"""Kernels chosen by measurement (kernels/choice.py) and the AMX kernels on our panels
(kernels/csrc/amx_bf16.c): every candidate against the float64 reference at odd shapes, the C table
against the Python buckets, the chooser's cache, forcing and fallbacks; the ops with a native kernel
and a torch path (attention, rmsnorm, routing): each candidate against the reference, their tables
followed, forced, measured and left alone without the library."""
import json
import logging

import pytest
import torch

import kernels.choice as choice
import kernels.int8 as int8
import kernels.native as native

NEEDS_NATIVE = pytest.mark.skipif(not native.available(), reason="native kernels unavailable here (no AVX2 or no cc)")
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
def test_a_disturbed_table_is_measured_again_once(cache, table, monkeypatch, caplog):
    """A table whose times fall by more than a third from a row bucket to a larger one (at DISTURBED_MIN_US
    and over) was measured while something else ran: it is measured again, once, and the second
    table is the one cached (a host that stays busy keeps it, so a process measures at most twice)."""
    n = len(choice.BUCKET_ROWS)
    rising = [300.0 + 100 * b for b in range(n)]
    noisy = choice.Choice("moe", [(64, 48)], ["avx512"] * n, {"avx512": [300.0, 4000.0, *rising[2:]]})
    quiet = choice.Choice("moe", [(64, 48)], ["avx512"] * n, {"avx512": rising})
    assert choice.disturbed(noisy) and not choice.disturbed(quiet)
    small = choice.Choice("moe", [(64, 48)], ["avx512"] * n, {"avx512": [20.0, 150.0, *([30.0] * (n - 2))]})
    assert not choice.disturbed(small)  # toy shapes' times: under DISTURBED_MIN_US
    tables = [noisy, quiet, noisy]
    monkeypatch.setattr(choice, "measure", lambda op, shapes: tables.pop(0))
    caplog.set_level(logging.WARNING, logger="shuttle")
    got = choice.configure("moe", [(64, 48)])
    assert got.times_us == quiet.times_us and len(tables) == 1
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["times_us"] == quiet.times_us and "measured again" in caplog.text

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
    monkeypatch.setattr(choice, "time_us", lambda fn, min_s=None: fn.us)
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


@pytest.mark.skipif(not {int8.BF16DOT, int8.AMX} & int8.kernels(),
                    reason="int8_moe has one candidate without AVX-512 BF16 or AMX")
def test_int8_moe_threshold_follows_its_table(cache, monkeypatch):
    """The int8 (and FP8) block takes one big kernel and threshold: the kernel that won the largest bucket,
    from the first bucket after which it always won; measured on the model's shapes (here forced and
    given), and the native decode step takes the same."""
    experts = int8.Int8Experts.quantize(torch.randn(1, 32, 64), torch.randn(1, 64, 16))
    monkeypatch.setattr(int8, "_moe_big", {"int8": None, "fp8": None})
    big = int8.AMX if int8.AMX in int8.kernels() else int8.BF16DOT
    name = "amx" if big == int8.AMX else "bf16dot"
    for picks, want in ((["fma"] * 4 + [name] * 8, (big, 9)), ([name] * 12, (big, 1)),
                        (["fma"] * 12, (int8.AVX512, 0)), (["fma", name, "fma"] + [name] * 9, (big, 5))):
        choice._apply(choice.Choice("int8_moe", [(64, 32)], picks))
        assert int8._default_moe_kernels(torch.bfloat16, int8.kernels()) == (int8.AVX512, *want)
        assert int8.moe_kernels(experts, torch.bfloat16) == (int8.AVX512, *want, 0)  # (the native decode step's)
    monkeypatch.setenv(choice.ENV_VAR, "int8_moe=fma")
    assert choice.configure("int8_moe", [(64, 32)]).source == "forced" and int8._moe_big["int8"] == (None, 1)
    monkeypatch.setenv(choice.ENV_VAR, "measure")
    c = choice.configure("int8_moe", [(64, 32)])
    assert c.source == "measured" and set(c.picks) <= {"fma", "bf16dot", "amx", "vnni"}


def test_a_candidate_that_changes_the_numbers_must_win_by_the_margin():
    """vnni (per-token int8 activations) takes a bucket only where it beats every weight-only kernel by
    more than NUMERICS_MARGIN; otherwise the fastest of the others (with the tie rule) does."""
    times = {"fma": [100, 100, 120, 200], "bf16dot": [110, 100, 100, 150], "vnni": [95, 95, 80, 100]}
    times = {c: t + [None] * (len(choice.BUCKET_ROWS) - 4) for c, t in times.items()}
    picks = choice.pick_buckets("int8_moe", times)
    assert picks[:4] == ["fma", "fma", "vnni", "vnni"] and set(picks[4:]) == {"vnni"}
    assert choice.pick_buckets("int8_moe", times, ("fma", "bf16dot"))[:4] == ["fma", "fma", "bf16dot", "bf16dot"]


@pytest.mark.skipif(int8.VNNI not in int8.kernels(), reason="no AVX-512 VNNI here")
def test_int8_experts_take_vnni_from_its_bucket_and_linears_never(cache, monkeypatch):
    """A table whose last buckets went to vnni: experts with that many rows take VNNI (moe_kernels'
    fourth entry, as the native decode step reads it), the rows below and every int8 linear the fastest
    weight-only kernel of each bucket; forced vnni has no weight-only times and keeps fma below."""
    monkeypatch.setattr(int8, "_moe_big", {"int8": None, "fp8": None})
    monkeypatch.setattr(int8, "_moe_vnni", [0])
    experts = int8.Int8Experts.quantize(torch.randn(1, 32, 64), torch.randn(1, 64, 16))
    n = len(choice.BUCKET_ROWS)
    times = {"fma": [10.0, 20, 40] + [80.0] * (n - 3), "bf16dot": [12.0, 15, 20] + [40.0] * (n - 3),
             "vnni": [12.0, 15, 19] + [20.0] * (n - 3)}
    picks = choice.pick_buckets("int8_moe", times)
    assert picks == ["fma", "bf16dot", "bf16dot"] + ["vnni"] * (n - 3)
    choice._apply(choice.Choice("int8_moe", [(64, 32)], picks, times))
    assert int8.moe_kernels(experts, torch.bfloat16) == (int8.AVX512, int8.BF16DOT, 2, 5)
    assert int8.moe_kernels(experts, torch.float32)[3] == 0  # (timed on bf16 rows)
    assert int8._default_kernel(torch.bfloat16, 1000, int8.kernels()) == int8.BF16DOT
    monkeypatch.setenv(choice.ENV_VAR, "int8_moe=vnni")
    choice.configure("int8_moe", [(64, 32)])
    assert int8.moe_kernels(experts, torch.bfloat16) == (int8.AVX512, int8.AVX512, 0, 1)
    monkeypatch.setenv(choice.ENV_VAR, "int8_moe=bf16dot")
    choice.configure("int8_moe", [(64, 32)])
    assert int8.moe_kernels(experts, torch.bfloat16) == (int8.AVX512, int8.BF16DOT, 1, 0)


@pytest.mark.skipif(not {int8.BF16DOT, int8.AMX} & int8.kernels(),
                    reason="fp8_moe has one candidate without AVX-512 BF16 or AMX")
def test_fp8_moe_threshold_is_its_own(cache, monkeypatch):
    """FP8 codes decode at other costs than int8's, so the FP8 block and FP8 linears take the table
    measured on FP8 codes ("fp8_moe") and int8 ones int8's, each unmoved by the other's; the FP8 block's
    timing runs its own kernels on FP8 experts."""
    from kernels import fp8_weights as fp8

    monkeypatch.setattr(int8, "_moe_big", {"int8": None, "fp8": None})
    fp8_experts = fp8.Fp8Experts.quantize(torch.randn(1, 64, 64), torch.randn(1, 64, 32))
    int8_experts = int8.Int8Experts.quantize(torch.randn(1, 64, 64), torch.randn(1, 64, 32))
    big, name = (int8.AMX, "amx") if int8.AMX in int8.kernels() else (int8.BF16DOT, "bf16dot")
    choice._apply(choice.Choice("fp8_moe", [(64, 32)], [name] * 12))
    choice._apply(choice.Choice("int8_moe", [(64, 32)], ["fma"] * 12))
    assert fp8.moe_kernels(fp8_experts)[1:] == (big, 1, 0) and int8.moe_kernels(int8_experts, torch.bfloat16)[1:] == (
        int8.AVX512, 0, 0)
    assert int8._default_kernel(torch.bfloat16, 1, int8.kernels(), "fp8") == big
    assert int8._default_kernel(torch.bfloat16, 1, int8.kernels()) == int8.AVX512
    ran = []
    monkeypatch.setattr(fp8, "fused_moe_fp8", lambda *a, kernel=None: ran.append((type(a[3]), kernel)))
    monkeypatch.setenv(choice.ENV_VAR, "measure")
    c = choice.configure("fp8_moe", [(64, 32)])
    assert c.source == "measured" and set(c.picks) <= {"fma", "bf16dot", "amx"}
    kernels_ran = {k for _, k in ran}
    assert {t for t, _ in ran} == {fp8.Fp8Experts} and int8.AVX512 in kernels_ran
    assert kernels_ran & {int8.BF16DOT, int8.AMX}


# -- the ops with a native kernel and a torch path (native.NATIVE_OR_TORCH) ------------------------

@pytest.fixture
def step_tables():
    """Set every bucket of attention's, rmsnorm's or routing's table to one candidate; put back after."""
    saved = {op: list(native._NATIVE_ROWS[op]) for op in native.NATIVE_OR_TORCH}
    yield lambda op, which: native.set_runs_native(op, [which == "native"] * len(choice.BUCKET_ROWS))
    for op, picks in saved.items():
        native.set_runs_native(op, picks)


def spy(monkeypatch, name: str) -> list:
    """Count the calls of native.<name>."""
    calls, real = [], getattr(native, name)
    monkeypatch.setattr(native, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def torch_rms_norm(x, w, res=None):
    """The torch ops of kernels/rmsnorm.py, written out: (y, x + res)."""
    r = x if res is None else x + res
    x32 = r.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(r.dtype), r


@NEEDS_NATIVE
@pytest.mark.parametrize("which", ["native", "torch"])
@pytest.mark.parametrize("T", [1, 3, 17, 255])
@pytest.mark.parametrize("D", [37, 100, 1030])
def test_rmsnorm_candidates_equal_the_torch_ops(T, D, which, step_tables, monkeypatch):
    """Both candidates of rmsnorm, with and without the residual: torch's is the torch ops; the kernel
    sums the squares in another order, so its float32 values are within float32 rounding and its bf16
    values the ops' bits but for a rare one-ulp step (3 of 255 x 1030 here); the table decides which
    runs."""
    from kernels import rmsnorm

    step_tables("rmsnorm", which)
    calls = spy(monkeypatch, "add_rms_norm")
    g = torch.Generator().manual_seed(T * D)
    for dtype in (torch.bfloat16, torch.float32):
        x, res, w = (torch.randn(*shape, generator=g).to(dtype) for shape in ((T, D), (T, D), (D,)))
        (y, r), y_alone = rmsnorm.fused_add_rms_norm(x, res, w, 1e-6), rmsnorm.rms_norm(x, w, 1e-6)
        (y_ref, r_ref), y_alone_ref = torch_rms_norm(x, w, res), torch_rms_norm(x, w)[0]
        assert torch.equal(r, r_ref)
        if which == "torch":
            assert torch.equal(y, y_ref) and torch.equal(y_alone, y_alone_ref)
            continue
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
        torch.testing.assert_close(y, y_ref, **tol)
        torch.testing.assert_close(y_alone, y_alone_ref, **tol)
        if dtype == torch.bfloat16:
            assert (y != y_ref).float().mean() < 1e-3
    assert len(calls) == (4 if which == "native" else 0)


@NEEDS_NATIVE
@pytest.mark.parametrize("which", ["native", "torch"])
@pytest.mark.parametrize("T", [1, 3, 17, 255])
@pytest.mark.parametrize("E,K,renormalize", [(7, 2, True), (60, 8, False), (130, 5, True)])
def test_routing_candidates_equal_the_torch_ops(T, E, K, renormalize, which, step_tables, monkeypatch):
    """Both candidates of routing: the torch ops' experts (where no two scores tie at the k-th) and
    weights, to the bit for torch's, within a few float32 ulps for the kernel (its exp and sums differ)."""
    from kernels.routing import topk_route
    from tests.test_native_decode import torch_route

    step_tables("routing", which)
    calls = spy(monkeypatch, "route_softmax_topk")
    g = torch.Generator().manual_seed(T * E + K)
    for dtype in (torch.bfloat16, torch.float32):
        logits = (torch.randn(T, E, generator=g) * 2).to(dtype)
        w, ids = topk_route(logits, K, "softmax", renormalize, scaling=1.5)
        w_ref, ids_ref = torch_route(logits, K, renormalize, 1.5)
        assert ids.dtype == torch.int64 and w.dtype == torch.float32 and w.shape == ids.shape == (T, K)
        top = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
        untied = top[:, K - 1] != top[:, K]
        assert torch.equal(ids[untied].sort(-1).values, ids_ref[untied].sort(-1).values)
        got, ref = (v.gather(1, i.argsort(-1))[untied] for v, i in ((w, ids), (w_ref, ids_ref)))
        torch.testing.assert_close(got, ref, rtol=0 if which == "torch" else 2e-6, atol=0 if which == "torch" else 1e-9)
    assert len(calls) == (2 if which == "native" else 0)


@NEEDS_NATIVE
@pytest.mark.parametrize("which", ["native", "torch"])
@pytest.mark.parametrize("B", [1, 3, 17, 255])
@pytest.mark.parametrize("N,K,H,V,S,window", [(6, 2, 20, 20, 5, None), (5, 1, 24, 24, 3, 4), (4, 4, 36, 36, 16, 9),
                                              (6, 3, 40, 24, 5, None)])
def test_attention_candidates_equal_the_reference(B, N, K, H, V, S, window, which, step_tables, monkeypatch):
    """Both candidates of attention (head sizes not a multiple of 16, values narrower than keys, odd
    pages, a sliding window, sinks) against the float64 reference: within float32 rounding in float32,
    bf16's in bf16."""
    from kernels import attention
    from tests.test_cpu_attention import paged

    step_tables("attention", which)
    calls = spy(monkeypatch, "paged_decode_attention")
    g = torch.Generator().manual_seed(B * H + N)
    lens = torch.randint(1, 3 * S + 2, (B,), generator=g).tolist()
    for dtype in (torch.float32, torch.bfloat16):
        args = paged(lens, K, H, S, dtype, seed=B, V=V)
        q = torch.randn(B, H, N, generator=g).to(dtype).transpose(1, 2)  # strided, as the model's views are
        sinks = torch.randn(N, generator=g)
        got = attention.paged_decode_attention(q, **args, scale=H ** -0.5, sliding_window=window, sinks_N=sinks)
        args64 = {k: v.double() if v.is_floating_point() else v for k, v in args.items()}
        ref = attention.paged_decode_attention_reference(q.double(), **args64, scale=H ** -0.5, sliding_window=window,
                                                         sinks_N=sinks).to(dtype)
        assert got.dtype == dtype and got.shape == (B, N, V)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got, ref, **tol)
    assert len(calls) == (2 if which == "native" else 0)


@NEEDS_NATIVE
def test_step_ops_forced(cache, step_tables, monkeypatch):
    """SHUTTLE_KERNEL_CHOICE=attention=torch forces attention alone; "torch" every op with a torch
    path, "native" every op with a native candidate; the tables follow, nothing is measured."""
    from kernels import attention
    from tests.test_cpu_attention import paged

    monkeypatch.setenv(choice.ENV_VAR, "attention=torch")
    got = choice.configure("attention", [(4, 2, 16, 4)])
    assert got.source == "forced" and set(got.picks) == {"torch"}
    assert not any(native.runs_native("attention", r) for r in choice.BUCKET_ROWS)
    calls = spy(monkeypatch, "paged_decode_attention")
    q = torch.randn(3, 4, 16)
    attention.paged_decode_attention(q, **paged([5, 9, 1], 2, 16, 4, torch.float32), scale=0.25)
    assert not calls
    monkeypatch.setenv(choice.ENV_VAR, "torch")
    assert {choice.configure(op, [(64, 4)] if op == "rmsnorm" else [(8, 2, 4)]).picks[0]
            for op in ("rmsnorm", "routing")} == {"torch"}
    monkeypatch.setenv(choice.ENV_VAR, "native")
    assert set(choice.configure("routing", [(8, 2, 4)]).picks) == {"native"} and native.runs_native("routing", 3)
    assert not cache.exists()
    monkeypatch.setenv(choice.ENV_VAR, "routing=amx")
    with pytest.raises(ValueError, match="op=candidate"):
        choice.configure("routing", [(8, 2, 4)])


@NEEDS_NATIVE
def test_step_ops_measured_cached_and_reported(cache, step_tables, monkeypatch):
    """Each op is measured on its shapes, its table installed and cached, and reported by chosen();
    buckets past TIMED_BYTES are not timed and take the largest timed bucket's pick; TIMED_BYTES is
    part of the cache key (another budget measures again)."""
    shapes = {"attention": [(4, 2, 16, 2)], "rmsnorm": [(48, 4), (16, 4)], "routing": [(10, 3, 2)]}
    monkeypatch.setattr(choice, "TIMED_BYTES", 64 * 4 * 2 * 48)  # rmsnorm: 64 rows of 48 (x and residual)
    for op, s in shapes.items():
        got = choice.configure(op, s)
        assert got.source == "measured" and set(got.picks) <= {"native", "torch"}
        assert [native.runs_native(op, r) for r in choice.BUCKET_ROWS] == [p == "native" for p in got.picks]
        assert choice.chosen()[op]["runs"] == got.runs()
        assert choice.configure(op, s).source == "cached"
    rms = choice.chosen()["rmsnorm"]
    last = choice.BUCKET_ROWS.index(64)
    assert all(rms["times_us"][c][last + 1:] == [None] * (len(choice.BUCKET_ROWS) - last - 1) for c in rms["times_us"])
    assert rms["picks"][last:] == [rms["picks"][last]] * (len(choice.BUCKET_ROWS) - last)
    assert any(t is not None for t in rms["times_us"]["native"][:last + 1])
    monkeypatch.setattr(choice, "TIMED_BYTES", 1 << 20)
    assert choice.configure("rmsnorm", shapes["rmsnorm"]).source == "measured"


def test_step_ops_without_the_library(cache, step_tables, monkeypatch):
    """Without the native library nothing is chosen for the three ops (one candidate) and each runs its
    torch path; a native candidate that fails when first run is dropped and torch is picked."""
    from kernels import rmsnorm
    from kernels.routing import topk_route
    from tests.test_native_decode import torch_route

    if native.available():
        real = choice._RUNNERS["routing"]

        def broken(shape):
            setup = real(shape)
            setup["runners"]["native"] = lambda x: (lambda: (_ for _ in ()).throw(OSError("no kernel")))
            return setup

        monkeypatch.setitem(choice._RUNNERS, "routing", broken)
        assert set(choice.configure("routing", [(6, 2, 4)]).picks) == {"torch"}
        assert not native.runs_native("routing", 1)
    step_tables("routing", "native")
    monkeypatch.setenv(native.ENV_VAR, "0")
    native._library.cache_clear()
    try:
        assert all(choice.configure(op, s) is None for op, s in (
            ("attention", [(4, 2, 16, 4)]), ("rmsnorm", [(40, 4)]), ("routing", [(6, 2, 4)])))
        x, res, w = torch.randn(3, 40), torch.randn(3, 40), torch.randn(40)
        assert all(torch.equal(a, b) for a, b in zip(rmsnorm.fused_add_rms_norm(x, res, w, 1e-6),
                                                     torch_rms_norm(x, w, res)))
        logits = torch.randn(5, 6)
        assert all(torch.equal(a, b) for a, b in zip(topk_route(logits, 2, "softmax", True),
                                                     torch_route(logits, 2, True, 1.0)))
        assert "attention" not in choice.chosen()
    finally:
        native._library.cache_clear()
