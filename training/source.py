"""Where a run's model comes from: its config.json (as a dict), its starting weights and its tokenizer.

In order: the run's own latest checkpoint (resumption), --init-from CHECKPOINT, --config FILE,
--family with shape flags. A new model gets a tokenizer trained on the data unless --tokenizer names
one, and its special token ids are the tokenizer's.
"""
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.checkpoint import latest_checkpoint, weights_dir
from training.config import TrainConfig, new_model_config, read_config_json
from training.data import TOKENIZER_FILES, load_tokenizer, train_new_tokenizer
from training.parallel import ParallelContext

NEW_MODEL_VOCAB = 4096  # vocabulary of a new model's tokenizer when --vocab-size is not given


@dataclass(frozen=True)
class ModelSource:
    """Where a run starts from (see model_source)."""

    raw_config: dict[str, Any]  # config.json, the family's transformers format
    weights: Path | None  # a checkpoint directory to load float32 weights from; None: initialise
    resume_from: Path | None  # the run's own checkpoint, with trainer state


def model_source(cfg: TrainConfig) -> ModelSource:
    """The config and weights to start from (no tokenizer yet: see resolve_tokenizer)."""
    checkpoint = latest_checkpoint(cfg.out)
    if checkpoint is not None and not cfg.resume:
        raise ValueError(f"{cfg.out} already holds checkpoints (latest: {checkpoint.name}); with --no-resume give "
                         f"a new --out, or continue that run without --no-resume")
    if checkpoint is not None:
        return ModelSource(read_config_json(checkpoint), weights_dir(checkpoint), checkpoint)
    if cfg.init_from:
        return ModelSource(read_config_json(cfg.init_from), Path(cfg.init_from), None)
    raw = read_config_json(cfg.model_config) if cfg.model_config else new_model_config(cfg.family, cfg.model_flags)
    if cfg.family and "vocab_size" not in cfg.model_flags:
        raw["vocab_size"] = NEW_MODEL_VOCAB
    return ModelSource(raw, None, None)


def resolve_tokenizer(cfg: TrainConfig, source: ModelSource, ctx: ParallelContext) -> tuple[Path, dict[str, Any]]:
    """(OUT/tokenizer, config dict with the tokenizer's special ids for a new model). The run's
    tokenizer is copied there once (rank 0) from --tokenizer, the starting checkpoint or, on resume,
    the run's checkpoint, so that later checkpoints carry it after older ones are pruned; a new model
    naming none gets one trained on the data there. A new model's tokenizer must define an eos token
    (it separates the documents); its bos and pad ids replace the family's defaults."""
    raw = dict(source.raw_config)
    out_dir = cfg.out / "tokenizer"
    origin = (source.resume_from or (Path(cfg.tokenizer) if cfg.tokenizer else None) or source.weights)
    if ctx.is_main:
        if origin is not None:
            _copy_tokenizer(origin, out_dir)
        elif not (out_dir / "tokenizer.json").is_file():
            train_new_tokenizer(list(cfg.data), out_dir, int(raw["vocab_size"]), cfg.text_field)
    ctx.barrier()
    size = load_tokenizer(out_dir).get_vocab_size()
    if size > int(raw["vocab_size"]):
        raise ValueError(f"the tokenizer in {origin or out_dir} has {size} tokens, more than the model's vocab_size "
                         f"{raw['vocab_size']}")
    if source.weights is None:
        ids = special_token_ids(out_dir)
        if "eos_token_id" not in ids:
            raise ValueError(f"the tokenizer in {origin or out_dir} defines no eos_token (in tokenizer_config.json) "
                             f"that is in its vocabulary; a new model needs one to separate documents")
        raw.update({f"{kind}_token_id": ids.get(f"{kind}_token_id") for kind in ("bos", "eos", "pad")})
    return out_dir, raw


def _copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files of `src` into `dst`, replacing what was there (atomically per file)."""
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src / 'tokenizer.json'}: file not found (the run's tokenizer)")
    dst.mkdir(parents=True, exist_ok=True)
    if src.resolve() == dst.resolve():
        return
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            tmp = dst / f".{name}.tmp"
            shutil.copyfile(src / name, tmp)
            tmp.replace(dst / name)
        else:
            (dst / name).unlink(missing_ok=True)


def special_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """bos/eos/pad token ids named by tokenizer_config.json, as config.json fields."""
    path = tokenizer_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    tok_cfg, tok = json.loads(path.read_text()), load_tokenizer(tokenizer_dir)
    ids = {}
    for kind in ("bos", "eos", "pad"):
        token = tok_cfg.get(f"{kind}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tok.token_to_id(token) is not None:
            ids[f"{kind}_token_id"] = tok.token_to_id(token)
    return ids

