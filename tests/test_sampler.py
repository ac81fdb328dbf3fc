"""Sampling: penalties, min-p with top-k / top-p, seeds, greedy, logprobs, min_tokens, padded
vocabularies (kernels/sampling.py and attention_nodes/sampler.py), and SamplingParams checks.

Legend: B rows, V vocabulary.
"""
import math
import zlib

import pytest
import torch

from attention_nodes.sampler import Sampler, SamplerOutput, SamplingRow
from attention_nodes.sampling_params import SamplingParams
from kernels.sampling import apply_penalties, compute_logprobs, filtered_probs, sample, token_counts

EOS = 3


def _reference_penalties(logits_BV: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]],
                         presence: list[float], frequency: list[float], repetition: list[float]) -> torch.Tensor:
    """vLLM's penalties, one row and one token at a time."""
    out_BV = logits_BV.clone().double()
    for b in range(out_BV.shape[0]):
        for v in range(out_BV.shape[1]):
            x = out_BV[b, v].item()
            if v in prompts[b] or v in outputs[b]:
                x = x / repetition[b] if x > 0 else x * repetition[b]
            count = outputs[b].count(v)
            out_BV[b, v] = x - frequency[b] * count - presence[b] * (count > 0)
    return out_BV.float()


def _reference_filter(probs_V: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Ids kept by top-k, min-p then top-p on the renormalised rest (vLLM's order)."""
    order = sorted(range(len(probs_V)), key=lambda v: -probs_V[v])
    kept = order[:top_k] if top_k > 0 else order
    kept = [v for v in kept if probs_V[v] >= min_p * probs_V[order[0]]]
    total, mass, result = sum(probs_V[v] for v in kept), 0.0, set()
    for v in kept:
        if mass >= top_p and top_p < 1:
            break
        result.add(v)
        mass += probs_V[v] / total
    return result


def test_token_counts_pads_into_a_dropped_column():
    counts_BV = token_counts([[1, 1, 4], [], [0, 4, 4, 4, 2]], vocab=5, device="cpu")
    assert counts_BV.dtype == torch.long
    assert counts_BV.tolist() == [[0, 2, 0, 0, 1], [0, 0, 0, 0, 0], [1, 0, 1, 0, 3]]
    assert token_counts([], vocab=5).shape == (0, 5)


def test_apply_penalties_matches_per_row_reference():
    gen = torch.Generator().manual_seed(0)
    B, V = 4, 12
    logits_BV = torch.randn(B, V, generator=gen) * 3
    prompts = [[0, 1, 1, 5], [], [7, 8], [2, 3, 11]]
    outputs = [[1, 2, 2, 2], [4, 4, 9], [], [3, 3, 10]]
    presence, frequency, repetition = [0.5, -0.3, 1.0, 0.0], [0.25, 1.5, -1.0, 0.0], [1.3, 0.7, 2.0, 1.0]
    got_BV = apply_penalties(logits_BV, token_counts(prompts, V) > 0, token_counts(outputs, V),
                             torch.tensor(presence), torch.tensor(frequency), torch.tensor(repetition))
    want_BV = _reference_penalties(logits_BV, prompts, outputs, presence, frequency, repetition)
    torch.testing.assert_close(got_BV, want_BV)
    assert torch.equal(got_BV[3, [0, 1, 4, 5, 6, 7, 8, 9]], logits_BV[3, [0, 1, 4, 5, 6, 7, 8, 9]])


def test_min_p_drops_exactly_the_tokens_below_the_threshold():
    probs_V = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.08, 0.04, 0.03])
    temperature = 0.5  # min_p applies to the tempered distribution: p^2 renormalised
    tempered_V = (probs_V.log() / temperature).softmax(-1)
    kept_V = tempered_V >= 0.3 * tempered_V.max()  # keeps 0.3, 0.25, 0.2; drops 0.1 (0.11 < 0.3)
    assert kept_V.tolist() == [True, True, True, False, False, False, False]
    n = 4000
    logits_BV = probs_V.log().repeat(n, 1)
    got_V = filtered_probs(logits_BV[:1] / temperature, min_p_B=torch.tensor([0.3]))[0]
    torch.testing.assert_close(got_V, torch.where(kept_V, tempered_V, 0) / tempered_V[kept_V].sum())
    ids_B = sample(logits_BV, torch.full((n,), temperature), None, None, [None] * n,
                   min_p_B=torch.full((n,), 0.3))
    freq_V = torch.bincount(ids_B, minlength=7).float() / n
    assert set(ids_B.unique().tolist()) == {0, 1, 2}
    assert (freq_V - got_V).abs().max() < 0.03
    # min_p = 0 keeps everything; min_p = 1 keeps only the most likely
    assert (filtered_probs(logits_BV[:1], min_p_B=torch.zeros(1)) > 0).all()
    assert (filtered_probs(logits_BV[:1], min_p_B=torch.ones(1)) > 0).sum() == 1


