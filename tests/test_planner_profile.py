"""The planner's fits and profile: fits recover known constants from synthetic timings; the
profile command measures the real code (a tiny model, a tiny grid) and names the hardware."""
import json

import numpy as np
import pytest

from planner.fit import Fit, fit_linear
from planner.shapes import shape_from


def test_fit_recovers_constants_with_noise():
    rng = np.random.default_rng(0)
    rows = [{"tokens": b, "kv_reads": b * c} for b in (1, 4, 16, 64, 256) for c in (16, 128, 1024)]
    k1, k2, kc = 40e-6, 300e-6, 2e-8
    y = [(k1 * r["tokens"] + k2 + kc * r["kv_reads"]) * rng.uniform(0.97, 1.03) for r in rows]
    f = fit_linear(rows, y, ("tokens", "const", "kv_reads"))
    assert f.coef == pytest.approx((k1, k2, kc), rel=0.06)
    assert f.median_abs_residual < 0.03 and f.max_abs_residual < 0.08
    assert f(tokens=10, kv_reads=1000) == pytest.approx(k1 * 10 + k2 + kc * 1000, rel=0.05)
    assert Fit.from_dict(json.loads(json.dumps(f.to_dict()))) == f


def test_fit_is_nonnegative_and_robust_to_an_outlier():
    rows = [{"pairs": p, "active": a} for p in (2, 8, 32, 128, 512) for a in (2, 8)]
    y = [5e-6 * r["pairs"] + 100e-6 for r in rows]  # no dependence on active experts
    y[3] *= 1.5  # one noisy point
    f = fit_linear(rows, y, ("pairs", "const", "active"))
    assert all(c >= 0 for c in f.coef)
    assert f.coef[0] == pytest.approx(5e-6, rel=0.1) and f.coef[1] == pytest.approx(100e-6, rel=0.15)
    assert f.median_abs_residual < 0.05 and f.max_abs_residual > 0.2  # the outlier is reported


def test_fit_needs_enough_points():
    with pytest.raises(ValueError, match="at least 3 samples"):
        fit_linear([{"a": 1}], [1.0], ("a", "const", "b"))


def test_shipped_shapes_match_published_sizes():
    expected = {"mixtral-8x22b": 141e9, "dbrx": 132e9, "qwen3-235b-a22b": 235e9, "deepseek-v3": 671e9,
                "deepseek-v4-flash": 284e9}
    for name, params in expected.items():
        c = shape_from(name).config
        assert c.total_params() == pytest.approx(params, rel=0.02), name
    ds = shape_from("deepseek-v3").config
    assert ds.mla is not None and ds.kv_bytes_per_token(ds.dtype) == 61 * (512 + 64) * 2
    mixtral = shape_from("mixtral-8x22b").config
    assert mixtral.kv_bytes_per_token(mixtral.dtype) == 56 * 2 * 8 * 128 * 2


def test_profile_command_measures_and_names_the_host(tmp_path, make_checkpoint):
    from server.cli import main

    tiny_checkpoint = make_checkpoint("mixtral")
    out = tmp_path / "p.json"
    assert main(["profile", "--model", str(tiny_checkpoint), "--torch-threads", "1,2", "--transport", "shm",
                 "--quick", "--no-front", "--out", str(out)]) == 0
    p = json.loads(out.read_text())
    assert p["host"]["cores"] >= 1 and p["host"]["cpu"] and "bf16_packed" in p["host"]
    assert p["model"]["config_hash"] == shape_from(tiny_checkpoint).config_hash
    # the 2-thread points again with OpenMP's passive waits, as the worker pools run (a child process)
    assert set(p["fits"]) == {"1", "2"} and set(p["fits_passive"]) == {"2"}
    for fits in (p["fits"]["1"], p["fits"]["2"], p["fits_passive"]["2"]):
        for name in ("attention", "head", "step", "experts"):
            assert fits[name]["samples"] >= 3 and sum(fits[name]["coef"]) > 0
    assert p["transfer"]["shm"]["coef"][1] > 0 and p["front"] is None
    # whole colocated steps, per thread count, on random tokens (the experts they reach vary)
    assert all(p["fits"][t]["colocated"]["samples"] >= 6 for t in ("1", "2"))
    assert {round(s["active"], 3) for s in p["samples"]["colocated"]} > {2.0}
    # a float32 model keeps the eager decode step: nothing measured for the native one
    assert p["samples"]["native_decode"] == [] and "native_decode" not in p["fits"]["1"]


