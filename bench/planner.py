"""The planner's predictions against measured runs on this host, side by side.

    python bench/planner.py [--quick] [--dtype bfloat16] [--serve-dtype auto] [--quantization Q] [--rounds R]
                            [--repeats N] [--shapes mixtral,fine] [--only NAME,...] [--fresh-profile] [--fresh-front]
    python bench/planner.py --speculative [--quick] [--rounds R] [--only NAME,...]

For each model shape (built locally with random weights: "mixtral" about 400M parameters, 8
experts of 2048, top-2; "fine" the same size in 32 experts of 512, top-4; --quick: about 25M):
1. `shuttle profile` measures this host with that model (one command, --quick with --quick);
2. every deployment below is predicted by the simulator (what `shuttle simulate` prints) and
   measured with `shuttle bench serve` against a real `shuttle serve` of the same deployment and
   the same workload (random prompts, EOS ignored, max concurrency = the batch);
3. `shuttle plan --hardware host` picks a deployment (before any measurement); it is measured too,
   through `shuttle serve --plan`, and compared with the best measured one; with --repeats or
   --rounds 2 or more also in paired runs: the two measured alternately, under a minute apart
   (`picked_vs_best_paired`), since the host drifts by more than the 5% the pick is judged by
   between rows minutes apart.
With --speculative the model is the built-in one with its MTP head, served plain and with MTP drafts
(SPEC_DEPLOYMENTS: batch 4, colocated and 1 + 1, and batch 1), predicted at the acceptance the profile
measured on random prompts (the served runs' own acceptance is in each row); writes planner_mtp.json.
The table gives output throughput and mean TPOT, predicted and measured, and their errors; the
summary: median absolute throughput error and how many are within 10% (throughput) and 15% (TPOT)
over the deployments that do not oversubscribe the cores. Writes bench/results/planner.json
(planner_int8.json with --quantization int8: every profile, plan and server with int8 experts; likewise
w8a8_int8, fp8 and mxfp4).
Each measurement follows a warm-up run of one batch on the same server; with --repeats N each
compared metric (throughput, mean TPOT, mean TTFT) is the median of N runs, and every row keeps
their spread, the host's load average, and the CPU seconds per output token of the front, each
pool and the load generator (from /proc), beside the shares the model assumes. Every run serves
HOST_WAVES batches of prompts (at least MIN_MEASURED_PROMPTS), as `shuttle plan` simulates them.
With --rounds R every deployment is measured R times, in rounds over the whole list (each run on a
server started for it; the order reversed every other round), and every round after the first
starts with a whole profile again (the workers, M2N, the front and its served runs, as
--fresh-front): a row's measured metrics are the medians over the rounds and its `*_rounds` errors
the median of the rounds' predictions against them, so the host's drift over the run lands on both
sides alike rather than between one profile at the start and a row measured at one moment minutes
later (`tok_s_err` stays the first profile's alone, what a plan made once would get). Each such row
also says how noisy both medians were (`noise_sd_rounds`, bootstrap over the rounds) and so how
likely a prediction without bias was to land within 10% of it (`p_within_10pct_rounds`; the
summary's `expected_within_10pct_by_noise` and `p_all_within_10pct_by_noise`: the targets' odds on
this host for a perfect model; bench/host_noise.py measures the host's share of that noise).
With --fresh-profile (one round) each deployment is also predicted from the workers and M2N
profiled again right after its measurement (`pred_fresh_tok_s`, `tok_s_err_fresh`): on a host whose
speed drifts by minutes, that separates the model's own error from the drift between the first
profile and the measurement. --fresh-front re-profiles the front and its served runs too,
so the served factors (which carry the cost of both pools computing at once) are fresh as well.
`--replay RESULT.json` measures nothing: it predicts a stored run's rows again with the simulator
as it is now (from the profiles the file keeps) and prints the old and new errors side by side, so a
change to the model is judged on the same measurements, not on a new run the host's drift moves.
The machine is shared: re-run on a quiet one before trusting a number (the profile's residuals,
printed first, and the rows' spreads and load averages say how noisy it was).
"""
import argparse
import contextlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_nodes.config import QUANTIZATIONS  # noqa: E402
from bench.common import median_noise, print_table, save, within_by_noise  # noqa: E402
from clients.bench_serve import run_bench  # noqa: E402
from planner.plan import HOST_WAVES  # noqa: E402
from clients.live_server import LiveServer  # noqa: E402