def test_top_k_top_p_min_p_combined_match_reference():
    gen = torch.Generator().manual_seed(1)
    B, V = 6, 30
    scaled_BV = torch.randn(B, V, generator=gen) * 2
    top_k = [0, 5, 12, 3, 0, 30]
    top_p = [1.0, 0.8, 0.6, 1.0, 0.5, 0.95]
    min_p = [0.0, 0.1, 0.05, 0.5, 0.2, 0.0]
    got_BV = filtered_probs(scaled_BV, torch.tensor(top_p), torch.tensor(top_k), torch.tensor(min_p))
    for b in range(B):
        probs_V = scaled_BV[b].softmax(-1)
        kept = _reference_filter(probs_V.tolist(), top_k[b], top_p[b], min_p[b])
        assert set(got_BV[b].nonzero().flatten().tolist()) == kept, b
        torch.testing.assert_close(got_BV[b][list(kept)], probs_V[list(kept)] / probs_V[list(kept)].sum())
    # the draws stay inside the support
    reps = 300
    ids_RB = sample(scaled_BV.repeat(reps, 1), torch.ones(B * reps), torch.tensor(top_p).repeat(reps),
                    torch.tensor(top_k).repeat(reps), min_p_B=torch.tensor(min_p).repeat(reps)).view(reps, B)
    assert (got_BV.gather(1, ids_RB.T) > 0).all()


@pytest.mark.parametrize("V, scale", [(3000, 4.0), (3000, 0.05), (70000, 0.01)])
def test_filtered_draws_follow_filter_mask_on_large_vocabularies(V, scale):
    """The sampler looks for a row's kept tokens among its 256 largest, then 4,096, 65,536, all:
    peaked rows (scale 4) end inside the first candidates, flat ones (0.05, 0.01) need the larger
    rounds or the whole row. Either way the draws keep to filter_mask's support and frequencies."""
    gen = torch.Generator().manual_seed(V)
    scaled_BV = torch.randn(8, V, generator=gen) * scale
    top_k = torch.tensor([0, 5, 300, 0, 5000, 0, 1, 0])
    top_p = torch.tensor([0.9, 1.0, 0.95, 0.5, 0.99, 1.0, 0.3, 0.8])
    min_p = torch.tensor([0.0, 0.1, 0.0, 0.0, 0.0, 0.01, 0.0, 0.001])
    want_BV = filtered_probs(scaled_BV, top_p, top_k, min_p)
    reps = 20 if V > 10000 else 400
    ids_RB = sample(scaled_BV.repeat(reps, 1), torch.ones(8 * reps), top_p.repeat(reps), top_k.repeat(reps),
                    min_p_B=min_p.repeat(reps)).view(reps, 8)
    assert (want_BV.gather(1, ids_RB.T) > 0).all()
    if scale < 1:  # row 0 (top-p 0.9 of a flat row) keeps most of the vocabulary, and draws from all of it
        rank_R = (scaled_BV[0][None, :] > scaled_BV[0, ids_RB[:, 0]][:, None]).sum(-1)
        assert rank_R.max() > V // 2
    if V > 10000:
        return
    small = ((want_BV > 0).sum(-1) <= 10).nonzero().squeeze(1)  # rows with few kept tokens: frequencies
    reps = 3000
    ids_RS = sample(scaled_BV[small].repeat(reps, 1), torch.ones(len(small) * reps), top_p[small].repeat(reps),
                    top_k[small].repeat(reps), min_p_B=min_p[small].repeat(reps)).view(reps, len(small))
    freq_SV = torch.zeros(len(small), V).scatter_add_(1, ids_RS.T, torch.ones(len(small), reps)) / reps
    assert (freq_SV - want_BV[small]).abs().sum(-1).max() < 0.1  # total variation (about 0.05 expected)
    assert len(small) >= 2


