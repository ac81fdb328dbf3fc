"""Speculative sampling of drafts drawn from a distribution q (attention_nodes/speculative.py:
rejection_sample; the sampler's and the engine's use of it): every emitted token has the target's
law p whatever q, the acceptance rate is sum_x min(p(x), q(x)), seeded runs repeat, and in the
engine greedy ids stay those without speculation.

The laws are checked with Pearson's chi-square goodness-of-fit test at significance 0.001 (every
draw is from a fixed seed, so each check is deterministic; the threshold only says how far from
the law a pass may be): the p-value is the chi-square survival function Q(df / 2, stat / 2), the
regularised upper incomplete gamma function (torch.special.gammaincc; scipy is not installed).
Acceptance rates are checked to within 4 binomial standard deviations.
"""
import pytest
import torch

from attention_nodes.sampler import Sampler, SamplingRow
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.speculative import rejection_sample
from server import LLM
from tests.conftest import PROMPTS

V = 6
N = 20_000
ALPHA = 0.001


def chi2_pvalue(counts_V: torch.Tensor, probs_V: torch.Tensor) -> tuple[float, int]:
    """(p-value, degrees of freedom) of Pearson's test of counts_V against probs_V; the cells
    where probs_V is 0 must be empty."""
    counts_V, probs_V = counts_V.double(), probs_V.double()
    support = probs_V > 0
    assert counts_V[~support].sum() == 0, f"draws where the law has no mass: {counts_V.tolist()} vs {probs_V.tolist()}"
    expected = probs_V[support] * counts_V.sum()
    stat = ((counts_V[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    if df == 0:
        return 1.0, 0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2)), df


def test_chi2_pvalue_matches_the_table():
    """Upper-tail 0.001 critical values of the chi-square distribution (NIST/SEMATECH e-Handbook of
    Statistical Methods, section 1.3.6.7.4): df 1: 10.828, df 5: 20.515, df 10: 29.588."""
    for df, critical in ((1, 10.828), (5, 20.515), (10, 29.588)):
        q = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(critical / 2))
        assert float(q) == pytest.approx(ALPHA, rel=1e-3)