# name -> (shuttle serve flags, batch = max_num_seqs = max concurrency)
DEPLOYMENTS = {
    "colocated 1 thread": (["--colocated", "--torch-threads", "1"], 64),
    "colocated 2 threads": (["--colocated", "--torch-threads", "2"], 64),
    "colocated 2 threads batch 256": (["--colocated", "--torch-threads", "2"], 256),
    "1+1 m=1": (["--micro-batches", "1"], 64),
    "1+1 m=2": (["--micro-batches", "2"], 64),
    "1+1 m=3": (["--micro-batches", "3"], 64),
    "1+1 m=2 batch 16": (["--micro-batches", "2"], 16),
    "1+1 m=2 batch 256": (["--micro-batches", "2"], 256),
    "1+1 m=2 tcp": (["--micro-batches", "2", "--transport", "tcp"], 64),
    "2+1 m=2 (oversubscribed)": (["--attention-workers", "2", "--micro-batches", "2"], 64),
    "1+2 m=2 (oversubscribed)": (["--expert-workers", "2", "--micro-batches", "2"], 64),
}
# Prompts per measured run: HOST_WAVES batches (what `shuttle plan` simulates each candidate with), at
# least 256 (batch 16 with 32 prompts was a third of a second of load whose repeats spread up to
# 29%; with two waves at batch 64 a run's TPOT depended on how its requests fell into them).
MIN_MEASURED_PROMPTS = 256
COMPARED = ("output_throughput", "mean_tpot_ms", "mean_ttft_ms")  # measured as the median over the repeats
# What a fresh profile keeps of the first (unless --fresh-front): the front and the calibration on its
# served runs (planner.calibrate.served_factor, served_factors and front_scales)
CALIBRATION = ("front", "served_factor", "served_factors", "front_scales")
SECOND_SHAPE = ("colocated 2 threads", "1+1 m=1", "1+1 m=2")
SHAPES = {  # name -> (hidden, layers, experts, expert intermediate, top-k)
    "mixtral": (1024, 8, 8, 2048, 2), "fine": (1024, 8, 32, 512, 4),
}
QUICK_SHAPES = {"mixtral": (384, 4, 8, 512, 2), "fine": (384, 4, 32, 128, 4)}
# --speculative: the built-in model with its trained MTP head, plain and with MTP drafts (k = SPEC_K) at
# disable_by_batch_size's default batch (4: the largest where speculation runs unless asked) and at 1
SPEC_K = 2
_MTP = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": SPEC_K})]
SPEC_DEPLOYMENTS = {
    "colocated 2 threads batch 4": (["--colocated", "--torch-threads", "2"], 4),
    f"colocated 2 threads batch 4 mtp k={SPEC_K}": (["--colocated", "--torch-threads", "2", *_MTP], 4),
    "1+1 m=1 batch 4": (["--micro-batches", "1"], 4),
    f"1+1 m=1 batch 4 mtp k={SPEC_K}": (["--micro-batches", "1", *_MTP], 4),
    "colocated 2 threads batch 1": (["--colocated", "--torch-threads", "2"], 1),
    f"colocated 2 threads batch 1 mtp k={SPEC_K}": (["--colocated", "--torch-threads", "2", *_MTP], 1),
}


def checkpoint(out: Path, shape: tuple, dtype: str) -> Path:
    from transformers import MixtralConfig

    from models.builtin import make_random_checkpoint

    hidden, layers, experts, inter, top_k = shape
    cfg = MixtralConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                        num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=2048,
                        bos_token_id=0, eos_token_id=0)
    return make_random_checkpoint(out, cfg, seed=0, dtype=dtype)


def parse(flags: list[str], batch: int, cores: int):
    from planner.simulate import Deployment

    def val(name: str, default):
        return type(default)(flags[flags.index(name) + 1]) if name in flags else default

    colocated = "--colocated" in flags
    return Deployment(colocated, val("--attention-workers", 1), val("--expert-workers", 1), val("--micro-batches", 1),
                      val("--torch-threads", 0) or None, cores, val("--transport", "shm"), max_num_seqs=batch)


def measure(ckpt: Path, flags: list[str], batch: int, args, seed: int = 0) -> dict:
    """bench serve's metrics of `--repeats` runs on one server, after a warm-up run of one batch: the
    median run by throughput (the lower middle one for an even count), with each of COMPARED the
    median over all runs (for an even count, the mean of the middle two); adds each run's
    throughput and mean TPOT, the throughputs' spread (max / min - 1), the host's
    load average, and the CPU seconds per output token of the front, each worker pool and this
    process (the load generator), from /proc."""
    from planner.front import tree_cpu
    from planner.metrics import lower_median

    n, base = _load_args(ckpt, batch, args)
    runs = []
    with _server(ckpt, flags, batch, args) as srv:
        url = ["--base-url", srv.url]
        for i in range(args.repeats):
            cpu0 = tree_cpu(srv.proc.pid)
            m = run_bench([*url, *base, "--seed", str(seed + i), "--num-prompts", str(n), "--output-len",
                           str(args.output_len)])
            cpu1 = tree_cpu(srv.proc.pid)
            m["cpu_s_per_token"] = _cpu_by_role(srv.proc.pid, cpu0, cpu1, m["client_cpu_s"], m["total_output_tokens"])
            m["load_average"] = os.getloadavg()[0]
            runs.append(m)
    tput = [r["output_throughput"] for r in runs]
    out = dict(lower_median(runs, key=lambda r: r["output_throughput"]))
    # Each compared metric is the median over the repeats, not the median-throughput run's own: one
    # server's repeats of a colocated 2-thread deployment (128 prompts, 0.7 s each) measured 2,650-
    # 3,054 tok/s with mean TPOT 10.7-14.7 ms, so one run's TPOT moved by more than the 15% target.
    for key in COMPARED:
        out[key] = statistics.median(r[key] for r in runs)
    out["repeat_tok_s"], out["repeat_spread"] = tput, max(tput) / min(tput) - 1
    out["repeat_tpot_ms"] = [r["mean_tpot_ms"] for r in runs]
    # Requests bench serve counted as failed, per run (a stream whose tokens decode to no text
    # counts as served).
    out["repeat_failed"] = [r["failed"] for r in runs]
    return out