def test_unfiltered_draws_follow_the_softmax_and_take_one_uniform_each():
    from attention_nodes.sampler import skip_draws

    logits_V = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    n = 20000
    ids_B = sample(logits_V.repeat(n, 1), torch.full((n,), 0.7), None, None)
    freq_V = torch.bincount(ids_B, minlength=6).float() / n
    assert (freq_V - (logits_V / 0.7).softmax(-1)).abs().max() < 0.012 and freq_V[4] == 0
    # A seeded row takes one value of its generator per token: what skip_draws skips on a resume.
    g, fresh = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(3):
        sample(logits_V[None], torch.ones(1), None, None, [g])
    skip_draws(fresh, 3)
    assert torch.equal(g.get_state(), fresh.get_state())


def _run(rows: list[tuple[SamplingParams, str]], steps: int, V: int = 64) -> list[list[int]]:
    """Decode `steps` tokens for rows of (params, key) through a Sampler. A row's logits depend only
    on its key, the step and its own outputs, so the same key sees the same logits in any batch."""
    sampler = Sampler(V, {EOS})
    batch = [SamplingRow(p, [int(c, 36) % V for c in key], [],
                         torch.Generator().manual_seed(p.seed) if p.seed is not None else None) for p, key in rows]
    for step in range(steps):
        logits = []
        for row, (_, key) in zip(batch, rows):
            g = torch.Generator().manual_seed(zlib.crc32(repr((key, step, row.output_token_ids)).encode()))
            logits.append(torch.randn(V, generator=g) * 2)
        out = sampler(torch.stack(logits), batch)
        for row, tok in zip(batch, out.token_ids):
            row.output_token_ids.append(tok)
    return [row.output_token_ids for row in batch]


def test_seeded_rows_do_not_depend_on_the_batch():
    filtered = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                              repetition_penalty=1.2, seed=7, ignore_eos=True)
    plain = SamplingParams(temperature=1.0, seed=11, ignore_eos=True)  # no filter of its own
    others = [(SamplingParams(temperature=1.0, top_p=0.5, seed=3, logprobs=2), "other1"),
              (SamplingParams(temperature=1.3, frequency_penalty=1.0), "unseeded"),
              (SamplingParams(temperature=0, repetition_penalty=1.5), "greedy")]
    steps = 8
    alone_filtered = _run([(filtered, "a")], steps)[0]
    alone_plain = _run([(plain, "b")], steps)[0]
    mixed = _run([others[0], (filtered, "a"), others[1], (plain, "b"), others[2]], steps)
    assert mixed[1] == alone_filtered and mixed[3] == alone_plain
    again = _run([(plain, "b"), others[1], (filtered, "a")], steps)
    assert again[0] == alone_plain and again[2] == alone_filtered


def test_different_seeds_give_different_tokens():
    runs = [_run([(SamplingParams(temperature=1.0, seed=s), "same")], 8)[0] for s in (1, 2, 3)]
    assert runs[0] != runs[1] and runs[1] != runs[2] and runs[0] != runs[2]


