"""CPU seconds that a served run spends outside the workers: the front and the load generator.

On one host the front process (HTTP, tokenizer and incremental detokenizer, SSE encoding, the
control plane's reader threads, PoolEngine) and the client that drives the load (`shuttle bench
serve`) share the cores with the workers. `measure_front` serves the profiled model for real as a
1 + 1 pool (`shuttle serve --torch-threads 1 --micro-batches 2`), so the front process does only
front work, drives it with `clients.bench_serve`, and reads the front's CPU time from /proc; the
client's is this process's own CPU time during the load (bench serve's `client_cpu_s`: not loading
the tokenizer, making the requests or the report, which over few tokens looked like per-token
cost). Both are returned per output token, per request and per engine step (with the workers' CPU
per token, which includes their waits' polling): runs of two output lengths at the profile's
batch, one at a quarter of it and one at four times it (LARGE), and the server's own step count (/metrics
shuttle_engine_steps_total), solve cpu = per_request x requests + per_token x tokens + per_step x
steps. The per-step part is what a step's deltas cost whatever they carry (reading the message,
waking the engine thread and the event loop); charged per token at one batch size it made batch
16 look 17% faster than served on the AVX-512 EPYC, where it measured ~0.9 ms (front) + ~0.25 ms
(load generator) a step.

The batch-64 and batch-16 runs are also kept as served (`run`, `run_small`: requests, lengths,
concurrency, the load's wall time): planner.calibrate.served_factor and served_factors calibrate the
simulator against them. `measure_scale_runs` serves the deployments whose steps take every core (a
colocated engine, also at batch 256; 1 + 1 at m = 1) the same way, for planner.calibrate.front_scales.

`tree_cpu` (per process of a process tree) is also what bench/planner.py records beside each
measured deployment, so the model's shares can be checked against served runs.
"""
import contextlib
import io
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from clients.ready import NotReady, wait_until_healthy
from planner.metrics import lower_median

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
MICRO_BATCHES = 2  # the served run's pools both compute at once, as most deployments' do
SERVED_REPEATS = 3  # runs at each calibrated batch size (the median one calibrates)
# The colocated engine's served run at this concurrency too (measure_scale_runs): the factor solved at
# batch 64 alone put the quick Mixtral shape's colocated batch-256 rows 4-15% fast on a Zen 5 EPYC in
# three of four planner runs (the fine shape's within 5%): what a step of 256 sequences costs beside
# the front is not what one of 64 does. planner.factors.front_scale interpolates between the two.
LARGE_SCALE_BATCH = 256
# ... and the colocated engine at the most threads and the 1 + 1 pool at m = 1 also at this concurrency,
# SMALL_SCALE_PROMPTS requests: the front's CPU per step, solved on runs of 16 and 64 sequences with the
# front apart from the workers (0.75 ms with the load generator's on the built-in model), is more than a
# colocated step of one sequence takes as served (0.69 ms), so the factor at 64 made batch-1 rows 43% slow.
SMALL_SCALE_BATCH, SMALL_SCALE_PROMPTS = 1, 32
# ... and, for a model with MTP layers, both deployments speculating (method mtp, SPEC_SCALE_K drafts) at
# SPEC_SCALE_BATCH, a concurrency where disable_by_batch_size's default (4) keeps speculation on: the front
# beside speculative steps is not the front beside plain ones (without these runs the simulator put the
# built-in model's MTP rows 13-48% fast: it charges the front per step, so MTP's fewer steps cost it less,
# where the served 1 + 1 front's CPU per token with MTP was 159, 181 and 134 us against plain's 156, 168, 164).
SPEC_SCALE_BATCH, SPEC_SCALE_K = 2, 2
# Runs at LARGE x the batch, for the split of the CPU into per token and per step only: the same
# tokens in about half the batch-64 run's steps. With the batch-16 and batch-64 runs alone (about
# 260 and 80 steps for the same 4,096 tokens) the split follows the host's noise: three profiles of
# the quick Mixtral shape on one host put the load generator at 50, 69 and 23 us a token with 263,
# 0 and 295 us a step, 13.2, 17.6 and 6.2 ms for a decode step of 256, where served runs measured
# 60-64 us a token (15.4-16.4 ms).
LARGE, LARGE_REPEATS = 4, 2


