"""`shuttle train` (also `python -m training`): train a new MoE model or continue a checkpoint.

    shuttle train --family mixtral --hidden-size 256 --num-layers 4 --num-experts 8 --top-k 2 \\
                  --data corpus.jsonl --out runs/a --max-steps 2000
    shuttle train --init-from CHECKPOINT_DIR --data more.txt --out runs/b --max-steps 500
    torchrun --nproc-per-node 2 --max-restarts 1 -m training --init-from CKPT --data d.jsonl --out runs/c ...
    shuttle train --nproc-per-node 2 --max-restarts 1 ...    (starts the ranks itself, as torchrun does)
    shuttle train --recipe builtin --out models/builtin --max-minutes 60
    shuttle train --recipe builtin --init-from models/builtin --mtp-layers 1 --train-only mtp --out runs/mtp \
                  --max-steps 300      (an MTP head for a frozen model: speculative method mtp's drafter)

Each process of a torchrun job runs this command with the same arguments. A run writes OUT/checkpoints/
(HF checkpoints with trainer state; `latest` names the newest), OUT/train_log.jsonl, OUT/heartbeat/ and
at the end the final model itself into OUT. Running the same command again resumes from `latest`.
"""
import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from training.config import AUTOCAST_DTYPES, FAMILIES, SAVE_DTYPES, SHAPE_FLAGS, TRAIN_ONLY, TrainConfig

