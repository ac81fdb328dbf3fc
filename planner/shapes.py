"""Model shapes for planning: what a deployment's cost depends on, read from config.json alone.

The planner never needs weights: sizes, FLOPs per token and KV bytes per token follow from the
config. Families: everything models.config serves (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) plus the
published shapes planned for before they are served: DBRX (its own field names) and DeepSeek-V3
(multi-head latent attention: the KV cache holds kv_lora_rank + qk_rope_head_dim values per token
and layer, and decode attention reads that latent cache with absorbed projections).
Shipped configs (no weights) live in planner/models/NAME/config.json; `shape_from` takes a name.
"""
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELS_DIR = Path(__file__).parent / "models"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ShapeError(ValueError):
    """A config.json the planner cannot read; the message names the file and the field."""


@dataclass(frozen=True)
class ModelShape:
    """Sizes of one MoE decoder. Parameter counts are elements; bytes use `dtype_bytes`.
    attention: "gqa" (grouped-query) or "mla" (DeepSeek latent attention)."""

    name: str
    family: str
    config_hash: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_moe_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention: str
    kv_lora_rank: int
    q_lora_rank: int
    rope_head_dim: int
    v_head_dim: int
    dense_intermediate_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    num_experts: int
    top_k: int
    dtype_bytes: int
    max_model_len: int

    # -- parameters -------------------------------------------------------------------------
    def attention_params(self) -> int:
        """Attention projections of one layer."""
        D, N, H = self.hidden_size, self.num_heads, self.head_dim
        if self.attention == "mla":
            q = D * self.q_lora_rank + self.q_lora_rank * N * (H + self.rope_head_dim) if self.q_lora_rank \
                else D * N * (H + self.rope_head_dim)
            kv = D * (self.kv_lora_rank + self.rope_head_dim) + self.kv_lora_rank * N * (H + self.v_head_dim)
            return q + kv + N * self.v_head_dim * D
        return D * (N + 2 * self.num_kv_heads) * H + N * H * D

    def expert_params(self) -> int:
        """One routed expert of one layer (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def non_expert_params(self) -> int:
        """Everything an attention worker holds: embeddings, attention, norms, routers, dense MLPs,
        shared experts, LM head."""
        D = self.hidden_size
        dense = (self.num_layers - self.num_moe_layers) * 3 * D * self.dense_intermediate_size
        per_moe = D * self.num_experts + 3 * D * self.shared_intermediate_size
        return (2 * self.vocab_size * D + self.num_layers * (self.attention_params() + 2 * D) + dense
                + self.num_moe_layers * per_moe)

    def total_params(self) -> int:
        return self.non_expert_params() + self.num_moe_layers * self.num_experts * self.expert_params()

    # -- per-token costs ----------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token over all layers."""
        per_layer = (self.kv_lora_rank + self.rope_head_dim if self.attention == "mla"
                     else 2 * self.num_kv_heads * self.head_dim)
        return self.num_layers * per_layer * self.dtype_bytes

    def attention_flops_per_token(self) -> float:
        """Matmul FLOPs of one token's attention-side work in one layer, excluding the scores over
        the context (see `context_flops_per_token`): projections, router, dense or shared MLP."""
        D = self.hidden_size
        mlp = 3 * D * (self.shared_intermediate_size if self.num_moe_layers else self.dense_intermediate_size)
        return 2.0 * (self.attention_params() + D * self.num_experts + mlp)

    def context_flops_per_token(self) -> float:
        """Score and value FLOPs of one query token per context token, in one layer."""
        if self.attention == "mla":  # absorbed: scores and values over the latent cache
            return 2.0 * self.num_heads * (2 * self.kv_lora_rank + self.rope_head_dim)
        return 4.0 * self.num_heads * self.head_dim

    def expert_flops_per_pair(self) -> float:
        """FLOPs of one (token, expert) pair through one expert."""
        return 2.0 * self.expert_params()

    def dispatch_bytes_per_token(self) -> int:
        """M2N bytes one token carries to one expert worker (hidden row, ids, weights)."""
        return self.hidden_size * self.dtype_bytes + 8 * self.top_k


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
        raise ShapeError(f"{model}: no config.json there (a checkpoint directory, a config.json, or one of: {shipped})")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ShapeError(f"{path}: not valid JSON ({e})") from None
    name = path.parent.name if path.name == "config.json" else path.stem
    return parse_shape(raw, name, str(path))