def test_greedy_takes_argmax_of_penalised_logits():
    gen = torch.Generator().manual_seed(2)
    V = 16
    logits_BV = torch.randn(4, V, generator=gen)
    prompts, outputs = [[0, 1], [2], [3, 4], [5]], [[int(logits_BV[b].argmax())] * 2 for b in range(4)]
    presence, frequency, repetition = [1.0, 0.0, 0.0, 2.0], [0.0, 2.0, 0.0, 0.0], [1.0, 1.0, 3.0, 1.0]
    params = [SamplingParams(temperature=0, presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
              for p, f, r in zip(presence, frequency, repetition)]
    want_B = _reference_penalties(logits_BV, prompts, outputs, presence, frequency, repetition).argmax(-1)
    sampler = Sampler(V, {EOS})
    rows = [SamplingRow(p, pr, o, None) for p, pr, o in zip(params, prompts, outputs)]
    assert sampler(logits_BV, rows).token_ids == want_B.tolist()
    assert want_B.tolist() != logits_BV.argmax(-1).tolist()  # the penalties changed the picks
    # the same greedy rows beside sampled ones
    hot = SamplingRow(SamplingParams(temperature=1.5, top_k=4, seed=5), [1], [], torch.Generator().manual_seed(5))
    got = sampler(torch.cat([logits_BV, logits_BV[:1]]), rows + [hot]).token_ids
    assert got[:4] == want_B.tolist()


def test_logprobs_of_raw_logits_ranks_and_top_alternatives():
    gen = torch.Generator().manual_seed(3)
    V = 40
    raw_BV = torch.randn(4, V, generator=gen) * 2
    asked = [3, None, 0, 5]
    rows = [SamplingRow(SamplingParams(temperature=0.7, logprobs=n, presence_penalty=1.0, repetition_penalty=1.4),
                        [1, 2, 3], [4, 4, 5], torch.Generator().manual_seed(b)) for b, n in enumerate(asked)]
    out = Sampler(V, {EOS})(raw_BV, rows)
    logprobs_BV = raw_BV.log_softmax(-1)
    for b, tok in enumerate(out.token_ids):
        assert out.logprobs[b] == pytest.approx(logprobs_BV[b, tok].item(), abs=1e-5)
        assert out.ranks[b] == 1 + int((logprobs_BV[b] > logprobs_BV[b, tok]).sum())
        top = out.top_logprobs[b]
        assert len(top) == (asked[b] or 0)
        assert [i for i, _ in top] == logprobs_BV[b].topk(len(top)).indices.tolist()
        assert all(top[j][1] >= top[j + 1][1] for j in range(len(top) - 1))
        assert all(lp == pytest.approx(logprobs_BV[b, i].item(), abs=1e-5) for i, lp in top)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []
    none_asked = Sampler(V, {EOS})(raw_BV, [SamplingRow(SamplingParams(), [], [], None) for _ in range(4)])
    assert none_asked.logprobs is None and none_asked.ranks is None and none_asked.top_logprobs is None
    chosen_B, rank_B, top_BL, ids_BL = compute_logprobs(raw_BV, raw_BV.argmax(-1), 0)
    assert rank_B.tolist() == [1] * 4 and top_BL.shape == ids_BL.shape == (4, 0)
    assert chosen_B.dtype == torch.float32 and rank_B.dtype == torch.int64


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    V, stop_id = 10, 5
    logits_BV = torch.zeros(6, V)
    logits_BV[:, EOS], logits_BV[:, stop_id], logits_BV[:, 7] = 50.0, 40.0, 30.0
    base = dict(min_tokens=2, stop_token_ids=[stop_id])
    rows = [SamplingRow(SamplingParams(temperature=0, **base), [1], [], None),
            SamplingRow(SamplingParams(temperature=0, **base), [1], [8], None),
            SamplingRow(SamplingParams(temperature=0, **base), [1], [8, 8], None),  # reached
            SamplingRow(SamplingParams(temperature=0, ignore_eos=True, **base), [1], [], None),
            SamplingRow(SamplingParams(temperature=1.0, seed=1, **base), [1], [8], torch.Generator().manual_seed(1)),
            SamplingRow(SamplingParams(temperature=0), [1], [], None)]  # no min_tokens
    sampler = Sampler(V, {EOS})
    for _ in range(20):
        assert sampler(logits_BV, rows).token_ids[:5] == [7, 7, EOS, EOS, 7]
    assert sampler(logits_BV, rows).token_ids[5] == EOS


def test_padded_vocab_columns_are_never_sampled():
    V, padded = 20, 32
    gen = torch.Generator().manual_seed(4)
    logits_BV = torch.randn(3, padded, generator=gen)
    logits_BV[:, V:] = 100.0
    rows = [SamplingRow(SamplingParams(temperature=t, logprobs=20, seed=s), [], [],
                        torch.Generator().manual_seed(s) if s is not None else None)
            for t, s in [(0, None), (1.0, 9), (2.0, None)]]
    out = Sampler(V, {EOS})(logits_BV, rows)
    assert all(t < V for t in out.token_ids)
    assert all(i < V for top in out.top_logprobs for i, _ in top)
    assert out.token_ids[0] == int(logits_BV[0, :V].argmax())
    assert sum(math.exp(lp) for _, lp in out.top_logprobs[0]) == pytest.approx(1.0, abs=1e-4)  # 20 = all of V
    with pytest.raises(ValueError, match="logits must be"):
        Sampler(V, {EOS})(logits_BV[:, :V - 1], rows)


def test_sampler_output_is_plain_python():
    out = Sampler(8, {EOS})(torch.randn(2, 8), [SamplingRow(SamplingParams(temperature=0), [], [], None)] * 2)
    assert isinstance(out, SamplerOutput) and all(isinstance(t, int) for t in out.token_ids)


@pytest.mark.parametrize("field, bad", [
    ("n", "2"), ("n", True), ("n", 1.0), ("n", 0),
    ("min_p", "0.1"), ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")),
    ("presence_penalty", "x"), ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", None), ("frequency_penalty", -3), ("frequency_penalty", float("inf")),
    ("repetition_penalty", "1"), ("repetition_penalty", 0), ("repetition_penalty", -1.0),
    ("logprobs", 2.0), ("logprobs", True), ("logprobs", -1), ("logprobs", 21),
    ("include_stop_str_in_output", 1), ("include_stop_str_in_output", "yes"),
    ("skip_special_tokens", 0), ("skip_special_tokens", None),
    ("min_tokens", 1.5), ("min_tokens", False), ("min_tokens", -1), ("min_tokens", 17),  # max_tokens is 16
])
def test_sampling_params_rejects_bad_values(field, bad):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**{field: bad})
    assert repr(bad) in str(err.value)


