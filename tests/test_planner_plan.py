"""shuttle plan: the search's choices follow MegaScale-Infer's rules on catalogue devices, it scales
to 1,024 devices, it says what bound an infeasible request, and every CLI error exits 2."""
import json
import time

import pytest

from planner.hardware import load_catalogue, parse_hardware
from planner.perf import RooflinePerf
from planner.search import evaluate, search
from planner.shapes import shape_from


def run_search(model: str, kinds: str, devices: int, slo_ms: float = 200.0, top: int = 3, **kw):
    shape, pairs = shape_from(model), [(k, k) for k in parse_hardware(kinds)]
    _, eff = load_catalogue()
    return search(lambda a, e: RooflinePerf(shape, a, e, eff), shape, kw.get("pairs", pairs), devices,
                  slo_ms / 1e3, 640.0, 768, top)


def test_closed_form_matches_the_simulator_recurrence():
    """The search's TBT for a full pipeline equals the per-layer recurrence of planner.simulate."""
    shape = shape_from("mixtral-8x22b")
    hw = parse_hardware("A100-80GB")[0]
    _, eff = load_catalogue()
    perf = RooflinePerf(shape, hw, hw, eff)
    r = evaluate(perf, shape, hw, hw, 24, 640.0, 768, batches=(128,))
    i = next(j for j in range(len(r["n_a"])) if (r["n_a"][j], r["n_e"][j], r["m"][j]) == (4, 8, 3))
    t_a, t_e, t_c = r["t_a"][i], r["t_e"][i], r["t_c"][i]
    L = shape.config.num_layers
    pipeline = (t_a + t_e + 2 * t_c) + max(t_a, t_e) * (3 * L - 1)
    assert 3 * max(t_a, t_e) >= t_a + t_e + 2 * t_c  # the full-pipeline case
    extra = 3 * perf.head(128 / 3, 128 / 3) + perf.step(128)
    assert r["tbt"][i] == pytest.approx(pipeline + extra, rel=1e-9)


def test_closed_form_runs_dense_layers_without_experts():
    """DeepSeek-V3's 3 dense layers (first_k_dense_replace) take m attention micro-batches each and
    no expert stage; its 58 MoE layers pipeline as in the test above."""
    shape = shape_from("deepseek-v3")
    hw = parse_hardware("H100")[0]
    _, eff = load_catalogue()
    perf = RooflinePerf(shape, hw, hw, eff)
    r = evaluate(perf, shape, hw, hw, 64, 640.0, 768, batches=(256,))
    i = next(j for j in range(len(r["n_a"])) if (r["n_a"][j], r["n_e"][j], r["m"][j]) == (16, 32, 2))
    t_a, t_e, t_c = r["t_a"][i], r["t_e"][i], r["t_c"][i]
    c = shape.config
    assert (c.num_dense_layers, c.num_moe_layers) == (3, 58)
    period = max(2 * t_a, 2 * t_e, 2 * t_c, t_a + t_e + 2 * t_c)
    extra = 2 * perf.head(128, 128) + perf.step(256)
    assert r["tbt"][i] == pytest.approx(58 * period + 3 * 2 * t_a + min(t_a, t_e) + 2 * t_c + extra, rel=1e-9)
    assert r["util_e"][i] == pytest.approx(58 * 2 * t_e / r["tbt"][i])


def test_plan_prefers_overlap_and_balances_pools():
    best, _ = run_search("mixtral-8x22b", "A100-80GB", 64)
    assert best and best[0].micro_batches >= 2 and best[0].estimated
    assert 0.5 < best[0].expert_util <= 1.0


def test_heterogeneous_beats_homogeneous_h20_per_cost():
    shape = shape_from("mixtral-8x22b")
    h20, l40s = parse_hardware("H20,L40S")
    homo, _ = run_search("mixtral-8x22b", "H20", 64, pairs=[(h20, h20)])
    hetero, _ = run_search("mixtral-8x22b", "H20", 64, pairs=[(h20, l40s)])
    assert hetero[0].per_cost > homo[0].per_cost, (shape.name, hetero[0], homo[0])


def test_search_of_1024_devices_is_fast():
    t0 = time.monotonic()
    best, _ = run_search("dbrx", "H100", 1024)
    assert best and time.monotonic() - t0 < 60


def test_plan_command_writes_a_plan_and_reports_infeasible(tmp_path, capsys):
    from server.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "dbrx", "--hardware", "A100-80GB=1.5", "--tbt-slo-ms", "200",
                 "--max-devices", "32", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["estimated"] and plan["hardware"]["attention"]["price_per_hour"] == 1.5
    assert plan["deployment"]["attention_workers"] + plan["deployment"]["expert_workers"] <= 32
    assert "estimated" in capsys.readouterr().out
    assert main(["plan", "--model", "dbrx", "--hardware", "A100-80GB", "--tbt-slo-ms", "2",
                 "--max-devices", "16"]) == 2
    err = capsys.readouterr().err
    assert "no plan meets 2 ms TBT on 16 devices; the best reaches" in err


