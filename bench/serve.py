"""Serving end to end: `shuttle serve` deployments side by side under `shuttle bench serve`.

    python bench/serve.py [--model DIR] [--num-prompts 64] [--max-concurrency 32] [--quick]

Each deployment is started as a real server on a free port (the built-in model unless --model),
loaded with the same random requests (64-token prompts, 32 new tokens, EOS ignored) through the
OpenAI streaming API, then stopped; the table gives output throughput (and its ratio to the
colocated baseline), TTFT and TPOT. The deployments:
  colocated             experts in the attention process, torch's default threads (the baseline)
  pools                 1 attention + 1 expert worker process, cores shared out between them (default)
  pools, 2 threads each 1 + 1 workers that each use every core: the old default, oversubscribed
  pools, m=2            1 + 1 workers, two micro-batches per step
Writes bench/results/serve.json.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from clients.bench_serve import run_bench  # noqa: E402
from clients.live_server import LiveServer  # noqa: E402

DEPLOYMENTS = {
    "colocated": ["--colocated"],
    "pools": [],
    "pools, 2 threads each": ["--torch-threads", "2"],
    "pools, m=2": ["--micro-batches", "2"],
}


def run(name: str, flags: list[str], args: argparse.Namespace) -> dict:
    model = ["--model", args.model] if args.model else []
    with LiveServer([*model, *flags]) as srv:
        result = run_bench(["--base-url", srv.url, "--num-prompts", str(args.num_prompts), "--input-len", "64",
                            "--output-len", "32", "--max-concurrency", str(args.max_concurrency), "--ignore-eos",
                            "--disable-tqdm", "--seed", "0"])
    return {"deployment": name, "flags": " ".join(flags), "completed": result["completed"],
            "output_tok_s": result["output_throughput"], "mean_ttft_ms": result["mean_ttft_ms"],
            "mean_tpot_ms": result["mean_tpot_ms"], "p99_itl_ms": result["p99_itl_ms"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="16 prompts, concurrency 8")
    args = p.parse_args()
    if args.quick:
        args.num_prompts, args.max_concurrency = 16, 8
    rows = []
    for name, flags in DEPLOYMENTS.items():
        rows.append(run(name, flags, args))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["output_tok_s"]
    for r in rows:
        r["vs_colocated"] = r["output_tok_s"] / base
    print_table(rows, ["deployment", "completed", "output_tok_s", "vs_colocated", "mean_ttft_ms", "mean_tpot_ms",
                       "p99_itl_ms"])
    path = save("serve", {"model": args.model or "built-in", "num_prompts": args.num_prompts,
                          "max_concurrency": args.max_concurrency, "input_len": 64, "output_len": 32, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