def _load_args(ckpt: Path, batch: int, args) -> tuple[int, list[str]]:
    """Prompts per measured run and bench serve's load arguments at `batch` (without --base-url,
    --seed, --num-prompts, --output-len). Prompts of exactly --input-len tokens of the model's
    tokenizer (as vllm bench serve's random dataset makes them), the workload `shuttle plan` is asked
    for. Not --input-len random words: those are ~97 tokens for 64, so a plan chosen for 64-token
    prompts would be measured on 97 (the fine shape's pools at batch 256 are predicted 2% ahead of
    colocated at 256 for 64 tokens, 8% behind for 97)."""
    n = max(args.min_prompts, HOST_WAVES * batch, MIN_MEASURED_PROMPTS)
    return n, ["--input-len", str(args.input_len), "--tokenizer", str(ckpt), "--max-concurrency", str(batch),
               "--ignore-eos", "--disable-tqdm"]


@contextlib.contextmanager
def _server(ckpt: Path, flags: list[str], batch: int, args):
    """A live `shuttle serve` of the deployment, warmed up with one batch of short requests."""
    dtype = [] if args.serve_dtype == "auto" else ["--dtype", args.serve_dtype]
    with LiveServer(["--model", str(ckpt), "--max-num-seqs", str(batch), *dtype, *quantization(args), *flags]) as srv:
        # Every run draws other prompts (its own --seed): a prompt the server saw before is served from
        # its prefix cache, and the simulated workload has no repeated prompt. (With one seed for all,
        # the measured runs re-sent the warm-up's prompts: half the prompts at batch < 256, all at
        # 256, were prefilled from the cache.)
        _, base = _load_args(ckpt, batch, args)
        with contextlib.redirect_stdout(io.StringIO()):  # first calls, allocations, oneDNN's caches
            run_bench(["--base-url", srv.url, *base, "--seed", "1000", "--num-prompts", str(batch), "--output-len",
                       str(min(4, args.output_len))])
        yield srv


def paired(ckpt: Path, a: tuple[list[str], int], b: tuple[list[str], int], args) -> dict:
    """Two deployments ((flags, batch) each) measured in alternating runs, as many rounds as the larger
    of --repeats and --rounds, in the order A B, B A, A B, ..., each run on a server of its own
    started for it (warmed up, measured,
    stopped), so only one of them is on the host at a time: each run's throughput and the median of
    the rounds' A / B ratios. On this host the same deployment measured a fifth apart in runs
    minutes away (colocated at 2 threads 2,071 and 2,640 tok/s), more than the plan's 5% target, so
    its pick is judged against the best other row in runs well under a minute apart. (Both servers
    kept up, the idle one stopped with SIGSTOP meanwhile, was tried: a pool stopped for more than its peers'
    3 s liveness timeout comes back to a worker restart, and idle but running, a pool's attention
    worker polls at about 6% of a core beside the other's runs.) A run with a request that failed
    or did not complete raises."""
    tput = {"a": [], "b": []}
    deployments = {"a": a, "b": b}
    for i in range(max(args.repeats, args.rounds)):
        for key in ("a", "b") if i % 2 == 0 else ("b", "a"):
            flags, batch = deployments[key]
            n, base = _load_args(ckpt, batch, args)
            with _server(ckpt, flags, batch, args) as srv, contextlib.redirect_stdout(io.StringIO()):
                m = run_bench(["--base-url", srv.url, *base, "--seed", str(100 + i), "--num-prompts", str(n),
                               "--output-len", str(args.output_len)])
            if m["completed"] != n or m["failed"]:
                raise RuntimeError(f"paired run {i} of {' '.join(flags)}: {m['completed']} of {n} requests "
                                   f"completed, {m['failed']} failed")
            tput[key].append(m["output_throughput"])
    return {"a_tok_s": tput["a"], "b_tok_s": tput["b"], "ratio": paired_ratio(tput["a"], tput["b"])}