@pytest.mark.skipif(not __import__("kernels.native").native.avx512_bf16(), reason="needs AVX-512 BF16")
def test_profile_measures_what_the_native_decode_step_saves(make_checkpoint):
    """For a model the native decode step takes, its colocated decode step whole in one call and
    layer by layer (as the attention samples time it) at every batch and thread count, and a fit of
    the saving that the simulator subtracts."""
    import torch

    from models.config import ModelConfig
    from planner.profile import NATIVE_DECODE_TERMS, ProfileOptions, measure_native_decode

    ckpt = make_checkpoint("mixtral", dtype="bfloat16")
    opts = ProfileOptions(str(ckpt), torch.bfloat16, threads=(1,), repeats=2, batches=(1, 4, 16), contexts=(16,))
    samples = measure_native_decode(opts, ModelConfig.from_pretrained(str(ckpt)))
    assert [(s["threads"], s["tokens"]) for s in samples] == [(1, 1), (1, 4), (1, 16)]
    assert all(s["step_s"] > 0 and s["layers_s"] > 0 and s["saving_s"] >= 1e-6 for s in samples)
    fit = fit_linear(samples, [s["saving_s"] for s in samples], NATIVE_DECODE_TERMS)
    assert fit.samples == 3 and fit(tokens=1) > 0


def test_tree_cpu_counts_a_busy_child():
    import subprocess
    import sys
    import time

    from planner.front import tree_cpu

    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            seen = tree_cpu(child.pid)
            if seen[child.pid][1] >= 0.25:
                break
            time.sleep(0.05)
        assert seen[child.pid][0] == sys.executable and seen[child.pid][1] >= 0.25
        import os
        assert child.pid in tree_cpu(os.getpid())  # a descendant of this process
    finally:
        child.kill()
        child.wait()


