"""ModelRunner: the model, its paged KV cache, and one forward pass over a scheduled batch.

An attention worker's compute core. It sees token ids only (never text).
"""
import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from attention_nodes.config import EngineConfig
from attention_nodes.scheduler import ScheduledBatch
from models.config import ModelConfig
from models.dispatcher import Dispatcher, LocalDispatcher
from kernels import native
from kernels.sampling import _inverse_cdf, greedy
from kernels.ops import choose_backend
from kernels.quant import TRITON_QUANTIZATIONS
from models.cpu_inference import (SKINNY_MAX_ROWS, decode_is_native, half_copy_bytes, pack_for_cpu_inference,
                                  pack_modules, resident_weight_bytes)
from models.kv_cache import AttentionBatch, cache_bytes_per_block, make_paged_cache
from models.loader import load_model
from models.native_decode import NativeDecode, why_not
from models.stages import compile_stages

log = logging.getLogger("shuttle")
CPU_DEFAULT_KV_GIB = 2.0
# The MTP layer's pass over prompt chunks runs natively, as one-token rows, while its rows read at most this
# many cached keys in all (key_reads: n c + n (n + 1) / 2 for n rows from context c). Each row reads its keys
# apart, where the eager pass's chunk attention reads them once but costs ~0.4 ms of torch calls; on the
# Zen 5 EPYC (bf16, built-in model) one-token rows were faster for chunks from context 0 up to ~700 rows
# (0.18 against 0.52 ms at 16 rows, 4.4 against 5.1 at 512) and slower from 1024 (12.1 against 11.1).
MTP_NATIVE_KEY_READS = 131072
# A step's prompt chunks run as one-token rows too, the step whole in the native decode step (verification's
# rows, `_prepare`), where the model takes that step and its prompt rows read at most this many cached keys.
PROMPT_ROWS_KEY_READS = 131072
CUDA_MEMORY_FRACTION = 0.85  # of the memory left free after the weights


@dataclass
class PromptLogits:
    """Logits of prompt positions start .. start + count - 1 of the batch's sequence seq_index
    (position p's logits give the logprob of prompt token p + 1). logits_NV: float32 (count, V)."""

    seq_index: int
    start: int
    logits_NV: torch.Tensor | None = None
    count: int = 0

    def __post_init__(self) -> None:
        if self.logits_NV is not None:
            self.count = self.logits_NV.shape[0]


