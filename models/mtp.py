"""Multi-token prediction (DeepSeek-V3, GLM-4.5, the built-in model, any model trained with `shuttle
train --mtp-layers 1`: config.json's num_nextn_predict_layers) as a draft model for speculative
decoding (--speculative-config '{"method": "mtp", "num_speculative_tokens": k}').

The checkpoint stores the MTP module as the layer past the last one, model.layers.{L}. (L =
num_hidden_layers): a decoder layer of the usual names (self_attn, mlp, input_layernorm,
post_attention_layernorm) plus enorm, hnorm, eh_proj, shared_head.norm, shared_head.head and
embed_tokens (the last two optional: the target's embedding and LM head where it has none). Given
the target's last hidden state h_t at position t (after its final norm, as vLLM's deepseek_mtp
takes it) and the token x_{t+1} that follows:

    x = eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))       # (embedding first, as vLLM and SGLang)
    y = x + attn(input_layernorm(x)); y = y + mlp(post_attention_layernorm(y))  # one decoder layer, at position t
    logits(x_{t+2}) = shared_head.head(shared_head.norm(y))

The layer runs at position t (vLLM's and SGLang's MTP reuse the target's positions), so its keys go
to the sequence's own KV slots: the engine's paged cache gets one layer more (index L) for it, and
the block tables are the target's (attention_nodes/model_runner.py). For k > 1 drafts the same layer
is chained on its own output y (before shared_head.norm, as vLLM chains it) with the draft it just
proposed, at positions t + 1, t + 2, ...

vLLM also zeroes the embedding of the token at position 0; SGLang and the published formula do not,
and neither does this module (it only changes the drafts of position 0, never an output token).

The MTP layer's experts live with it (a LocalDispatcher of its own), also on an attention worker of
the pools, whose target model has no experts: drafting never crosses M2N.
"""
import ctypes
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from kernels import native
from kernels.cpu_linear import PackedLinear
from kernels.int8 import from_panels
from kernels.ops import KernelOps, select_ops
from kernels.rotary import RotaryEmbedding
from kernels.routing import RouterConfig
from models.config import ModelConfig
from models.cpu_inference import pack_modules
from models.dispatcher import LocalDispatcher
from models.kv_cache import AttentionBatch, _padded_table_np
from models.moe_decoder import MLP, DecoderLayer, MoEForCausalLM, SparseMoE
from models.native_decode import MAX_BUFFER_SETS, _Mtp
from models.norm import RMSNorm

OWN_OPTIONAL = ("embed_tokens.weight", "shared_head.head.weight")  # the target's are used where these are absent


def mtp_prefix(cfg: ModelConfig) -> str:
    """The checkpoint name prefix of the (first) MTP layer."""
    return f"model.layers.{cfg.num_layers}."


