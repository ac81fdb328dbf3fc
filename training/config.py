"""TrainConfig: one frozen description of a training run, checked on construction (errors name the
command-line flag), and the model it trains: a checkpoint to continue, a config.json, or a family
with shape flags (a new model, its config written in the family's transformers format).
"""
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.config import ARCHITECTURES, DTYPES

FAMILIES = {family: arch for arch, family in reversed(ARCHITECTURES.items())}  # (Llama 4: Llama4ForCausalLM)
_MODEL_TYPES = {"llama4": "llama4_text"}  # a new model's transformers config, where it is not the family's name
SAVE_DTYPES = tuple(DTYPES)  # model files: any dtype the loader reads (models.config.DTYPES)
TRAIN_ONLY = ("mtp",)  # --train-only: the parts that train while the rest stays frozen
AUTOCAST_DTYPES = ("float32", "bfloat16")  # float16 autocast would need loss scaling, which we do not do
# Shape flags of a new model: TrainConfig.model_flags key -> (command-line flag, type).
SHAPE_FLAGS: dict[str, tuple[str, type]] = {
    "hidden_size": ("--hidden-size", int), "num_hidden_layers": ("--num-layers", int),
    "num_attention_heads": ("--num-heads", int), "num_key_value_heads": ("--num-kv-heads", int),
    "head_dim": ("--head-dim", int), "intermediate_size": ("--intermediate-size", int),
    "expert_intermediate_size": ("--expert-intermediate-size", int),
    "shared_expert_intermediate_size": ("--shared-expert-intermediate-size", int),
    "num_experts": ("--num-experts", int), "num_experts_per_tok": ("--top-k", int), "vocab_size": ("--vocab-size", int),
    "max_position_embeddings": ("--max-position-embeddings", int),
    "initializer_range": ("--initializer-range", float), "tie_word_embeddings": ("--tie-word-embeddings", bool)}