class ModelRunner:
    """dispatcher: where the experts run (None: in this process, the colocated reference; else the
    model is built without experts and an M2NSender reaches the expert workers). micro_batches:
    how many disjoint groups of sequences each step is split into, to ping-pong with the experts."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig | None = None, dispatcher: Dispatcher | None = None,
                 micro_batches: int = 1):
        self.model_cfg = model_cfg or ModelConfig.from_pretrained(cfg.model)
        self.device = torch.device(cfg.device)
        # quantization fp8 of an FP8 checkpoint: its codes and scales as shipped go to the packed modules
        # (CPU with torch kernels: models/cpu_inference.py; Triton: models/triton_quant.py)
        triton = choose_backend(self.device, cfg.kernels) == "triton"
        if triton and cfg.quantization == "fp8":
            from models.triton_quant import check_fp8_runs
            check_fp8_runs(self.device)  # (before loading anything)
        keep_fp8 = cfg.quantization == "fp8" and self.model_cfg.fp8_block is not None and (
            self.device.type == "cpu" or triton)
        # quantization mxfp4 of an MXFP4 checkpoint: its experts' blocks and scales as shipped
        keep_mxfp4 = cfg.quantization == "mxfp4" and self.model_cfg.mxfp4 and (self.device.type == "cpu" or triton)
        if cfg.speculative is not None and cfg.speculative.method == "mtp":  # (before loading anything)
            from models.mtp import check_mtp_checkpoint
            check_mtp_checkpoint(cfg.model, self.model_cfg)
        self.draft_cfg = None  # (method draft_model) the draft checkpoint's config: its cache shares the blocks
        if cfg.speculative is not None and cfg.speculative.method == "draft_model":
            from attention_nodes.draft_model import draft_model_config
            self.draft_cfg = draft_model_config(cfg, self.model_cfg)
        self.model = load_model(cfg.model, self.model_cfg, dtype=cfg.dtype, device=self.device, kernels=cfg.kernels,
                                with_experts=dispatcher is None, keep_fp8=keep_fp8, keep_mxfp4=keep_mxfp4)
        self.model.dispatcher = dispatcher or LocalDispatcher(self.model_cfg.num_experts, self.device)  # counts load
        # speculative method mtp: the checkpoint's MTP layer (models/mtp.py), its experts with it, and the
        # paged cache one layer deeper for its keys and values (cache_cfg: the model config with that layer)
        self.mtp = None
        if cfg.speculative is not None and cfg.speculative.method == "mtp":
            from models.mtp import load_mtp
            self.mtp = load_mtp(cfg.model, self.model_cfg, self.model, dtype=self.model.lm_head.weight.dtype,
                                device=self.device, kernels=cfg.kernels, token_map=cfg.speculative.token_map)
            log.info("speculative decoding: up to %d drafts a step from the MTP layer (model.layers.%d, %s; its keys "
                     "and values in one more KV cache layer)%s", cfg.speculative.num_speculative_tokens,
                     self.model_cfg.num_layers, "MoE" if self.mtp.layer.is_moe else "dense MLP",
                     "" if self.mtp.draft_ids is None else
                     f"; drafting from the {self.mtp.draft_vocab_size} tokens of {cfg.speculative.token_map}")
        self.cache_cfg = self.model_cfg if self.mtp is None else self.mtp.cfg
        # (mtp) a sequence keeping at most this many positions in a step (a decode, or a verify step of
        # 1 + k) runs them through the MTP layer as one-token rows (mtp_draft)
        self.mtp_decode_rows = 0 if self.mtp is None else 1 + cfg.speculative.num_speculative_tokens
        self.last_hidden_TD: torch.Tensor | None = None  # (mtp) the last step's final hidden states, batch order
        self.last_decode_attn: AttentionBatch | None = None  # (mtp) the last step's, where all its rows were one-token
        self.prompt_rows_key_reads = PROMPT_ROWS_KEY_READS  # (prompts_as_rows; the profile times 0 too)
        if not 1 <= micro_batches <= 4:
            raise ValueError(f"micro_batches must be 1 to 4, got {micro_batches}")
        self.micro_batches = micro_batches
        self.num_executed = 0
        self.dtype = self.model.lm_head.weight.dtype
        self.weight_bytes = _weight_bytes(self.model)
        cpu_torch = self.device.type == "cpu" and self.model.ops.backend == "torch"
        self.packed = cpu_torch and pack_for_cpu_inference(self.model, cfg.quantization, cfg.quantize_linears)
        if self.model.ops.backend == "triton" and cfg.quantization in TRITON_QUANTIZATIONS:
            from models.triton_quant import pack_for_triton  # (int8 etc.: experts on CPU workers only)
            pack_for_triton(self.model, cfg.quantization, cfg.quantize_linears)
            if self.mtp is not None:  # (its experts as the target's, its linears unquantised)
                pack_for_triton(self.mtp.layer, cfg.quantization)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the float weights swapped out: free for the KV cache's budget
        if self.packed and self.mtp is not None:  # (its layer on the target's kernels; its linears unquantised)
            pack_modules(self.mtp.layer, cfg.quantization)
        self.resident_bytes = resident_weight_bytes(self.model)  # after packing / quantising
        # What --quantization saved against the unquantised weights: the CPU's default KV budget gets it
        self.freed_bytes = max(0, sum(self.weight_bytes.values()) - sum(self.resident_bytes.values())) \
            if cfg.quantization else 0
        # Under passive OpenMP waits (the pools on one host) a decode step whose heavy work is all
        # native keeps torch's small ops on one thread: each would wake the pool (native.py).
        self.narrow_decode = self.packed and native.passive_waits() and decode_is_native(self.model)
        # The CPU's torch ops run one dispatch per small op: compile their chains once, now (on
        # CUDA the Triton kernels are already fused).
        self.compiled = cpu_torch and not cfg.enforce_eager
        if self.compiled:
            compile_stages(self.model)
        self.block_size = cfg.cache.block_size
        self.kv_from_freed = 0  # of the KV budget (_num_blocks)
        # linear-attention layers (Qwen3-Next): a state per running sequence, taken from the KV budget
        self.state_slots = cfg.scheduler.max_num_seqs if self.model_cfg.has_sequence_state else 0
        self.state_bytes = self.state_slots * self.model_cfg.state_bytes_per_sequence(self.dtype)
        self.num_blocks = self._num_blocks(cfg)
        self.cache = make_paged_cache(self.cache_cfg, self.num_blocks, self.block_size, self.dtype, self.device,
                                      self.model.ops, self.state_slots)
        self.drafter = None  # (method draft_model) attention_nodes/draft_model.py, over the same block tables
        if self.draft_cfg is not None:
            from attention_nodes.draft_model import DraftModel, draft_engine_config
            self.drafter = DraftModel(ModelRunner(draft_engine_config(cfg, self.num_blocks), self.draft_cfg), cfg)
        # A bf16 decode step's layers as native calls, where the model takes it: colocated the whole
        # step in one, on an attention worker each layer's attention side (models/native_decode.py)
        if self.packed and cfg.native_decode:
            self.model.native_decode = NativeDecode.build(self.model, self.cache, local=dispatcher is None)
            log.info("native decode: %s", ("each step's layers in one call" if dispatcher is None else
                                           "each layer's attention side in one call")
                     if self.model.native_decode else f"off ({why_not(self.model, self.cache, dispatcher is None)})")
            if self.mtp is not None:
                why = self.mtp.use_native(self.cache)
                log.info("native decode of the MTP layer: %s",
                         f"off ({why})" if why else "its one-token passes in one call")
        log.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB%s, %d bytes per token%s), kernels: %s%s",
                 self.num_blocks, self.block_size, self.num_blocks * self.block_size,
                 self.num_blocks * self._block_bytes() / 2 ** 30,
                 f"; {_size(self.kv_from_freed)} of it freed by {cfg.quantization} weights" if self.kv_from_freed else "",
                 self.cache_cfg.kv_bytes_per_token(self.dtype),
                 ": MLA latents" if self.model_cfg.mla else "", self.model.ops.backend,
                 "" if not self.packed else " (weights packed for oneDNN" + (
                     f"; bf16 copies for up to {SKINNY_MAX_ROWS} rows, {half / 2 ** 30:.2f} GiB)"
                     if (half := half_copy_bytes(self.model)) else ")"))
        if self.state_slots:
            c = self.model_cfg
            log.info("per-sequence state: %d sequences x %s = %s (%s)", self.state_slots,
                     _size(c.state_bytes_per_sequence(self.dtype)), _size(self.state_bytes),
                     "DeepSeek-V4's sliding windows and pending compressor rows" if c.v4 is not None
                     else f"linear attention, {c.num_linear_layers} of {c.num_layers} layers")
        r = self.resident_bytes
        log.info("weights: %s resident (experts %s%s, embedding %s, other %s)", _size(sum(r.values())),
                 _size(r["experts"]), f" {cfg.quantization}" if cfg.quantization and r["experts"] else "",
                 _size(r["embedding"]), _size(r["other"]) + (f" {cfg.quantization}" if cfg.quantize_linears else ""))

    def _block_bytes(self) -> int:
        """A block's bytes in this cache and, with a draft model, in its cache too."""
        draft = 0 if self.draft_cfg is None else cache_bytes_per_block(self.draft_cfg, self.block_size, self.dtype)
        return cache_bytes_per_block(self.cache_cfg, self.block_size, self.dtype) + draft

    def _num_blocks(self, cfg: EngineConfig) -> int:
        """cache.num_blocks, else cache.kv_cache_gib, else (CPU) enough for every sequence at full
        context capped at 2 GiB plus what quantising the weights freed (the same memory as the
        unquantised model's weights and cache), or (CUDA) a fraction of the free memory (which the
        freed bytes are part of). The linear-attention states come out of an explicit or CUDA
        budget, and on top of the CPU's default one."""
        if cfg.cache.num_blocks is not None:
            return cfg.cache.num_blocks
        per_block = self._block_bytes()
        if cfg.cache.kv_cache_gib is not None:
            budget = cfg.cache.kv_cache_gib * 2 ** 30
        elif self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] * CUDA_MEMORY_FRACTION
        else:
            full = cfg.scheduler.max_num_seqs * -(-self.model_cfg.max_model_len // self.block_size) * per_block
            budget = min(full, CPU_DEFAULT_KV_GIB * 2 ** 30 + self.freed_bytes)
            self.kv_from_freed = int(max(0, budget - CPU_DEFAULT_KV_GIB * 2 ** 30))
            budget += self.state_bytes  # (the states come on top of the default KV budget)
        blocks = int((budget - self.state_bytes) // per_block)
        if blocks < 1:
            raise ValueError(f"the KV cache budget of {budget / 2 ** 30:.3f} GiB holds no block of {per_block} bytes"
                             + (f" beside the linear-attention states ({_size(self.state_bytes)})"
                                if self.state_bytes else ""))
        return blocks

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[PromptLogits]]:
        """Compute the batch's scheduled tokens. Returns float32 logits (R, V) of the last token of
        each sequence whose batch.sample flag is set (of its last d + 1 with d drafts), in batch order, and the logits of the prompt
        positions of this step for the sequences that need their prompt's logprobs."""
        with self.decode_threads(batch.num_new_tokens):
            groups = split_micro_batches(batch.num_new_tokens, self.micro_batches)
            rows_each = self.prompts_as_rows(batch, groups)
            inputs = [None if not group else self._prepare(batch, group, rows_each) for group in groups]
            # Each micro-batch's LM head runs as soon as its last layer is combined (overlapping the
            # experts of the next micro-batch's last layer).
            hidden = [None] * len(inputs)
            logits = self._forward(inputs, self._head(inputs, hidden))
        if self.mtp is not None:  # every computed row's hidden state, for the MTP layer (mtp_draft)
            hidden = [h for h in hidden if h is not None]
            self.last_hidden_TD = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
            # and, for a step of one-token rows in one micro-batch, their attention batch: the MTP
            # layer's first pass runs over some of those very rows
            attn = inputs[0][1] if len(inputs) == 1 and inputs[0] is not None else None
            self.last_decode_attn = attn if attn is not None and attn.max_q_len == 1 and attn.parts is None else None
        sampled, prompt = [], []
        for lg, inp in zip(logits, inputs):
            if inp is None:
                continue
            n_sampled = len(inp[2]) - sum(span.count for span in inp[3])
            sampled.append(lg[:n_sampled])
            offset = n_sampled
            for span in inp[3]:
                prompt.append(PromptLogits(span.seq_index, span.start, lg[offset:offset + span.count]))
                offset += span.count
        return (sampled[0] if len(sampled) == 1 else torch.cat(sampled)), prompt  # one: no copy of rows x vocab

    def decode_threads(self, num_new_tokens: list[int]):
        """The threads a step with these new tokens per sequence runs on: under passive waits a
        decode-only step of a model whose heavy work is native keeps torch on one thread
        (native.native_parallel_only), unless attention's measured choice at this batch is torch's
        (kernels/choice.py); otherwise unchanged."""
        return native.native_parallel_only(self.narrow_decode and max(num_new_tokens) == 1
                                           and native.runs_native("attention", len(num_new_tokens)))

    def logits(self, h_TD: torch.Tensor) -> torch.Tensor:
        """The LM head of these rows on every thread, also inside decode_threads: the cast of rows x
        vocabulary logits is worth both threads."""
        with native.torch_parallel():
            return self.model.logits(h_TD)

    @torch.inference_mode()
    def last_logits(self, ids: list[int], q_lens: list[int], ctx_lens: list[int], tables: list) -> torch.Tensor:
        """Logits (B, V) of each sequence's last row after computing q_lens[b] tokens (ids, in order)
        at positions ctx_lens[b].. over block table tables[b] (a draft model's pass: attention_nodes/
        draft_model.py). Each one-token sequence is a decode row, so decode passes take the native step."""
        attn = AttentionBatch.build_paged(q_lens, ctx_lens, tables, self.block_size, self.device)
        rows = (torch.tensor(q_lens).cumsum(0) - 1).to(self.device)
        inputs = [(torch.tensor(ids, dtype=torch.long, device=self.device), attn, rows, [])]
        with self.decode_threads(q_lens):
            return self._forward(inputs, self._head(inputs))[0]

    def _head(self, inputs: list, hidden: list | None = None):
        def head(i: int, h_TD: torch.Tensor) -> torch.Tensor:
            if hidden is not None and self.mtp is not None:
                hidden[i] = h_TD
            return self.logits(h_TD[inputs[i][2]])
        return head

    @torch.inference_mode()
    def mtp_draft(self, batch: ScheduledBatch, starts: list[int], num_drafts: list[int],
                  temperatures: list[float | None] | None = None,
                  uniforms: list[list[float] | None] | None = None) -> tuple[list[list[int]], list]:
        """After a step (sampled and verified): run the MTP layer over the positions each sequence of
        `batch` computed and kept, so its keys and values of those positions are cached, and propose
        drafts: in one native call where MTPDrafter.native_drafts takes the rows, else as torch modules
        (_eager_drafts), the same kernels in the same order. starts[b]: batch.seqs[b].num_computed_tokens before the step; num_drafts[b]:
        drafts wanted (0: only cache the MTP layer's keys and values; < 0: skip the sequence, e.g.
        finished). Position p's row combines the target's hidden state at p with token p + 1 (known
        now: the prompt's, or the one just sampled); the last kept position's output gives the first
        draft, and draft j + 1 comes from the layer run again at the next position on its own output
        and draft j (only where the sequence's blocks already hold that position: a chain stops at
        the end of its last block). A sequence that kept at most mtp_decode_rows positions (a decode
        or a verify step) runs them as one-token rows over its blocks, as verification does
        (`_prepare`), so the pass is a decode batch; a prompt chunk runs as one chunk in the eager
        pass, as one-token rows in the native call (while they read at most MTP_NATIVE_KEY_READS
        cached keys in all, else eagerly). A chained
        position in the page of the one before reuses that batch, each token one slot further.
        Drafted positions' entries are overwritten when those positions are kept: every kept
        position is run here once, in order, after every position before it.
        temperatures[b]: draw sequence b's drafts from q = softmax(logits / T) instead of the argmax (None:
        greedy): draft j where the running sum of q first passes uniforms[b][j] (None: fresh uniforms
        of the global generator). Returns (drafts, probs): probs[b] the q rows (d, V) of b's drafts, or
        None for greedy ones (point masses; speculative.rejection_sample verifies both exactly)."""
        rows, eager = self._draft_rows(batch, starts, num_drafts, temperatures, uniforms)
        drafts, probs = [[] for _ in batch.seqs], [None] * len(batch.seqs)
        got = None if self.mtp.native is None or eager or not rows.ids else self.mtp.native_drafts(
            self.last_hidden_TD, self.cache, rows, self.block_size)
        if got is None and rows.ids:
            got = self._eager_drafts(rows)
        for b, d, q in zip(rows.owner, *(got or ((), ()))):
            drafts[b], probs[b] = d, q
        return drafts, probs

    def _eager_drafts(self, rows: "DraftRows") -> tuple[list[list[int]], list]:
        """mtp_draft's passes as torch modules (MTPDrafter.forward and logits): the first over every row
        (the step's decode rows where those are the rows, one-token rows or a chunk per sequence), then
        each drafting sequence's chain; (drafts, q rows or None) per drafting sequence, as native_drafts."""
        mtp, bs, device = self.mtp, self.block_size, self.device
        q_lens, ctx, rows_table, first = [], [], [], 0
        for s, run in itertools.groupby(rows.table_of):  # (a sequence's rows: consecutive, from its first position)
            n = len(list(run))
            add_rows(q_lens, ctx, rows_table, rows.positions[first], n, rows.tables[s], n <= self.mtp_decode_rows)
            first += n
        h_TD, step_attn = self.last_hidden_TD, self.last_decode_attn
        kept_rows = None if len(rows.ids) == h_TD.shape[0] else torch.tensor(rows.hrow, device=device)
        if kept_rows is not None:
            h_TD = h_TD[kept_rows]
        if step_attn is not None and all(q == 1 for q in q_lens):  # (the step's rows, or some of them)
            attn = step_attn if kept_rows is None else step_attn.decode_rows(kept_rows, max(ctx) + 1)
        else:
            attn = AttentionBatch.build_paged(q_lens, ctx, rows_table, bs, device)
        y_TD = mtp.forward(torch.tensor(rows.ids, dtype=torch.long, device=device), h_TD, attn, self.cache)
        A = len(rows.pick)
        drafts: list[list[int]] = [[] for _ in range(A)]
        probs: list = [[] if t > 0 else None for t in rows.temperature]
        active = list(range(A))
        y_AD = y_TD if A == y_TD.shape[0] else y_TD[torch.tensor(rows.pick, dtype=torch.long, device=device)]
        attn, j = None, 0  # attn: the last chained batch
        while active:
            if j:  # chained: at position last + j, on the layer's previous output and the previous draft
                if attn is not None and all((rows.last[a] + j) % bs for a in active):
                    attn = attn.next_slots()
                else:
                    attn = AttentionBatch.build_paged([1] * len(active), [rows.last[a] + j for a in active],
                                                      [rows.tables[rows.drafting[a]] for a in active], bs, device)
                toks = torch.tensor([drafts[a][-1] for a in active], dtype=torch.long, device=device)
                y_AD = mtp.forward(toks, y_AD, attn, self.cache)
            logits_AV = mtp.draft_logits(y_AD)  # (V: the token map's tokens where there is one)
            picks = greedy(logits_AV).tolist()
            for r, a in enumerate(active):
                if probs[a] is not None:  # (a sampled request's draft: drawn from q, q kept for verification)
                    q_V = torch.softmax(logits_AV[r].float() / rows.temperature[a], dim=-1)
                    u = rows.uniforms[a][j] if rows.uniforms[a] else torch.rand(()).item()
                    picks[r] = int(_inverse_cdf(q_V.cumsum(0)[None], torch.tensor([u]))[0])
                    probs[a].append(mtp.full_q(q_V))
                drafts[a].append(mtp.draft_tokens([picks[r]])[0])
            j += 1
            more = [r for r, a in enumerate(active) if rows.count[a] > j]  # (a chain ends at its block's end)
            if len(more) < len(active):
                active, y_AD, attn = [active[r] for r in more], y_AD[torch.tensor(more, dtype=torch.long,
                                                                                  device=device)], None
        return drafts, [None if p is None else torch.stack(p) for p in probs]

    @torch.inference_mode()
    def idle_step(self) -> None:
        """Take part in a step with no sequences (attention workers run steps in lock-step)."""
        self._forward([None] * self.micro_batches)

    def _forward(self, inputs: list, head=None) -> list[torch.Tensor]:
        dispatcher = self.model.dispatcher
        dispatcher.begin_step()
        try:
            return self.model.forward_micro_batches([None if i is None else i[:2] for i in inputs], self.cache, head)
        finally:
            dispatcher.end_step()
            self.num_executed += 1

    def prompts_as_rows(self, batch: ScheduledBatch, groups: list[range] | None = None) -> bool:
        """Whether the step's prompt chunks run as one-token rows (`_prepare`), so that the native decode
        step takes the whole step: where the model has that step, the rows of every micro-batch (groups:
        split_micro_batches') are a size it runs natively (NativeDecode.chosen_native), and the chunks'
        rows read at most prompt_rows_key_reads cached keys in all (each row reads its context apart,
        where a chunk's attention reads it once)."""
        nd = self.model.native_decode
        if nd is None or self.state_slots or max(batch.num_new_tokens, default=1) == 1:
            return False
        reads = prompt_key_reads(batch.seqs, batch.num_new_tokens)
        groups = split_micro_batches(batch.num_new_tokens, self.micro_batches) if groups is None else groups
        return 0 < reads <= self.prompt_rows_key_reads and all(
            nd.chosen_native(sum(batch.num_new_tokens[g.start:g.stop])) for g in groups if g)

    def _prepare(self, batch: ScheduledBatch, group: range,
                 rows_each: bool = False) -> tuple[torch.Tensor, AttentionBatch, torch.Tensor, list]:
        """(input ids, AttentionBatch, rows to compute logits of, prompt spans) of the sequences
        `group` of the batch: the rows are the sampled sequences' last tokens (with d speculative
        drafts, the last d + 1), then the prompt positions of each PromptLogits span (sequences that
        need their prompt's logprobs). rows_each: prompt chunks as one-token rows too (prompts_as_rows)."""
        seqs, q_lens = batch.seqs[group.start:group.stop], batch.num_new_tokens[group.start:group.stop]
        ids, spans, offset = [], [], 0
        firsts, counts = [], []  # the logits rows: spans of the sampled sequences' last 1 + d positions
        prompt_firsts, prompt_counts = [], []  # then those of the prompt spans
        rows_q, rows_ctx, rows_table = [], [], []  # the attention batch's sequences
        state_slots = [] if self.state_slots else None  # (linear-attention layers; no drafts there)
        for i, (seq, n, sampled) in enumerate(zip(seqs, q_lens, batch.sample[group.start:group.stop])):
            c = seq.num_computed_tokens
            # (verifying drafts, or rows_each: each token a decode row of its own, below)
            add_rows(rows_q, rows_ctx, rows_table, c, n, seq.block_table, rows_each or bool(seq.num_draft_tokens))
            ids.extend(seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n])
            if sampled:  # its last token's logits (with d drafts, its last d + 1 positions', in order)
                firsts.append(offset + n - 1 - seq.num_draft_tokens)
                counts.append(1 + seq.num_draft_tokens)
            if self.state_slots:
                state_slots.append(seq.state_slot)
            if seq.needs_prompt_logprobs:  # positions whose next token is a prompt token
                start = max(seq.num_computed_tokens, seq.num_prompt_logprobs)
                count = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1) - start
                if count > 0:
                    spans.append(PromptLogits(group.start + i, start, count=count))
                    prompt_firsts.append(offset + start - seq.num_computed_tokens)
                    prompt_counts.append(count)
            offset += n
        # A sequence's 1 + d tokens of a speculative step (or n of a prompt chunk, rows_each) are one-token
        # rows over its blocks with contexts c .. c + d: every token's key and value is cached before any
        # row attends, so each sees the ones before it, as causal attention over them would, and the step
        # is a decode step (the native decode kernels and step take it) rather than a prefill chunk.
        attn = AttentionBatch.build_paged(rows_q, rows_ctx, rows_table, self.block_size, self.device, state_slots)
        rows = row_spans(firsts + prompt_firsts, counts + prompt_counts)
        return torch.tensor(ids, dtype=torch.long, device=self.device), attn, rows.to(self.device), spans

    def _draft_rows(self, batch: ScheduledBatch, starts: list[int], num_drafts: list[int],
                    temperatures: list[float | None] | None,
                    uniforms: list[list[float] | None] | None) -> tuple["DraftRows", bool]:
        """mtp_draft's rows (every position a sequence kept, in the order of the step's hidden states)
        and its drafting sequences, as MTPDrafter.native_drafts takes them; and whether only the eager
        passes should take them: prompt chunks (a sequence keeping more than mtp_decode_rows positions)
        whose one-token rows would read more than MTP_NATIVE_KEY_READS cached keys in all."""
        from models.mtp import DraftRows

        rows, bs, offset, chunked, reads = DraftRows([], [], [], [], []), self.block_size, 0, False, 0
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            c, want = starts[b], num_drafts[b]
            kept = kept_positions(seq, c, n)
            if want >= 0 and kept > 0:
                chunked |= kept > self.mtp_decode_rows
                reads += key_reads(kept, c)
                rows.ids += seq.token_ids[c + 1:c + 1 + kept]
                rows.hrow += range(offset, offset + kept)
                rows.positions += range(c, c + kept)
                rows.table_of += [len(rows.tables)] * kept
                if want > 0:  # (draft j at position c + kept - 1 + j, inside the sequence's blocks)
                    rows.count.append(min(want, len(seq.block_table) * bs - (c + kept - 1)))
                    rows.pick.append(len(rows.ids) - 1)
                    rows.drafting.append(len(rows.tables))
                    rows.last.append(c + kept - 1)
                    rows.owner.append(b)
                    rows.temperature.append((temperatures[b] or 0.0) if temperatures else 0.0)
                    rows.uniforms.append(uniforms[b] if uniforms else None)
                rows.tables.append(seq.block_table)
            offset += n
        return rows, chunked and reads > MTP_NATIVE_KEY_READS


