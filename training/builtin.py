"""The built-in model's recipe: a small Mixtral-shaped MoE trained on English text every Python
install carries, with nothing downloaded.

    shuttle train --recipe builtin --out models/builtin --max-minutes 60

Corpus: the Python documentation's topics (pydoc_data.topics, one document each) and the docstrings
of the standard library (one document per module: its module, class and function docstrings in
source order), read by parsing the source files with `ast` (no module is imported); test packages
and site-packages are left out. About 2% of the documents, chosen by a hash of their names, are held
out for the evaluation loss. Model: 6 layers, hidden 384, 6 heads (2 kv heads), 8 experts of 320,
top-2, a 4096-token byte-level BPE trained on the training split; about 23M parameters, 46 MB in
bfloat16. Any flag given on the command line overrides the recipe's value.
"""
import ast
import json
import os
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

from training.config import TrainConfig
from training.data import read_documents

MODEL = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 2,
         "expert_intermediate_size": 320, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 4096,
         "max_position_embeddings": 2048, "initializer_range": 0.02}
TRAINING = {"seq_len": 512, "micro_batch_size": 8, "grad_accum": 1, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 100,
            "weight_decay": 0.1, "grad_clip": 1.0, "dtype": "bfloat16", "aux_loss_coef": 0.01, "z_loss_coef": 0.001,
            "save_every": 250, "eval_every": 250, "eval_batches": 8, "log_every": 20, "save_dtype": "bfloat16",
            "keep_checkpoints": 2, "seed": 0}
