"""Sampler: turns one step's sequences into tensors once and picks their next tokens.

Per step, as vLLM: raw logits (logprobs are taken from these) -> min_tokens bans -> logit_bias -> penalties -> grammar masks (structured outputs) ->
greedy argmax, or temperature -> top-k / min-p / top-p -> draw. Work no row needs is skipped: no
penalty tensors when every row is neutral, argmax only for an all-greedy batch, no sort without
a filter, no logprobs unless a row asked.

Legend: B rows (one per sampled sequence), V vocabulary (valid ids only), L top alternatives.
"""
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attention_nodes.sampling_params import SamplingParams
from attention_nodes.structured import apply_grammar_masks
from kernels.sampling import apply_penalties, compute_logprobs, sample, token_counts


@dataclass
class SamplingRow:
    """One sequence of the step. generator: the request's seeded torch.Generator on the logits'
    device, or None to draw from the global one."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: Sequence[int]  # generated so far (penalties, min_tokens): a list or a TokenSpan view
    generator: torch.Generator | None = None
    grammar: object | None = None  # xgrammar GrammarMatcher: only tokens it allows may be picked


@dataclass
class SamplerOutput:
    """What the step picked. logprobs, ranks and top_logprobs are None when no row asked for
    logprobs; otherwise logprobs and ranks hold one value per row (rank 1 is the most likely) and
    top_logprobs per row its params.logprobs best (id, logprob), [] for rows that did not ask.
    Logprobs are those of the raw logits (before penalties and temperature)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Sampler:
    """Picks the next token of each row from the model's logits (see the module docstring).

    vocab_size: number of valid ids; logits columns beyond it (a padded LM head) are never sampled
    nor counted in logprobs. eos_token_ids: ids banned while a row is under its min_tokens (unless
    it ignores eos).
    """

    def __init__(self, vocab_size: int, eos_token_ids: set[int]) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(i for i in eos_token_ids if 0 <= i < vocab_size)

    @torch.inference_mode()
    def __call__(self, logits_BV: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits_BV: (B, >= vocab_size) float logits, row b for rows[b]. Seeded rows draw only from
        their generator, so their tokens do not depend on the rest of the batch."""
        if logits_BV.dim() != 2 or logits_BV.shape[0] != len(rows) or logits_BV.shape[1] < self.vocab_size:
            raise ValueError(f"logits must be ({len(rows)}, >= {self.vocab_size}) for {len(rows)} rows, "
                             f"got {tuple(logits_BV.shape)}")
        raw_BV = logits_BV[:, :self.vocab_size].float()
        logits_BV = self._penalise(self._bias(self._ban_early_stops(raw_BV, rows), rows), rows)
        if any(r.grammar is not None for r in rows):
            if logits_BV is raw_BV:  # masked in place: keep the raw logits for logprobs
                logits_BV = logits_BV.clone()
            apply_grammar_masks(logits_BV, [r.grammar for r in rows], self.vocab_size)
        token_ids_B = self._pick(logits_BV, rows)
        return self._output(raw_BV, token_ids_B, rows)

    def _ban_early_stops(self, logits_BV: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """-inf on eos (unless ignore_eos) and stop_token_ids of rows still under min_tokens."""
        row_idx, tok_idx = [], []
        for b, row in enumerate(rows):
            if len(row.output_token_ids) >= row.params.min_tokens:
                continue
            banned = set(row.params.stop_token_ids) | (set() if row.params.ignore_eos else set(self.eos_token_ids))
            banned = [t for t in banned if 0 <= t < self.vocab_size]
            row_idx += [b] * len(banned)
            tok_idx += banned
        if not row_idx:
            return logits_BV
        device = logits_BV.device
        return logits_BV.index_put((torch.tensor(row_idx, device=device), torch.tensor(tok_idx, device=device)),
                                   torch.tensor(float("-inf"), device=device))

    def _bias(self, logits_BV: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Add each row's logit_bias (one index_put over the whole batch)."""
        row_idx, tok_idx, values = [], [], []
        for b, row in enumerate(rows):
            for tok, bias in (row.params.logit_bias or {}).items():
                if tok < self.vocab_size:
                    row_idx.append(b)
                    tok_idx.append(tok)
                    values.append(bias)
        if not row_idx:
            return logits_BV
        device = logits_BV.device
        return logits_BV.index_put((torch.tensor(row_idx, device=device), torch.tensor(tok_idx, device=device)),
                                   torch.tensor(values, dtype=logits_BV.dtype, device=device), accumulate=True)

    def _penalise(self, logits_BV: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Apply presence / frequency / repetition penalties to the rows whose values are not neutral."""
        idx = [b for b, r in enumerate(rows) if r.params.presence_penalty != 0 or r.params.frequency_penalty != 0
               or r.params.repetition_penalty != 1]
        if not idx:
            return logits_BV
        device, chosen = logits_BV.device, [rows[b] for b in idx]
        output_counts_RV = token_counts([list(r.output_token_ids) for r in chosen], self.vocab_size, device)
        if any(r.params.repetition_penalty != 1 for r in chosen):
            prompt_mask_RV = token_counts([r.prompt_token_ids for r in chosen], self.vocab_size, device) > 0
        else:
            prompt_mask_RV = torch.zeros_like(output_counts_RV, dtype=torch.bool)

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(r.params, name) for r in chosen], dtype=torch.float32, device=device)

        idx_R = torch.tensor(idx, device=device)
        penalised_RV = apply_penalties(logits_BV[idx_R], prompt_mask_RV, output_counts_RV, column("presence_penalty"),
                                       column("frequency_penalty"), column("repetition_penalty"))
        return logits_BV.index_copy(0, idx_R, penalised_RV)

    def _pick(self, logits_BV: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Greedy rows take the argmax; the others sample with only the filters some row uses."""
        sampled = [r for r in rows if r.params.temperature > 0]
        if not sampled:
            return logits_BV.argmax(dim=-1)
        device, V = logits_BV.device, self.vocab_size

        def column(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([getattr(r.params, name) for r in rows], dtype=dtype, device=device)

        top_p_B = column("top_p", torch.float32) if any(r.params.top_p < 1 for r in sampled) else None
        top_k_B = column("top_k", torch.long) if any(0 < r.params.top_k < V for r in sampled) else None
        min_p_B = column("min_p", torch.float32) if any(r.params.min_p > 0 for r in sampled) else None
        generators = [r.generator if r.params.temperature > 0 else None for r in rows]
        return sample(logits_BV, column("temperature", torch.float32), top_p_B, top_k_B, generators, min_p_B=min_p_B)

    def _output(self, raw_BV: torch.Tensor, token_ids_B: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Move the picks to Python; add logprobs (of the raw logits) when some row asked."""
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        if not asked:
            return SamplerOutput(token_ids_B.tolist())
        chosen_B, rank_B, top_logprobs_BL, top_ids_BL = compute_logprobs(raw_BV, token_ids_B, max(asked))
        top_ids, top_lps = top_ids_BL.tolist(), top_logprobs_BL.tolist()
        tops = [list(zip(ids[:r.params.logprobs], lps[:r.params.logprobs])) if r.params.logprobs is not None else []
                for r, ids, lps in zip(rows, top_ids, top_lps)]
        return SamplerOutput(token_ids_B.tolist(), chosen_B.tolist(), rank_B.tolist(), tops)