def key_reads(n: int, context: int) -> int:
    """Cached keys n new tokens after `context` positions read in all, causally (the i-th reads context
    + i + 1): n context + n (n + 1) / 2."""
    return n * context + n * (n + 1) // 2


def is_prompt_chunk(seq, n: int) -> bool:
    """Whether a sequence's n new tokens of a step are a prompt chunk: more than one, none of them drafts
    to verify."""
    return n > 1 and not seq.num_draft_tokens


def prompt_key_reads(seqs, num_new_tokens: list[int]) -> int:
    """Cached keys the prompt chunks of a step read as one-token rows (key_reads; verifications' rows not
    counted: they are rows whatever the choice)."""
    return sum(key_reads(n, seq.num_computed_tokens) for seq, n in zip(seqs, num_new_tokens) if is_prompt_chunk(seq, n))


def kept_positions(seq, start: int, n: int) -> int:
    """Of the n positions a step computed from `start`, those the step kept and whose next token is
    known (the MTP layer's rows after the step: ModelRunner.mtp_draft)."""
    return min(seq.num_computed_tokens - start, len(seq.token_ids) - 1 - start, n)


def add_rows(q_lens: list[int], ctx: list[int], tables: list, c: int, n: int, table: list[int], one_each: bool) -> None:
    """Append a sequence's n tokens from position c to an attention batch's rows: one row of n, or
    (one_each) n one-token decode rows with contexts c .. c + n - 1 over the same blocks."""
    if one_each:
        q_lens += [1] * n
        ctx += range(c, c + n)
        tables += [table] * n
    else:
        q_lens.append(n)
        ctx.append(c)
        tables.append(table)