def test_profile_errors_exit_2(tmp_path, capsys):
    from server.cli import main

    assert main(["profile", "--model", str(tmp_path), "--out", str(tmp_path / "p.json")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["profile", "--transport", "rdma", "--out", str(tmp_path / "p.json")]) == 2
    assert "rdma" in capsys.readouterr().err


def test_front_cpu_splits_into_per_token_per_request_and_per_step():
    from planner.front import split_front_cpu

    def run(tokens: int, steps: int, per_token: float, per_request: float, per_step: float) -> dict:
        return {"requests": 64, "tokens": tokens, "steps": steps,
                "front": 64 * per_request + tokens * per_token + steps * per_step}
    costs = (1e-4, 2e-3, 9e-4)
    runs = [run(1024, 17, *costs), run(64, 2, *costs), run(1024, 65, *costs)]  # batch 64 x 16, x 1; batch 16
    assert split_front_cpu(runs, "front") == pytest.approx(costs)
    # Without step counts (two runs at one batch size): per token and per request, as before.
    two = [{k: v for k, v in r.items() if k != "steps"} for r in (run(1024, 0, 1e-4, 2e-3, 0.0),
                                                                   run(256, 0, 1e-4, 2e-3, 0.0))]
    assert split_front_cpu(two, "front") == pytest.approx((1e-4, 2e-3, 0.0))
    # Noise that makes the short run dearer than the long one (a negative cost per token): no
    # negative cost; one term carries it all (the closer fit of the two).
    long, short = run(1024, 0, 1e-4, 0.0, 0.0), run(256, 0, 1e-4, 0.0, 0.0)
    short["front"] *= 5
    per_token, per_request, per_step = split_front_cpu([long, short], "front")
    assert per_step == 0.0 and min(per_token, per_request) == 0.0 and max(per_token, per_request) > 0
    assert min(split_front_cpu([dict(r, front=-r["front"]) for r in runs], "front")) == 0.0
    # Two runs with steps and no per-step cost: no more terms than runs (three would fit anything),
    # and the exact two-term fit is not displaced by rounding in another.
    two_steps = [run(1024, 17, 1e-4, 2e-3, 0.0), run(64, 2, 1e-4, 2e-3, 0.0)]
    assert split_front_cpu(two_steps, "front") == pytest.approx((1e-4, 2e-3, 0.0))


def test_cache_evictor_reads_the_llc_size_and_runs_only_for_models_larger_than_it(tmp_path):
    """The profile times every step with its weights out of the cache where a served step would find
    them so (weights larger than the last-level cache); a model that fits is timed as it is."""
    from planner.timing import CacheEvictor, StampingDispatcher, llc_bytes

    cache = tmp_path / "cache"
    for i, (level, size) in enumerate([(1, "48K"), (2, "1024K"), (3, "32768K")]):
        (cache / f"index{i}").mkdir(parents=True)
        (cache / f"index{i}" / "level").write_text(f"{level}\n")
        (cache / f"index{i}" / "size").write_text(f"{size}\n")
    assert llc_bytes(str(cache)) == 32 << 20
    assert llc_bytes(str(tmp_path / "missing")) == 32 << 20
    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir(), big.mkdir()
    (small / "model.safetensors").write_bytes(b"\0" * 1024)
    with open(big / "model.safetensors", "wb") as f:  # sparse: larger than any cache, no disk used
        f.truncate(4 * llc_bytes())
    assert not CacheEvictor(small).on and CacheEvictor(big).on
    evict = CacheEvictor(big)
    assert evict.buffer.numel() * 4 == 2 * llc_bytes()
    calls = []
    disp = StampingDispatcher(lambda: calls.append(1))
    disp.begin_step()
    assert calls == [1] and len(disp.stamps) == 1


def test_prefill_features_count_only_the_prefilling_sequences():
    from planner.profile import ATTN_TERMS, prefill_features

    assert {"prefill_tokens", "kv_prefill", "eager", "mixed"} <= set(ATTN_TERMS)
    # decodes (1 new token) are left out; a 5-token chunk after 0 and a 3-token one after 4 tokens
    # of context read 1 + ... + 5 = 15 and 3 * 4 + 6 = 18 positions; the step runs eagerly and mixes
    assert prefill_features([1, 1, 5, 3], [10, 20, 0, 4]) == {"prefill_tokens": 8, "kv_prefill": 33, "eager": 1,
                                                               "mixed": 1}
    assert prefill_features([1, 1], [7, 9]) == {"prefill_tokens": 0, "kv_prefill": 0, "eager": 0, "mixed": 0}
    assert prefill_features([4, 2], [0, 3]) == {"prefill_tokens": 6, "kv_prefill": 10 + 9, "eager": 1, "mixed": 0}


def test_step_shapes_time_mixed_steps():
    """The attention and colocated samples include a prompt beside decode rows (the `mixed` term's
    only samples) at the grid's largest context, and the cache holds every shape."""
    from planner.profile import ProfileOptions, step_shapes
    from types import SimpleNamespace

    opts = ProfileOptions("m", batches=(1, 8), contexts=(16, 300), prefill=(40,), prefill_chunks=((2, 24),),
                          mixed=((32, 4), (5000, 2)), max_kv_reads=4096)
    shapes, blocks = step_shapes(opts, SimpleNamespace(max_model_len=2048))
    assert ([32, 1, 1, 1, 1], [0, 300, 300, 300, 300]) in shapes
    assert not any(q[0] == 5000 for q, _ in shapes)  # past max_model_len
    assert ([1] * 8, [300] * 8) in shapes and ([40], [0]) in shapes and ([24, 24], [0, 0]) in shapes
    assert blocks * 16 > 300


def test_profile_quantization_reaches_every_measurement(tmp_path, make_checkpoint, monkeypatch, capsys):
    """shuttle profile --quantization int8 (-q, or vLLM's experts_int8) [--quantize-linears]: the runners
    and the engine it builds, the expert samples, the passive-waits child and the served front hold the
    experts as int8 (and the linears), as serving does, and the profile records it. Stubbed where a
    step would be timed, except the expert samples (a tiny grid)."""
    import io
    import sys
    from types import SimpleNamespace

    import planner.front as front
    import planner.profile as prof
    from models.config import ModelConfig
    from planner.cli import PlannerError, load_profile
    from planner.profile import ProfileOptions
    from server.cli import main

    ckpt = make_checkpoint("mixtral")
    cfg = ModelConfig.from_pretrained(ckpt)
    got = []

    def stop(x, *args, **kw):
        got.append(x)
        raise PlannerError("stopped")

    with monkeypatch.context() as m:
        m.setattr(prof, "run_profile", stop)
        for flags, q in ((["-q", "experts_int8"], "int8"), (["--quantization", "int8"], "int8"), ([], None),
                         (["-q", "fp8", "--quantize-linears"], "fp8")):
            assert main(["profile", "--model", str(ckpt), *flags, "--quick", "--out", str(tmp_path / "p.json")]) == 2
            o = got.pop()
            assert o.quantization == q and o.quantize_linears == ("--quantize-linears" in flags)
    assert main(["profile", "--model", str(ckpt), "--quantize-linears", "--out", str(tmp_path / "p.json")]) == 2
    assert "--quantize-linears quantises the linears as --quantization int8 or fp8 does" in capsys.readouterr().err

    opts = ProfileOptions(str(ckpt), threads=(1, 2), repeats=1, batches=(1,), contexts=(16,), prefill=(32,),
                          prefill_chunks=(), expert_tokens=(1, 4), quantization="int8", quantize_linears=True)
    with monkeypatch.context() as m:  # the runners and the engine: EngineConfig.quantization
        m.setattr(prof, "ModelRunner", stop)
        m.setattr(prof, "LLMEngine", stop)
        for measure in (prof.measure_attention, prof.measure_step, prof.measure_native_decode,
                        prof.measure_colocated):
            with pytest.raises(PlannerError):
                measure(opts, cfg)
            engine_cfg = got.pop()
            assert engine_cfg.quantization == "int8" and engine_cfg.quantize_linears

    held, run = [], prof.run_local_experts
    monkeypatch.setattr(prof, "run_local_experts", lambda experts, batch: held.append(experts) or run(experts, batch))
    samples = prof.measure_experts(ProfileOptions(**{**opts.__dict__, "threads": (1,)}), cfg)
    assert [s["tokens"] for s in samples] == [1, 4, 4] and held
    assert all(w.int8 is not None for e in held for w in e.w13_packed + e.w2_packed)

    with monkeypatch.context() as m:  # the passive-waits child gets it in its spec, and builds its options with it
        m.setattr(prof.subprocess, "run", lambda argv, input, **kw: got.append(input) or SimpleNamespace(
            returncode=0, stdout="{}\n"))
        prof.measure_passive(opts)
        spec = got.pop()
        assert json.loads(spec)["quantization"] == "int8" and json.loads(spec)["quantize_linears"]
        m.setattr(sys, "stdin", io.StringIO(spec))
        m.setattr(prof, "measure_workers", lambda o, c: got.append(o) or {})
        prof._passive_child()
        o = got.pop()
        assert o.quantization == "int8" and o.quantize_linears

    with monkeypatch.context() as m:  # the served 1 + 1 run: shuttle serve --quantization int8
        m.setattr(front.subprocess, "Popen", stop)
        with pytest.raises(PlannerError):
            front.measure_front(str(ckpt), quantization="int8", quantize_linears=True)
        cmd = got.pop()
        assert cmd[cmd.index("--quantization") + 1] == "int8" and "--quantize-linears" in cmd
        with pytest.raises(PlannerError):  # ... and the served colocated and m = 1 runs
            front.measure_scale_runs(str(ckpt), (2,), quantization="int8")
        cmd = got.pop()
        assert cmd[cmd.index("--quantization") + 1] == "int8" and cmd[cmd.index("--torch-threads") + 1] == "2"
        assert "--colocated" in cmd

    # the profile's model block records it; plan and simulate refuse it for unquantised experts
    monkeypatch.setattr(prof, "measure_workers", lambda o, c: {})
    monkeypatch.setattr(prof, "measure_native_decode", lambda o, c: [])
    monkeypatch.setattr(prof, "measure_colocated", lambda o, c: [])
    monkeypatch.setattr(prof, "fit_samples", lambda s, t: {})
    p = prof.run_profile(ProfileOptions(str(ckpt), threads=(1,), transports=(), front=False, quantization="int8",
                                        quantize_linears=True))
    assert p["model"]["quantization"] == "int8" and p["model"]["quantize_linears"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p))
    assert load_profile(str(path), str(ckpt), "int8")["model"]["quantization"] == "int8"
    with pytest.raises(PlannerError, match="was measured with quantization int8, not none"):
        load_profile(str(path), str(ckpt), None)


