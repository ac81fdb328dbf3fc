"""How much this host's own speed moves a measured deployment: the noise floor under bench/planner.py.

    python bench/host_noise.py [--runs 10] [--shape fine] [--deployments "colocated 2 threads,1+1 m=1"]

Serves bench/planner.py's quick model shape `--runs` times per deployment (the deployments in turn,
each run on a server started for it, the workload and measurement of bench/planner.py's rows) and
times a fixed CPU probe right before and right after each run: a bf16 MLP at the shape's hidden size
on every core, in a process of its own, the median of 7 timings of 200 calls. Prints each run's
throughput beside the probe, and per deployment the runs' spread, the correlation of log throughput
with log probe speed (the host's own speed, which no model of our code predicts), and what the runs'
noise leaves a model without bias against the median of --rounds such runs (the planner's rows):
the standard deviation of that median (bench.common.median_noise) and its chance of landing within
10% (within_by_noise). Writes bench/results/host_noise.json.
"""
import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import median_noise, print_table, save, within_by_noise  # noqa: E402
from bench.planner import DEPLOYMENTS, QUICK_SHAPES, checkpoint, measure  # noqa: E402

PROBE = """
import sys, time, torch
h = int(sys.argv[1])
g = torch.Generator().manual_seed(0)
x = torch.randn(64, h, generator=g).bfloat16()
w1, w2 = torch.randn(h, 4 * h, generator=g).bfloat16(), torch.randn(4 * h, h, generator=g).bfloat16()
mlp = lambda: torch.nn.functional.silu(x @ w1) @ w2
for _ in range(50):
    mlp()
times = []
for _ in range(7):
    t0 = time.perf_counter()
    for _ in range(200):
        mlp()
    times.append(time.perf_counter() - t0)
print(sorted(times)[3])
"""


def probe(hidden: int) -> float:
    """Seconds for the probe's 200 calls (the median of 7 timings), in a fresh process on every core."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(hidden)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="measured runs per deployment")
    p.add_argument("--shape", default="fine", choices=sorted(QUICK_SHAPES))
    p.add_argument("--deployments", default="colocated 2 threads,1+1 m=1",
                   help=f"comma-separated, of: {', '.join(DEPLOYMENTS)}")
    p.add_argument("--rounds", type=int, default=6, help="the planner's rounds a row's median is taken over")
    args = p.parse_args()
    names = args.deployments.split(",")
    unknown = [n for n in names if n not in DEPLOYMENTS]
    if unknown or args.runs < 2:
        p.error(f"unknown deployment(s) {unknown}" if unknown else "--runs must be at least 2")
    hidden = QUICK_SHAPES[args.shape][0]
    bench_args = argparse.Namespace(serve_dtype="auto", input_len=64, output_len=16, min_prompts=16, repeats=1)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = checkpoint(Path(tmp) / args.shape, QUICK_SHAPES[args.shape], "bfloat16")
        t_start = time.monotonic()
        for i in range(args.runs):
            for name in names:
                flags, batch = DEPLOYMENTS[name]
                before = probe(hidden)
                m = measure(ckpt, flags, batch, bench_args, seed=i)
                after = probe(hidden)
                runs.append({"deployment": name, "run": i, "at_s": round(time.monotonic() - t_start, 1),
                             "tok_s": m["output_throughput"], "mean_tpot_ms": m["mean_tpot_ms"],
                             "probe_ms": 1e3 * (before + after) / 2, "probe_before_ms": 1e3 * before,
                             "probe_after_ms": 1e3 * after})
                print(runs[-1], flush=True)
    summary = {}
    for name in names:
        mine = [r for r in runs if r["deployment"] == name]
        tok = np.log([r["tok_s"] for r in mine])
        speed = -np.log([r["probe_ms"] for r in mine])
        # the median of --rounds runs drawn from these; a row's prediction, the median over as many
        # profiles that the host's speed moves alike, taken to be as noisy
        sd_median = median_noise(np.exp(tok), size=args.rounds)
        noise = float(np.hypot(sd_median, sd_median))
        summary[name] = {"runs": len(mine), "median_tok_s": statistics.median(np.exp(tok)),
                         "spread": float(np.exp(tok.max() - tok.min()) - 1), "sd_one_run": float(tok.std(ddof=1)),
                         "probe_spread": float(np.exp(speed.max() - speed.min()) - 1),
                         "corr_tok_s_probe_speed": float(np.corrcoef(tok, speed)[0, 1]),
                         "sd_median_of_rounds": sd_median, "sd_median_of_these_runs": median_noise(np.exp(tok)),
                         "p_within_10pct_by_noise": within_by_noise(noise, 0.10)}
    print_table(runs, ["deployment", "run", "at_s", "tok_s", "mean_tpot_ms", "probe_before_ms", "probe_after_ms"])
    print_table([{"deployment": k, **v} for k, v in summary.items()],
                ["deployment", "runs", "median_tok_s", "spread", "sd_one_run", "probe_spread",
                 "corr_tok_s_probe_speed", "sd_median_of_rounds", "p_within_10pct_by_noise"])
    path = save("host_noise", {"config": vars(args), "runs": runs, "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