def paired_ratio(a: list[float], b: list[float]) -> float:
    """The median over rounds of a[i] / b[i]: each round's two runs share the host's state."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _cpu_by_role(front: int, cpu0: dict, cpu1: dict, client_s: float, tokens: int) -> dict:
    """CPU seconds per output token of the front process, the attention and expert workers and the client."""
    roles = {"front": 0.0, "attention": 0.0, "expert": 0.0, "client": client_s}
    for pid, (title, cpu) in cpu1.items():
        if pid not in cpu0:
            continue
        pools = [r for r in ("attention", "expert") if title.startswith(f"shuttle-{r}")]
        role = "front" if pid == front else (pools[0] if pools else None)
        if role:
            roles[role] += cpu - cpu0[pid][1]
    return {k: v / max(tokens, 1) for k, v in roles.items()}


def workload(measured: dict) -> dict:
    """The measured run's requests as the simulator takes them: as many, as long (the prompts' mean
    tokens as served: --input-len, unless the server adds tokens)."""
    return {"completed": measured["completed"],
            "prompt_len": round(measured["total_input_tokens"] / max(measured["completed"], 1))}


def speculation(flags: list[str], profile: dict):
    """The simulator's Speculation of a deployment served with --speculative-config (method mtp), at
    the acceptance the profile measured on random prompts; None without it."""
    from planner.simulate import Speculation

    if "--speculative-config" not in flags:
        return None
    try:
        return Speculation.of(flags[flags.index("--speculative-config") + 1], profile.get("mtp_acceptance"))
    except ValueError as e:
        raise SystemExit(f"{profile['model']['path']}: {e}") from None


def predict(profile: dict, dep, wl: dict, output_len: int, flags: list[str] = ()) -> dict:
    from planner.perf import ProfilePerf
    from planner.simulate import SimModel, Simulator, Workload

    w = Workload(wl["completed"], wl["prompt_len"], output_len, dep.max_num_seqs)
    return Simulator(ProfilePerf(profile), SimModel.from_profile(profile), dep,
                     spec=speculation(flags, profile)).run(w)


def stored(profile: dict) -> dict:
    """What a result file keeps of a profile: everything the simulator reads (not the raw samples)."""
    return {k: v for k, v in profile.items() if k != "samples"}


def setup_shape(name: str, shape: tuple, deployments: dict, tmp: Path, args) -> dict:
    """A shape's checkpoint, its first profile (`shuttle profile`, the front and its served runs
    included), the plan `shuttle plan` picks from it (before anything is measured) and the
    deployments to measure: name -> (serve flags, batch), with the pick's `serve --plan`."""
    if shape is None:  # --speculative: the built-in model as committed (its MTP head included)
        from models.builtin import builtin_model_dir
        ckpt = builtin_model_dir()
    else:
        ckpt = checkpoint(tmp / name, shape, args.dtype)
    prof_path = tmp / f"{name}.profile.json"
    cmd = [sys.executable, "-m", "server.cli", "profile", "--model", str(ckpt), "--out", str(prof_path),
           "--torch-threads", "1,2", "--transport", "shm,tcp", "--dtype", args.serve_dtype,
           *(["--quick"] if args.quick else []), *quantization(args)]
    subprocess.run(cmd, check=True)
    profile = json.loads(prof_path.read_text())
    fresh_path = tmp / f"{name}.fresh.json"
    fresh_cmd = [*cmd[:cmd.index("--out") + 1], str(fresh_path), *cmd[cmd.index("--out") + 2:],
                 *([] if args.fresh_front else ["--no-front"])]
    if shape is None:  # (shuttle plan does not search speculative deployments)
        return {"ckpt": ckpt, "profile": profile, "plan": None, "deployments": deployments, "fresh_cmd": fresh_cmd,
                "fresh_path": fresh_path, "round_profiles": []}
    plan, plan_path = plan_pick(ckpt, prof_path, args)
    if not args.only or "plan" in args.only:
        deployments = {**deployments, "the plan's pick (serve --plan)": (["--plan", str(plan_path)],
                                                                        plan["deployment"]["max_num_seqs"])}
    return {"ckpt": ckpt, "profile": profile, "plan": plan, "deployments": deployments, "fresh_cmd": fresh_cmd,
            "fresh_path": fresh_path, "round_profiles": []}


def profile_again(st: dict, args) -> dict:
    """The workers and M2N profiled again (and the front too with --fresh-front; else the first
    profile's front and served factors are kept: CALIBRATION)."""
    subprocess.run(st["fresh_cmd"], check=True, stdout=subprocess.DEVNULL)
    fresh = json.loads(st["fresh_path"].read_text())
    if not args.fresh_front:
        fresh.update({k: st["profile"].get(k) for k in CALIBRATION})
    return fresh


def deployment_of(st: dict, dname: str):
    flags, batch = st["deployments"][dname]
    cores = st["profile"]["host"]["cores"]
    return plan_deployment(st["plan"], cores) if "--plan" in flags else parse(flags, batch, cores)