def check_mtp_checkpoint(model_dir, cfg: ModelConfig, names=None) -> None:
    """ValueError naming the checkpoint unless it ships an MTP layer this module can serve: config.json's
    num_nextn_predict_layers > 0 and the tensors model.layers.{num_hidden_layers}.eh_proj etc. present.
    names: the checkpoint's tensor names (read from the checkpoint when None)."""
    if cfg.num_mtp_layers < 1:
        raise ValueError(f"speculative method mtp needs multi-token-prediction layers, but {model_dir} has none "
                         f"(config.json: num_nextn_predict_layers is 0 or absent for {cfg.architecture}); use "
                         f"method ngram, a checkpoint that ships MTP layers (DeepSeek-V3, GLM-4.5, the built-in "
                         f"model), or train one for it: shuttle train --init-from DIR --mtp-layers 1 --train-only mtp")
    if cfg.linear_layers is not None:
        raise ValueError(f"speculative method mtp is not supported for {cfg.architecture} (linear-attention layers)")
    if names is None:
        from models.checkpoint import CheckpointReader
        names = CheckpointReader.of(model_dir, cfg).files
    prefix = mtp_prefix(cfg)
    need = [prefix + n for n in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")]
    missing = [n for n in need if n not in names]
    if missing:
        raise ValueError(f"speculative method mtp: {model_dir} sets num_nextn_predict_layers = {cfg.num_mtp_layers} "
                         f"in config.json but has no tensor '{missing[0]}' (its MTP layer, {prefix}*, was not saved "
                         f"with the checkpoint)")


def mtp_model_config(cfg: ModelConfig, is_moe: bool, has_indexer: bool = False) -> ModelConfig:
    """cfg with one layer more, the MTP layer (index cfg.num_layers): its per-layer fields extended
    for it (full attention, MoE or dense as the checkpoint's tensors say). The paged cache made from
    it has the MTP layer's KV as its last layer."""
    def more(t, value):
        return None if t is None else tuple(t) + (value,)

    mla = cfg.mla
    if mla is not None and mla.index_topk:
        if not has_indexer:
            raise ValueError("speculative method mtp: this checkpoint's MTP layer has no indexer of its own "
                             "(DeepSeek Sparse Attention reusing another layer's choice is not supported there)")
        mla = replace(mla, index_layers=tuple(mla.index_layers) + (True,))
    return replace(cfg, num_layers=cfg.num_layers + 1, moe_layers=tuple(cfg.moe_layers) + (is_moe,),
                   sliding_windows=tuple(cfg.sliding_windows) + (None,), mla=mla,
                   rope_layers=more(cfg.rope_layers, True), attention_chunks=more(cfg.attention_chunks, None),
                   layer_kv_heads=more(cfg.layer_kv_heads, cfg.num_kv_heads),
                   sink_layers=more(cfg.sink_layers, False), linear_layers=more(cfg.linear_layers, False))


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_head else None


class MTPLayer(DecoderLayer):
    """The MTP layer: a DecoderLayer (index L of `mtp_cfg`, so its attention uses the cache's last
    layer) plus enorm, hnorm, eh_proj and shared_head, named as the checkpoint names them under
    model.layers.{L}. own_embed / own_head: the checkpoint ships embed_tokens / shared_head.head
    (else the target's embedding and LM head are used)."""

    def __init__(self, mtp_cfg: ModelConfig, ops: KernelOps, own_embed: bool = True, own_head: bool = True):
        super().__init__(mtp_cfg, mtp_cfg.num_layers - 1, True, ops)
        D = mtp_cfg.hidden_size
        self.enorm = RMSNorm(D, mtp_cfg.rms_norm_eps, ops)
        self.hnorm = RMSNorm(D, mtp_cfg.rms_norm_eps, ops)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.shared_head = SharedHead(mtp_cfg, ops, own_head)
        self.embed_tokens = nn.Embedding(mtp_cfg.vocab_size, D) if own_embed else None


def _one_expert(layer: MTPLayer, cfg: ModelConfig) -> tuple[ModelConfig, SparseMoE] | None:
    """A dense SwiGLU MLP (bias-free, on bf16 panels) as a MoE layer of one expert that every token takes
    with weight 1 (a router of zeros: softmax over one logit), packed for the fused native block, with its
    config; None for any other MLP. The block rounds where the dense path rounds (gate and up, SiLU, the
    product, the output; weight 1 and one partial sum change nothing), so it differs only in how exp rounds."""
    mlp = layer.mlp
    lins = (getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None), getattr(mlp, "down_proj", None))
    if (not isinstance(mlp, MLP) or not mlp.act.is_silu or not all(
            isinstance(p, PackedLinear) and p.bias is None and p.weight.panels is not None for p in lins)):
        return None
    gate, up, down = (from_panels(p.weight.panels, p.out_features, p.in_features) for p in lins)
    one = replace(cfg, num_experts=1, moe_intermediate_size=gate.shape[0], shared_expert_intermediate_size=0,
                  moe_layers=(True,) * cfg.num_layers, router=RouterConfig(1, weights_fp32=cfg.router.weights_fp32))
    moe = SparseMoE(one, cfg.num_layers - 1, True, select_ops("cpu"))
    moe.gate.weight = nn.Parameter(torch.zeros(1, cfg.hidden_size, dtype=gate.dtype), requires_grad=False)
    moe.experts.w13 = nn.Parameter(torch.cat((gate, up))[None], requires_grad=False)
    moe.experts.w2 = nn.Parameter(down[None], requires_grad=False)
    holder = nn.Module()
    holder.mlp = moe
    pack_modules(holder)
    return one, holder.mlp


