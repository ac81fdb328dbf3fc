"""TrainConfig: one frozen description of a training run, checked on construction (errors name the
command-line flag), and the model it trains: a checkpoint to continue, a config.json, or a family
with shape flags (a new model, its config written in the family's transformers format).
"""
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.config import ARCHITECTURES

FAMILIES = {family: arch for arch, family in ARCHITECTURES.items()}
DTYPES = ("float32", "bfloat16")
# Shape flags (TrainConfig.model_flags keys) -> the config.json field of each family (default: same name).
_FIELD = {
    "num_experts": {"mixtral": "num_local_experts"},
    "expert_intermediate_size": {"mixtral": "intermediate_size", "olmoe": "intermediate_size",
                                 "*": "moe_intermediate_size"},
    "intermediate_size": {"mixtral": None, "olmoe": None},  # these families size experts with it
}


@dataclass(frozen=True)
class TrainConfig:
    """Every option of a run. Paths are as given; `out` receives checkpoints, logs and the final model."""

    out: Path
    data: tuple[str, ...]
    # the model: exactly one of init_from / model_config / family
    init_from: str | None = None
    model_config: str | None = None
    family: str | None = None
    model_flags: dict[str, Any] = field(default_factory=dict)  # shape flags of a new model (see _FIELD)
    tokenizer: str | None = None  # default: the checkpoint's, else one trained on the data
    eval_data: tuple[str, ...] = ()
    text_field: str = "text"
    # schedule and batch
    seq_len: int = 256
    micro_batch_size: int = 8
    grad_accum: int = 1
    max_steps: int | None = None
    max_minutes: float | None = None
    lr: float = 3e-4
    min_lr: float | None = None  # default lr / 10
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0: none
    dtype: str = "float32"  # autocast dtype; weights and optimiser state stay float32
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    seed: int = 0
    # parallelism and device
    expert_parallel: int | None = None
    device: str | None = None
    # checkpoints, logs
    save_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    save_dtype: str | None = None  # default: the model config's dtype
    resume: bool = True
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 4
    straggler_factor: float = 1.5
    progress: bool = True
    peak_tflops: float | None = None  # default: measured by a matmul at start
    recipe: str | None = None
    debug_delay: tuple[int, float] | None = None  # (rank, seconds): that rank sleeps every step (tests)

    def __post_init__(self) -> None:
        sources = [f for f, v in (("--init-from", self.init_from), ("--config", self.model_config),
                                  ("--family", self.family)) if v]
        if len(sources) != 1:
            raise ValueError(f"give exactly one of --init-from, --config, --family (got {sources or 'none'})")
        if self.family and self.family not in FAMILIES:
            raise ValueError(f"--family {self.family!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
        if self.model_flags and not self.family:
            raise ValueError(f"model shape flags ({', '.join(sorted(self.model_flags))}) need --family")
        if not self.data:
            raise ValueError("--data: give at least one file")
        if self.max_steps is None and self.max_minutes is None:
            raise ValueError("give --max-steps or --max-minutes")
        for flag, v in (("--seq-len", self.seq_len), ("--micro-batch-size", self.micro_batch_size),
                        ("--grad-accum", self.grad_accum), ("--max-steps", self.max_steps or 1),
                        ("--keep-checkpoints", self.keep_checkpoints), ("--log-every", self.log_every),
                        ("--eval-batches", self.eval_batches)):
            if v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        for flag, v in (("--warmup-steps", self.warmup_steps), ("--save-every", self.save_every),
                        ("--eval-every", self.eval_every), ("--grad-clip", self.grad_clip),
                        ("--weight-decay", self.weight_decay), ("--aux-loss-coef", self.aux_loss_coef),
                        ("--z-loss-coef", self.z_loss_coef)):
            if v < 0:
                raise ValueError(f"{flag} must be >= 0, got {v}")
        if self.lr <= 0 or (self.min_lr is not None and not 0 <= self.min_lr <= self.lr):
            raise ValueError(f"--lr must be > 0 and --min-lr in [0, lr] (got lr={self.lr}, min_lr={self.min_lr})")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"--max-minutes must be > 0, got {self.max_minutes}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.save_dtype is not None and self.save_dtype not in DTYPES:
            raise ValueError(f"--save-dtype {self.save_dtype!r}: expected one of {', '.join(DTYPES)}")
        if not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise ValueError(f"--beta1/--beta2 must be in [0, 1) (got {self.beta1}, {self.beta2})")
        if self.straggler_factor <= 1:
            raise ValueError(f"--straggler-factor must be > 1, got {self.straggler_factor}")

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr


def new_model_config(family: str, flags: dict[str, Any]) -> dict[str, Any]:
    """config.json of a new model of `family`: transformers' defaults for the family, with the shape
    flags (TrainConfig.model_flags) mapped to the family's field names."""
    import transformers

    fields: dict[str, Any] = {}
    for flag, value in flags.items():
        names = _FIELD.get(flag, {})
        name = names.get(family, names.get("*", flag))
        if name is None:
            raise ValueError(f"--{flag.replace('_', '-')}: {family} sizes its experts with --expert-intermediate-size "
                             f"and has no separate dense intermediate size")
        fields[name] = value
    try:
        config = transformers.AutoConfig.for_model(family, **fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--family {family}: invalid shape ({e})") from None
    raw = config.to_diff_dict()  # what save_pretrained writes
    raw["architectures"] = [FAMILIES[family]]
    return raw


def read_config_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