EVAL_PERCENT = 2
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_docstrings(root: Path | None = None) -> Iterator[tuple[str, str]]:
    """(module name, its docstrings joined by blank lines) for every parsable stdlib source file."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS & set(rel.parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            continue
        docs = [ast.get_docstring(node) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        text = "\n\n".join(d for d in docs if d)
        if text:
            yield ".".join(rel.with_suffix("").parts), text


def documents() -> list[tuple[str, str]]:
    """(name, text) of the whole corpus, in a fixed order."""
    from pydoc_data.topics import topics

    return [(f"topic:{k}", topics[k]) for k in sorted(topics)] + [(f"module:{m}", t) for m, t in stdlib_docstrings()]


def is_held_out(name: str) -> bool:
    """Whether a document (by name) is in the held-out set: a stable hash, EVAL_PERCENT of them."""
    return zlib.crc32(name.encode()) % 100 < EVAL_PERCENT


def write_corpus(directory: Path) -> None:
    """OUT/data/train.jsonl and eval.jsonl, one {"name", "text"} object per document (each file
    replaced atomically; the content is deterministic, so concurrent ranks may all write it)."""
    directory.mkdir(parents=True, exist_ok=True)
    docs = documents()
    for split, held_out in (("train", False), ("eval", True)):
        text = "".join(json.dumps({"name": name, "text": t}) + "\n" for name, t in docs if is_held_out(name) == held_out)
        path = directory / f"{split}.jsonl"
        if path.is_file() and path.read_text() == text:
            continue  # unchanged: keep its mtime, so the tokenized-data cache (keyed on it) still hits
        tmp = directory / f".{split}.jsonl.tmp{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, path)


def recipe_config(given: dict[str, Any]) -> TrainConfig:
    """The recipe's TrainConfig with the command line's values (`given`, TrainConfig fields) on top."""
    if "out" not in given:
        raise ValueError("--recipe builtin needs --out DIR")
    if "max_steps" not in given and "max_minutes" not in given:
        raise ValueError("--recipe builtin needs --max-minutes (or --max-steps)")
    if "init_from" not in given and "model_config" not in given:
        given = {"family": "mixtral", **given, "model_flags": {**MODEL, **given.get("model_flags", {})}}
    out = Path(given["out"])
    if "data" not in given:
        write_corpus(out / "data")
        given = {**given, "data": (str(out / "data" / "train.jsonl"),), "eval_data": (str(out / "data" / "eval.jsonl"),)}
    return TrainConfig(**{**TRAINING, "recipe": "builtin", **given})


def write_model_card(cfg: TrainConfig, summary: dict[str, Any]) -> Path:
    """OUT/README.md: what the model is, its data, how it was trained and what it reached."""
    from models.config import ModelConfig
    from training.metrics import active_params, read_log

    out = Path(cfg.out)
    mcfg = ModelConfig.from_pretrained(out)
    steps = read_log(out / "train_log.jsonl")
    evals = read_log(out / "train_log.jsonl", "eval")
    corpus = _corpus_stats(cfg)
    total_params = _count_params(out)
    curve = [s for s in steps if s["step"] % max(1, len(steps) // 10) == 0 or s is steps[-1]]
    eval_at = {e["step"]: e["eval_loss"] for e in evals}
    lines = [
        "# Shuttle built-in model", "",
        "A small Mixtral-shaped mixture-of-experts language model trained from scratch by `shuttle train --recipe "
        "builtin` on English text that ships with Python (no download). It is a test and demo model: it writes "
        "Python-documentation-flavoured English, not reliable facts.", "",
        "## Model", "",
        f"- architecture: {mcfg.architecture}, {mcfg.num_layers} layers, hidden {mcfg.hidden_size}, "
        f"{mcfg.num_heads} heads ({mcfg.num_kv_heads} kv heads, head dim {mcfg.head_dim})",
        f"- experts: {mcfg.num_experts} per layer of intermediate size {mcfg.moe_intermediate_size}, top-{mcfg.top_k}",
        f"- vocabulary: {mcfg.vocab_size} (byte-level BPE trained on the training split), context "
        f"{mcfg.max_position_embeddings} (trained at {cfg.seq_len})",
        f"- parameters: {total_params / 1e6:.1f}M, of which {active_params(mcfg) / 1e6:.1f}M active per token "
        f"(embedding lookup excluded); weights in {mcfg.dtype}".replace("torch.", ""), "",
        "## Data", "",
        "- `pydoc_data.topics` (one document per topic) and the docstrings of the Python "
        f"{corpus.get('python', '')} standard library, one document per module, read with `ast` from the source "
        "files (test packages and site-packages left out)",
        f"- training split: {_fmt_split(corpus.get('train'))}",
        f"- held-out split ({EVAL_PERCENT}% of documents by a hash of their names): {_fmt_split(corpus.get('eval'))}",
        "",
        "## Training", "",
        f"- {summary['step']} steps of {summary['tokens_per_step']} tokens ({summary['world_size']} rank(s)), "
        f"{summary['tokens_seen'] / 1e6:.2f}M tokens seen",
        f"- AdamW (betas {cfg.beta1}, {cfg.beta2}, weight decay {cfg.weight_decay}), lr {cfg.lr} with "
        f"{cfg.warmup_steps} warmup steps and a cosine to {cfg.final_lr}, gradient clipping {cfg.grad_clip}",
        f"- {cfg.dtype} autocast, float32 master weights; load-balancing loss x{cfg.aux_loss_coef}, "
        f"router z-loss x{cfg.z_loss_coef}",
        f"- training time {summary['train_seconds_total'] / 60:.1f} minutes; median step "
        f"{_median(steps, 'tokens_per_s'):.0f} tokens/s, MFU {100 * _median(steps, 'mfu'):.1f}% of a measured "
        f"{summary['peak_tflops']:.2f} TFLOP/s peak (step times only: checkpoints and evaluations not counted)", "",
        "## Results", "",
        f"- final training loss {steps[-1]['lm_loss']:.3f} (cross entropy, nats per token)" if steps else "",
        f"- held-out loss {summary['eval_loss']:.3f}" if summary.get("eval_loss") is not None else "", "",
        "| step | training loss | held-out loss |", "|---:|---:|---:|",
        *[f"| {s['step']} | {s['lm_loss']:.3f} | {_fmt(eval_at.get(s['step']), '.3f')} |" for s in curve], "",
        "## Reproduce", "",
        "```", f"shuttle train --recipe builtin --out {cfg.out} " + (f"--max-minutes {cfg.max_minutes:g}" if
                                                                    cfg.max_minutes else f"--max-steps {cfg.max_steps}")
        + (f" --nproc-per-node {summary['world_size']}" if summary["world_size"] > 1 else ""),
        "```",
        "", f"Written {time.strftime('%Y-%m-%d %H:%M:%S')}. Recipe: training/builtin.py.", ""]
    path = out / "README.md"
    path.write_text("\n".join(lines))
    (out / "recipe.json").write_text(json.dumps(asdict(cfg), indent=2, default=str) + "\n")
    return path


def _corpus_stats(cfg: TrainConfig) -> dict[str, Any]:
    stats: dict[str, Any] = {"python": sys.version.split()[0]}
    for split, files in (("train", cfg.data), ("eval", cfg.eval_data)):
        docs = chars = 0
        for text in read_documents(list(files), cfg.text_field):
            docs += 1
            chars += len(text)
        stats[split] = {"documents": docs, "characters": chars}
    return stats


def _median(steps: list[dict], key: str) -> float:
    values = sorted(s[key] for s in steps) or [0.0]
    return values[len(values) // 2]


def _fmt_split(s: dict | None) -> str:
    return "n/a" if not s else f"{s['documents']} documents, {s['characters'] / 1e6:.2f}M characters"


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def _count_params(model_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                shape = h.get_slice(k).get_shape()
                p = 1
                for s in shape:
                    p *= s
                n += p
    return n