def test_profile_times_mtp_drafting_and_measures_its_acceptance(make_checkpoint, tmp_path):
    """A checkpoint with an MTP layer: every mtp_draft call of real drafting engines (k = 1 and 3) is a
    sample with its rows, passes and prompt rows, the fit has them, each verifying step's own work is a
    sample with its sequences and verified rows, and the acceptance per position is a non-increasing
    share; a checkpoint without one has none of them."""
    import torch

    from models.config import ModelConfig
    from planner.profile import MTP_DRAFTS, MTP_TERMS, SPEC_STEP_TERMS, ProfileOptions, measure_mtp
    from tests.test_mtp import add_mtp_layer

    ckpt = add_mtp_layer(make_checkpoint("mixtral"), tmp_path / "mtp", seed=2)
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    opts = ProfileOptions(str(ckpt), torch.float32, threads=(1,), repeats=1, batches=(1, 4, 128))
    samples, steps, acceptance = measure_mtp(opts, ModelConfig.from_pretrained(str(ckpt)))
    assert {s["k"] for s in steps} == set(MTP_DRAFTS) and {s["seqs"] for s in steps} >= {1, 4}
    assert all(s["seqs"] <= s["verify_rows"] <= s["seqs"] * (1 + s["k"]) and s["step_s"] > 0 for s in steps)
    assert any(s["verify_rows"] > s["seqs"] for s in steps)
    assert fit_linear(steps, [s["step_s"] for s in steps], SPEC_STEP_TERMS)(seqs=4, verify_rows=12) > 0
    assert {s["k"] for s in samples} == set(MTP_DRAFTS) and {s["seqs"] for s in samples} >= {1, 4}
    assert max(s["seqs"] for s in samples) <= 4  # (batches above MTP_MAX_BATCH are not drafted for)
    assert any(s["prefill_tokens"] for s in samples) and any(s["passes"] == max(MTP_DRAFTS) for s in samples)
    assert all(s["passes"] == 1 for s in samples if s["k"] == 1) and all(s["mtp_s"] > 0 for s in samples)
    assert len(acceptance) == max(MTP_DRAFTS) and all(1 >= a >= b >= 0 for a, b in zip(acceptance, acceptance[1:]))
    fit = fit_linear(samples, [s["mtp_s"] for s in samples], MTP_TERMS)
    assert fit(rows=4, passes=3, prefill_tokens=0) > 0
    plain = make_checkpoint("mixtral")
    assert measure_mtp(opts.__class__(str(plain), torch.float32),
                       ModelConfig.from_pretrained(str(plain))) == ([], [], None)
    # a model the engine does not speculate on (its linear-attention state cannot take back drafts)
    hybrid = make_checkpoint("qwen3_next")
    raw = json.loads((hybrid / "config.json").read_text())
    (hybrid / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    cfg = ModelConfig.from_pretrained(str(hybrid))
    assert cfg.num_mtp_layers == 1 and measure_mtp(opts.__class__(str(hybrid), torch.float32), cfg) == ([], [], None)


def test_scale_runs_of_a_speculative_model_also_speculate(monkeypatch):
    """measure_scale_runs(speculative=True) (a model with MTP layers): the colocated engine at the most
    threads and the m = 1 pool are also served drafting (method mtp) at SPEC_SCALE_BATCH, each entry
    naming its --speculative-config; the plain runs name none."""
    import contextlib

    from planner import front

    served = []

    @contextlib.contextmanager
    def serving(model, flags, *a):
        served.append(flags)
        yield None, "url", lambda conc, n, seed, length: {"completed": n, "total_input_tokens": 64 * n,
                                                        "duration": 1.0, "mean_ttft_ms": 5.0}
    monkeypatch.setattr(front, "_serving", serving)
    runs = front.measure_scale_runs("m", (1, 2), speculative=True)
    spec = [r for r in runs if r["speculative"]]
    assert [(r["kind"], r["threads"], r["concurrency"]) for r in spec] == [
        ("colocated", 2, front.SPEC_SCALE_BATCH), ("m1", None, front.SPEC_SCALE_BATCH)]
    assert json.loads(spec[0]["speculative"]) == {"method": "mtp", "num_speculative_tokens": front.SPEC_SCALE_K}
    assert sum("--speculative-config" in f for f in served) == 2 and len(runs) == len(served)
    assert len([r for r in front.measure_scale_runs("m", (1, 2)) if r["speculative"]]) == 0