log = logging.getLogger("shuttle.train")
_LAUNCH = ("nproc_per_node", "max_restarts", "recipe", "set", "debug_delay", "no_resume", "no_progress", "command",
           "func")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag defaults to 'not given' (argparse.SUPPRESS), so a recipe's values apply unless overridden."""
    S = argparse.SUPPRESS
    m = p.add_argument_group("model (exactly one of --init-from, --config, --family)")
    m.add_argument("--init-from", default=S, metavar="DIR", help="continue this Hugging Face checkpoint")
    m.add_argument("--config", dest="model_config", default=S, metavar="FILE", help="a new model from this config.json")
    m.add_argument("--family", choices=sorted(FAMILIES), default=S, help="a new model of this family")
    for key, (flag, typ) in SHAPE_FLAGS.items():  # dest: the TrainConfig.model_flags key
        if typ is bool:
            m.add_argument(flag, dest=key, action="store_true", default=S)
        else:
            m.add_argument(flag, dest=key, type=typ, default=S, metavar=typ.__name__.upper())
    m.add_argument("--set", action="append", default=S, metavar="FIELD=JSON",
                   help="any other config.json field of a new model, e.g. --set rope_theta=10000")
    d = p.add_argument_group("data")
    d.add_argument("--data", nargs="+", default=S, metavar="FILE", help=".jsonl (a 'text' field per line) or text")
    d.add_argument("--eval-data", nargs="+", default=S, metavar="FILE", help="held-out files for the eval loss")
    d.add_argument("--text-field", default=S, help="JSONL field holding the text (default text)")
    d.add_argument("--tokenizer", default=S, metavar="DIR", help="default: the checkpoint's, else trained on --data")
    d.add_argument("--seq-len", type=int, default=S, help="tokens per training sequence (default 256)")
    o = p.add_argument_group("optimisation")
    for flag, typ, help_ in (("micro-batch-size", int, "sequences per rank and micro-step (default 8)"),
                             ("grad-accum", int, "micro-steps per optimiser step (default 1)"),
                             ("max-steps", int, "optimiser steps (the schedule's length)"),
                             ("max-minutes", float, "time budget; without --max-steps it sizes the schedule"),
                             ("lr", float, "peak learning rate (default 3e-4)"),
                             ("min-lr", float, "learning rate at the end of the cosine (default lr/10)"),
                             ("warmup-steps", int, "linear warmup steps (default 100)"),
                             ("weight-decay", float, "AdamW weight decay of matrices (default 0.1)"),
                             ("beta1", float, None), ("beta2", float, None),
                             ("grad-clip", float, "max global gradient norm, 0 for none (default 1.0)"),
                             ("aux-loss-coef", float, "MoE load-balancing loss coefficient (default 0: off)"),
                             ("z-loss-coef", float, "router z-loss coefficient (default 0: off)"),
                             ("seed", int, "initialisation and data order (default 0)")):
        o.add_argument(f"--{flag}", type=typ, default=S, help=help_)
    o.add_argument("--dtype", choices=AUTOCAST_DTYPES, default=S,
                   help="autocast dtype; weights stay float32 (default float32)")
    t = p.add_argument_group("multi-token prediction (speculative method mtp's drafter, models/mtp.py)")
    t.add_argument("--mtp-layers", type=int, default=S, choices=[0, 1],
                   help="1: train an MTP layer (one more decoder layer of the model's shape) beside the model, "
                        "saved as model.layers.{L}.* with num_nextn_predict_layers in config.json (default 0)")
    t.add_argument("--mtp-loss-weight", type=float, default=S,
                   help="the MTP layer's cross entropy (of the token after next) enters the loss times this "
                        "(DeepSeek-V3's lambda; default 0.3)")
    t.add_argument("--mtp-dense", action="store_true", default=S,
                   help="a new MTP layer gets a dense MLP (the config's intermediate_size) instead of experts like "
                        "the model's last layer: smaller, and cheaper to draft with")
    t.add_argument("--mtp-distill", action="store_true", default=S,
                   help="the MTP loss is cross entropy against the model's own distribution of the token after "
                        "next (its logits one position on), not the data's: the drafter learns what speculative "
                        "decoding accepts (self-distillation)")
    t.add_argument("--mtp-depth", type=int, default=S,
                   help="also train the MTP layer chained on its own outputs, as speculative decoding runs it for "
                        "k >= 2 drafts: depth d takes depth d - 1's output and the token it was to predict, and "
                        "predicts the next; the loss is the mean over the positions of every depth (default 1)")
    t.add_argument("--train-only", choices=TRAIN_ONLY, default=S,
                   help="mtp: train only the MTP layer on a frozen --init-from checkpoint, whose own tensors "
                        "are saved bitwise unchanged")
    r = p.add_argument_group("parallelism")
    r.add_argument("--expert-parallel", type=int, default=S, help="ranks sharing one copy of the experts "
                   "(default: all ranks when they divide the experts)")
    r.add_argument("--device", choices=["cpu", "cuda"], default=S, help="default: cuda when present")
    r.add_argument("--nproc-per-node", type=int, default=S, help="start this many ranks here (torchrun's launcher)")
    r.add_argument("--max-restarts", type=int, default=S, help="with --nproc-per-node: restarts after a failure")
    r.add_argument("--collective-timeout-s", type=float, default=S, help="seconds a collective may wait for the "
                   "other ranks before it fails the job, which --max-restarts then restarts from the last "
                   "checkpoint; rank 0 warns of a rank without a finished step for a fifth of this (default 600)")
    c = p.add_argument_group("output")
    c.add_argument("--out", type=Path, default=S, metavar="DIR", help="run directory (required)")
    for flag, typ, help_ in (("save-every", int, "checkpoint every N steps (default: only at the end)"),
                             ("keep-checkpoints", int, "checkpoints kept (default 2)"),
                             ("log-every", int, "log line, straggler check every N steps (default 10)"),
                             ("eval-every", int, "held-out loss every N steps (default: at the end)"),
                             ("eval-batches", int, "global batches of held-out data per evaluation (default 4)"),
                             ("straggler-factor", float, "name a rank slower than the median by this (default 1.5)"),
                             ("peak-tflops", float, "the device's peak for MFU (default: measured)")):
        c.add_argument(f"--{flag}", type=typ, default=S, help=help_)
    c.add_argument("--save-dtype", choices=SAVE_DTYPES, default=S, help="model files' dtype (default: the config's)")
    c.add_argument("--no-resume", action="store_true", default=S, help="ignore OUT/checkpoints/latest")
    c.add_argument("--no-progress", action="store_true", default=S, help="no progress bar")
    p.add_argument("--recipe", choices=["builtin"], default=S, help="the built-in model's recipe (training/builtin.py)")
    p.add_argument("--debug-delay", default=S, help=argparse.SUPPRESS)  # RANK:SECONDS, a slow rank for tests


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `train` sub-command to a parser's subparsers; its `func` returns an exit code."""
    p = subparsers.add_parser("train", help="train or continue an MoE model (under torchrun for several ranks)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run_from_args)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed `train` arguments (only the flags given; a recipe fills the rest).
    Raises ValueError naming the flag for a malformed --set or --debug-delay, or any invalid value."""
    given = {k: v for k, v in vars(args).items() if k not in _LAUNCH}
    flags = {k: given.pop(k) for k in list(given) if k in SHAPE_FLAGS}
    flags.update(parse_set(getattr(args, "set", [])))
    if flags:
        given["model_flags"] = flags
    if hasattr(args, "debug_delay"):
        rank, _, seconds = args.debug_delay.partition(":")
        try:
            given["debug_delay"] = (int(rank), float(seconds))
        except ValueError:
            raise ValueError(f"--debug-delay {args.debug_delay!r}: expected RANK:SECONDS") from None
    given["resume"] = not getattr(args, "no_resume", False)
    given["progress"] = not getattr(args, "no_progress", False)
    for key in ("data", "eval_data"):
        if key in given:
            given[key] = tuple(given[key])
    if getattr(args, "recipe", None) == "builtin":
        from training.builtin import recipe_config
        return recipe_config(given)
    if "out" not in given:
        raise ValueError("--out DIR is required")
    return TrainConfig(**given)


def parse_set(items: list[str]) -> dict[str, Any]:
    """--set FIELD=JSON items as {field: value}; a value that is not JSON (strings need quotes:
    --set 'hidden_act="silu"') is an error naming the item."""
    fields: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected FIELD=JSON")
        try:
            fields[key] = json.loads(value)
        except ValueError:
            raise ValueError(f"--set {item!r}: {value!r} is not valid JSON (quote strings: "
                             f"--set '{key}=\"{value}\"')") from None
    return fields


def run_from_args(args: argparse.Namespace) -> int:
    """The `train` sub-command: 0 on success, 2 on a usage error, 1 when a launched rank failed."""
    from training.parallel import LaunchEnv

    try:
        cfg = config_from_args(args)
        check_model_config(cfg)
        nproc = getattr(args, "nproc_per_node", 1)
        if nproc > 1 and not LaunchEnv.from_environ().by_torchrun:
            return launch(cfg, nproc, getattr(args, "max_restarts", 0))
        run(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"shuttle train: error: {e}", file=sys.stderr)
        return 2
    return 0


def check_model_config(cfg: TrainConfig) -> None:
    """Build the run's ModelConfig once here, before any rank starts, so an impossible shape (say
    --hidden-size 96 with 32 heads: head_dim 3) is one line from this command, not a failure
    report of every rank. ValueError naming the field."""
    from models.config import ModelConfig
    from training.source import model_source

    ModelConfig.from_dict(model_source(cfg).raw_config, source="the model's configuration")


def run(cfg: TrainConfig) -> dict:
    """Train (this rank's share), then, for a recipe, write its model card. Returns the summary."""
    from training.trainer import train

    summary = train(cfg)
    if cfg.recipe == "builtin" and summary["rank"] == 0:
        from training.builtin import write_mtp_card, write_model_card
        (write_mtp_card if cfg.train_only == "mtp" else write_model_card)(cfg, summary)
    return summary


def _launched_entry(cfg: TrainConfig) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(cfg)


def launch(cfg: TrainConfig, nproc: int, max_restarts: int) -> int:
    """Start nproc ranks on this host with torchrun's launcher (restarting them all up to
    max_restarts times after a failure), each running `run(cfg)`."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from training.parallel import LaunchEnv

    if LaunchEnv.from_environ().omp_num_threads is None:  # the ranks share this host's cores
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"shuttle-train-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          monitor_interval=1, start_method="spawn")
    try:
        elastic_launch(config, _launched_entry)(cfg)
    except ChildFailedError as e:
        log.error("training failed: %s", e)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m training ARGS`: parse and run; the exit code of run_from_args."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run_from_args)
    args = p.parse_args(argv)
    return args.func(args)