class _OneLayer:
    """What models/native_decode.py reads of a model, for the MTP layer alone: a config, the layer (its
    MLP as `mlp`) as the only layer and shared_head's norm as the final norm."""

    def __init__(self, layer: MTPLayer, cfg: ModelConfig, mlp: nn.Module):
        self.cfg = cfg
        view = nn.Module()
        view.self_attn, view.mlp = layer.self_attn, mlp
        view.input_layernorm, view.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.model = nn.Module()
        self.model.layers, self.model.norm = [view], layer.shared_head.norm


@dataclass
class DraftRows:
    """The rows of MTPDrafter.native_drafts' first pass, built by the engine (ModelRunner.mtp_draft): one
    token each, in the order of the target's hidden states they read."""
    ids: list[int]  # the token at each row's position + 1
    hrow: list[int]  # the row's hidden state: its row of the target's step
    positions: list[int]  # its position (its context: the positions before it)
    table_of: list[int]  # its sequence: an index into tables
    tables: list[list[int]]  # the block tables of the sequences with rows
    pick: list[int] = field(default_factory=list)  # per drafting sequence: the row its first draft comes from
    drafting: list[int] = field(default_factory=list)  # ... its index into tables
    last: list[int] = field(default_factory=list)  # ... that row's position
    count: list[int] = field(default_factory=list)  # ... its drafts (a chain stays inside the sequence's blocks)
    owner: list[int] = field(default_factory=list)  # ... the caller's index of it (its place in the batch)
    temperature: list[float] = field(default_factory=list)  # ... 0: greedy drafts, else drawn from q (native_drafts)
    uniforms: list[list[float] | None] = field(default_factory=list)  # ... its draws' uniforms (None: fresh ones)


