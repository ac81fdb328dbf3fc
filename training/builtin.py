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

Its MTP head (speculative method mtp's drafter) is trained on the frozen model by the same recipe, on the
corpus and then on the model's own continuations of training prompts (write_generations); the model
card (models/builtin/README.md) lists the runs. One of them:

    shuttle train --recipe builtin --init-from models/builtin --mtp-layers 1 --train-only mtp --mtp-dense \
                  --mtp-distill --out /tmp/builtin-mtp --max-steps 400
    python -c "from training.builtin import install_mtp_layer; install_mtp_layer('/tmp/builtin-mtp', 'models/builtin')"
"""
import ast
import json
import shlex
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


def write_generations(model_dir: str | Path, path: str | Path, count: int, seed: int = 0, prompt_tokens: int = 64,
                      new_tokens: int = 192, temperature: float = 0.8) -> Path:
    """Self-distillation data for an MTP head: `count` continuations by the model at model_dir (served by
    Shuttle, bf16) of prompts cut from the recipe's training split (prompt_tokens each, at a random
    offset of a random document: random.Random(seed)), half greedy and half sampled at `temperature`
    (request i of that half with seed i), new_tokens each unless EOS comes first; written to `path` as {"name", "text"}
    JSON lines (prompt and continuation decoded together). The head then sees contexts as speculative
    decoding meets them (the model's own tokens after a prompt), not only the corpus's."""
    import random

    from server import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", num_kv_blocks=8192)
    try:
        tok, rng = llm.tokenizer, random.Random(seed)
        docs = [ids for name, text in documents() if not is_held_out(name) for ids in [tok.encode(text)]
                if len(ids) >= prompt_tokens]
        prompts = []
        for _ in range(count):
            d = docs[rng.randrange(len(docs))]
            at = rng.randrange(len(d) - prompt_tokens + 1)
            prompts.append(d[at:at + prompt_tokens])
        half = count // 2  # (two generates: the greedy half, then the sampled one, request i with seed i)
        outs = llm.generate(prompts[:half], SamplingParams(max_tokens=new_tokens, temperature=0.0))
        outs += llm.generate(prompts[half:], [SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=i)
                                              for i in range(count - half)])
        eos = set(llm.eos_token_ids)
    finally:
        llm.shutdown()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    texts = []
    for p, o in zip(prompts, outs):  # (a continuation's final EOS stays out: the data pipeline ends each document)
        ids = list(o.outputs[0].token_ids)
        texts.append(tok.decode(p + (ids[:-1] if ids and ids[-1] in eos else ids)))
    path.write_text("".join(json.dumps({"name": f"gen{seed}:{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


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


def _count_params(model_dir: Path, prefix: str = "") -> int:
    """Parameters in the checkpoint's files (of the tensors whose names start with prefix)."""
    from safetensors import safe_open

    n = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                if not k.startswith(prefix):
                    continue
                shape = h.get_slice(k).get_shape()
                p = 1
                for s in shape:
                    p *= s
                n += p
    return n


MTP_SECTION = "## Multi-token prediction (MTP) head"
# flags of an MTP run named in its card's command line where they differ from the recipe's
MTP_RUN = {k: TRAINING[k] for k in ("lr", "min_lr", "warmup_steps", "seq_len", "micro_batch_size")}
MTP_FILE = "model-mtp.safetensors"


def write_mtp_card(cfg: TrainConfig, summary: dict[str, Any]) -> Path:
    """OUT/README.md of a --train-only mtp run: the starting model's card with a section on the MTP
    head (replacing an older one), and OUT/recipe_mtp.json (the run's TrainConfig; the model's own
    recipe.json is copied from --init-from)."""
    from models.config import ModelConfig
    from training.metrics import read_log

    out, src = Path(cfg.out), Path(cfg.init_from)
    mcfg = ModelConfig.from_pretrained(out)
    steps = read_log(out / "train_log.jsonl")
    evals = read_log(out / "train_log.jsonl", "eval")
    prefix = f"model.layers.{mcfg.num_layers}."
    n_params = _count_params(out, prefix)
    from models.checkpoint import CheckpointReader

    moe = any(n.startswith(prefix) and ".experts." in n for n in CheckpointReader(out).files)
    mlp = (f"{mcfg.num_experts} experts, top-{mcfg.top_k}" if moe
           else f"a dense MLP of intermediate size {mcfg.intermediate_size}")
    card = (src / "README.md").read_text() if (src / "README.md").is_file() else "# Shuttle built-in model\n"
    head, _, rest = card.partition("\n" + MTP_SECTION + "\n")
    if rest:  # drop the old section: up to the next "## " heading
        nxt = rest.find("\n## ")
        card = head + ("" if nxt < 0 else rest[nxt:])
    eval_at = {e["step"]: e.get("eval_mtp_loss") for e in evals}
    every = max(1, len(steps) // 8)
    curve = [s for s in steps if s["step"] % every == 0 or s["step"] in eval_at or s is steps[-1]]
    last = steps[-20:]
    lines = [
        MTP_SECTION, "",
        f"- one MTP layer as DeepSeek-V3 stores it, `{prefix}*` (config.json: `num_nextn_predict_layers: 1`): "
        f"enorm, hnorm, eh_proj and one more decoder layer of the model's shape ({mlp}), shared_head.norm; "
        f"the model's embedding and LM head are shared; "
        f"{n_params / 1e6:.1f}M parameters, in `{MTP_FILE}`",
        "- it predicts the token after next from the model's last hidden state and the next token: the drafter of "
        "speculative decoding, `--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'`",
        f"- trained alone on the frozen model (`--train-only mtp`: every other tensor is bitwise the model's) on "
        + ("the training split above" if _recipe_data(cfg) else "the given data (`--data`; the built-in head's: the "
           "model's own continuations of training prompts, `write_generations`)")
        + (f", also chained {cfg.mtp_depth} deep on its own outputs (`--mtp-depth`)" if cfg.mtp_depth > 1 else "")
        + f": {summary['step']} steps of {summary['tokens_per_step']} tokens, AdamW lr {cfg.lr} "
        f"({cfg.warmup_steps} warmup steps, cosine to {cfg.final_lr}), {cfg.dtype} autocast, "
        f"{summary['train_seconds_total'] / 60:.1f} minutes on {summary['world_size']} rank(s)"
        + ("; its loss is the cross entropy against the model's own distribution of the token after next "
           "(`--mtp-distill`: self-distillation), not the data's" if cfg.mtp_distill else ""),
        f"- MTP loss (cross entropy of the token after next{', the mean over the depths' if cfg.mtp_depth > 1 else ''}, "
        f"nats per token): training {steps[0]['mtp_loss']:.3f} at "
        f"step {steps[0]['step']}, {sum(s['mtp_loss'] for s in last) / len(last):.3f} over the last {len(last)} steps"
        if steps else "",
        f"- held-out MTP loss {summary['eval_mtp_loss']:.3f} (the model's own next-token loss there: "
        f"{summary['eval_loss']:.3f})" if summary.get("eval_mtp_loss") is not None else "",
        f"- its top token is the model's own top token at {summary['eval_mtp_agreement']:.1%} of held-out positions "
        f"(teacher forced: a greedy draft's acceptance)" if summary.get("eval_mtp_agreement") is not None else "", "",
        "| step | MTP training loss | MTP held-out loss |", "|---:|---:|---:|",
        *[f"| {s['step']} | {s['mtp_loss']:.3f} | {_fmt(eval_at.get(s['step']), '.3f')} |" for s in curve], "",
        "Reproduce (then `install_mtp_layer` adds its tensors to a model directory, leaving the others as they are):",
        "", "```", f"shuttle train --recipe builtin --init-from {cfg.init_from} --mtp-layers 1 --train-only mtp"
        + (" --mtp-dense" if cfg.mtp_dense else "") + (" --mtp-distill" if cfg.mtp_distill else "")
        + (f" --mtp-depth {cfg.mtp_depth}" if cfg.mtp_depth > 1 else "")
        + ("" if _recipe_data(cfg) else " --data " + " ".join(map(shlex.quote, map(str, cfg.data)))
           + (" --eval-data " + " ".join(map(shlex.quote, map(str, cfg.eval_data))) if cfg.eval_data else ""))
        + f" --out {cfg.out} --max-steps {summary['step']}"
        + "".join(f" --{k.replace('_', '-')} {getattr(cfg, k)}" for k, v in MTP_RUN.items() if getattr(cfg, k) != v)
        + (f" --nproc-per-node {summary['world_size']}" if summary["world_size"] > 1 else ""),
        f"python -c \"from training.builtin import install_mtp_layer; install_mtp_layer('{cfg.out}', "
        f"'{cfg.init_from}')\"", "```", ""]
    at = card.find("\n## Reproduce")  # the section goes before the model's own Reproduce section
    section = "\n".join(lines)
    card = (card.rstrip("\n") + "\n\n" + section if at < 0 else
            card[:at].rstrip("\n") + "\n\n" + section + card[at:])
    path = out / "README.md"
    path.write_text(card)
    (out / "recipe_mtp.json").write_text(json.dumps(asdict(cfg), indent=2, default=str) + "\n")
    if (src / "recipe.json").is_file():
        (out / "recipe.json").write_text((src / "recipe.json").read_text())
    return path


def _recipe_data(cfg: TrainConfig) -> bool:
    """Whether the run trained on the recipe's own corpus (write_corpus) rather than files it was given."""
    return all(Path(f).parent == Path(cfg.out) / "data" for f in cfg.data)


def install_mtp_layer(run_dir: str | Path, model_dir: str | Path) -> Path:
    """Add the MTP layer a `--train-only mtp` run exported (run_dir) to the model it started from
    (model_dir), leaving that model's files as they are: its tensors model.layers.{L}.* go to
    model_dir/model-mtp.safetensors (listed in the index), config.json gets num_nextn_predict_layers
    and README.md, recipe_mtp.json come from the run. ValueError unless every other tensor of the
    run equals the model's bitwise. Returns the new file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from models.checkpoint import CheckpointReader

    run_dir, model_dir = Path(run_dir), Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    prefix = f"model.layers.{raw['num_hidden_layers']}."
    theirs = {n: f for n, f in CheckpointReader(run_dir).files.items()}
    mine = CheckpointReader(model_dir).files
    mtp = {}
    for name, f in theirs.items():
        with safe_open(f, framework="pt") as h:
            t = h.get_tensor(name)
        if name.startswith(prefix):
            mtp[name] = t
            continue
        if name not in mine:
            raise ValueError(f"{run_dir}: tensor {name} is not in {model_dir}")
        with safe_open(mine[name], framework="pt") as h:
            want = h.get_tensor(name)
        if want.dtype != t.dtype or want.shape != t.shape or not _same_bits(want, t):
            raise ValueError(f"{run_dir}: tensor {name} differs from {model_dir}'s (not a --train-only mtp run of it)")
    missing = [n for n in mine if not n.startswith(prefix) and n not in theirs]
    if not mtp or missing:
        raise ValueError(f"{run_dir}: " + (f"no tensor {missing[0]} of {model_dir}" if missing else
                                           f"no MTP layer ({prefix}*)"))
    path = model_dir / MTP_FILE
    save_file(dict(sorted(mtp.items())), str(path), {"format": "pt"})
    path.chmod(0o644)  # (as the model's other files)
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        weight_map = {n: f for n, f in index["weight_map"].items() if not n.startswith(prefix)}
        weight_map.update({n: MTP_FILE for n in mtp})
        files = sorted(set(weight_map.values()))
        total = 0
        for f in files:
            with safe_open(model_dir / f, framework="pt") as h:
                for n in h.keys():
                    t = h.get_tensor(n)
                    total += t.numel() * t.element_size()
        index = {**index, "metadata": {**index.get("metadata", {}), "total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    raw["num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    for name in ("README.md", "recipe_mtp.json"):
        if (run_dir / name).is_file():
            (model_dir / name).write_text((run_dir / name).read_text())
    return path


def _same_bits(a, b) -> bool:
    """Whether two tensors hold the same bytes."""
    import torch

    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
