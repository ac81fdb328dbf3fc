"""Training throughput: tokens per second and MFU of `python -m training` on the built-in model's
shape, one rank (the baseline) against two ranks with expert parallelism (the same global batch),
in float32 and under bfloat16 autocast; on a GPU too when one is present.

    python bench/train.py [--steps 8] [--quick]

Model: the built-in recipe's Mixtral shape (training/builtin.py: 6 layers, hidden 384, 8 experts of
320, top-2, 4096 vocabulary), random init; data: the Python documentation's topics; sequences of 512
tokens, a global batch of 8 sequences. Each configuration is a real run (torchrun for several ranks)
of --steps optimiser steps; the table reports the median over its steps after the first two.
MFU = tokens/s x training FLOPs per token (6 x active parameters, only the top-k experts counted,
plus attention) / peak, the peak being a square matmul's rate measured by every rank at the same
time at the start of the run, summed over ranks. Writes bench/results/train.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import print_table, save  # noqa: E402
from models.builtin import corpus  # noqa: E402
from training.builtin import MODEL  # noqa: E402
from training.config import SHAPE_FLAGS  # noqa: E402
from training.metrics import read_log  # noqa: E402


def write_data(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in corpus()))
    return path


def run(tmp: Path, data: Path, ranks: int, dtype: str, device: str, args: argparse.Namespace) -> dict:
    """One training run; returns its row of the table."""
    out = tmp / f"{device}-{ranks}-{dtype}"
    model = MODEL if not args.quick else {**MODEL, "num_hidden_layers": 2, "hidden_size": 128,
                                          "expert_intermediate_size": 128, "num_attention_heads": 4}
    flags = [f"{SHAPE_FLAGS[k][0]}={v}" if k in SHAPE_FLAGS else f"--set={k}={json.dumps(v)}" for k, v in model.items()]
    cmd = ["-m", "training", "--family", "mixtral", *flags, "--data", str(data), "--out", str(out),
           "--max-steps", str(args.steps), "--seq-len", str(args.seq_len),
           "--micro-batch-size", str(args.global_batch // ranks), "--dtype", dtype, "--device", device,
           "--log-every", str(args.steps), "--warmup-steps", "2", "--no-progress", "--aux-loss-coef", "0.01"]
    if ranks > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *cmd]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if device == "cpu" and ranks > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    steps = read_log(out / "train_log.jsonl")[2:]
    start = read_log(out / "train_log.jsonl", "start")[0]
    return {"device": device, "ranks": ranks, "expert_parallel": start["ep_size"], "dtype": dtype,
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in steps),
            "mfu": statistics.median(s["mfu"] for s in steps),
            "step_s": statistics.median(s["seconds"] for s in steps),
            "peak_tflops": start["peak_tflops"], "gflop_per_token": start["flops_per_token"] / 1e9,
            "last_loss": steps[-1]["lm_loss"], "wall_s": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="optimiser steps per configuration (first 2 not counted)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="a 2-layer, hidden-128 model (a smoke run)")
    args = p.parse_args()
    if args.steps < 3:
        p.error(f"--steps must be >= 3 (the first 2 are not timed), got {args.steps}")
    if args.seq_len < 2:
        p.error(f"--seq-len must be >= 2, got {args.seq_len}")
    for n in args.ranks:
        if n < 1 or args.global_batch % n:
            p.error(f"--ranks {n}: must be >= 1 and divide --global-batch {args.global_batch}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = write_data(Path(tmp) / "topics.jsonl")
        for device in devices:
            ranks = args.ranks if device == "cpu" else sorted({1, torch.cuda.device_count()})
            for dtype in args.dtypes:
                for n in ranks:
                    rows.append(run(Path(tmp), data, n, dtype, device, args))
                    print(rows[-1], flush=True)
                    base = next(r for r in rows if (r["device"], r["dtype"], r["ranks"]) == (device, dtype, ranks[0]))
                    rows[-1]["speedup_vs_1_rank"] = rows[-1]["tokens_per_s"] / base["tokens_per_s"]
    print(f"\nTraining throughput, {args.seq_len}-token sequences, global batch {args.global_batch}, "
          f"{os.cpu_count()} CPU cores")
    print_table(rows, ["device", "ranks", "expert_parallel", "dtype", "tokens_per_s", "speedup_vs_1_rank", "mfu",
                       "step_s", "peak_tflops", "gflop_per_token"])
    payload = {"benchmark": "train", "model": "builtin recipe shape" + (" (quick)" if args.quick else ""),
               "load_average_1min_at_end": os.getloadavg()[0],  # other processes on the host skew CPU numbers
               "seq_len": args.seq_len, "global_batch": args.global_batch, "steps": args.steps, "rows": rows,
               "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"wrote {save('train', payload, device='cuda' if 'cuda' in devices else 'cpu')}")


if __name__ == "__main__":
    main()