def make_row(name: str, dname: str, runs: list[dict], st: dict, args) -> dict:
    """A deployment's row from its measurements (one per round, each the median of --repeats runs
    on one server): each compared metric the median over the rounds; predicted from the first
    profile and, with --rounds 2 or more, from each round's profile (the median of those
    predictions against the median of the measurements: `*_rounds`)."""
    dep, flags = deployment_of(st, dname), st["deployments"][dname][0]
    m = {**runs[0], **{key: statistics.median(r[key] for r in runs) for key in COMPARED}}
    tput = [t for r in runs for t in r["repeat_tok_s"]]
    wl = workload(m)
    p = predict(st["profile"], dep, wl, args.output_len, flags)
    row = {"model": name, "deployment": dname, "oversubscribed": dep.oversubscribed or "oversubscribed" in dname,
           "pred_tok_s": p["output_throughput"], "meas_tok_s": m["output_throughput"],
           "tok_s_err": p["output_throughput"] / m["output_throughput"] - 1,
           "pred_tpot_ms": p["mean_tpot_ms"], "meas_tpot_ms": m["mean_tpot_ms"],
           "tpot_err": p["mean_tpot_ms"] / m["mean_tpot_ms"] - 1,
           "pred_ttft_ms": p["mean_ttft_ms"], "meas_ttft_ms": m["mean_ttft_ms"],
           "meas_repeat_tok_s": tput, "meas_spread": max(tput) / min(tput) - 1,
           "meas_repeat_tpot_ms": [t for r in runs for t in r["repeat_tpot_ms"]],
           "meas_repeat_failed": [f for r in runs for f in r["repeat_failed"]],
           "meas_round_tok_s": [r["output_throughput"] for r in runs],
           "load_average": max(r["load_average"] for r in runs), "meas_cpu_us_per_token": {
               k: round(statistics.median(r["cpu_s_per_token"][k] for r in runs) * 1e6)
               for k in runs[0]["cpu_s_per_token"]},
           "pred_attn_busy": p["attention_busy"], "pred_expert_busy": p["expert_busy"], "workload": wl}
    spec = speculation(flags, st["profile"])
    if spec is not None:
        row.update(profile_acceptance=list(spec.acceptance[:spec.num_speculative_tokens]),
                   pred_acceptance=p["spec_decode_per_position_acceptance_rates"],
                   meas_acceptance=m.get("spec_decode_per_position_acceptance_rates"))
    if len(st["round_profiles"]) > 1:
        row.update(rounds_errors(st["round_profiles"], dep, wl, args.output_len, row, flags))
    return row


def rounds_errors(profiles: list[dict], dep, wl: dict, output_len: int, row: dict, flags: list[str] = ()) -> dict:
    """The median of the predictions from each round's profile against the row's measurement (the
    median over the same rounds): the host's drift over the run is in both sides alike. With the
    noise of both medians (bench.common.median_noise over the rounds' measurements and over their
    predictions, combined as independent): `noise_sd_rounds`, and `p_within_10pct_rounds`, the
    chance that a prediction without any bias lands within 10% of this measurement on this host."""
    preds = [predict(prof, dep, wl, output_len, flags) for prof in profiles]
    tok = statistics.median(q["output_throughput"] for q in preds)
    tpot = statistics.median(q["mean_tpot_ms"] for q in preds)
    noise = math.hypot(median_noise(row["meas_round_tok_s"]), median_noise([q["output_throughput"] for q in preds]))
    return {"pred_rounds_tok_s": tok, "tok_s_err_rounds": tok / row["meas_tok_s"] - 1,
            "pred_rounds_tpot_ms": tpot, "tpot_err_rounds": tpot / row["meas_tpot_ms"] - 1,
            "pred_round_tok_s": [q["output_throughput"] for q in preds],
            "noise_sd_rounds": noise, "p_within_10pct_rounds": within_by_noise(noise, 0.10)}


def measure_shapes(states: dict, args) -> list[dict]:
    """Every shape's deployments measured in --rounds rounds: each round profiles every shape again
    (the first round takes the first profile) and then measures each deployment once on a server
    started for it, in the order of the list in even rounds and the reverse in odd ones, so a
    deployment's measurements and the profiles spread over the whole run alike and a drift of the
    host over it moves both sides of the comparison (on this host the same deployment measured a
    fifth apart minutes apart). With --fresh-profile (one round) each deployment is also predicted
    from a profile made right after its measurement."""
    order = [(name, d) for name, st in states.items() for d in st["deployments"]]
    runs: dict[tuple[str, str], list[dict]] = {k: [] for k in order}
    rows: dict[tuple[str, str], dict] = {}
    for rnd in range(args.rounds):
        for st in states.values():
            st["round_profiles"].append(st["profile"] if rnd == 0 else profile_again(st, args))
        for name, dname in order if rnd % 2 == 0 else order[::-1]:
            st = states[name]
            flags, batch = st["deployments"][dname]
            runs[name, dname].append(measure(st["ckpt"], flags, batch, args, seed=rnd * args.repeats))
            if args.rounds == 1:
                rows[name, dname] = row = make_row(name, dname, runs[name, dname], st, args)
                if args.fresh_profile:  # the workers and M2N (and the front) profiled again right after the measurement
                    fresh = profile_again(st, args)
                    f = predict(fresh, deployment_of(st, dname), row["workload"], args.output_len, flags)
                    row.update(fresh_profile=stored(fresh), pred_fresh_tok_s=f["output_throughput"],
                               tok_s_err_fresh=f["output_throughput"] / row["meas_tok_s"] - 1,
                               tpot_err_fresh=f["mean_tpot_ms"] / row["meas_tpot_ms"] - 1)
                print(json.dumps(row), flush=True)
            else:
                print(json.dumps({"round": rnd, "model": name, "deployment": dname,
                                  "tok_s": runs[name, dname][-1]["output_throughput"]}), flush=True)
    if args.rounds > 1:
        rows = {k: make_row(*k, runs[k], states[k[0]], args) for k in order}
    return [rows[k] for k in order]