def load_token_map(path, vocab_size: int) -> torch.Tensor:
    """The token ids a drafter's head is cut to (SGLang's --speculative-token-map, FR-Spec: the frequent
    tokens): a JSON list of ints, or a torch file (.pt) of a 1-D integer tensor or a list. Returned int64,
    ascending (so an argmax over the cut head breaks ties as the full one does: the lowest id). ValueError
    naming the file for anything else: no ids, an id twice or outside the vocabulary."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"speculative_config token_map: no file {path}")
    try:
        if path.suffix == ".pt":
            ids = torch.load(path, map_location="cpu", weights_only=True)
        else:
            ids = json.loads(path.read_text())
        ids = torch.as_tensor(ids)
    except Exception as e:  # (any unreadable content: the message names the file)
        raise ValueError(f"speculative_config token_map {path}: not a JSON list or torch file of token ids ({e})") \
            from None
    if ids.dim() != 1 or not len(ids) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"speculative_config token_map {path}: expected a non-empty list of integer token ids, "
                         f"got {ids.dtype} of shape {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if len(bad):
        raise ValueError(f"speculative_config token_map {path}: token id {int(bad[0])} is outside the model's "
                         f"vocabulary of {vocab_size}")
    ids, counts = ids.unique(sorted=True, return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"speculative_config token_map {path}: token id {int(ids[counts > 1][0])} appears "
                         f"{int(counts.max())} times")
    return ids


class MTPDrafter:
    """An MTP layer beside its target model: `forward` runs it over a flat batch (the paged cache's
    last layer holds its keys and values), `logits` maps its outputs to vocabulary scores,
    `draft_logits` to the scores of the tokens it drafts from: the whole vocabulary, or with a token map
    (draft_ids) a head of those rows only (layer.shared_head.draft_head), whose index j is token
    draft_ids[j] (draft_tokens, full_q map back). After
    `use_native`, batches of one-token rows run the decoder layer as a native decode step of that layer
    alone (models/native_decode.py), as the target's decode steps run, and `native_drafts` runs a
    step's whole chain, heads and draws included, in one native call: at batch 1 in bf16 the eager chain's Python
    and small ops cost more than its kernels (built-in model, k = 3: 1.1 of a 2.7 ms step, 0.5 after)."""

    def __init__(self, layer: MTPLayer, target: MoEForCausalLM, mtp_cfg: ModelConfig,
                 draft_ids: torch.Tensor | None = None):
        """draft_ids: a token map's ids (load_token_map), the rows of the head it drafts with (a copy, made
        here, before the layer is packed: it packs with it); None: the whole head."""
        self.layer, self.target, self.cfg = layer, target, mtp_cfg
        self.draft_ids, self._draft_list = draft_ids, None if draft_ids is None else draft_ids.tolist()
        if draft_ids is not None:
            w = self._full_head().weight.detach()
            cut = nn.Linear(w.shape[1], len(draft_ids), bias=False, device=w.device, dtype=w.dtype)
            cut.weight = nn.Parameter(w[draft_ids.to(w.device)].clone(), requires_grad=False)
            layer.shared_head.draft_head = cut
        self.draft_vocab_size = mtp_cfg.vocab_size if draft_ids is None else len(draft_ids)
        self.dispatcher = LocalDispatcher()
        self._rotary: RotaryEmbedding | None = None
        self.native = None  # models/native_decode.NativeDecode of the layer alone (use_native)
        self._head = None  # (native_drafts) its tables, False where it cannot run
        self._steps = {}  # (native_drafts) (B, A, n): step structure, drafts buffer, index buffer, _Mtp (_pass_step)
        self._native_rows = {}  # (native_drafts) (B, drafts per sequence sorted): whether the native step runs it
        self._native_view = None

    def use_native(self, cache) -> str | None:
        """Run one-token batches over `cache` natively where the layer (packed for the CPU) takes it:
        a MoE layer as it is, a dense MLP as one expert (_one_expert). Returns why not, None where it does."""
        from models.native_decode import NativeDecode, why_not

        cfg, mlp = self.cfg, self.layer.mlp
        if not self.layer.is_moe:
            one = _one_expert(self.layer, cfg)
            if one is None:
                return "a dense MLP other than a bias-free SiLU one on bf16 panels"
            cfg, mlp = one
        view, last = _OneLayer(self.layer, cfg, mlp), self.cfg.num_layers - 1
        reason = why_not(view, cache, True, last)
        self.native = None if reason else NativeDecode(view, cache, True, last)
        self._native_view = view  # (owns the one expert's panels, which the native tables point at)
        return reason

    def embed(self, ids_T: torch.Tensor) -> torch.Tensor:
        if self.layer.embed_tokens is not None:
            return self.layer.embed_tokens(ids_T)
        return self.target.model.embed_tokens(ids_T)

    def forward(self, ids_T: torch.Tensor, h_TD: torch.Tensor, batch: AttentionBatch, cache) -> torch.Tensor:
        """ids_T: the tokens x_{t+1}; h_TD: the hidden states h_t (the target's after its final norm,
        or this layer's own output when chaining); batch: positions t. Returns the layer's output
        (T, D) before shared_head.norm."""
        layer = self.layer
        e_TD = self.embed(ids_T).to(h_TD.dtype)
        x_TD = layer.eh_proj(torch.cat((layer.enorm(e_TD), layer.hnorm(h_TD)), dim=-1))
        cos_sin = self._rotary_of(x_TD.device)(batch.positions_T, x_TD.dtype, batch.kv_lens_B[batch.seq_idx_T])
        if self.native is not None and self.native.mode([(x_TD, batch)], self.dispatcher, cache) == "step":
            return self.native(x_TD, cos_sin, batch, self.dispatcher, before_norm=True)
        h_TD, residual_TD = layer.attention(x_TD, None, cos_sin, cache, batch)
        self.dispatcher.begin_step()
        y_TD = SparseMoE.finish(layer.start_mlp(h_TD, self.dispatcher, 0))
        self.dispatcher.end_step()
        return y_TD + residual_TD

    def native_drafts(self, h_TD: torch.Tensor, cache, rows: DraftRows,
                      block_size: int) -> tuple[list[list[int]], list[torch.Tensor | None]] | None:
        """(drafts, probs): rows.count[a] drafts for drafting sequence a, in one native call (kernels/csrc/
        decode_step.c: shuttle_mtp_draft): the layer over `rows`' one-token rows (the target's hidden states
        h_TD, the rows the step kept), each drafting sequence's first draft from its last row, then chained
        passes of a row for each sequence drafting on, each one position further. The kernels and their
        order are forward's and logits', so greedy drafts are the eager passes' argmaxes. A sequence with
        rows.temperature[a] > 0 draws each draft from q = softmax(logits / temperature) (one uniform a
        draft: rows.uniforms[a]'s, else the global generator's) and probs[a] holds those q rows (count,
        vocab_size) float32, for rejection sampling; None for greedy ones. None where the native step would not run these rows or
        the layer's input projection or head is not on bf16 panels (the caller drafts eagerly)."""
        head = self._native_head()
        B, A, n = len(rows.ids), len(rows.pick), max(rows.count, default=1)  # (A = 0: pass 0 caches, no head)
        # (bf16 q/k/v and o: an int8 / FP8 kernel would depend on each pass's rows, the call keeps pass 0's)
        if (head is None or cache is not self.native.cache or not self.native.local or self.native.layer_by_layer
                or self.native.linears != "bf16"
                or torch.is_grad_enabled() or h_TD.dtype != torch.bfloat16
                or not h_TD.is_contiguous() or self.dispatcher.expert_tokens_E is not None
                or not self._rows_native(B, rows.count)):
            return None
        last = max((a + c - 1 for a, c in zip(rows.last, rows.count)), default=0)  # (the chains' last positions)
        rope = self._rope_tables(max(max(rows.positions), last) + 1)
        if rope is None:
            return None
        step, drafts, idx, m = self._pass_step(B, A, n, head)
        # (the rows' index arrays into the call's int64 buffer, in _Mtp's order: one store, no arrays made)
        idx[:] = (rows.ids + rows.hrow + rows.positions + rows.table_of + rows.pick + rows.drafting + rows.last
                  + rows.count)
        pages = _padded_table_np(rows.tables)
        V = self.draft_vocab_size
        sampled = any(t > 0 for t in rows.temperature)
        m.cos, m.sin, m.h0, m.pages, m.M, m.bs = (rope[0].data_ptr(), rope[1].data_ptr(), h_TD.data_ptr(),
                                                  pages.ctypes.data, pages.shape[1], block_size)
        m.temp = m.u = m.q = None
        if sampled:
            temp = np.asarray(rows.temperature, dtype=np.float32)
            u_An = torch.rand(A, n, dtype=torch.float32)
            for a, u in enumerate(rows.uniforms):
                if u:
                    u_An[a, :min(n, len(u))] = torch.tensor(u[:n], dtype=torch.float32)
            q_AnV = torch.empty(A, n, V, dtype=torch.float32)
            m.temp, m.u, m.q = temp.ctypes.data, u_An.data_ptr(), q_AnV.data_ptr()
        native.mtp_draft(ctypes.byref(step), self.native.layers, ctypes.byref(m), n, drafts.data_ptr())
        probs = [self.full_q(q_AnV[a, :c]) if sampled and rows.temperature[a] > 0 else None
                 for a, c in enumerate(rows.count)]
        return [d[:c] for d, c in zip(drafts.tolist(), rows.count)], probs

    def _rows_native(self, B: int, count: list[int]) -> bool:
        """Whether the native step runs every pass of native_drafts' rows: B in the first, then those
        drafting on (count: each drafting sequence's drafts), and the heads' (kept per row pattern)."""
        key = (B, *sorted(count))
        ok = self._native_rows.get(key)
        if ok is None:
            sizes = {B, len(count), *(sum(c > j for c in count) for j in range(1, max(count, default=1)))} - {0}
            if len(self._native_rows) >= 4 * MAX_BUFFER_SETS:
                self._native_rows.clear()
            ok = self._native_rows[key] = all(self.native.chosen_native(b) for b in sizes)
        return ok

    def _rope_tables(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary float32 cos and sin tables for positions < max_pos (None: "dynamic" scaling has none)."""
        return self._rotary_of("cpu").tables(max_pos)

    def _rotary_of(self, device) -> RotaryEmbedding:
        """The layer's rotary embedding (made on first use, on `device`)."""
        if self._rotary is None:
            self._rotary = RotaryEmbedding(self.cfg.rope, self.cfg.rope_dim, device)
        return self._rotary

    def _pass_step(self, B: int, A: int, n: int, head: tuple) -> tuple:
        """native_drafts' structures for B rows and A drafting sequences of up to n drafts (head: _native_head's tables),
        kept per shape (a verify step keeps 1 to k + 1 rows, and a chain ending in its last block drafts fewer: at batch
        1 and k = 3, 12 shapes, which 8 kept made 17% of the calls rebuild theirs): the step structure (its rows' fields
        are the native call's to fill), the drafts buffer (A, n), the int64 buffer of the rows' indices (4B + 4A: ids,
        hrow, positions, table_of, then pick, drafting, last, count) and the _Mtp pointing into it, its per-call fields
        (rope tables, pages and their width M, block size, hidden states, sampling) left for the call."""
        got = self._steps.get((B, A, n))
        if got is None:
            if len(self._steps) >= 4 * MAX_BUFFER_SETS:
                self._steps.clear()
            D, R = self.cfg.hidden_size, self.cfg.rope_dim
            bf, i64 = torch.bfloat16, torch.int64
            step, t = self.native.step_of(torch.empty(B, D, dtype=bf), torch.empty(B, R, dtype=bf),
                                          torch.empty(B, R, dtype=bf), torch.empty(B, dtype=i64),
                                          torch.empty(B, 1, dtype=i64), torch.empty(B, dtype=i64))
            idx = np.empty(4 * B + 4 * A, dtype=np.int64)
            at = [idx.ctypes.data + 8 * o for o in (0, B, 2 * B, 3 * B, 4 * B, 4 * B + A, 4 * B + 2 * A, 4 * B + 3 * A)]
            embed, eh, head_panels, Vh = head  # (_native_head's)
            layer = self.layer
            m = _Mtp(embed.data_ptr(), layer.enorm.weight.data_ptr(), layer.hnorm.weight.data_ptr(), eh, head_panels,
                     None, None, self.draft_vocab_size, Vh, A, 0, 0, None, *at[:4], None, *at[4:])
            if self.draft_ids is not None:  # (the token map's ids: the native call maps head rows to tokens)
                m.vocab = self.draft_ids.data_ptr()
            got = self._steps[(B, A, n)] = (step, torch.empty(A, n, dtype=i64), idx, m, t)
        return got[:4]

    def _full_head(self) -> nn.Module:
        """The head over the whole vocabulary: the layer's own, else the target's."""
        return self.layer.shared_head.head if self.layer.shared_head.head is not None else self.target.lm_head

    def _draft_head(self) -> nn.Module:
        """The head drafts come from: the token map's rows, else the whole head."""
        return self._full_head() if self.draft_ids is None else self.layer.shared_head.draft_head

    def draft_tokens(self, picks: list[int]) -> list[int]:
        """Token ids of draft_logits' column indices."""
        return picks if self._draft_list is None else [self._draft_list[p] for p in picks]

    def full_q(self, q: torch.Tensor) -> torch.Tensor:
        """Distributions over draft_logits' columns (..., draft_vocab_size) as distributions over the
        vocabulary (..., vocab_size): 0 at the tokens outside the token map."""
        if self.draft_ids is None:
            return q
        out = q.new_zeros(*q.shape[:-1], self.cfg.vocab_size)
        return out.index_copy_(-1, self.draft_ids.to(q.device), q)

    def _native_head(self) -> tuple | None:
        """(embedding table, eh_proj's panels' address, the draft head's panels' address, the head's outputs)
        for native_drafts, or None where a part is not bf16 on panels (or the layer has no native step)."""
        if self._head is None:
            layer = self.layer
            head = self._draft_head()
            embed = (layer.embed_tokens if layer.embed_tokens is not None else self.target.model.embed_tokens).weight
            on_panels = [isinstance(p, PackedLinear) and p.bias is None and getattr(p.weight, "panels", None) is not None
                         and p.weight.panels.dtype == torch.bfloat16 for p in (layer.eh_proj, head)]
            ok = (self.native is not None and all(on_panels) and embed.dtype == torch.bfloat16 and embed.is_contiguous()
                  and layer.enorm.weight.dtype == layer.hnorm.weight.dtype == torch.bfloat16
                  and head.out_features >= self.draft_vocab_size)
            self._head = (embed, layer.eh_proj.weight.panels.data_ptr(), head.weight.panels.data_ptr(),
                          head.out_features) if ok else False
        return self._head or None

    def logits(self, y_TD: torch.Tensor) -> torch.Tensor:
        """float32 (T, V) logits of the next-next token from the layer's outputs."""
        h_TD = self.layer.shared_head.norm(y_TD)
        if self.layer.shared_head.head is not None:
            return self.layer.shared_head.head(h_TD).float()
        return self.target.logits(h_TD)

    def draft_logits(self, y_TD: torch.Tensor) -> torch.Tensor:
        """float32 (T, draft_vocab_size) logits of the tokens drafts come from (column j: token
        draft_tokens([j])): logits' first vocab_size columns, or the token map's head's."""
        if self.draft_ids is None:
            return self.logits(y_TD)[:, :self.cfg.vocab_size]
        return self.layer.shared_head.draft_head(self.layer.shared_head.norm(y_TD)).float()


def load_mtp(model_dir, cfg: ModelConfig, target: MoEForCausalLM, dtype: torch.dtype | None = None,
             device: torch.device | str = "cpu", kernels: str | None = None, token_map=None) -> MTPDrafter:
    """The checkpoint's first MTP layer (model.layers.{num_hidden_layers}.*), in `dtype`, beside the
    loaded `target` (whose embedding and LM head it uses where the checkpoint has none of its own);
    token_map: a file of the token ids it drafts from (load_token_map; None: the whole vocabulary).
    Its tensors are read with the loader's checks (FP8 ones dequantised); ValueError where the
    checkpoint has none (check_mtp_checkpoint)."""
    from models.checkpoint import CheckpointError, CheckpointReader, checkpoint_targets, numel, target_shape
    from models.loader import fill_params, offset_norms

    dtype = dtype or cfg.dtype
    reader = CheckpointReader.of(model_dir, cfg)
    check_mtp_checkpoint(model_dir, cfg, reader.files)
    prefix = mtp_prefix(cfg)
    names = [n for n in reader.files if n.startswith(prefix)]
    is_moe = any(n.startswith(prefix + "mlp.gate.") or n.startswith(prefix + "mlp.experts.")
                 or n.startswith(prefix + "block_sparse_moe.") for n in names)
    mtp_cfg = mtp_model_config(cfg, is_moe, any(".self_attn.indexer." in n for n in names))
    own_embed, own_head = (prefix + OWN_OPTIONAL[0]) in reader.files, (prefix + OWN_OPTIONAL[1]) in reader.files
    ops = select_ops(device, kernels)
    with torch.device("meta"):
        layer = MTPLayer(mtp_cfg, ops, own_embed, own_head).to(dtype)
    params = {prefix + n: p for n, p in layer.named_parameters()}
    wanted, covered = {}, {}
    for name in names:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        targets = checkpoint_targets(name, mtp_cfg)
        if ".shared_expert" in name and not cfg.shared_expert_intermediate_size and reader.is_empty(name):
            continue
        if targets is None or any(t.param not in params for t in targets):
            raise CheckpointError(f"{reader.files[name]}: unexpected tensor '{name}' (no such parameter in the MTP "
                                  f"layer of {cfg.architecture})")
        wanted[name] = targets
        for t in targets:
            shape = target_shape(t, params[t.param].shape)
            covered[t.param] = covered.get(t.param, 0) + numel(shape)
    for pname, p in params.items():
        if covered.get(pname, 0) != p.numel():
            raise CheckpointError(f"{reader.dir}: MTP layer tensor for parameter {pname} is missing or incomplete")
    model_shape = {t: target_shape(t, params[t.param].shape) for ts in wanted.values() for t in ts}
    tensors = reader.read(wanted, model_shape)
    layer.to_empty(device=device)
    params = {prefix + n: p for n, p in layer.named_parameters()}
    fill_params(params, wanted, tensors)
    offset_norms(layer, cfg.norm_offset)
    draft_ids = None if token_map is None else load_token_map(token_map, cfg.vocab_size)
    return MTPDrafter(layer.eval(), target, mtp_cfg, draft_ids)