def _stat_cpu(path: str) -> float:
    """utime + stime of a /proc/<pid>[/task/<tid>]/stat file, seconds."""
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def tree_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """pid and its descendants: pid -> (process title, CPU seconds so far). Processes that exit
    while walking are left out."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            title = Path(f"/proc/{p}/cmdline").read_text(errors="replace").split("\0")[0]
            out[p] = (title, _stat_cpu(f"/proc/{p}/stat"))
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            continue
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 180.0) -> None:
    try:
        wait_until_healthy(url, timeout_s, proc, "shuttle serve (the front's profile)")
    except NotReady as e:
        raise RuntimeError(f"{e}:\n{log.read_text(errors='replace')[-4000:]}") from None


def measure_front(model: str, dtype: str | None = None, batch: int = 64, prompts: int = 256, input_len: int = 64,
                  output_len: int = 16, short_len: int = 1, quantization: str | None = None,
                  quantize_linears: bool = False) -> dict:
    """Serve `model` as a 1 + 1 pool (m=2, one torch thread per worker) and measure the CPU seconds of
    the front process and of the load generator per output token, per request and per engine step:
    runs of `prompts` requests, (`batch`, `output_len`) and (`batch` // 4, `output_len`)
    SERVED_REPEATS times each, (`batch`, `short_len`) once and (LARGE x `batch`, `output_len`)
    LARGE_REPEATS times (concurrency, tokens each; the server takes LARGE x `batch` sequences);
    split_front_cpu solves them all. `run` and `run_small` are the repeats of median duration: a
    single served run calibrated the simulator with this host's noise (the batch-16 run's load took
    1.81-2.58 s in eleven planner runs, its served factor at 8 tokens a call 1.25-2.26). Returns
    {"front_s_per_token", "front_s_per_request", "front_s_per_step", "client_s_per_token",
    "client_s_per_request", "client_s_per_step", "workers_s_per_token", "tokens", "wall_s", "run",
    "run_small", "runs"} (the workers' and the wall time of `run`; `run` and `run_small` the
    batch-64 and batch-16 runs as served, with their mean TTFT (kept for comparison, not used by
    the simulator); `runs` what the split was solved from). quantization, quantize_linears: served
    with --quantization (and --quantize-linears), as the profile's other measurements hold the weights. 256 requests: the
    CPU times come from /proc in 10 ms ticks, and with 64 the 1-token run was a few ticks, so the
    per-request cost came out 0 on the AVX-512 EPYC where 256 measure it at ~0.7 ms (the front) and
    ~0.19 ms (the load generator)."""
    runs = []
    flags = ["--torch-threads", "1", "--micro-batches", str(MICRO_BATCHES), "--max-num-seqs", str(LARGE * batch)]
    with _serving(model, flags, dtype, quantization, input_len, quantize_linears) as (proc, url, load):
        load(batch, batch, 1000, output_len)  # warm-up: first calls, allocations
        # other prompts each run (its seed): none from the prefix cache
        plan = ([("run", batch, output_len)] * SERVED_REPEATS + [("short", batch, short_len)]
                + [("run_small", max(1, batch // 4), output_len)] * SERVED_REPEATS
                + [("run_large", LARGE * batch, output_len)] * LARGE_REPEATS)
        for seed, (role, concurrency, length) in enumerate(plan):
            steps0 = engine_steps(url)
            t0, w0 = tree_cpu(proc.pid), time.perf_counter()
            m = load(concurrency, prompts, seed, length)
            t1, w1 = tree_cpu(proc.pid), time.perf_counter()
            workers = sum(cpu - t0[p][1] for p, (title, cpu) in t1.items() if p in t0 and title.startswith("shuttle-"))
            steps = engine_steps(url) - steps0
            if steps <= 0:  # a counter that did not move (or restarted) would misplace the per-step cost
                raise RuntimeError(f"the served run at concurrency {concurrency} counted {steps} engine steps "
                                   f"(/metrics shuttle_engine_steps_total); the front's profile needs them")
            runs.append({"role": role, "tokens": max(int(m["total_output_tokens"]), 1),
                         "requests": max(int(m["completed"]), 1),
                         "steps": steps, "concurrency": concurrency,
                         "front": t1[proc.pid][1] - t0[proc.pid][1], "client": m["client_cpu_s"], "workers": workers,
                         "wall": w1 - w0, "load_s": m["duration"], "input_tokens": int(m["total_input_tokens"]),
                         "ttft_s": float(m["mean_ttft_ms"]) / 1e3})

    long, small = (lower_median((r for r in runs if r["role"] == role), key=lambda r: r["load_s"])
                   for role in ("run", "run_small"))

    def served(r: dict) -> dict:
        return _served(r, output_len, MICRO_BATCHES)
    out = {"workers_s_per_token": long["workers"] / long["tokens"], "tokens": long["tokens"], "wall_s": long["wall"],
           # the runs at both batch sizes as served, for the simulator's calibration
           # (planner.calibrate.served_factor and served_factors)
           "run": served(long), "run_small": served(small),
           "runs": [{k: r[k] for k in ("role", "concurrency", "requests", "tokens", "steps", "front", "client")}
                    for r in runs]}
    for who in ("front", "client"):
        out[f"{who}_s_per_token"], out[f"{who}_s_per_request"], out[f"{who}_s_per_step"] = split_front_cpu(runs, who)
    return out


def _served(r: dict, output_len: int, micro_batches: int) -> dict:
    """A served run as the simulator's calibration takes it: its workload and the load's wall time."""
    return {"requests": r["requests"], "prompt_len": round(r["input_tokens"] / r["requests"]),
            "output_len": output_len, "concurrency": r["concurrency"], "micro_batches": micro_batches,
            "load_s": r["load_s"], "ttft_s": r["ttft_s"]}


@contextlib.contextmanager
def _serving(model: str, flags: list[str], dtype: str | None, quantization: str | None, input_len: int = 64,
             quantize_linears: bool = False):
    """A live `shuttle serve` of `model` with `flags`: yields (its process, its URL, load), where
    load(concurrency, prompts, seed, output_len) runs `shuttle bench serve`'s client against it with
    prompts of exactly input_len tokens of the model's tokenizer (as bench/planner.py's rows) and
    returns its metrics. The server is stopped on exit; a server that does not come up raises with
    its log's tail."""
    from clients.bench_serve import run_bench

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", prefix="shuttle-profile-front-", suffix=".log") as log:
        cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", str(port), *flags,
               *(["--dtype", dtype] if dtype else []), *(["--quantization", quantization] if quantization else []),
               *(["--quantize-linears"] if quantize_linears else [])]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(proc, url, Path(log.name))

            def load(concurrency: int, n: int, seed: int, length: int) -> dict:
                with contextlib.redirect_stdout(io.StringIO()):  # bench serve prints its table
                    return run_bench(["--base-url", url, "--input-len", str(input_len), "--tokenizer", str(model),
                                      "--max-concurrency", str(concurrency), "--ignore-eos", "--disable-tqdm",
                                      "--num-prompts", str(n), "--seed", str(seed), "--output-len", str(length)])
            yield proc, url, load
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def measure_scale_runs(model: str, threads: tuple[int, ...], dtype: str | None = None, batch: int = 64,
                       prompts: int = 256, input_len: int = 64, output_len: int = 16,
                       quantization: str | None = None, quantize_linears: bool = False,
                       large_batch: int | None = LARGE_SCALE_BATCH,
                       small_batch: int | None = SMALL_SCALE_BATCH, speculative: bool = False) -> list[dict]:
    """Served runs of the deployments whose steps take every core the front and the load generator
    share: `shuttle serve --colocated --torch-threads t` for each t in `threads`, and a 1 + 1 pool
    at m = 1 (serve's threads), each at concurrency `batch`; the colocated engine at the most threads
    and the m = 1 pool also at `small_batch` (SMALL_SCALE_PROMPTS requests; None: not); the colocated
    engine at the most threads also at `large_batch` (None: not), with as many waves of prompts (prompts / batch: requests of one
    wave start and end a few steps apart, so later waves mix prefill into decode steps, which one wave
    of 256 does not: its factor came out below batch 64's where the 4-wave rows needed one above).
    With speculative (a model with MTP layers), the colocated engine at the most threads and the m = 1
    pool also drafting (SPEC_SCALE_K, method mtp) at SPEC_SCALE_BATCH. SERVED_REPEATS runs after a
    warm-up, the run of median duration kept as served. planner.calibrate.front_scales solves each for
    the factor on the front's CPU beside such steps. Returns [{"kind": "colocated" or "m1", "threads",
    "speculative": its --speculative-config or None, **served run}] (threads None: serve's own)."""
    plan = [("colocated", t, ["--colocated", "--torch-threads", str(t)], batch, prompts) for t in threads]
    if large_batch and large_batch != batch:
        t = max(threads)
        plan.append(("colocated", t, ["--colocated", "--torch-threads", str(t)], large_batch,
                     -(-prompts // batch) * large_batch))
    plan.append(("m1", None, ["--micro-batches", "1"], batch, prompts))
    if small_batch and small_batch != batch:
        t = max(threads)
        plan += [("colocated", t, ["--colocated", "--torch-threads", str(t)], small_batch, SMALL_SCALE_PROMPTS),
                 ("m1", None, ["--micro-batches", "1"], small_batch, SMALL_SCALE_PROMPTS)]
    if speculative:
        spec = json.dumps({"method": "mtp", "num_speculative_tokens": SPEC_SCALE_K})
        t = max(threads)
        plan += [("colocated", t, ["--colocated", "--torch-threads", str(t), "--speculative-config", spec],
                  SPEC_SCALE_BATCH, SMALL_SCALE_PROMPTS),
                 ("m1", None, ["--micro-batches", "1", "--speculative-config", spec], SPEC_SCALE_BATCH,
                  SMALL_SCALE_PROMPTS)]
    out = []
    for kind, t, flags, conc, n in plan:
        with _serving(model, [*flags, "--max-num-seqs", str(conc)], dtype, quantization, input_len,
                      quantize_linears) as (_, _, load):
            load(conc, conc, 1000, output_len)  # warm-up
            runs = []
            for seed in range(SERVED_REPEATS):
                m = load(conc, n, seed, output_len)
                runs.append({"requests": max(int(m["completed"]), 1), "concurrency": conc,
                             "input_tokens": int(m["total_input_tokens"]), "load_s": m["duration"],
                             "ttft_s": float(m["mean_ttft_ms"]) / 1e3})
        run = lower_median(runs, key=lambda r: r["load_s"])
        spec = flags[flags.index("--speculative-config") + 1] if "--speculative-config" in flags else None
        out.append({"kind": kind, "threads": t, "speculative": spec, **_served(run, output_len, 1)})
    return out


def engine_steps(url: str, settle_s: float = 3.0) -> int:
    """The server's engine steps so far (/metrics shuttle_engine_steps_total), once two reads 0.1 s
    apart agree: pool workers report their counters when they park, a moment after the last delta."""
    def read() -> int:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("shuttle_engine_steps_total"):
                return int(float(line.split()[-1]))
        raise RuntimeError(f"{url}/metrics has no shuttle_engine_steps_total")
    last, deadline = read(), time.monotonic() + settle_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read()
        if now == last:
            break
        last = now
    return last


FRONT_TERMS = ("tokens", "requests", "steps")


def split_front_cpu(runs: list[dict], who: str) -> tuple[float, float, float]:
    """(seconds per token, per request, per step) of `who`'s CPU over runs of different output
    lengths and batch sizes: the least-squares solution of cpu = per_token x tokens + per_request x
    requests + per_step x steps with every coefficient >= 0 (the best fit over the subsets of terms
    whose unconstrained solution is non-negative: noise can make a term negative; then the others
    carry it). Runs without a step count (older callers): the per-step term is left out."""
    terms = FRONT_TERMS if all(r.get("steps") for r in runs) else FRONT_TERMS[:2]
    X = np.array([[float(r[t]) for t in terms] for r in runs])
    y = np.array([float(r[who]) for r in runs])
    best, best_err = np.zeros(len(terms)), float(np.sum(y ** 2))
    tie = 1e-12 * best_err  # fits this close are equal: the one with fewer terms (found first) stays
    for k in range(1, min(len(terms), len(runs)) + 1):  # no more terms than runs: those fit anything
        for cols in itertools.combinations(range(len(terms)), k):
            coef = np.linalg.lstsq(X[:, cols], y, rcond=None)[0]
            if (coef < 0).any():
                continue
            err = float(np.sum((X[:, cols] @ coef - y) ** 2))
            if err < best_err - tie:
                best, best_err = np.zeros(len(terms)), err
                best[list(cols)] = coef
    per = dict(zip(terms, best.tolist()))
    return per["tokens"], per["requests"], per.get("steps", 0.0)