# Shape flags -> the config.json field of each family (default: same name; None: the family has none).
_FIELD = {
    "num_experts": {"mixtral": "num_local_experts", "deepseek_v2": "n_routed_experts",
                    "deepseek_v3": "n_routed_experts", "deepseek_v32": "n_routed_experts",
                    "glm_moe_dsa": "n_routed_experts", "glm4_moe": "n_routed_experts",
                    "minimax_m2": "num_local_experts", "gpt_oss": "num_local_experts", "llama4": "num_local_experts",
                    "mimo_v2_flash": "n_routed_experts"},
    "expert_intermediate_size": {"mixtral": "intermediate_size", "olmoe": "intermediate_size",
                                 "minimax_m2": "intermediate_size", "gpt_oss": "intermediate_size",
                                 "llama4": "intermediate_size", "*": "moe_intermediate_size"},
    # these families size experts with it (Llama 4: its dense layers' is intermediate_size_mlp)
    "intermediate_size": {"mixtral": None, "olmoe": None, "minimax_m2": None, "gpt_oss": None,
                          "llama4": "intermediate_size_mlp"},
}
_READ_IF_PRESENT = {"head_dim"}  # fields every family's transformers model reads when config.json has them


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
    collective_timeout_s: float = 600.0  # a collective waiting longer for the other ranks fails the job
    # multi-token prediction (DeepSeek-V3's MTP; models/mtp.py serves it as speculative method mtp)
    mtp_layers: int = 0  # 1: train an MTP layer beside the model, saved as model.layers.{L}.*
    mtp_loss_weight: float = 0.3  # DeepSeek's lambda: the loss adds weight * the MTP layer's cross entropy
    mtp_dense: bool = False  # a new MTP layer's MLP: dense (intermediate_size) instead of the last layer's kind
    mtp_distill: bool = False  # the MTP loss against the model's own distribution of x_{t+2}, not the data's
    mtp_depth: int = 1  # the MTP layer also trained chained on its own outputs, up to this depth (k >= 2 drafts)
    train_only: str | None = None  # "mtp": only the MTP layer trains; the model's own weights stay as loaded

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
        if self.dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: expected one of {', '.join(AUTOCAST_DTYPES)}")
        if self.save_dtype is not None and self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"--save-dtype {self.save_dtype!r}: expected one of {', '.join(SAVE_DTYPES)}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"--collective-timeout-s must be > 0, got {self.collective_timeout_s}")
        if not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise ValueError(f"--beta1/--beta2 must be in [0, 1) (got {self.beta1}, {self.beta2})")
        if self.straggler_factor <= 1:
            raise ValueError(f"--straggler-factor must be > 1, got {self.straggler_factor}")
        if self.mtp_layers not in (0, 1):
            raise ValueError(f"--mtp-layers must be 0 or 1 (serving drafts with the first MTP layer), "
                             f"got {self.mtp_layers}")
        if self.mtp_loss_weight <= 0:
            raise ValueError(f"--mtp-loss-weight must be > 0, got {self.mtp_loss_weight}")
        if self.train_only is not None:
            if self.train_only not in TRAIN_ONLY:
                raise ValueError(f"--train-only {self.train_only!r}: expected one of {', '.join(TRAIN_ONLY)}")
            if not self.mtp_layers:
                raise ValueError("--train-only mtp needs --mtp-layers 1 (the layer to train)")
            if not self.init_from:
                raise ValueError("--train-only mtp trains an MTP layer for an existing model: give --init-from DIR")
        if self.mtp_distill and not self.mtp_layers:
            raise ValueError("--mtp-distill needs --mtp-layers 1 (the layer to train)")
        if isinstance(self.mtp_depth, bool) or not isinstance(self.mtp_depth, int) or self.mtp_depth < 1:
            raise ValueError(f"--mtp-depth must be a positive integer, got {self.mtp_depth!r}")
        if self.mtp_depth > 1 and not self.mtp_layers:
            raise ValueError("--mtp-depth needs --mtp-layers 1 (the layer to train)")
        if self.mtp_depth >= self.seq_len:
            raise ValueError(f"--mtp-depth {self.mtp_depth} leaves no position of a {self.seq_len}-token sequence")

    @property
    def final_lr(self) -> float:
        """The learning rate at the end of the cosine: --min-lr, default lr / 10."""
        return self.lr / 10 if self.min_lr is None else self.min_lr


def flag_name(key: str) -> str:
    """The command-line flag that sets a TrainConfig.model_flags key (`--set KEY` for any other field)."""
    return SHAPE_FLAGS[key][0] if key in SHAPE_FLAGS else f"--set {key}"


def new_model_config(family: str, flags: dict[str, Any]) -> dict[str, Any]:
    """config.json of a new model of `family`: transformers' defaults for the family, with the shape
    flags (TrainConfig.model_flags) mapped to the family's field names. A shape flag the family's
    transformers config does not define is an error naming the flag (transformers would ignore it)."""
    import transformers

    model_type = _MODEL_TYPES.get(family, family)
    defaults = transformers.AutoConfig.for_model(model_type)
    fields: dict[str, Any] = {}
    for flag, value in flags.items():
        names = _FIELD.get(flag, {})
        name = names.get(family, names.get("*", flag))
        if name is None:
            raise ValueError(f"{flag_name(flag)}: {family} sizes its experts with --expert-intermediate-size "
                             f"and has no separate dense intermediate size")
        if flag in SHAPE_FLAGS and name not in _READ_IF_PRESENT and not hasattr(defaults, name):
            raise ValueError(f"{flag_name(flag)} does not apply to --family {family} (its config has no {name})")
        fields[name] = value
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--family {family}: invalid shape ({e})") from None
    raw = config.to_diff_dict()  # what save_pretrained writes
    raw["architectures"] = [FAMILIES[family]]
    return raw


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A config.json as a dict: `path` is the file or a checkpoint directory holding it. Errors name
    the file (missing, or not JSON)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