def judge_pick(name: str, st: dict, rows: list[dict], args) -> dict:
    """What a result file keeps of a shape: its profiles, its plan and, with --repeats or --rounds 2
    or more, the pick paired against the best other row in alternating runs."""
    info = {"profile": stored(st["profile"]), "plan": st["plan"]}
    if len(st["round_profiles"]) > 1:
        info["round_profiles"] = [stored(p) for p in st["round_profiles"][1:]]
    mine = [r for r in rows if r["model"] == name]
    pick = next((r for r in mine if r["deployment"].startswith("the plan's pick")), None)
    others = [r for r in mine if r is not pick]
    if pick is not None and others and max(args.repeats, args.rounds) >= 2:
        best = max(others, key=lambda r: r["meas_tok_s"])
        deps = st["deployments"]
        try:
            info["paired"] = {"against": best["deployment"],
                              **paired(st["ckpt"], deps[pick["deployment"]], deps[best["deployment"]], args)}
        except RuntimeError as e:  # the rows stand without it
            info["paired"] = {"against": best["deployment"], "error": str(e)}
        print(json.dumps({"paired": info["paired"]}), flush=True)
    return info


def plan_pick(ckpt: Path, prof_path: Path, args) -> dict:
    out = prof_path.with_suffix(".plan.json")
    cmd = [sys.executable, "-m", "server.cli", "plan", "--model", str(ckpt), "--hardware", "host", "--profile",
           str(prof_path), "--max-devices", "2", "--tbt-slo-ms", "100000", "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--out", str(out), *(["--quick"] if args.quick else []),
           *quantization(args)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text()), out


def quantization(args) -> list[str]:
    """The --quantization flag of profile, plan and serve (none for unquantised weights)."""
    return ["--quantization", args.quantization] if args.quantization else []


def plan_deployment(plan: dict, cores: int):
    from planner.simulate import Deployment

    d = plan["deployment"]
    return Deployment(d["colocated"], d["attention_workers"], d["expert_workers"], d["micro_batches"],
                      d["torch_threads"], cores, d["transport"], max_num_seqs=d["max_num_seqs"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small models, short outputs: about 10 minutes")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the checkpoints' dtype")
    p.add_argument("--serve-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="shuttle serve's and shuttle profile's --dtype (auto: what serve makes of the checkpoint)")
    p.add_argument("--repeats", type=int, default=1, help="measured runs per deployment on one server (the median "
                                                            "is the truth; the spread is reported)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every deployment this many times, in rounds over the whole list (each on a "
                        "server started for it, the order reversed every other round), each round after a "
                        "whole profile of its own (the front's too): the rows' medians and the *_rounds errors "
                        "(the median of the rounds' predictions) spread over the run alike")
    p.add_argument("--fresh-profile", action="store_true",
                   help="also predict each deployment from the workers and M2N profiled again right after its "
                        "measurement (the first profile's front and served factor kept): the model's error with "
                        "the host's drift between the profile and the measurement taken out")
    p.add_argument("--fresh-front", action="store_true",
                   help="with --fresh-profile, profile the front and its served runs again too (about 12 s more "
                        "a deployment), so the served factors are as fresh as the workers' fits")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="profile, plan and serve with these weights (shuttle serve --quantization); the result "
                        "goes to planner_<quantization>.json")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-prompts", type=int, default=32,
                   help=f"prompts per measured run at least (and at least {MIN_MEASURED_PROMPTS} and "
                        f"{HOST_WAVES} batches)")
    p.add_argument("--only", default=None, help="comma-separated deployment names (of the first shape)")
    p.add_argument("--shapes", default=None, help="comma-separated model shapes to run (default: both)")
    p.add_argument("--speculative", action="store_true",
                   help="instead: the built-in model with its MTP head, plain and with MTP drafts at small batches "
                        "(SPEC_DEPLOYMENTS; writes planner_mtp.json)")
    p.add_argument("--replay", default=None, metavar="RESULT.json",
                   help="measure nothing: predict every row of a result file this script wrote again, with the "
                        "simulator as it is now and the profiles the file stored, and print both errors")
    args = p.parse_args()
    if args.replay:
        replay(Path(args.replay))
        return
    args.fresh_profile = args.fresh_profile or args.fresh_front
    if args.quick:
        args.output_len, args.min_prompts = 16, 16
    shapes = QUICK_SHAPES if args.quick else SHAPES
    first = {k: v for k, v in DEPLOYMENTS.items() if not args.only or k in args.only.split(",")}
    if args.speculative:
        shapes = {"builtin-mtp": None}
        first = {k: v for k, v in SPEC_DEPLOYMENTS.items() if not args.only or k in args.only.split(",")}
    if args.rounds < 1 or args.repeats < 1:
        p.error("--rounds and --repeats must be at least 1")
    if args.rounds > 1 and args.fresh_profile:
        p.error("--fresh-profile and --fresh-front predict each row from a profile made right after its one "
                "measurement; with --rounds every round profiles everything again (the rows' *_rounds errors)")
    # Each round's profile is whole, the front and its served runs (the served factors) included: kept
    # from the first profile, one measurement of the front set every round's prediction (in a run that
    # kept it, its per-request CPU was half of the next run's, and all rows came out fast, then slow).
    args.fresh_front = args.fresh_front or args.rounds > 1
    with tempfile.TemporaryDirectory() as tmp:
        states = {}
        for i, (name, shape) in enumerate(shapes.items()):
            if args.shapes and name not in args.shapes.split(","):
                continue
            deps = first if i == 0 else {k: DEPLOYMENTS[k] for k in SECOND_SHAPE}
            states[name] = setup_shape(name, shape, deps, Path(tmp), args)
        rows = measure_shapes(states, args)
        extra = {name: judge_pick(name, st, rows, args) for name, st in states.items()}
    summary = summarize(rows, extra)
    print_table(rows, ["model", "deployment", "pred_tok_s", "meas_tok_s", "tok_s_err", "meas_spread", "pred_tpot_ms",
                       "meas_tpot_ms", "tpot_err", "pred_attn_busy", "pred_expert_busy", "load_average",
                       *(["pred_fresh_tok_s", "tok_s_err_fresh", "tpot_err_fresh"] if args.fresh_profile else []),
                       *(["pred_rounds_tok_s", "tok_s_err_rounds", "tpot_err_rounds", "noise_sd_rounds"]
                         if args.rounds > 1 else [])])
    print(json.dumps(summary, indent=1))
    result = {"config": vars(args), "rows": rows, "summary": summary, "shapes": extra}
    path = save("planner_partial" if args.only or args.shapes else "planner_mtp" if args.speculative else
                f"planner_{args.quantization}" if args.quantization else "planner", result)
    print(f"wrote {path}")