def law(*values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


# (target p, draft q): q with mass where p has none, p with mass where q has none, q = p, a flat q
# under a peaked p, and a point mass (q None: the draft is token 1).
CASES = {
    "q-outside-p": (law(5, 3, 2, 0, 0, 0), law(1, 1, 1, 3, 2, 2)),
    "p-outside-q": (law(1, 3, 4, 5, 5, 2), law(6, 4, 0, 0, 0, 0)),
    "q-equals-p": (law(3, 1, 1, 2, 2, 1), law(3, 1, 1, 2, 2, 1)),
    "peaked-p-flat-q": (law(90, 2, 2, 2, 2, 2), law(1, 1, 1, 1, 1, 1)),
    "point-mass": (law(2, 3, 1, 1, 2, 1), None),
}
BONUS = law(1, 0, 2, 3, 1, 1)


def check_rate(accepted: torch.Tensor, rate: float) -> None:
    got, n, rate = float(accepted.float().mean()), accepted.numel(), min(rate, 1.0)
    assert abs(got - rate) <= 4 * (rate * (1 - rate) / n) ** 0.5, (got, rate)


@pytest.mark.parametrize("case", list(CASES))
def test_first_token_has_the_target_law_and_acceptance_is_the_overlap(case):
    p, q = CASES[case]
    g = torch.Generator().manual_seed(1)
    x_N = torch.multinomial(q, N, replacement=True, generator=g) if q is not None else torch.ones(N, dtype=torch.long)
    tokens_N2, accepted_N = rejection_sample(p.expand(N, 1, V), None if q is None else q.expand(N, 1, V),
                                             x_N[:, None], BONUS.expand(N, V), g)
    first = tokens_N2[:, 0]
    pvalue, df = chi2_pvalue(torch.bincount(first, minlength=V), p)
    assert pvalue > ALPHA and df == int((p > 0).sum()) - 1
    check_rate(accepted_N, float(torch.minimum(p, q).sum()) if q is not None else float(p[1]))
    if case == "q-equals-p":
        assert bool(accepted_N.all())
    # an accepted row emitted its draft then the bonus token (of the bonus law); a rejected row a
    # token other than its draft, then nothing
    acc = accepted_N == 1
    assert torch.equal(first[acc], x_N[acc]) and bool((first[~acc] != x_N[~acc]).all())
    assert bool((tokens_N2[~acc, 1] == -1).all())
    assert chi2_pvalue(torch.bincount(tokens_N2[acc, 1], minlength=V), BONUS)[0] > ALPHA


def test_second_token_given_the_first_accepted_has_the_conditional_target_law():
    """K = 2 with a target and a drafter whose second distributions depend on the first token:
    given draft 1 accepted (and equal to a), the second token follows p2(. | a), draft 2 is
    accepted at the rate sum min(p2(. | a), q2(. | a)), and the token after both follows the bonus law."""
    n = 60_000
    g = torch.Generator().manual_seed(2)
    p1, q1 = law(4, 3, 1, 1, 1, 0), law(2, 2, 2, 2, 1, 1)
    P2 = torch.rand(V, V, generator=g) * (torch.rand(V, V, generator=g) > 0.25)  # p2(. | a): row a, some zeros
    P2[:, 0] += 0.1
    P2 /= P2.sum(1, keepdim=True)
    Q2 = torch.rand(V, V, generator=g) ** 2
    Q2 /= Q2.sum(1, keepdim=True)
    x1 = torch.multinomial(q1, n, replacement=True, generator=g)
    x2 = torch.multinomial(Q2[x1], 1, generator=g).squeeze(1)
    target = torch.stack([p1.expand(n, V), P2[x1]], dim=1)
    draft = torch.stack([q1.expand(n, V), Q2[x1]], dim=1)
    tokens_n3, accepted_n = rejection_sample(target, draft, torch.stack([x1, x2], 1), BONUS.expand(n, V), g)
    assert chi2_pvalue(torch.bincount(tokens_n3[:, 0], minlength=V), p1)[0] > ALPHA
    check_rate(accepted_n >= 1, float(torch.minimum(p1, q1).sum()))
    stat, df = 0.0, 0
    for a in range(V):
        rows = (accepted_n >= 1) & (x1 == a)
        if int(rows.sum()) < 500:
            continue
        pv, d = chi2_pvalue(torch.bincount(tokens_n3[rows, 1], minlength=V), P2[a])
        assert pv > ALPHA, (a, pv)
        check_rate(accepted_n[rows] == 2, float(torch.minimum(P2[a], Q2[a]).sum()))
        df += d
    assert df >= 10  # several first tokens were checked
    both = accepted_n == 2
    assert torch.equal(tokens_n3[both, :2], torch.stack([x1, x2], 1)[both])
    assert chi2_pvalue(torch.bincount(tokens_n3[both, 2], minlength=V), BONUS)[0] > ALPHA


def test_sampler_verifies_a_chain_of_drafts_at_once_with_each_positions_law():
    """Sampler.verify_chains (unseeded rows whose K = 2 drafts came from q): the first token follows p1,
    the second, given the first draft accepted, p2 (the target there, here the same whatever the first
    token), the token after both drafts the bonus law; drafts are accepted at sum min(p, q) and every
    chain is its accepted drafts then one token."""
    n = 30_000
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(3)
    logits_3V = torch.randn(3, V, generator=g) * 1.5
    p_3V = logits_3V.softmax(-1)
    q1, Q2 = law(2, 2, 2, 2, 1, 1), torch.rand(V, V, generator=g) ** 2
    Q2 /= Q2.sum(1, keepdim=True)
    x1 = torch.multinomial(q1, n, replacement=True, generator=g)
    x2 = torch.multinomial(Q2[x1], 1, generator=g).squeeze(1)
    drafts = torch.stack([x1, x2], 1).tolist()
    row = SamplingRow(SamplingParams(temperature=1.0), [], [])
    chains = Sampler(V, set()).verify_chains(logits_3V.repeat(n, 1), [row] * (3 * n), drafts,
                                             list(torch.stack([q1.expand(n, V), Q2[x1]], 1)))
    accepted = torch.tensor([len(c) - 1 for c in chains])
    assert all(c[:len(c) - 1] == d[:len(c) - 1] for c, d in zip(chains, drafts)) and int(accepted.max()) <= 2
    first = torch.tensor([c[0] for c in chains])
    assert chi2_pvalue(torch.bincount(first, minlength=V), p_3V[0])[0] > ALPHA
    check_rate(accepted >= 1, float(torch.minimum(p_3V[0], q1).sum()))
    second = torch.tensor([c[1] for c in chains if len(c) > 1])
    assert chi2_pvalue(torch.bincount(second, minlength=V), p_3V[1])[0] > ALPHA
    bonus = torch.tensor([c[2] for c in chains if len(c) > 2])
    assert len(bonus) > 1000 and chi2_pvalue(torch.bincount(bonus, minlength=V), p_3V[2])[0] > ALPHA


def test_same_seed_same_tokens_and_rows_independent_of_the_batch():
    p, q = CASES["q-outside-p"]
    x = torch.multinomial(q, 3 * 64, replacement=True, generator=torch.Generator().manual_seed(3)).view(64, 3)
    args = (p.expand(64, 3, V), q.expand(64, 3, V), x, BONUS.expand(64, V))
    a = rejection_sample(*args, torch.Generator().manual_seed(7))
    b = rejection_sample(*args, torch.Generator().manual_seed(7))
    c = rejection_sample(*args, torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    # one generator per row (the engine's seeded requests): a row draws the same alone or in a batch
    gens = [torch.Generator().manual_seed(100 + i) for i in range(64)]
    batch, _ = rejection_sample(*args, gens)
    alone = [rejection_sample(p.expand(1, 3, V), q.expand(1, 3, V), x[i:i + 1], BONUS.expand(1, V),
                              [torch.Generator().manual_seed(100 + i)])[0] for i in (0, 17, 63)]
    assert torch.equal(torch.cat(alone), batch[[0, 17, 63]])
    # padding: accepted drafts, one more token, then -1
    tokens, accepted = a
    for row, k in zip(tokens.tolist(), accepted.tolist()):
        assert row[k + 1:] == [-1] * (3 - k) and row[k] >= 0


def test_sampler_rejection_samples_from_the_processed_distribution():
    """The sampler verifies a draft against the distribution it would draw from: here logit bias,
    a presence penalty, temperature and top-k; a greedy row keeps the argmax whatever the draft."""
    logits_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    params = SamplingParams(temperature=0.7, top_k=4, presence_penalty=0.8, logit_bias={4: 3.0})
    # expected: bias 4 -> 2.0, penalty on the generated token 0 -> 1.2; top 4 of [1.2, 1, .5, 0, 2, 1.5] / 0.7
    processed = torch.tensor([1.2, 1.0, 0.5, 0.0, 2.0, 1.5]) / 0.7
    p = torch.where(processed >= processed.topk(4).values[-1], processed, float("-inf")).softmax(0)
    q = law(1, 3, 1, 3, 1, 1)
    g = torch.Generator().manual_seed(4)
    x = torch.multinomial(q, N, replacement=True, generator=g).tolist()
    sampler = Sampler(V, set())
    rows = [SamplingRow(params, [], [0], g, None, t, q) for t in x]
    assert torch.allclose(sampler.probs(logits_V.expand(2, V), rows[:2]), p.expand(2, V), atol=1e-6)
    got = torch.tensor(sampler(logits_V.expand(N, V), rows).token_ids)
    assert chi2_pvalue(torch.bincount(got, minlength=V), p)[0] > ALPHA
    check_rate(got == torch.tensor(x), float(torch.minimum(p, q).sum()))
    greedy = SamplingRow(SamplingParams(temperature=0), [], [], None, None, 3, q)
    assert sampler(logits_V[None], [greedy]).token_ids == [0]
    # a seeded verifying row takes two uniforms from its generator
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    sampler(logits_V[None], [SamplingRow(params, [], [0], g1, None, 1, q)])
    torch.rand(2, generator=g2)
    assert torch.equal(g1.get_state(), g2.get_state())


# -- the engine: a drafter that proposes from a fixed distribution ------------------------------
NUM_SPEC = 3


from tests.test_speculative import ckpt, plain  # noqa: E402,F401 (fixtures: the tiny Mixtral, its plain engine)


def fixed_q(vocab: int) -> torch.Tensor:
    """Half flat over the vocabulary, half on 8 tokens."""
    q = torch.full((vocab,), 0.5 / vocab)
    q[[3, 7, 11, 40, 41, 42, 100, 200]] += 0.5 / 8
    return q


@pytest.fixture
def drafting_from_q(monkeypatch):
    """Replace the engine's n-gram drafts with drafts drawn from fixed_q (with their distribution);
    reset() restarts the drafter's generator."""
    from attention_nodes.engine import LLMEngine

    gen = torch.Generator()

    def draft(self) -> None:
        q = fixed_q(self.model_cfg.vocab_size)
        for seq in self.scheduler.running:
            room = min(NUM_SPEC, seq.max_tokens - seq.num_output_tokens - 1)
            if seq.num_computed_tokens != seq.num_tokens - 1 or room < 1:
                continue
            seq.token_ids.extend(torch.multinomial(q, room, replacement=True, generator=gen).tolist())
            seq.num_draft_tokens, seq.draft_probs = room, q.expand(room, -1)

    monkeypatch.setattr(LLMEngine, "_draft", draft)
    return lambda: gen.manual_seed(0)


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 8}], ids=["plain", "chunked-8"])
def test_engine_rejection_samples_distribution_drafts(ckpt, plain, drafting_from_q, kwargs):
    """Greedy ids equal the engine's without speculation (the argmax rule); seeded samples are
    valid and repeat with the same seed and drafts; drafts were accepted and rejected."""
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=2, ignore_eos=True)
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(PROMPTS, greedy)]
    llm = LLM(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": NUM_SPEC}, **kwargs)
    try:
        drafting_from_q()
        assert [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, greedy)] == want
        before = dict(llm.engine.stats()["spec_decode"])
        runs = []
        for _ in range(2):
            drafting_from_q()
            runs.append([[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, seeded)])
        after = llm.engine.stats()["spec_decode"]
        spec = {k: after[k] - before[k] for k in ("num_draft_tokens", "num_accepted_tokens")}
        vocab = llm.engine.model_cfg.vocab_size
    finally:
        llm.shutdown()
    assert runs[0] == runs[1]
    for sample in (ids for o in runs[0] for ids in o):
        assert len(sample) == 16 and all(0 <= t < vocab for t in sample)
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]  # the seeded runs' drafts


def test_engine_verifies_unseeded_q_drafts_at_once_with_penalties_and_min_tokens(ckpt, drafting_from_q):
    """Unseeded sampled sequences with drafts from q take Sampler.verify_chains, here with a repetition
    penalty and min_tokens (each position's row sees the drafts before it as outputs): no EOS comes
    before min_tokens, drafted or drawn, and drafts are accepted and rejected."""
    from attention_nodes.sampler import Sampler

    params = SamplingParams(max_tokens=16, temperature=1.0, repetition_penalty=1.3, min_tokens=12)
    llm = LLM(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": NUM_SPEC})
    calls, real = [], Sampler.verify_chains

    def spy(self, *args):
        calls.append(len(args[2]))
        return real(self, *args)

    try:
        Sampler.verify_chains = spy
        drafting_from_q()
        outs = llm.generate(PROMPTS, params)
        spec = llm.engine.stats()["spec_decode"]
        eos = llm.engine.eos_token_ids
    finally:
        Sampler.verify_chains = real
        llm.shutdown()
    assert calls and 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
    for o in outs:
        ids = o.outputs[0].token_ids
        assert len(ids) >= 12 and not set(ids[:11]) & set(eos)
