"""Draft-model speculation (vLLM's method "draft_model"): a smaller checkpoint proposes each
sequence's drafts, which the target verifies as it verifies every other draft (engine._sample).

    --speculative-config '{"method": "draft_model", "model": "DRAFT_DIR", "num_speculative_tokens": 3}'

The draft model runs in the engine's process (colocated, or on each attention worker in pools) with
its experts, on a `ModelRunner` of its own whose paged cache has the target's block size and block
count: a sequence's block table addresses both caches, so the draft model needs no blocks of its own
and frees nothing (the target's budget pays for both; model_runner counts the draft's bytes per block).

A sequence's `draft_pos` counts the positions whose draft keys and values were computed from its own
tokens. Before a step, each sequence to draft for runs the positions from there to its last token
(its whole prompt the first time, else the one or few tokens the last step kept) and takes the argmax
of the last row; then each further draft is one decode row fed the previous draft. Rejected drafts
leave their positions' entries behind: the next call recomputes from min(draft_pos, the target's
computed positions), so every position is rewritten with the token the sequence kept (after a
preemption that is 0: the blocks were given back). A chain stops where the sequence's blocks end,
as MTP's does (the scheduler gives blocks to the drafted tokens only after they are proposed).
Drafts are argmax point masses for every request: rejection sampling verifies them exactly, so
sampled and seeded requests keep the target's distribution.
"""
import logging
from dataclasses import replace

import torch

from attention_nodes.config import EngineConfig
from kernels.sampling import greedy
from models.config import ModelConfig
from models.errors import ConfigError

log = logging.getLogger("shuttle")


def draft_model_config(cfg: EngineConfig, target: ModelConfig) -> ModelConfig:
    """The draft checkpoint's config, checked against the target's: ConfigError naming the draft
    where its token ids could mean something else or its state cannot roll back."""
    path = cfg.speculative.model
    draft = ModelConfig.from_pretrained(path)
    if draft.vocab_size > target.vocab_size:
        raise ConfigError(f"speculative_config model {path}: its vocabulary ({draft.vocab_size} tokens) is larger "
                          f"than the target's ({target.vocab_size}); a draft model must share the target's tokenizer")
    if draft.has_sequence_state:
        raise ConfigError(f"speculative_config model {path}: {draft.architecture} keeps per-sequence state that "
                          "rejected drafts would change; choose a draft model with attention layers only")
    return draft


def draft_engine_config(cfg: EngineConfig, num_blocks: int) -> EngineConfig:
    """The draft model's runner's config: the target's, on the draft checkpoint, without speculation,
    with the target cache's block count (which its cache mirrors)."""
    return replace(cfg, model=cfg.speculative.model, speculative=None,
                   cache=replace(cfg.cache, num_blocks=num_blocks, kv_cache_gib=None))


class DraftModel:
    """The draft model of one engine: `runner` (a ModelRunner on draft_engine_config) and its config."""

    def __init__(self, runner, cfg: EngineConfig):
        spec, draft_cfg = cfg.speculative, runner.model_cfg
        self.runner, self.block_size, self.vocab_size = runner, cfg.cache.block_size, draft_cfg.vocab_size
        log.info("speculative decoding: up to %d drafts a step from the draft model %s (%s, %d layers)",
                 spec.num_speculative_tokens, spec.model, draft_cfg.architecture, draft_cfg.num_layers)

    @torch.inference_mode()
    def propose(self, seqs: list, wanted: list[int]) -> list[list[int]]:
        """Drafts for each sequence (about to decode: all but its last token computed by the target),
        up to wanted[b] each (0: none)."""
        bs, drafts = self.block_size, [[] for _ in seqs]
        ids, q_lens, ctx, tables, who = [], [], [], [], []
        for b, (seq, n) in enumerate(zip(seqs, wanted)):
            last = seq.num_tokens - 1
            if n <= 0 or last >= len(seq.block_table) * bs:  # (its last token has no slot yet)
                continue
            start = min(seq.draft_pos, seq.num_computed_tokens)
            ids += seq.token_ids[start:last + 1]
            q_lens.append(last + 1 - start)
            ctx.append(start)
            tables.append(seq.block_table)
            who.append(b)
        j = 0
        while who:
            toks = greedy(self.runner.last_logits(ids, q_lens, ctx, tables)[:, :self.vocab_size]).tolist()
            more = []
            for r, b in enumerate(who):
                seq = seqs[b]
                drafts[b].append(toks[r])
                seq.draft_pos = seq.num_tokens + j  # positions up to the one just fed are computed
                if len(drafts[b]) < wanted[b] and seq.num_tokens + j < len(seq.block_table) * bs:
                    more.append(r)
            ids = [toks[r] for r in more]
            ctx = [seqs[who[r]].num_tokens + j for r in more]
            tables = [seqs[who[r]].block_table for r in more]
            q_lens, who, j = [1] * len(more), [who[r] for r in more], j + 1
        return drafts