@pytest.mark.parametrize("argv,message", [
    (["--hardware", "TPU-v9"], "unknown hardware kind 'TPU-v9'"),
    (["--hardware", "H100=cheap"], "not a number"),
    (["--hardware", "L20", "--max-devices", "1"], "holds"),
    (["--hardware", "host", "--profile", "PROFILE"], "measured on model"),
    (["--hardware", "host", "--profile", "PROFILE", "--model", "MODEL", "--max-devices", "64"], "bigger than this host"),
    # a profile measured without --quantization plans no int8 deployment
    (["--hardware", "host", "--profile", "PROFILE", "--model", "MODEL", "-q", "int8"],
     "was measured with quantization none, not int8; profile again with shuttle profile --quantization int8"),
    (["--hardware", "H100,L40S", "--quantization", "experts_int8"],
     "--quantization int8 runs the experts on CPU workers only (kernels/int8.py), and H100, L40S are GPU kinds"),
])
def test_plan_errors_exit_2(argv, message, tmp_path, capsys, make_checkpoint):
    from server.cli import main

    model = make_checkpoint("mixtral")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"kind": "measured", "fits": {}, "transfer": {}, "host": {"cores": 2},
                                "model": {"name": "x", "config_hash": shape_from(model).config_hash}}))
    argv = [a.replace("PROFILE", str(prof)).replace("MODEL", str(model)) for a in argv]
    base = {"--model": "dbrx", "--tbt-slo-ms": "100", "--max-devices": "8"}
    for k, v in base.items():
        if k not in argv:
            argv += [k, v]
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_host_plan_is_the_best_simulated_deployment(tmp_path, make_checkpoint, capsys, monkeypatch):
    from server.cli import main
    from tests.test_planner_simulate import profile

    model = make_checkpoint("mixtral")
    p = profile(a=1.0, a_tok=0.01, e=1.0, e_pair=0.005, c=0.05, layers=2)
    p["model"]["config_hash"] = shape_from(model).config_hash
    p["model"]["quantization"] = "int8"  # measured with --quantization int8: the plan is served so
    p["model"]["quantize_linears"] = True  # and with --quantize-linears
    prof, out, js = tmp_path / "p.json", tmp_path / "plan.json", tmp_path / "all.json"
    prof.write_text(json.dumps(p))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})  # this process on one core, the profile's 2
    assert main(["plan", "--model", str(model), "--hardware", "host", "--profile", str(prof), "--tbt-slo-ms", "1000",
                 "--max-devices", "2", "--input-len", "16", "--output-len", "8", "--quick", "--top", "50",
                 "--out", str(out), "--json", str(js)]) == 0
    plans = json.loads(js.read_text())["plans"]
    best = json.loads(out.read_text())
    assert best["predicted"]["throughput"] == max(c["throughput"] for c in plans)
    assert not best["estimated"] and best["deployment"]["attention_device"] == "cpu"
    assert best["deployment"]["quantization"] == "int8" and best["deployment"]["quantize_linears"]
    assert {c["micro_batches"] for c in plans if c["attention_workers"]} == {1, 2, 3, 4}
    out_text, err = capsys.readouterr()
    assert "experts and linears as int8" in out_text
    from planner.plan import plan_engine_kwargs
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # a host that runs the plan
    assert plan_engine_kwargs(out)["quantize_linears"]
    with pytest.raises(ValueError, match="was made with quantize_linears .*, not without; plan again from a profile "
                                         "measured without --quantize-linears"):
        plan_engine_kwargs(out, quantize_linears=False)
    # the toy profile's host is not this one, nor its cores this process's: the plan says so
    assert f"--profile {prof} was measured on another host (cpu 'toy', here" in err
    assert "was measured with 2 usable cores, this process has 1 (taskset, a cgroup?); the plan is for 2" in err


def test_a_profile_of_this_host_is_not_another_host():
    from planner.cli import _other_host
    from planner.hardware import describe_host

    here = describe_host()
    assert _other_host(here, here) == ""
    # written before cpu_id was recorded; other cores get a warning of their own
    assert _other_host({"cpu": here["cpu"], "cores": here["cores"] + 1}, here) == ""
    assert _other_host({**here, "cpu_id": "family 0 model 0 stepping 0"}, here).startswith("cpu_id 'family 0 model 0")


def test_cpuinfo_gives_the_first_cpus_name_family_and_flags():
    from planner.hardware import parse_cpuinfo

    x86 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
           "model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu avx2 avx512f avx512fp16x\n\n"
           "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nflags\t\t: sse\n")
    assert parse_cpuinfo(x86) == ("AMD EPYC", "family 25 model 17 stepping 1", {"fpu", "avx2", "avx512f", "avx512fp16x"})
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n"
    assert parse_cpuinfo(arm) == ("", "", set())
    assert parse_cpuinfo("a line without a colon\n\n") == ("", "", set())