def replay(path: Path, only_rows: set[int] | None = None, only_rounds: int | None = None) -> list[dict]:
    """Predict a stored run's rows again (from its first and, where stored, fresh profiles) against
    the same measurements: a change to the simulator judged on runs already measured, not on a new
    run whose host may have drifted. Prints the table and the summary and returns the rows (with the
    stored errors as was_*); writes nothing. only_rows: replay just these rows (by index);
    only_rounds: just the first profile and this many more of --rounds (the rounds' medians then
    differ from the stored ones; each round's prediction, pred_round_tok_s, does not)."""
    from planner.calibrate import front_scales, served_factor, served_factors

    result = json.loads(path.read_text())
    output_len, rows = result["config"]["output_len"], []
    # The served factors are the simulator's calibration on the profile's served runs: solved again
    # with the simulator as it is now.
    def solved(q: dict) -> dict:
        q = {**q, "served_factor": served_factor(q), "served_factors": served_factors(q)}
        return {**q, "front_scales": front_scales(q)}
    profiles = {}
    for name, shape in result["shapes"].items():
        prof = shape["profile"]
        profiles[name] = solved(prof)
        print(f"{name}: served factor {prof.get('served_factor')} -> {profiles[name]['served_factor']}, "
              f"by tokens {prof.get('served_factors')} -> {profiles[name]['served_factors']}")
    def round_profile(name: str, q: dict) -> dict:  # its own front (solved again, as the first's), or the first's
        if result["config"].get("fresh_front"):
            return solved(q)
        return {**q, **{k: profiles[name].get(k) for k in CALIBRATION}}
    round_profiles = {name: [round_profile(name, q) for q in shape.get("round_profiles", [])[:only_rounds]]
                      for name, shape in result["shapes"].items()}
    for i, r in enumerate(result["rows"]):
        if only_rows is not None and i not in only_rows:
            continue
        if "workload" not in r:
            raise SystemExit(f"{path}: row {r['deployment']!r} has no stored workload "
                             "(the file was written before --replay existed)")
        profile = profiles[r["model"]]
        plan = result["shapes"][r["model"]]["plan"]
        cores = profile["host"]["cores"]
        flags = []
        if r["deployment"].startswith("the plan's pick"):
            dep = plan_deployment(plan, cores)
        else:
            flags, batch = {**DEPLOYMENTS, **SPEC_DEPLOYMENTS}[r["deployment"]]
            dep = parse(flags, batch, cores)
        p = predict(profile, dep, r["workload"], output_len, flags)
        new = {**r, "was_tok_s_err": r["tok_s_err"], "was_tpot_err": r["tpot_err"],
               "pred_tok_s": p["output_throughput"], "tok_s_err": p["output_throughput"] / r["meas_tok_s"] - 1,
               "pred_tpot_ms": p["mean_tpot_ms"], "tpot_err": p["mean_tpot_ms"] / r["meas_tpot_ms"] - 1,
               "pred_ttft_ms": p["mean_ttft_ms"]}
        if "fresh_profile" in r:
            fresh = {**r["fresh_profile"], **{k: profile.get(k) for k in CALIBRATION
                                                if not result["config"].get("fresh_front")}}
            f = predict(fresh, dep, r["workload"], output_len, flags)
            new.update(tok_s_err_fresh=f["output_throughput"] / r["meas_tok_s"] - 1,
                       tpot_err_fresh=f["mean_tpot_ms"] / r["meas_tpot_ms"] - 1)
        if "round_profiles" in result["shapes"][r["model"]]:  # --rounds: every round's profile (the first is the first)
            rounds = [profile, *round_profiles[r["model"]]]
            new.update(rounds_errors(rounds, dep, r["workload"], output_len, new, flags))
        rows.append(new)
    print_table(rows, ["model", "deployment", "pred_tok_s", "meas_tok_s", "was_tok_s_err", "tok_s_err", "pred_tpot_ms",
                       "meas_tpot_ms", "was_tpot_err", "tpot_err", "pred_ttft_ms", "meas_ttft_ms",
                       *(["tok_s_err_fresh", "tpot_err_fresh"] if all("fresh_profile" in r for r in rows) else []),
                       *(["tok_s_err_rounds", "tpot_err_rounds", "noise_sd_rounds"]
                         if all("tok_s_err_rounds" in r for r in rows) else [])])
    was = summarize([r for i, r in enumerate(result["rows"]) if only_rows is None or i in only_rows], {})
    now = summarize(rows, {})
    keys = ("median_abs_tok_s_err", "within_10pct_tok_s", "within_15pct_tpot", "median_abs_tok_s_err_fresh",
            "within_10pct_tok_s_fresh", "within_15pct_tpot_fresh", "median_abs_tok_s_err_rounds",
            "within_10pct_tok_s_rounds", "within_15pct_tpot_rounds", "expected_within_10pct_by_noise",
            "p_all_within_10pct_by_noise")
    print(json.dumps({k: {"was": was.get(k), "now": now.get(k)} for k in keys}, indent=1))
    return rows