def test_sampling_params_accepts_the_edges():
    p = SamplingParams(n=3, min_p=1, presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=0.01,
                       logprobs=0, include_stop_str_in_output=True, skip_special_tokens=False, min_tokens=16)
    assert p.min_p == 1 and p.logprobs == 0
    d = SamplingParams()
    assert (d.n, d.min_p, d.presence_penalty, d.frequency_penalty, d.repetition_penalty, d.logprobs,
            d.include_stop_str_in_output, d.skip_special_tokens, d.min_tokens) == (1, 0.0, 0.0, 0.0, 1.0, None,
                                                                                   False, True, 0)
    assert SamplingParams(logprobs=20).logprobs == 20


def test_a_sequences_outputs_are_a_view_not_a_copy():
    """Sequence.output_token_ids is a TokenSpan over token_ids (the sampler reads every running
    sequence's outputs each step; a slice copied them all, quadratic in the output length): it sees
    later appends and reads like the list it stands for."""
    from attention_nodes.sequence import Sequence, TokenSpan

    seq = Sequence("r", 0, [5, 6, 7], 3, SamplingParams(), max_tokens=10, arrival=0)
    out = seq.output_token_ids
    assert isinstance(out, TokenSpan) and len(out) == 0 and list(out) == [] and out == []
    seq.token_ids += [11, 12, 13]
    assert len(out) == 3 and out == [11, 12, 13] and list(out) == [11, 12, 13]
    assert (out[0], out[-1], out[1:], out[::-1]) == (11, 13, [12, 13], [13, 12, 11])
    with pytest.raises(IndexError):
        out[3]
    with pytest.raises(IndexError):
        out[-4]
    assert 12 in out and out.count(13) == 1 and out != [11, 12]
    # the sampler's penalties count them as they are
    row = SamplingRow(SamplingParams(temperature=0, frequency_penalty=2.0), [5, 6, 7], out)
    logits = torch.zeros(1, 16)
    logits[0, 11] = 1.0
    assert Sampler(16, set())(logits, [row]).token_ids == [0]  # 11 was penalised below the zeros
