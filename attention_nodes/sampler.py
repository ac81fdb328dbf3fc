"""Sampler: turns one step's sequences into tensors once and picks their next tokens.

Per step, as vLLM: raw logits (logprobs are taken from these) -> min_tokens bans -> logit_bias -> penalties -> grammar masks (structured outputs) ->
greedy argmax, or temperature -> top-k / min-p / top-p -> draw. Work no row needs is skipped: no
penalty tensors when every row is neutral, argmax only for an all-greedy batch, no sort without
a filter, no logprobs unless a row asked. A sampled row that verifies a draft drawn from a
distribution (SamplingRow.draft_probs) takes the draft or a token of the residual instead of the
draw (speculative.rejection_sample), from the same distribution (`probs`).

Legend: B rows (one per sampled sequence), V vocabulary (valid ids only), L top alternatives.
"""
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attention_nodes.sampling_params import SamplingParams
from attention_nodes.structured import apply_grammar_masks
from attention_nodes.speculative import rejection_sample
from kernels.sampling import apply_penalties, compute_logprobs, filtered_probs, greedy, sample, token_counts


@dataclass
class SamplingRow:
    """One sequence of the step. generator: the request's seeded torch.Generator on the logits'
    device, or None to draw from the global one."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: Sequence[int]  # generated so far (penalties, min_tokens): a list or a TokenSpan view
    generator: torch.Generator | None = None
    grammar: object | None = None  # xgrammar GrammarMatcher: only tokens it allows may be picked
    # A draft this position verifies and the distribution it was drawn from ((>= V,) float): a
    # sampled row then accepts it or draws from the residual (speculative.rejection_sample), a
    # greedy row takes the argmax as always. None: an ordinary draw.
    draft_token: int | None = None
    draft_probs: torch.Tensor | None = None


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
        logits_BV = self._process(raw_BV, rows)
        verify = [b for b, r in enumerate(rows) if r.draft_probs is not None and r.params.temperature > 0]
        if not verify:
            token_ids_B = self._pick(logits_BV, rows)
        else:  # (the rows draw from their generators independently: the order does not matter)
            token_ids_B = torch.empty(len(rows), dtype=torch.long, device=logits_BV.device)
            rest = sorted(set(range(len(rows))) - set(verify))
            if rest:
                token_ids_B[rest] = self._pick(logits_BV[rest], [rows[b] for b in rest])
            token_ids_B[verify] = self._verify(logits_BV[verify], [rows[b] for b in verify])
        return self._output(raw_BV, token_ids_B, rows)

    @torch.inference_mode()
    def probs(self, logits_BV: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distributions (B, vocab_size) float32 that `__call__` draws the rows' tokens from:
        the logits after min_tokens bans, logit bias, penalties and grammar masks, tempered and
        filtered (top-k, min-p, top-p: kernels.sampling.filtered_probs). A greedy row gets a one-hot
        of its argmax."""
        return self._distributions(self._process(logits_BV[:, :self.vocab_size].float(), rows), rows)

    @torch.inference_mode()
    def verify_chains(self, logits_RV: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
                      draft_probs: list[torch.Tensor]) -> list[list[int]]:
        """Sequences whose d drafts were drawn from distributions q, each verified over all its positions
        at once: logits_RV and rows hold sequence i's d + 1 positions in order (at position j its
        outputs followed by drafts 0..j-1), draft_probs[i] its q rows (d, >= vocab_size). Returns each
        sequence's accepted drafts then the token after them (drawn from the residual at the first
        rejected draft, else from p at position d): speculative.rejection_sample with the bonus
        position, one call per draft count, which gives each token the law of verifying one position
        at a time (`__call__` with draft_probs). For rows without a grammar (its mask follows the
        tokens taken), logprobs or a seed (their uniforms are the global generator's)."""
        if any(r.generator is not None or r.grammar is not None for r in rows):
            raise ValueError("verify_chains takes unseeded rows without a grammar")
        p_RV, V = self.probs(logits_RV, rows), self.vocab_size
        firsts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
        out: list[list[int]] = [[] for _ in drafts]
        for K in sorted({len(d) for d in drafts}):
            group = [i for i, d in enumerate(drafts) if len(d) == K]
            at = torch.tensor([[firsts[i] + j for j in range(K + 1)] for i in group], device=p_RV.device)
            q_BKV = torch.stack([draft_probs[i][:K, :V] for i in group]).to(p_RV.device, torch.float32)
            ids_BK1, accepted_B = rejection_sample(p_RV[at[:, :K]], q_BKV, torch.tensor([drafts[i] for i in group]),
                                                   p_RV[at[:, K]])
            for i, row, n in zip(group, ids_BK1.tolist(), accepted_B.tolist()):
                out[i] = row[:n + 1]
        return out

    def _distributions(self, logits_BV: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """`probs` of logits already processed (_process)."""
        temperature_B = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32,
                                     device=logits_BV.device)
        greedy_B = temperature_B <= 0
        top_p_B, top_k_B, min_p_B = self._filters(rows, logits_BV.device)
        probs_BV = filtered_probs(logits_BV / torch.where(greedy_B, 1.0, temperature_B)[:, None],
                                  top_p_B, top_k_B, min_p_B)
        if bool(greedy_B.any()):
            one_hot_BV = torch.nn.functional.one_hot(greedy(logits_BV), self.vocab_size).float()
            probs_BV = torch.where(greedy_B[:, None], one_hot_BV, probs_BV)
        return probs_BV

    def _process(self, raw_BV: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The logits the rows draw from: min_tokens bans, logit bias, penalties, grammar masks (raw_BV
        is left alone)."""
        logits_BV = self._penalise(self._bias(self._ban_early_stops(raw_BV, rows), rows), rows)
        if any(r.grammar is not None for r in rows):
            if logits_BV is raw_BV:  # masked in place: keep the raw logits for logprobs
                logits_BV = logits_BV.clone()
            apply_grammar_masks(logits_BV, [r.grammar for r in rows], self.vocab_size)
        return logits_BV

    def _verify(self, logits_RV: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Sampled rows with a draft from a distribution: the draft, accepted with probability
        min(1, p/q), else a draw from the residual (speculative.rejection_sample); two uniforms each."""
        p_RV = self._distributions(logits_RV, rows)
        q_RV = torch.stack([r.draft_probs[:self.vocab_size] for r in rows]).to(p_RV.device, torch.float32)
        x_R = torch.tensor([r.draft_token for r in rows], device=p_RV.device)
        token_ids_R2, _ = rejection_sample(p_RV[:, None], q_RV[:, None], x_R[:, None], None,
                                           [r.generator for r in rows])
        return token_ids_R2[:, 0]

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
            return greedy(logits_BV)
        top_p_B, top_k_B, min_p_B = self._filters(rows, logits_BV.device)
        temperature_B = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=logits_BV.device)
        generators = [r.generator if r.params.temperature > 0 else None for r in rows]
        return sample(logits_BV, temperature_B, top_p_B, top_k_B, generators, min_p_B=min_p_B)

    def _filters(self, rows: list[SamplingRow], device: torch.device) -> tuple[torch.Tensor | None, ...]:
        """top_p_B, top_k_B, min_p_B of the rows (kernels.sampling.filter_mask), each None where no
        sampled row filters that way."""
        sampled, V = [r for r in rows if r.params.temperature > 0], self.vocab_size

        def column(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([getattr(r.params, name) for r in rows], dtype=dtype, device=device)

        top_p_B = column("top_p", torch.float32) if any(r.params.top_p < 1 for r in sampled) else None
        top_k_B = column("top_k", torch.long) if any(0 < r.params.top_k < V for r in sampled) else None
        min_p_B = column("min_p", torch.float32) if any(r.params.min_p > 0 for r in sampled) else None
        return top_p_B, top_k_B, min_p_B

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


def peek_uniforms(gen: torch.Generator, n: int) -> list[float]:
    """The uniforms a seeded sample's next n tokens will draw from its generator (one each, as
    kernels/sampling.uniforms draws them), the generator left where it was."""
    state = gen.get_state()
    try:
        return [float(torch.rand(1, generator=gen, device=gen.device)[0]) for _ in range(n)]
    finally:
        gen.set_state(state)


def skip_draws(gen: torch.Generator, num_tokens: int) -> None:
    """Advance a seeded sample's generator past the draws of num_tokens sampled tokens: the sampler
    takes one uniform per token from it (kernels.sampling.uniforms). On the CPU one draw of n values
    takes the same stream as n single draws; a CUDA generator's offset advances per call, so there
    it repeats the per-token calls."""
    if gen.device.type != "cpu":
        for _ in range(num_tokens):
            torch.rand(1, generator=gen, device=gen.device)
        return
    torch.rand(num_tokens, generator=gen)
