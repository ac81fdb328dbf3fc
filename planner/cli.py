"""The planner's subcommands of `shuttle`: profile, simulate, plan.

    shuttle profile [--model DIR] [--dtype D] [--quantization Q [--quantize-linears]] [--torch-threads 1,2]
                    [--transport shm,tcp] [--quick] --out PROFILE.json
    shuttle simulate --profile PROFILE.json (--colocated | --attention-workers A --expert-workers E --micro-batches M) ...
                     [--speculative-config '{"method": "mtp", "num_speculative_tokens": K}' [--spec-acceptance A1,A2]]
    shuttle plan --model DIR|NAME --hardware KIND[=PRICE][,KIND...] --tbt-slo-ms X --max-devices N ... --out PLAN.json

--quantization int8, w8a8_int8, fp8 or mxfp4 (-q; vLLM's experts_int8 too) profiles, simulates and plans the
experts so, as `shuttle serve --quantization Q` serves them; plan and simulate take a profile's or
plan's own quantization unless asked for one (none: unquantised), and refuse one made for another.
`profile --quantize-linears` measures the other linears in Q too; simulate and a plan of this host take
it from the profile, and the plan file records it for `shuttle serve --plan`.

Every user error ends with a one-line message naming what is wrong and exit code 2.
"""
import argparse
import json
import sys
from pathlib import Path

from attention_nodes.config import LINEAR_QUANTIZATIONS


class PlannerError(ValueError):
    """A user error of a planner command (printed as one line, exit code 2)."""


def _csv(kind: type):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")
    return parse


def _profile(args: argparse.Namespace) -> int:
    import torch

    from models.builtin import builtin_model_dir
    from planner.profile import ProfileOptions, run_profile

    model = args.model or str(builtin_model_dir())
    bad = [t for t in args.transport if t not in ("shm", "tcp")]
    if bad:
        raise PlannerError(f"--transport {','.join(bad)}: known backends are shm and tcp")
    if any(t < 1 for t in args.torch_threads):
        raise PlannerError(f"--torch-threads must be positive, got {args.torch_threads}")
    if args.device not in (None, "cpu"):
        raise PlannerError(f"--device {args.device}: this build profiles the CPU path only")
    quantization = _asked_quantization(args, model)
    quantization = None if quantization is ANY else quantization
    if args.quantize_linears and quantization not in LINEAR_QUANTIZATIONS:
        raise PlannerError(f"--quantize-linears quantises the linears as --quantization "
                           f"{' or '.join(LINEAR_QUANTIZATIONS)} does the experts; got {_quantization_name(quantization)}")
    kw = dict(model=model, dtype=_dtype(args.dtype, model), threads=args.torch_threads, transports=args.transport,
              front=args.front, quantization=quantization, quantize_linears=args.quantize_linears)
    opts = ProfileOptions.quick_options(**kw) if args.quick else ProfileOptions(**kw)
    torch.manual_seed(0)
    profile = run_profile(opts)
    Path(args.out).write_text(json.dumps(profile, indent=1))
    print(format_profile(profile))
    print(f"wrote {args.out} ({profile['seconds']} s)")
    return 0


ANY = object()  # no --quantization given: a profile's or plan's own is taken


def _asked_quantization(args: argparse.Namespace, model: str | None = None):
    """--quantization as EngineConfig names it (None, "int8" or "fp8"), or ANY where it is not given; with
    `model`, refused for a checkpoint that is already quantised."""
    from planner.shapes import quantization_of, shape_from

    if args.quantization is None:
        return ANY
    try:
        return quantization_of(args.quantization, None if model is None else shape_from(model).config,
                               str(model))
    except ValueError as e:
        raise PlannerError(f"--quantization {args.quantization}: {e}") from None


def _quantization_name(q: str | None) -> str:
    return q or "none"


