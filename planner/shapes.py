"""The model a plan is for: its ModelConfig, read by models/config.py (the one parser, and the one
set of formulas for sizes, KV bytes and FLOPs per token), plus the config's name and hash, which
profiles and plans record so that they are used only on the model they were made for.

Shipped configs (no weights) live in planner/models/NAME/config.json; `shape_from` takes a name.
Families that are planned for but not served (DBRX) are read with planning=True.
`quantization_of` names the expert quantization a profile or plan is for (EngineConfig.quantization).
"""
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.config import ConfigError, ModelConfig, read_config_json

MODELS_DIR = Path(__file__).parent / "models"


@dataclass(frozen=True)
class ModelShape:
    """A config.json as the planner uses it."""

    name: str
    config_hash: str
    config: ModelConfig


def shape_from(model: str | Path) -> ModelShape:
    """A ModelShape from a checkpoint directory, a config.json path, or the name of a shipped config
    (planner/models/NAME)."""
    path = Path(model)
    if not path.exists() and (MODELS_DIR / str(model)).is_dir():
        path = MODELS_DIR / str(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        shipped = ", ".join(sorted(p.name for p in MODELS_DIR.iterdir() if p.is_dir()))
        raise ConfigError(f"{model}: no config.json there (a checkpoint directory, a config.json, or one of: {shipped})")
    name = path.parent.name if path.name == "config.json" else path.stem
    return shape_of(read_config_json(path), name, str(path))


def shape_of(raw: dict[str, Any], name: str = "model", src: str = "config.json") -> ModelShape:
    return ModelShape(name, config_hash(raw), ModelConfig.from_dict(raw, source=src, planning=True))


def config_hash(raw: dict[str, Any]) -> str:
    """Hash of the fields that decide the model's shape and cost (not its name or tokens' ids)."""
    keep = {k: v for k, v in raw.items() if k not in ("_name_or_path", "transformers_version", "bos_token_id",
                                                      "eos_token_id", "pad_token_id", "auto_map")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def quantization_of(name: str | None, cfg: ModelConfig | None = None, model: str = "the model") -> str | None:
    """EngineConfig.quantization as profiles and plans record it: None (also "none"), "int8" (also
    vLLM's "experts_int8"), "fp8" or "mxfp4". ValueError for another name, or for a quantization of
    a checkpoint that is already quantised (FP8 block but for fp8, MXFP4 but for mxfp4), which
    engine_config refuses to serve."""
    from attention_nodes.config import QUANTIZATIONS

    if name is None or name == "none":
        return None
    q = "int8" if name == "experts_int8" else name
    if q not in QUANTIZATIONS:
        raise ValueError(f"quantization {name!r} is not supported; choose from none, {', '.join(QUANTIZATIONS)} "
                         "(or experts_int8, vLLM's name for int8)")
    shipped = None if cfg is None else "FP8 block" if cfg.fp8_block else "MXFP4" if cfg.mxfp4 else None
    if shipped and (shipped, q) not in (("FP8 block", "fp8"), ("MXFP4", "mxfp4")):
        raise ValueError(f"{model}: the checkpoint is already {shipped}-quantised; quantization {q} quantises "
                         "float checkpoints (plan this one without it)")
    return q