def row_spans(firsts: list[int], counts: list[int]) -> torch.Tensor:
    """int64 indices firsts[i] .. firsts[i] + counts[i] - 1 of each span in turn (numpy: no op per span)."""
    counts_S = np.asarray(counts, dtype=np.int64)
    starts_S = np.asarray(firsts, dtype=np.int64) - np.cumsum(counts_S) + counts_S
    return torch.from_numpy(np.repeat(starts_S, counts_S) + np.arange(counts_S.sum()))


def split_micro_batches(num_tokens: list[int], m: int) -> list[range]:
    """Split sequences (in order) into m contiguous groups of about equal token counts; groups may
    be empty when there are fewer sequences than m."""
    total, groups, start, acc = sum(num_tokens), [], 0, 0
    for i in range(m):
        end = start
        target = total * (i + 1) / m
        while end < len(num_tokens) and (i == m - 1 or acc + num_tokens[end] / 2 <= target):
            acc += num_tokens[end]
            end += 1
        groups.append(range(start, end))
        start = end
    return groups


def _size(nbytes: int) -> str:
    """Bytes for a log line: GiB from 1 GiB, else MiB."""
    return f"{nbytes / 2 ** 30:.2f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:.1f} MiB"


def _weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the embedding table, the experts and everything else (before any packing)."""
    out = {"embedding": 0, "experts": 0, "other": 0}
    for name, p in model.named_parameters():
        kind = "embedding" if "embed_tokens" in name else "experts" if ".experts." in name else "other"
        out[kind] += p.numel() * p.element_size()
    return out