def _dtype(name: str, model: str):
    """--dtype as the profile measures it: "auto" resolves as shuttle serve's does on this CPU."""
    from models.config import DTYPES, ModelConfig
    from models.loader import auto_dtype

    if name == "auto":
        return auto_dtype(ModelConfig.from_pretrained(model).dtype, ("cpu",))[0]
    if name not in DTYPES:
        raise PlannerError(f"--dtype {name}: expected auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def format_profile(p: dict) -> str:
    """The fits as a short table: coefficients in microseconds, residuals in percent."""
    h = p["host"]
    ident = f" ({h['cpu_id']})" if h.get("cpu_id") else ""
    quant = _experts(p["model"].get("quantization"), p["model"].get("quantize_linears", False))
    lines = [f"model {p['model']['name']} ({p['model']['dtype']}{quant}, config {p['model']['config_hash']}) on "
             f"{h['cpu']}{ident}, "
             f"{h['cores']} cores, {h['memory_gib']} GiB, {h['device']}, ISA {'+'.join(h['isa']) or '?'}, "
             f"bf16 packed: {h['bf16_packed']}"]
    load = max(p.get("load_average") or [0.0])
    if load > h["cores"] + 1:  # the profile itself keeps about one core busy
        lines.append(f"WARNING: the host was busy while profiling (load average up to {load:.1f} on {h['cores']} "
                     "cores): the times are slower and noisier than a quiet host's; profile again when it is quiet")
    fitted = [(f"{t} thread(s)", fits) for t, fits in p["fits"].items()]
    fitted += [(f"{t} passive", fits) for t, fits in (p.get("fits_passive") or {}).items()]  # the pools' OpenMP
    for threads, fits in fitted:
        for name, f in fits.items():
            terms = ", ".join(f"{c * 1e6:.4g} us*{t}" if t != "const" else f"{c * 1e6:.4g} us"
                              for t, c in zip(f["terms"], f["coef"]))
            lines.append(f"  {threads:<12} {name:<9} {terms}   residual median "
                         f"{f['median_abs_residual']:.0%} max {f['max_abs_residual']:.0%} ({f['samples']} points)")
    for backend, f in p["transfer"].items():
        lines.append(f"  M2N {backend:<4} one transfer = {f['coef'][1] * 1e6:.1f} us + {f['coef'][0] * 1e9:.3f} ns/byte"
                     f"   residual median {f['median_abs_residual']:.0%} max {f['max_abs_residual']:.0%}")
        if "wake_s" in f and "send" in f:
            lines.append(f"           sender's own CPU {f['send']['coef'][1] * 1e6:.1f} us + {f['send']['coef'][0] * 1e9:.3f}"
                         f" ns/byte; a wait polls {f['spin_s'] * 1e6:.0f} us, then blocks: wake-up "
                         f"{f['wake_s'] * 1e6:.0f} us")
    if p.get("served_factor", 1.0) != 1.0:
        lines.append(f"  served: the workers computed {p['served_factor']:.2f}x what the fits say in the front's served "
                     "1 + 1 run (the simulator applies it on a shared host)")
    if p.get("served_factors"):
        lines.append("  served at m=2 by tokens per call: " + ", ".join(
            f"{t:g} -> {f:.2f}x" for t, f in p["served_factors"]) + " (where both pools compute at once the "
            "simulator scales each call by its tokens, between these)")
    if p.get("front_scales"):
        lines.append("  the front's CPU beside steps that take every core, solved on served runs: " + ", ".join(
            f"{'colocated' if h['kind'] == 'colocated' else '1 + 1 m=1'} at {h['threads']} threads"
            + (f" batch {h['concurrency']}" if h.get("concurrency") else "")
            + (" speculating" if h.get("speculative") else "") + f" {h['scale']:.2f}x"
            for h in p["front_scales"]))
    if p.get("front"):
        fr = p["front"]
        lines.append(f"  front {fr['front_s_per_token'] * 1e6:.0f} us + load generator "
                     f"{fr['client_s_per_token'] * 1e6:.0f} us of CPU per output token, "
                     f"{fr.get('front_s_per_request', 0) * 1e6:.0f} + {fr.get('client_s_per_request', 0) * 1e6:.0f} us "
                     f"per request, {fr.get('front_s_per_step', 0) * 1e6:.0f} + {fr.get('client_s_per_step', 0) * 1e6:.0f}"
                     f" us per engine step (served 1 + 1 runs, {fr['tokens']} tokens)")
    return "\n".join(lines)


def load_profile(path: str, model: str | None = None, quantization=ANY) -> dict:
    """A profile written by `shuttle profile`; with `model`, check it was measured on that model, and
    with `quantization` (None or "int8"), with the experts so (profiles without the key: None)."""
    try:
        p = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlannerError(f"--profile {path}: file not found (write one with shuttle profile --out {path})") from None
    except json.JSONDecodeError as e:
        raise PlannerError(f"--profile {path}: not valid JSON ({e})") from None
    if not isinstance(p, dict) or p.get("kind") != "measured" or not all(k in p for k in ("fits", "transfer", "model")):
        raise PlannerError(f"--profile {path}: not a profile written by shuttle profile")
    if model is not None:
        from planner.shapes import shape_from

        shape = shape_from(model)
        if shape.config_hash != p["model"]["config_hash"]:
            raise PlannerError(f"--profile {path} was measured on model {p['model']['name']} (config "
                               f"{p['model']['config_hash']}), not on {model} (config {shape.config_hash}); "
                               f"profile this model with shuttle profile --model {model}")
    measured = p["model"].get("quantization")
    if quantization is not ANY and quantization != measured:
        raise PlannerError(f"--profile {path} was measured with quantization {_quantization_name(measured)}, not "
                           f"{_quantization_name(quantization)}; profile again with shuttle profile --quantization "
                           f"{_quantization_name(quantization)}")
    return p


def _other_host(measured: dict, here: dict) -> str:
    """How the CPU a profile was measured on differs from `here` (planner.hardware.describe_host:
    its name, and its family, model and stepping), or "" where they agree (a profile written before
    cpu_id was recorded is compared on the name)."""
    return ", ".join(f"{k} {measured[k]!r}, here {here[k]!r}" for k in ("cpu", "cpu_id")
                     if k in measured and measured[k] != here[k])


def _placement_shares(path: str | None, num_experts: int, workers: int) -> tuple[tuple, tuple] | tuple[None, None]:
    """(share of (token, expert) pairs, experts held) per expert worker from a placement file."""
    if path is None:
        return None, None
    from m2n_comm.m2n import Placement

    try:
        pl = Placement.from_file(path, num_experts, workers)
    except (OSError, json.JSONDecodeError) as e:
        raise PlannerError(f"--placement {path}: {e}") from None
    except ValueError as e:
        raise PlannerError(f"--placement {path}: {e}") from None
    share = [0.0] * workers
    for ws in pl.copies:
        for w in ws:
            share[w] += 1.0 / len(ws) / num_experts
    return tuple(share), tuple(float(len(pl.experts_on(w))) for w in range(workers))


def _simulate(args: argparse.Namespace) -> int:
    from planner.perf import ProfilePerf
    from planner.simulate import Deployment, SimModel, Simulator, Workload

    if args.plan is not None:
        if args.speculative_config is not None or args.spec_acceptance is not None:
            raise PlannerError("--speculative-config needs --profile (a host's measured MTP drafting), not --plan")
        return _simulate_plan(args)
    if args.profile is None:
        raise PlannerError("--profile PROFILE.json (from shuttle profile) or --plan PLAN.json (from shuttle plan) "
                           "is required")
    profile = load_profile(args.profile, quantization=_asked_quantization(args))
    mod = SimModel.from_profile(profile)
    pools = any(v is not None for v in (args.attention_workers, args.expert_workers, args.micro_batches))
    if args.colocated and pools:
        raise PlannerError("--colocated takes no --attention-workers/--expert-workers/--micro-batches")
    if args.transport not in profile["transfer"] and not args.colocated:
        raise PlannerError(f"--transport {args.transport}: the profile measured only "
                           f"{', '.join(profile['transfer']) or 'no backend'}")
    n_e = args.expert_workers or 1
    share, local = _placement_shares(args.placement, mod.num_experts, n_e)
    cores = args.cores if args.cores is not None else profile["host"]["cores"]
    try:
        dep = Deployment(args.colocated, args.attention_workers or 1, n_e, args.micro_batches or 1,
                         args.torch_threads, cores or None, args.transport, args.max_num_seqs,
                         args.max_num_batched_tokens, expert_share=share, local_experts=local)
        wl = Workload(args.num_prompts, args.input_len, args.output_len, args.max_concurrency,
                      args.request_rate, args.seed)
        if min(wl.num_prompts, wl.input_len, wl.output_len) < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be positive")
    except ValueError as e:
        raise PlannerError(str(e)) from None
    spec = _speculation(args, profile)
    sim = Simulator(ProfilePerf(profile), mod, dep, trace_steps=args.trace_steps if args.trace else 0, spec=spec)
    result = sim.run(wl)
    if spec is not None:
        result["speculative"] = {"num_speculative_tokens": spec.num_speculative_tokens,
                                 "acceptance": list(spec.acceptance[:spec.num_speculative_tokens]),
                                 "disable_by_batch_size": spec.disable_by_batch_size,
                                 "mean_accept_len": spec.mean_accept_len()}
    result["deployment"] = {"colocated": dep.colocated, "attention_workers": dep.attention_workers,
                            "expert_workers": dep.expert_workers, "micro_batches": dep.micro_batches,
                            "torch_threads": dep.threads, "expert_threads": dep.pool_threads[1], "cores": dep.cores,
                            "transport": dep.transport, "quantization": profile["model"].get("quantization"),
                            "quantize_linears": profile["model"].get("quantize_linears", False)}
    print(format_metrics(result, f"simulated: {_describe(dep)}"
                                 f"{_experts(*(result['deployment'][k] for k in ('quantization', 'quantize_linears')))}"
                                 f" on {profile['host']['cpu']}"))
    if spec is not None:
        where = "--spec-acceptance" if args.spec_acceptance else "the profile's, on random prompts"
        print(f"speculative mtp, k = {spec.num_speculative_tokens} while at most {spec.disable_by_batch_size} run: "
              f"acceptance per position {' / '.join(f'{a:.2f}' for a in spec.acceptance[:spec.num_speculative_tokens])}"
              f" ({where}), {spec.mean_accept_len():.2f} tokens per verify step")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    if args.trace:
        Path(args.trace).write_text(json.dumps({"traceEvents": sim.chrome_trace(), "displayTimeUnit": "ms"}))
        print(f"wrote {args.trace} (the first {args.trace_steps} steps)")
    return 0


def _speculation(args: argparse.Namespace, profile: dict):
    """--speculative-config (method mtp) and --spec-acceptance as a simulate.Speculation; the
    acceptance defaults to the profile's, measured on random prompts (measure_mtp)."""
    from planner.perf import NO_MTP_SAMPLES
    from planner.simulate import Speculation

    if args.speculative_config is None:
        if args.spec_acceptance is not None:
            raise PlannerError("--spec-acceptance needs --speculative-config")
        return None
    acceptance = args.spec_acceptance or profile.get("mtp_acceptance")
    try:
        cfg = Speculation.mtp_config(args.speculative_config)
        if "mtp" not in next(iter(profile["fits"].values()), {}):
            raise ValueError(NO_MTP_SAMPLES)
        if not acceptance:
            raise ValueError("--spec-acceptance RATE[,RATE...] is required: the profile measured no acceptance")
        spec = Speculation.of(cfg, acceptance)
    except ValueError as e:
        raise PlannerError(str(e)) from None
    if cfg.token_map is not None:
        print("note: the profile timed MTP drafting with the whole LM head; drafting from a token_map's rows "
              "costs less, so the predicted step times are an over-estimate", file=sys.stderr)
    if args.spec_acceptance is None and len(acceptance) < spec.num_speculative_tokens:
        print(f"note: the profile measured acceptance at {len(acceptance)} draft positions; later ones take the last "
              "one's rate (an over-estimate)", file=sys.stderr)
    return spec


def _simulate_plan(args: argparse.Namespace) -> int:
    """Simulate a plan of catalogue devices (roofline models: estimated) on the workload flags."""
    from planner.hardware import HardwareKind, load_catalogue
    from planner.perf import RooflinePerf
    from planner.shapes import quantization_of, shape_from
    from planner.simulate import Deployment, SimModel, Simulator, Workload

    try:
        plan = json.loads(Path(args.plan).read_text())
        hw = {k: HardwareKind(**plan["hardware"][k]) for k in ("attention", "expert")}
        d = plan["deployment"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise PlannerError(f"--plan {args.plan}: not a plan written by shuttle plan ({e})") from None
    if hw["attention"].name == "host":
        raise PlannerError(f"--plan {args.plan} is a plan of this host: simulate it with --profile and its flags")
    shape = shape_from(plan["model"]["path"])
    try:
        quantization = quantization_of(d.get("quantization"))
    except ValueError as e:
        raise PlannerError(f"--plan {args.plan}: {e}") from None
    asked = _asked_quantization(args)
    if asked is not ANY and asked != quantization:
        raise PlannerError(f"--plan {args.plan} was made for quantization {_quantization_name(quantization)}, not "
                           f"{_quantization_name(asked)}; plan again with shuttle plan --quantization "
                           f"{_quantization_name(asked)}")
    _, eff = load_catalogue()
    mod = SimModel.from_config(shape.config)
    dep = Deployment(d["colocated"], d["attention_workers"], d["expert_workers"], d["micro_batches"],
                     transport="rdma", max_num_seqs=d["max_num_seqs"],
                     max_num_batched_tokens=max(args.max_num_batched_tokens, d["max_num_seqs"]))
    wl = Workload(args.num_prompts, args.input_len, args.output_len, args.max_concurrency, args.request_rate, args.seed)
    sim = Simulator(RooflinePerf(shape, hw["attention"], hw["expert"], eff, quantization), mod, dep,
                    trace_steps=args.trace_steps if args.trace else 0)
    result = sim.run(wl)
    print(format_metrics(result, f"simulated: {_describe(dep)}{_experts(quantization)} ({hw['attention'].name} / "
                                 f"{hw['expert'].name})"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.trace:
        Path(args.trace).write_text(json.dumps({"traceEvents": sim.chrome_trace(), "displayTimeUnit": "ms"}))
    return 0


def _experts(quantization: str | None, linears: bool = False) -> str:
    return f", {quantization} experts{' and linears' if linears else ''}" if quantization else ""


def _describe(dep) -> str:
    if dep.colocated:
        return f"colocated, {dep.threads} thread(s)"
    return (f"{dep.attention_workers} attention + {dep.expert_workers} expert workers, m={dep.micro_batches}, "
            f"{dep.pool_threads[0]}/{dep.pool_threads[1]} attention/expert thread(s) each, {dep.transport}")


def format_metrics(r: dict, title: str) -> str:
    est = " (estimated)" if r.get("estimated") else ""
    lines = [f"============ {title} ============",
             f"Successful requests: {r['completed']}", f"Duration (s): {r['duration']:.2f}",
             f"Output token throughput (tok/s): {r['output_throughput']:.2f}{est}"]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        lines.append(f"{label} ms: mean {r[f'mean_{name}_ms']:.2f}  median {r[f'median_{name}_ms']:.2f}  "
                     f"p99 {r[f'p99_{name}_ms']:.2f}{est}")
    busy = f"attention pool busy {r['attention_busy']:.0%}"
    if r.get("expert_busy") is not None:
        busy += f", expert pool busy {r['expert_busy']:.0%}"
    lines.append(f"{busy}, {r['steps']} steps")
    return "\n".join(lines)


def _hardware_pairs(args: argparse.Namespace):
    from planner.hardware import HOST, parse_hardware

    if not (args.hardware or (args.attention_hardware and args.expert_hardware)):
        raise PlannerError("--hardware KIND[=PRICE][,KIND...] is required (or both --attention-hardware and "
                           "--expert-hardware)")
    kinds = parse_hardware(args.hardware) if args.hardware else []
    att = parse_hardware(args.attention_hardware) if args.attention_hardware else kinds
    exp = parse_hardware(args.expert_hardware) if args.expert_hardware else kinds
    pairs = [(a, e) for a in att for e in exp]
    if any(HOST in (a.name, e.name) for a, e in pairs) and not all(a.name == e.name == HOST for a, e in pairs):
        raise PlannerError("the host kind plans this machine alone; plan catalogue kinds in a separate run")
    return pairs


def _plan(args: argparse.Namespace) -> int:
    from planner.hardware import HOST, describe_host, load_catalogue
    from planner.perf import ProfilePerf, RooflinePerf
    from planner.plan import HostSearch, format_plans, plan_file, search_host
    from planner.search import search, serving_pairs
    from planner.shapes import shape_from
    from planner.simulate import SimModel

    if args.tbt_slo_ms <= 0 or args.max_devices < 1:
        raise PlannerError("--tbt-slo-ms must be positive and --max-devices at least 1")
    shape = shape_from(args.model)
    pairs = _hardware_pairs(args)
    host = pairs[0][0].name == HOST
    workload = {"input_len": args.input_len, "output_len": args.output_len}
    quantization = _asked_quantization(args, args.model)
    if host:
        if args.profile is None:
            raise PlannerError("planning for this host needs --profile PROFILE.json (from shuttle profile)")
        profile = load_profile(args.profile, args.model, quantization)
        quantization = profile["model"].get("quantization")
        linears = profile["model"].get("quantize_linears", False)
        here = describe_host()
        if other := _other_host(profile["host"], here):
            print(f"warning: --profile {args.profile} was measured on another host ({other}): its times may not hold "
                  "here; profile this host with shuttle profile", file=sys.stderr)
        cores = profile["host"]["cores"]
        if cores != here["cores"]:
            print(f"warning: --profile {args.profile} was measured with {cores} usable cores, this process has "
                  f"{here['cores']} (taskset, a cgroup?); the plan is for {cores}", file=sys.stderr)
        if args.max_devices > cores:
            raise PlannerError(f"--max-devices {args.max_devices} is bigger than this host ({cores} cores, one "
                               f"device per core); plan catalogue kinds for more")
        hs = HostSearch(args.max_devices, args.input_len, args.output_len,
                        batches=(16, 64, 256) if args.quick else (16, 32, 64, 128, 256))
        cands, why = search_host(ProfilePerf(profile), SimModel.from_profile(profile), hs,
                                 pairs[0][0].price_per_hour, args.tbt_slo_ms / 1e3, args.top)
    else:
        quantization, linears = None if quantization is ANY else quantization, False
        pairs, skipped = serving_pairs(pairs, quantization)
        if skipped and not pairs:
            raise PlannerError(f"--quantization {quantization} runs the experts on CPU workers only "
                               f"(kernels/int8.py), and {', '.join(skipped)} "
                               f"{'is a GPU kind' if len(skipped) == 1 else 'are GPU kinds'}; give a CPU kind for "
                               "the expert pool (device cpu in planner/hardware.json) or plan without --quantization")
        if skipped:
            print(f"note: --quantization {quantization} runs the experts on CPU workers only: skipped expert pools "
                  f"of the GPU kind(s) {', '.join(skipped)}", file=sys.stderr)
        _, eff = load_catalogue()
        ctx = args.input_len + args.output_len / 2
        cands, why = search(lambda a, e: RooflinePerf(shape, a, e, eff, quantization), shape, pairs, args.max_devices,
                            args.tbt_slo_ms / 1e3, ctx, args.input_len + args.output_len, args.top, quantization)
    if not cands:
        raise PlannerError(_infeasible(why, args, quantization))
    print(format_plans(cands))
    if quantization:
        print(f"experts{' and linears' if linears else ''} as {quantization}: their weight reads are "
              f"{quantization}'s bytes{' as the profile measured them' if linears else ''}")
    hw = {k.name: k for pair in pairs for k in pair}
    plan = plan_file(cands[0], hw, shape, str(args.model), args.tbt_slo_ms, workload, quantization, linears)
    if args.out:
        Path(args.out).write_text(json.dumps(plan, indent=1))
        print(f"wrote the best plan to {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps({"plans": [c.to_dict() for c in cands], "best": plan}, indent=1))
    return 0


def _infeasible(why: dict, args: argparse.Namespace, quantization: str | None = None) -> str:
    if not why["memory_ok"] or why["fastest"] is None:
        experts = f" (its experts as {quantization})" if quantization else ""
        return (f"no deployment of at most {args.max_devices} devices holds {args.model}{experts} in memory; "
                f"allow more devices or larger ones")
    f = why["fastest"]
    est = " (estimated)" if f.estimated else ""
    return (f"no plan meets {args.tbt_slo_ms:g} ms TBT on {args.max_devices} devices; the best reaches "
            f"{f.tbt_s * 1e3:.1f} ms{est} ({f.attention_workers} attention {f.attention_hw} + {f.expert_workers} "
            f"expert {f.expert_hw}, m={f.micro_batches}, batch {f.batch})")


def _add_quantization(p: argparse.ArgumentParser, help: str) -> None:
    from attention_nodes.config import QUANTIZATIONS

    p.add_argument("--quantization", "-q", default=None, choices=["none", *QUANTIZATIONS, "experts_int8"], help=help)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this host's worker, expert and M2N costs for the planner")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--dtype", default="auto", help="auto (as shuttle serve's: the checkpoint's, but float32 for bf16/fp16 on a CPU "
                        "without native bf16/fp16 GEMMs), float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu (the only device profiled by this build)")
    _add_quantization(p, "int8 / fp8: measure with the expert weights as int8 / FP8, as shuttle serve "
                         "--quantization int8 / fp8 serves them (the profile records it; default none)")
    p.add_argument("--quantize-linears", action="store_true",
                   help="with --quantization int8 / fp8: the other linears in it too, as shuttle serve "
                        "--quantize-linears serves them (the profile records it)")
    p.add_argument("--torch-threads", type=_csv(int), default=(1, 2), help="thread counts to profile (default 1,2)")
    p.add_argument("--transport", type=_csv(str), default=("shm", "tcp"), help="M2N backends (default shm,tcp)")
    p.add_argument("--quick", action="store_true", help="a smaller grid and fewer repeats (about a third)")
    p.add_argument("--front", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the front's and the load generator's CPU per output token, request and engine "
                        "step on served 1 + 1 runs, and on served colocated (batch 64, and 256 at the most threads) "
                        "and m=1 runs how much of it their steps pay (about 1-2 minutes on 25M-parameter models; "
                        "--no-front: taken as zero)")
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.set_defaults(func=_run(_profile, "profile"))
    s = sub.add_parser("simulate", help="simulate a deployment serving a workload, from a profile")
    s.add_argument("--profile", default=None, help="PROFILE.json from shuttle profile")
    s.add_argument("--plan", default=None, help="PLAN.json from shuttle plan on catalogue kinds (estimated)")
    s.add_argument("--colocated", action="store_true", help="experts in the attention process")
    _add_quantization(s, "the experts' quantization (default: the profile's or plan's; one it was not made "
                         "for is refused)")
    s.add_argument("--attention-workers", type=int, default=None)
    s.add_argument("--expert-workers", type=int, default=None)
    s.add_argument("--micro-batches", type=int, default=None)
    s.add_argument("--torch-threads", type=int, default=None, help="per process (default: cores / processes)")
    s.add_argument("--placement", default=None, help='JSON file {"expert": [workers]} (default: contiguous blocks)')
    s.add_argument("--cores", type=int, default=None, help="cores the processes share (default: the profiled host's; "
                                                          "0: each process has its own device)")
    s.add_argument("--transport", default="shm", help="M2N backend (one the profile measured)")
    s.add_argument("--max-num-seqs", type=int, default=128)
    s.add_argument("--max-num-batched-tokens", type=int, default=2048)
    s.add_argument("--num-prompts", type=int, default=64)
    s.add_argument("--input-len", type=int, default=64)
    s.add_argument("--output-len", type=int, default=32)
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (default: all at once)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding as shuttle serve takes it; the planner models method mtp: '
                        '\'{"method": "mtp", "num_speculative_tokens": 2}\'')
    s.add_argument("--spec-acceptance", type=_csv(float), default=None, metavar="RATE[,RATE...]",
                   help="per draft position, the share of drafted steps whose draft was accepted (vLLM's "
                        "per-position acceptance; default: the profile's, measured on random prompts)")
    s.add_argument("--json", default=None, metavar="FILE", help="write the metrics (bench serve's keys) as JSON")
    s.add_argument("--trace", default=None, metavar="FILE", help="a Chrome trace of the first steps")
    s.add_argument("--trace-steps", type=int, default=20)
    s.set_defaults(func=_run(_simulate, "simulate"))
    q = sub.add_parser("plan", help="search deployments (MegaScale-Infer Algorithm 1) for throughput per cost")
    q.add_argument("--model", required=True, help="checkpoint directory, config.json, or a shipped shape "
                                                  "(mixtral-8x22b, dbrx, qwen3-235b-a22b, deepseek-v3, deepseek-v4-flash)")
    q.add_argument("--hardware", default=None, help="KIND[=PRICE][,KIND...]: catalogue kinds, or host (this machine)")
    q.add_argument("--attention-hardware", default=None, help="kind(s) for the attention pool")
    q.add_argument("--expert-hardware", default=None, help="kind(s) for the expert pool")
    q.add_argument("--profile", default=None, help="this host's profile (for --hardware host)")
    _add_quantization(q, "int8 / fp8: plan the expert weights as int8 / FP8 (CPU kinds only; host: default the profile's, "
                         "which must match); the plan records it and shuttle serve --plan serves it")
    q.add_argument("--tbt-slo-ms", type=float, required=True, help="time-between-tokens SLO")
    q.add_argument("--max-devices", type=int, required=True, help="devices in one deployment (host: cores)")
    q.add_argument("--input-len", type=int, default=512, help="workload: prompt tokens")
    q.add_argument("--output-len", type=int, default=256, help="workload: output tokens")
    q.add_argument("--top", type=int, default=5)
    q.add_argument("--quick", action="store_true", help="host: fewer batch sizes")
    q.add_argument("--json", default=None, metavar="FILE", help="write the top plans as JSON")
    q.add_argument("--out", default=None, help="PLAN.json: the best plan")
    q.set_defaults(func=_run(_plan, "plan"))


def _run(fn, name: str):
    """Wrap a command: user errors become one line on stderr and exit code 2."""
    def run(args: argparse.Namespace) -> int:
        from models.config import ConfigError
        from planner.hardware import HardwareError

        try:
            return fn(args)
        except (PlannerError, HardwareError, ConfigError, FileNotFoundError) as e:
            print(f"shuttle {name}: error: {e}", file=sys.stderr)
            return 2
    return run
