"""CPU seconds that a served run spends outside the workers: the front and the load generator.

On one host the front process (HTTP, tokenizer and incremental detokenizer, SSE encoding, the
control plane's reader threads, PoolEngine) and the client that drives the load (`shuttle bench
serve`) share the cores with the workers. `measure_front` serves the profiled model for real as a
1 + 1 pool (`shuttle serve --torch-threads 1 --micro-batches 2`), so the front process does only
front work, drives it with `clients.bench_serve`, and reads the front's CPU time from /proc; the
client's is this process's own CPU time during the load (bench serve's `client_cpu_s`: not loading
the tokenizer, making the requests or the report, which over few tokens looked like per-token
cost). Both are returned per output token and per request (with the workers' CPU per token, which
includes their waits' polling).

The longer run is also kept as served (`run`: requests, lengths, concurrency, its load's wall time):
planner.profile.served_factor calibrates the simulator against it.

`tree_cpu` (per process of a process tree) is also what bench/planner.py records beside each
measured deployment, so the model's shares can be checked against served runs.
"""
import contextlib
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clients.ready import NotReady, wait_until_healthy

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
MICRO_BATCHES = 2  # the served run's pools both compute at once, as most deployments' do


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
                  output_len: int = 16, short_len: int = 1) -> dict:
    """Serve `model` as a 1 + 1 pool (m=2, one torch thread per worker) and measure the CPU seconds of
    the front process and of the load generator, per output token and per request: two runs of
    `prompts` requests, `output_len` and `short_len` tokens each, solve cpu = per_request x requests
    + per_token x tokens (each >= 0). Returns {"front_s_per_token", "front_s_per_request",
    "client_s_per_token", "client_s_per_request", "workers_s_per_token", "tokens", "wall_s"} (the
    workers' and the wall time of the longer run). 256 requests: the CPU times come from /proc in
    10 ms ticks, and with 64 the 1-token run was a few ticks, so the per-request cost came out 0 on
    the AVX-512 EPYC where 256 measure it at ~0.7 ms (the front) and ~0.19 ms (the load generator)."""
    from clients.bench_serve import run_bench

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    runs = []
    with tempfile.NamedTemporaryFile("w+", prefix="shuttle-profile-front-", suffix=".log") as log:
        cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", str(port),
               "--torch-threads", "1", "--micro-batches", str(MICRO_BATCHES), "--max-num-seqs", str(batch),
               *(["--dtype", dtype] if dtype else [])]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(proc, url, Path(log.name))
            args = ["--base-url", url, "--input-len", str(input_len), "--max-concurrency", str(batch), "--ignore-eos",
                    "--disable-tqdm"]
            with contextlib.redirect_stdout(io.StringIO()):  # bench serve prints its table
                run_bench([*args, "--num-prompts", str(batch), "--seed", "1000",  # warm-up: first calls, allocations
                           "--output-len", str(output_len)])
            for seed, length in enumerate((output_len, short_len)):
                t0, w0 = tree_cpu(proc.pid), time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):  # other prompts: none from the prefix cache
                    m = run_bench([*args, "--num-prompts", str(prompts), "--seed", str(seed), "--output-len",
                                   str(length)])
                t1, w1 = tree_cpu(proc.pid), time.perf_counter()
                workers = sum(cpu - t0[p][1] for p, (title, cpu) in t1.items() if p in t0 and title.startswith("shuttle-"))
                runs.append({"tokens": max(int(m["total_output_tokens"]), 1), "requests": max(int(m["completed"]), 1),
                             "front": t1[proc.pid][1] - t0[proc.pid][1], "client": m["client_cpu_s"], "workers": workers,
                             "wall": w1 - w0, "load_s": m["duration"], "input_tokens": int(m["total_input_tokens"])})
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    long, short = runs
    out = {"workers_s_per_token": long["workers"] / long["tokens"], "tokens": long["tokens"], "wall_s": long["wall"],
           # the longer run as served, for the simulator's calibration (planner.profile.served_factor)
           "run": {"requests": long["requests"], "prompt_len": round(long["input_tokens"] / long["requests"]),
                   "output_len": output_len, "concurrency": batch, "micro_batches": MICRO_BATCHES,
                   "load_s": long["load_s"]}}
    for who in ("front", "client"):
        out[f"{who}_s_per_token"], out[f"{who}_s_per_request"] = split_per_request(long, short, who)
    return out


def split_per_request(long: dict, short: dict, who: str) -> tuple[float, float]:
    """(seconds per token, seconds per request) of `who`'s CPU from two runs of different output
    lengths: cpu = per_request x requests + per_token x tokens, both kept >= 0 (noise can make the
    difference negative: then everything is charged per token, as before the split)."""
    d_tok = long["tokens"] - short["tokens"] * long["requests"] / short["requests"]
    per_token = (long[who] - short[who] * long["requests"] / short["requests"]) / d_tok if d_tok > 0 else -1.0
    if not per_token > 0:
        return long[who] / long["tokens"], 0.0
    per_request = (long[who] - per_token * long["tokens"]) / long["requests"]
    if per_request < 0:
        return long[who] / long["tokens"], 0.0
    return per_token, per_request
