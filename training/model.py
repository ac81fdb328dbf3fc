"""The training view of models.MoEForCausalLM: its op table, a cache-less causal attention injected
in place of the serving KV cache, weight initialisation, and the forward that scores rows of tokens.

Legend: B rows (sequences), L tokens per row, T = B*L tokens, N query heads, K kv heads, H head dim,
E experts, V vocabulary.

Nothing here branches inside the model: training differs from serving only by what is injected (this
attention instead of a KV cache, an all-to-all dispatcher instead of the local one, see parallel.py)
and by the op table chosen at construction. cpu_inference's oneDNN packing is never applied.
"""
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import cached_attention
from kernels.ops import KernelOps, torch_ops
from models.config import ModelConfig
from models.kv_cache import AttentionBatch, LatentProjections, chunked_attention, sparse_latent_attention
from models.loader import load_experts, load_model
from models.moe_decoder import Experts, MoEForCausalLM


def training_ops() -> KernelOps:
    """The ops training runs: the torch references, whose autograd gives the backward. No Triton
    kernel of kernels/ defines a backward, so the references train on every device; a kernel that
    gains one is chosen here, once, like everything else at construction."""
    return torch_ops()


class CausalAttention:
    """A KVCache that stores nothing: each sequence of the batch attends causally to its own tokens
    of this call (every sequence starts at position 0). Rows of equal length take one
    scaled_dot_product_attention over a (B, N, L, H) view (masked for a sliding window or Llama 4's
    chunks); other layouts (and attention sinks, which it has no column for) the reference attention."""

    def attend(self, layer: int, q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor,
               batch: AttentionBatch, scale: float, sliding_window: int | None,
               sinks_N: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        T, N, H = q_TNH.shape
        B, L, K = batch.kv_lens_B.numel(), batch.max_q_len, k_TKH.shape[1]
        if batch.max_kv_len != L:
            raise ValueError("CausalAttention keeps no cache: every sequence must start at position 0")
        k_TKH, v_TKH = k_TKH.to(q_TNH.dtype), v_TKH.to(q_TNH.dtype)
        if T == B * L and sinks_N is None:  # all rows full: a plain (B, L) layout, no gather
            q, k, v = (t.view(B, L, *t.shape[1:]).transpose(1, 2) for t in (q_TNH, k_TKH, v_TKH))
            if K != N:
                k, v = k.repeat_interleave(N // K, dim=1), v.repeat_interleave(N // K, dim=1)
            mask = None
            i, j = torch.arange(L, device=q.device)[:, None], torch.arange(L, device=q.device)[None, :]
            if sliding_window and sliding_window < L:  # key j visible from query i: i - w < j <= i
                mask = (j <= i) & (j > i - sliding_window)
            elif chunk and chunk < L:  # in i's chunk: i - i % chunk <= j <= i
                mask = (j <= i) & (j // chunk == i // chunk)
            o_BNLH = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
            return o_BNLH.transpose(1, 2).reshape(T, N, -1)  # (values may be narrower than keys: MLA)
        k_BSKH = k_TKH.new_zeros(B, L, K, H).index_put((batch.seq_idx_T, batch.tok_idx_T), k_TKH)
        v_BSKH = v_TKH.new_zeros(B, L, *v_TKH.shape[1:]).index_put((batch.seq_idx_T, batch.tok_idx_T), v_TKH)
        if chunk:
            return chunked_attention(q_TNH, k_BSKH.transpose(1, 2), v_BSKH.transpose(1, 2), batch.seq_idx_T,
                                     batch.tok_idx_T, batch.positions_T, scale, chunk, sinks_N)
        return cached_attention(q_TNH, k_BSKH.transpose(1, 2), v_BSKH.transpose(1, 2), batch.seq_idx_T,
                                batch.tok_idx_T, batch.positions_T, L, scale, sliding_window, sinks_N)

    def attend_latent(self, layer: int, q_nope_TNP: torch.Tensor, q_pe_TNR: torch.Tensor, cached_TW: torch.Tensor,
                      batch: AttentionBatch, scale: float, mla: LatentProjections, index=None) -> torch.Tensor:
        """MLA without a cache: expand this call's latents into per-head keys and values (as
        transformers computes them), then attend like any other layer; with DeepSeek Sparse
        Attention's index (models/mla.IndexQuery) and rows longer than its top-k, each query attends
        to the tokens it chose (models/kv_cache.sparse_latent_attention over this call's rows)."""
        if index is not None and batch.max_q_len > index.topk:
            B, L, where = batch.kv_lens_B.numel(), batch.max_q_len, (batch.seq_idx_T, batch.tok_idx_T)
            rows_BLW = cached_TW.new_zeros(B, L, cached_TW.shape[-1]).index_put(where, cached_TW)
            keys_BLI = (None if index.k_TI is None  # (a layer reusing another's choice has no index keys)
                        else index.k_TI.new_zeros(B, L, index.k_TI.shape[-1]).index_put(where, index.k_TI))
            return sparse_latent_attention(q_nope_TNP, q_pe_TNR, rows_BLW, keys_BLI, batch, scale, mla, index)
        k_TNH, v_TNV = mla.expand(cached_TW)
        return self.attend(layer, torch.cat((q_nope_TNP, q_pe_TNR), dim=-1), k_TNH, v_TNV, batch, scale, None)


def rows_batch(B: int, L: int, device: torch.device | str) -> AttentionBatch:
    """The AttentionBatch of B rows of L tokens, each its own sequence from position 0."""
    return AttentionBatch.build([L] * B, [0] * B, list(range(B)), device)


@dataclass(frozen=True)
class Shard:
    """Which experts this process holds: global ids expert_ids (local index i is expert_ids[i])."""

    expert_ids: tuple[int, ...]


def build_model(cfg: ModelConfig, shard: Shard, device: torch.device, init_from: Path | None = None,
                seed: int = 0, initializer_range: float = 0.02, pad_token_id: int | None = None) -> MoEForCausalLM:
    """A float32 model for training: loaded from `init_from` (a Hugging Face checkpoint directory)
    or freshly initialised. Every MoE layer holds only the experts in `shard`; a model with all
    experts is the one serving loads."""
    all_experts = shard.expert_ids == tuple(range(cfg.num_experts))
    backend = training_ops().backend
    if init_from is not None:
        model = load_model(init_from, cfg, dtype=torch.float32, device=device, with_experts=all_experts,
                           kernels=backend)
        if not all_experts:
            local = load_experts(init_from, list(shard.expert_ids), cfg, torch.float32, device, kernels=backend)
            for i, experts in local.items():
                model.model.layers[i].mlp.experts = experts
        return model.train()
    with torch.device("meta"):  # no default init: init_weights writes every tensor
        model = MoEForCausalLM(cfg, with_experts=all_experts, ops=training_ops())
        if not all_experts:
            for layer in model.model.layers:
                if layer.is_moe:
                    layer.mlp.experts = Experts.of(cfg, len(shard.expert_ids), model.ops)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    init_weights(model, shard, seed, initializer_range, pad_token_id)
    return model.train()


def init_weights(model: MoEForCausalLM, shard: Shard, seed: int, std: float, pad_token_id: int | None) -> None:
    """transformers' _init_weights: linear, embedding, router and expert weights ~ normal(0, std),
    biases 0, norms 1, the padding token's embedding 0, gated DeltaNet's dt_bias 1 and A_log the log
    of uniform(0.01, 16). Each tensor (each expert) draws from its own
    generator seeded by (seed, name, expert id), so the weights do not depend on how experts are
    sharded over ranks."""
    init_parameters(model.named_parameters(), shard.expert_ids, seed, std)
    with torch.no_grad():
        if pad_token_id is not None and 0 <= pad_token_id < model.cfg.vocab_size:
            model.model.embed_tokens.weight[pad_token_id].zero_()


def init_parameters(named, expert_ids: tuple[int, ...], seed: int, std: float) -> None:
    """init_weights' rules over (name, parameter) pairs; stacked experts hold global ids expert_ids."""

    def normal(shape: tuple[int, ...], *key: object) -> torch.Tensor:
        gen = torch.Generator().manual_seed(zlib.crc32(":".join(map(str, (seed, *key))).encode()))
        return torch.randn(shape, generator=gen) * std

    with torch.no_grad():
        for name, p in named:
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith((".bias", "e_score_correction_bias", ".experts.b13", ".experts.b2")):
                p.zero_()
            elif name.endswith(".dt_bias"):  # gated DeltaNet's time step bias, as transformers: ones
                p.fill_(1.0)
            elif name.endswith(".A_log"):  # ... and its decay rates: log of uniform(0.01, 16)
                gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log_())
            elif is_expert_param(name):  # (E_local, ...): one draw per global expert
                for i, e in enumerate(expert_ids):
                    p[i].copy_(normal(tuple(p.shape[1:]), name, e))
            else:
                p.copy_(normal(tuple(p.shape), name))


MTP_NAME = "mtp."  # the MTP layer's parameters in the trainer's named lists (and its init seeds)


def check_mtp_family(cfg: ModelConfig) -> None:
    """ValueError unless --mtp-layers can train an MTP layer for this model (stored as
    model.layers.{L}.*, served by models/mtp.py)."""
    if cfg.linear_layers is not None or cfg.family == "deepseek_v4":
        raise ValueError(f"--mtp-layers: {cfg.architecture} is not supported (speculative method mtp serves "
                         f"MTP layers of full-attention models stored as model.layers.{{num_hidden_layers}}.*)")


def build_mtp(cfg: ModelConfig, model: MoEForCausalLM, device: torch.device, weights: Path | None = None,
              seed: int = 0, initializer_range: float = 0.02, dense: bool = False):
    """A float32 MTP layer for training beside `model` (models/mtp.MTPDrafter): the checkpoint's own
    (model.layers.{L}.* in `weights`, when it holds them), else a new one initialised as
    init_weights does, of the model's last layer's kind (MoE or dense; `dense`: a dense MLP of
    cfg.intermediate_size) and shape, with no embedding or head of its own (the model's are shared,
    as DeepSeek-V3 shares them). Every rank holds all of its experts. cfg: the model's config,
    num_mtp_layers >= 1."""
    from models.checkpoint import CheckpointReader
    from models.mtp import MTPDrafter, MTPLayer, load_mtp, mtp_model_config, mtp_prefix

    check_mtp_family(cfg)
    if weights is not None and mtp_prefix(cfg) + "eh_proj.weight" in CheckpointReader.of(weights, cfg).files:
        drafter = load_mtp(weights, cfg, model, dtype=torch.float32, device=device, kernels=training_ops().backend)
        drafter.layer.train()
        return drafter
    mtp_cfg = mtp_model_config(cfg, cfg.moe_layers[-1] and not dense, has_indexer=True)
    with torch.device("meta"):
        layer = MTPLayer(mtp_cfg, training_ops(), own_embed=False, own_head=False)
    layer.to_empty(device=device)
    init_parameters([(MTP_NAME + n, p) for n, p in layer.named_parameters()], tuple(range(cfg.num_experts)),
                    seed, initializer_range)
    return MTPDrafter(layer.train(), model, mtp_cfg)


def is_expert_param(name: str) -> bool:
    """Whether a parameter (by name) is a stacked expert matrix, sharded under expert parallelism."""
    return ".mlp.experts." in name


class RouterLogits:
    """Collects every MoE layer's router logits (T, E) during a forward through forward hooks on the
    routers, so the losses can use them without the model returning them."""

    def __init__(self, model: MoEForCausalLM, layers=None):
        """layers: the decoder layers to watch (default: the model's; the trainer adds its MTP layer)."""
        self._logits: list[torch.Tensor] = []
        self._handles = [layer.mlp.gate.register_forward_hook(self._hook)
                         for layer in (model.model.layers if layers is None else layers) if layer.is_moe]

    def _hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self._logits.append(output)

    def take(self) -> list[torch.Tensor]:
        """The logits collected since the last call, one (T, E) tensor per MoE layer, in layer order."""
        out, self._logits = self._logits, []
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def forward_logits(model: MoEForCausalLM, ids_BL: torch.Tensor) -> torch.Tensor:
    """Logits (T, V) float32 of B rows of token ids, each row a sequence of its own, no KV cache."""
    B, L = ids_BL.shape
    hidden_TD = model(ids_BL.reshape(-1), rows_batch(B, L, ids_BL.device), CausalAttention())
    return model.logits(hidden_TD)


def next_position(logits_TV: torch.Tensor, B: int, L: int, depth: int = 1) -> torch.Tensor:
    """The target's logits (B*L, V) aligned with forward_mtp's MTP rows of each depth d = 1..depth (rows
    at positions d..L-1 of each sequence, (B*(L-d), V) each, in that order): the target's own
    prediction of the token the MTP layer predicts there."""
    logits_BLV = logits_TV.view(B, L, -1)
    rows = [logits_BLV[:, d:].reshape(B * (L - d), -1) for d in range(1, depth + 1)]
    return rows[0] if depth == 1 else torch.cat(rows)


def forward_mtp(model: MoEForCausalLM, mtp, ids_BL: torch.Tensor, labels_BL: torch.Tensor,
                depth: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward of the target and its MTP layer (models/mtp.MTPDrafter), no KV cache: (the target's
    logits (B*L, V), the MTP layer's logits of each depth's rows, their labels: losses.mtp_targets).
    Depth 1 (B*(L-1) rows) is DeepSeek-V3's: at position t the layer takes the target's hidden state
    after its final norm, as serving gives it (attention_nodes/model_runner.py), and the token x_{t+1},
    and predicts x_{t+2}. Depth d > 1 (B*(L-d) rows, after depth d - 1's) runs the same layer on depth
    d - 1's output (before shared_head's norm) and the token that output was to predict, the inputs of
    a chained draft (ModelRunner.mtp_draft), and predicts the token after it; a label is IGNORE where
    any token its chain read is. Each depth attends causally over its own rows (a chained draft attends
    to depth 1's entries of the positions before it, as DeepSeek-V3's later MTP modules to their own
    depth's). The MTP layer's gradient reaches the target."""
    from training.losses import IGNORE, mtp_targets

    B, L = ids_BL.shape
    hidden_TD = model(ids_BL.reshape(-1), rows_batch(B, L, ids_BL.device), CausalAttention())
    inputs_BL1, targets_BL1 = mtp_targets(labels_BL)
    h_TD = hidden_TD.view(B, L, -1)[:, :-1].reshape(B * (L - 1), -1)
    y_TD = mtp.forward(inputs_BL1.reshape(-1), h_TD, rows_batch(B, L - 1, ids_BL.device), CausalAttention())
    outs, labels, targets_BL = [mtp.logits(y_TD)], [targets_BL1.reshape(-1)], targets_BL1
    for d in range(2, depth + 1):  # (row t of depth d: depth d - 1's row t, token x_{t+d}; predicts x_{t+d+1})
        n = L - d
        unknown_Bn = targets_BL[:, :n] == IGNORE  # (x_{t+d}, or a token before it, unknown)
        targets_BL = labels_BL[:, d:].masked_fill(unknown_Bn, IGNORE)
        y_TD = mtp.forward(labels_BL[:, d - 1:d - 1 + n].clamp(min=0).reshape(-1),
                           y_TD.view(B, L - d + 1, -1)[:, :n].reshape(B * n, -1), rows_batch(B, n, ids_BL.device),
                           CausalAttention())
        outs.append(mtp.logits(y_TD))
        labels.append(targets_BL.reshape(-1))
    if depth == 1:  # (no copy of the rows x vocabulary logits)
        return model.logits(hidden_TD), outs[0], labels[0]
    return model.logits(hidden_TD), torch.cat(outs), torch.cat(labels)