def summarize(rows: list[dict], extra: dict) -> dict:
    fair = [r for r in rows if not r["oversubscribed"]]
    out = {"deployments": len(rows), "not_oversubscribed": len(fair),
           "median_abs_tok_s_err": statistics.median(abs(r["tok_s_err"]) for r in fair) if fair else None,
           "within_10pct_tok_s": sum(abs(r["tok_s_err"]) <= 0.10 for r in fair),
           "within_15pct_tpot": sum(abs(r["tpot_err"]) <= 0.15 for r in fair),
           "oversubscribed_tok_s_err": {r["deployment"]: r["tok_s_err"] for r in rows if r["oversubscribed"]},
           "max_repeat_spread": max(r["meas_spread"] for r in rows),
           **({"median_abs_tok_s_err_fresh": statistics.median(abs(r["tok_s_err_fresh"]) for r in fair),
               "within_10pct_tok_s_fresh": sum(abs(r["tok_s_err_fresh"]) <= 0.10 for r in fair),
               "within_15pct_tpot_fresh": sum(abs(r["tpot_err_fresh"]) <= 0.15 for r in fair)}
              if fair and all("tok_s_err_fresh" in r for r in fair) else {}),
           **({"median_abs_tok_s_err_rounds": statistics.median(abs(r["tok_s_err_rounds"]) for r in fair),
               "within_10pct_tok_s_rounds": sum(abs(r["tok_s_err_rounds"]) <= 0.10 for r in fair),
               "within_15pct_tpot_rounds": sum(abs(r["tpot_err_rounds"]) <= 0.15 for r in fair),
               # what the rounds' noise alone allows a model without bias (rounds_errors)
               **({"expected_within_10pct_by_noise": sum(r["p_within_10pct_rounds"] for r in fair),
                   "p_all_within_10pct_by_noise": math.prod(r["p_within_10pct_rounds"] for r in fair)}
                  if all("p_within_10pct_rounds" in r for r in fair) else {}),
               "oversubscribed_tok_s_err_rounds": {r["deployment"]: r["tok_s_err_rounds"] for r in rows
                                                   if r["oversubscribed"]}}
              if fair and all("tok_s_err_rounds" in r for r in fair) else {}),
           "load_average": [min(r["load_average"] for r in rows), max(r["load_average"] for r in rows)]}
    for name, e in extra.items():
        mine = [r for r in rows if r["model"] == name]
        best = max(mine, key=lambda r: r["meas_tok_s"])
        pick = next((r for r in mine if r["deployment"].startswith("the plan's pick")), None)
        if pick is None:  # --only without the plan
            continue
        out[f"plan_{name}"] = {"picked": e["plan"]["deployment"], "picked_measured_tok_s": pick["meas_tok_s"],
                               "best_measured": best["deployment"], "best_measured_tok_s": best["meas_tok_s"],
                               "picked_vs_best": pick["meas_tok_s"] / best["meas_tok_s"]}
        if "ratio" in e.get("paired", {}):  # the pick against the best other row in alternating runs
            # (a ratio above 1: the pick is the best of the two, so 1 against the best)
            out[f"plan_{name}"].update(paired_against=e["paired"]["against"], paired_ratio=e["paired"]["ratio"],
                                       picked_vs_best_paired=min(1.0, e["paired"]["ratio"]))
    return out


if __name__ == "__main__":
    main()