def test_int8_experts_fit_where_bf16_ones_do_not():
    """The memory check counts the experts in the plan's quantization (ModelConfig.expert_bytes):
    Mixtral-8x22B's experts on one CPU server of 200 GiB (180 usable) are 252 GiB in bf16 and 126
    GiB as int8; the roofline reads the int8 bytes too."""
    from dataclasses import replace

    shape = shape_from("mixtral-8x22b")
    cpu = replace(parse_hardware("cpu-epyc-64c")[0], memory_gib=200)
    _, eff = load_catalogue()
    c = shape.config
    experts_gib = {q: c.num_moe_layers * c.num_experts * c.expert_bytes(c.dtype, q) / 2 ** 30 for q in (None, "int8")}
    assert experts_gib == {None: pytest.approx(252.0, abs=0.1), "int8": pytest.approx(126.1, abs=0.1)}
    bf16 = evaluate(RooflinePerf(shape, cpu, cpu, eff), shape, cpu, cpu, 2, 640.0, 768)
    int8 = evaluate(RooflinePerf(shape, cpu, cpu, eff, "int8"), shape, cpu, cpu, 2, 640.0, 768, quantization="int8")
    assert not bf16["fits"].any() and int8["fits"].any()
    # fewer bytes per active expert: faster where the experts are memory-bound, the same where compute-bound
    assert (int8["t_e"] <= bf16["t_e"]).all() and int8["t_e"][0] < bf16["t_e"][0]
    best, why = search(lambda a, e: RooflinePerf(shape, a, e, eff), shape, [(cpu, cpu)], 2, 1e3, 640.0, 768)
    assert not best and why["memory_ok"] == 0
    best, why = search(lambda a, e: RooflinePerf(shape, a, e, eff, "int8"), shape, [(cpu, cpu)], 2, 1e3, 640.0, 768,
                       quantization="int8")
    assert best and (best[0].attention_workers, best[0].expert_workers) == (1, 1)


def test_int8_plans_only_cpu_kinds_for_the_experts():
    from planner.search import serving_pairs

    h100, epyc = parse_hardware("H100,cpu-epyc-64c")
    pairs = [(h100, h100), (h100, epyc), (epyc, h100), (epyc, epyc)]
    assert serving_pairs(pairs, None) == (pairs, [])
    assert serving_pairs(pairs, "int8") == ([(h100, epyc), (epyc, epyc)], ["H100"])
    assert epyc.device == "cpu" and h100.device == "cuda"


def test_a_quantised_plan_round_trips_to_the_engine(tmp_path, capsys, monkeypatch):
    """shuttle plan --quantization int8 writes it into the plan (experts on a CPU kind; the attention
    pool may be a GPU's),
    plan_engine_kwargs gives it to LLM / shuttle serve, and refuses to serve the plan otherwise."""
    from planner.plan import plan_engine_kwargs
    from server.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "mixtral-8x22b", "--hardware", "H100,cpu-epyc-64c", "-q", "int8",
                 "--tbt-slo-ms", "1e6", "--max-devices", "4", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "skipped expert pools of the GPU kind(s) H100" in captured.err and "experts as int8" in captured.out
    plan = json.loads(out.read_text())
    d = plan["deployment"]
    assert d["quantization"] == "int8" and d["expert_device"] == "cpu"
    assert plan["hardware"]["expert"]["name"] == "cpu-epyc-64c"
    assert main(["plan", "--model", "mixtral-8x22b", "--hardware", "cpu-epyc-64c", "-q", "int8",
                 "--tbt-slo-ms", "1e6", "--max-devices", "4", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    d = plan["deployment"]
    assert d["quantization"] == "int8" and d["attention_device"] == d["expert_device"] == "cpu"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))  # a host big enough to run it
    assert plan_engine_kwargs(out)["quantization"] == "int8"
    assert plan_engine_kwargs(out, quantization="experts_int8")["quantization"] == "int8"
    with pytest.raises(ValueError, match="was made for quantization int8 .*, not none; plan again"):
        plan_engine_kwargs(out, quantization=None)
    # plans written before quantization was recorded: unquantised
    del d["quantization"]
    out.write_text(json.dumps(plan))
    assert plan_engine_kwargs(out)["quantization"] is None
    with pytest.raises(ValueError, match="was made for quantization none .*, not int8"):
        plan_engine_kwargs(out, quantization="int8")
    # and without --quantization the same search keeps bf16 experts, on GPUs too
    assert main(["plan", "--model", "mixtral-8x22b", "--hardware", "H100", "--tbt-slo-ms", "1e6",
                 "--max-devices", "16", "--out", str(out)]) == 0
    d = json.loads(out.read_text())["deployment"]
    assert d["quantization"] is None and d["attention_device"] == "cuda"


def test_simulate_takes_a_plans_quantization_and_refuses_another(tmp_path, capsys):
    from server.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "mixtral-8x22b", "--hardware", "cpu-epyc-64c", "-q", "int8",
                 "--tbt-slo-ms", "1e6", "--max-devices", "4", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--plan", str(out), "--num-prompts", "4", "--input-len", "8", "--output-len", "2"]) == 0
    assert "int8 experts (cpu-epyc-64c / cpu-epyc-64c)" in capsys.readouterr().out
    assert main(["simulate", "--plan", str(out), "-q", "none", "--num-prompts", "4"]) == 2
    assert "was made for quantization int8, not none" in capsys.readouterr().err
