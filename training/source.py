"""Where a run's model comes from: its config.json (as a dict), its starting weights and its tokenizer.

In order: the run's own latest checkpoint (resumption), --init-from CHECKPOINT, --config FILE,
--family with shape flags. A new model gets a tokenizer trained on the data unless --tokenizer names
one, and its special token ids are the tokenizer's.
"""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.checkpoint import latest_checkpoint, weights_dir
from training.config import TrainConfig, new_model_config, read_config_json
from training.data import load_tokenizer, train_new_tokenizer
from training.parallel import ParallelContext

NEW_MODEL_VOCAB = 4096  # vocabulary of a new model's tokenizer when --vocab-size is not given


@dataclass(frozen=True)
class ModelSource:
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
    """(tokenizer directory, config dict with the tokenizer's special ids for a new model). Trains
    one on the data into OUT/tokenizer (rank 0, once) when a new model names none."""
    raw = dict(source.raw_config)
    if source.resume_from is not None:
        return source.resume_from, raw
    if cfg.tokenizer:
        tokenizer_dir = Path(cfg.tokenizer)
    elif source.weights is not None:
        tokenizer_dir = source.weights
    else:
        tokenizer_dir = cfg.out / "tokenizer"
        if ctx.is_main and not (tokenizer_dir / "tokenizer.json").is_file():
            train_new_tokenizer(list(cfg.data), tokenizer_dir, int(raw["vocab_size"]), cfg.text_field)
        ctx.barrier()
    size = load_tokenizer(tokenizer_dir).get_vocab_size()
    if size > int(raw["vocab_size"]):
        raise ValueError(f"the tokenizer in {tokenizer_dir} has {size} tokens, more than the model's vocab_size "
                         f"{raw['vocab_size']}")
    if source.weights is None:
        raw.update(special_token_ids(tokenizer_dir))
    return tokenizer_dir, raw


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


def eos_token_id(raw: dict[str, Any]) -> int:
    """The id appended after each document: the config's (first) eos_token_id."""
    eos = raw.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int):
        raise ValueError("the model's config.json has no eos_token_id to separate documents with")
    return eos
