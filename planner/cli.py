"""The planner's subcommands of `shuttle`: profile, simulate, plan.

    shuttle profile [--model DIR] [--dtype D] [--torch-threads 1,2] [--transport shm,tcp] [--quick] --out PROFILE.json
    shuttle simulate --profile PROFILE.json (--colocated | --attention-workers A --expert-workers E --micro-batches M) ...
    shuttle plan --model DIR|NAME --hardware KIND[=PRICE][,KIND...] --tbt-slo-ms X --max-devices N ... --out PLAN.json

Every user error ends with a one-line message naming what is wrong and exit code 2.
"""
import argparse
import json
import sys
from pathlib import Path


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
    kw = dict(model=model, dtype=_dtype(args.dtype), threads=args.torch_threads, transports=args.transport)
    opts = ProfileOptions.quick_options(**kw) if args.quick else ProfileOptions(**kw)
    torch.manual_seed(0)
    profile = run_profile(opts)
    Path(args.out).write_text(json.dumps(profile, indent=1))
    print(format_profile(profile))
    print(f"wrote {args.out} ({profile['seconds']} s)")
    return 0


def _dtype(name: str):
    from models.config import DTYPES

    if name == "auto":
        return None
    if name not in DTYPES:
        raise PlannerError(f"--dtype {name}: expected auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def format_profile(p: dict) -> str:
    """The fits as a short table: coefficients in microseconds, residuals in percent."""
    h = p["host"]
    lines = [f"model {p['model']['name']} ({p['model']['dtype']}, config {p['model']['config_hash']}) on {h['cpu']}, "
             f"{h['cores']} cores, {h['memory_gib']} GiB, {h['device']}, ISA {'+'.join(h['isa']) or '?'}, "
             f"bf16 packed: {h['bf16_packed']}"]
    for threads, fits in p["fits"].items():
        for name, f in fits.items():
            terms = ", ".join(f"{c * 1e6:.4g} us*{t}" if t != "const" else f"{c * 1e6:.4g} us"
                              for t, c in zip(f["terms"], f["coef"]))
            lines.append(f"  {threads} thread(s)  {name:<9} {terms}   residual median "
                         f"{f['median_abs_residual']:.0%} max {f['max_abs_residual']:.0%} ({f['samples']} points)")
    for backend, f in p["transfer"].items():
        lines.append(f"  M2N {backend:<4} one transfer = {f['coef'][1] * 1e6:.1f} us + {f['coef'][0] * 1e9:.3f} ns/byte"
                     f"   residual median {f['median_abs_residual']:.0%} max {f['max_abs_residual']:.0%}")
    return "\n".join(lines)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this host's worker, expert and M2N costs for the planner")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu (the only device profiled by this build)")
    p.add_argument("--torch-threads", type=_csv(int), default=(1, 2), help="thread counts to profile (default 1,2)")
    p.add_argument("--transport", type=_csv(str), default=("shm", "tcp"), help="M2N backends (default shm,tcp)")
    p.add_argument("--quick", action="store_true", help="a smaller grid and fewer repeats (about a third)")
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.set_defaults(func=_run(_profile, "profile"))


def _run(fn, name: str):
    """Wrap a command: user errors become one line on stderr and exit code 2."""
    def run(args: argparse.Namespace) -> int:
        from models.config import ConfigError
        from planner.hardware import HardwareError
        from planner.shapes import ShapeError

        try:
            return fn(args)
        except (PlannerError, HardwareError, ShapeError, ConfigError, FileNotFoundError) as e:
            print(f"shuttle {name}: error: {e}", file=sys.stderr)
            return 2
    return run