def config_hash(raw: dict[str, Any]) -> str:
    """Hash of the fields that decide the model's shape and cost (not its name or tokens' ids)."""
    keep = {k: v for k, v in raw.items() if k not in ("_name_or_path", "transformers_version", "bos_token_id",
                                                      "eos_token_id", "pad_token_id", "auto_map")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def parse_shape(raw: dict[str, Any], name: str = "model", src: str = "config.json") -> ModelShape:
    def need(d: dict, key: str, *aliases: str) -> Any:
        for k in (key, *aliases):
            if d.get(k) is not None:
                return d[k]
        raise ShapeError(f"{src}: required field '{key}' is missing")

    mt = raw.get("model_type") or ""
    arch = " ".join(raw.get("architectures") or [])
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16").replace("torch.", "")
    if dtype not in DTYPE_BYTES:
        raise ShapeError(f"{src}: dtype {dtype!r} is not supported; supported: {', '.join(DTYPE_BYTES)}")
    common = dict(name=name, config_hash=config_hash(raw), dtype_bytes=DTYPE_BYTES[dtype])
    if mt == "dbrx" or "Dbrx" in arch:
        attn, ffn = raw.get("attn_config") or {}, raw.get("ffn_config") or {}
        D, N = int(need(raw, "d_model")), int(need(raw, "n_heads"))
        L = int(need(raw, "n_layers"))
        return ModelShape(family="dbrx", vocab_size=int(need(raw, "vocab_size")), hidden_size=D, num_layers=L,
                          num_moe_layers=L, num_heads=N, num_kv_heads=int(attn.get("kv_n_heads", N)), head_dim=D // N,
                          attention="gqa", kv_lora_rank=0, q_lora_rank=0, rope_head_dim=0, v_head_dim=D // N,
                          dense_intermediate_size=0, moe_intermediate_size=int(need(ffn, "ffn_hidden_size")),
                          shared_intermediate_size=0, num_experts=int(need(ffn, "moe_num_experts")),
                          top_k=int(need(ffn, "moe_top_k")), max_model_len=int(raw.get("max_seq_len", 32768)), **common)
    D, N, L = int(need(raw, "hidden_size")), int(need(raw, "num_attention_heads")), int(need(raw, "num_hidden_layers"))
    E = int(need(raw, "num_local_experts", "num_experts", "n_routed_experts"))
    K = int(need(raw, "num_experts_per_tok"))
    if not 1 <= K <= E:
        raise ShapeError(f"{src}: num_experts_per_tok ({K}) must be in [1, num_experts={E}]")
    mixtral = mt == "mixtral" or "Mixtral" in arch
    moe_inter = int(need(raw, "intermediate_size")) if mixtral or mt == "olmoe" else int(need(raw, "moe_intermediate_size"))
    dense_inter = int(raw.get("intermediate_size") or moe_inter)
    mla = raw.get("kv_lora_rank") is not None
    if mla:
        dense = int(raw.get("first_k_dense_replace", 0))
        shared = int(raw.get("n_shared_experts") or 0) * moe_inter
        head_dim, kv_heads = int(need(raw, "qk_nope_head_dim")), N
    else:
        step, only = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or [])
        dense = sum(1 for i in range(L) if i in only or (i + 1) % step)
        shared = int(raw.get("shared_expert_intermediate_size") or 0)
        head_dim, kv_heads = int(raw.get("head_dim") or D // N), int(raw.get("num_key_value_heads") or N)
    return ModelShape(family=mt or arch, vocab_size=int(need(raw, "vocab_size")), hidden_size=D, num_layers=L,
                      num_moe_layers=L - dense, num_heads=N, num_kv_heads=kv_heads, head_dim=head_dim,
                      attention="mla" if mla else "gqa", kv_lora_rank=int(raw.get("kv_lora_rank") or 0),
                      q_lora_rank=int(raw.get("q_lora_rank") or 0),
                      rope_head_dim=int(raw.get("qk_rope_head_dim") or 0),
                      v_head_dim=int(raw.get("v_head_dim") or head_dim), dense_intermediate_size=dense_inter,
                      moe_intermediate_size=moe_inter, shared_intermediate_size=shared, num_experts=E, top_k=K,
                      max_model_len=int(raw.get("max_position_embeddings", 4096)), **common)
