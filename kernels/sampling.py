"""Token sampling from logits: penalties, temperature, top-k, min-p, top-p, logprobs, with
optional per-row generators. Everything is vectorised over rows and vocabulary; the only Python
loop is over the rows that carry their own seeded generator.

Legend: B rows (one per sequence), V vocabulary, T tokens per row (padded), L top alternatives.
"""
import torch

from kernels import native


def greedy(logits_BV: torch.Tensor) -> torch.Tensor:
    """The argmax of each row (int64, B): native.argmax_rows where it runs (float32 CPU rows, 3-4x
    torch's one value at a time), else torch's, whose answer it is."""
    if (logits_BV.dtype == torch.float32 and logits_BV.dim() == 2 and logits_BV.shape[1] > 0
            and logits_BV.stride(1) == 1 and native.eager_cpu(logits_BV)):
        return native.argmax_rows(logits_BV)
    return logits_BV.argmax(dim=-1)


def token_counts(token_lists: list[list[int]], vocab: int, device: torch.device | str | None = None) -> torch.Tensor:
    """How often each id occurs in each row. Returns counts_BV (int64) on device.

    token_lists: B lists of ids in [0, vocab). The lists are padded with the id `vocab` into one
    (B, T) tensor and counted with one scatter_add into B x (vocab + 1); the pad column is dropped.
    """
    T = max((len(ids) for ids in token_lists), default=0)
    padded = [ids + [vocab] * (T - len(ids)) for ids in token_lists]
    ids_BT = torch.tensor(padded, dtype=torch.long, device=device).reshape(len(token_lists), T)
    counts_BV = torch.zeros(len(token_lists), vocab + 1, dtype=torch.long, device=device)
    counts_BV.scatter_add_(1, ids_BT, torch.ones_like(ids_BT))
    return counts_BV[:, :vocab]


def apply_penalties(
    logits_BV: torch.Tensor,
    prompt_mask_BV: torch.Tensor,
    output_counts_BV: torch.Tensor,
    presence_B: torch.Tensor,
    frequency_B: torch.Tensor,
    repetition_B: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties; returns new float32 logits_BV (the input is left alone).

    prompt_mask_BV bool: the id occurs in the row's prompt. output_counts_BV int: times the id was
    generated so far. presence_B, frequency_B, repetition_B float32. The repetition penalty divides
    positive logits and multiplies negative ones of ids seen in the prompt or the output; then
    frequency * count and presence * (count > 0) are subtracted, on output ids only. Neutral values
    (0, 0, 1) leave a row exactly as it was.
    """
    logits_BV = logits_BV.float()
    output_mask_BV = output_counts_BV > 0
    repetition_B1 = repetition_B.float()[:, None]
    penalised_BV = torch.where(logits_BV > 0, logits_BV / repetition_B1, logits_BV * repetition_B1)
    logits_BV = torch.where(prompt_mask_BV | output_mask_BV, penalised_BV, logits_BV)
    logits_BV = logits_BV - frequency_B.float()[:, None] * output_counts_BV
    return logits_BV - presence_B.float()[:, None] * output_mask_BV


def filter_mask(
    scaled_BV: torch.Tensor,
    top_p_B: torch.Tensor | None = None,
    top_k_B: torch.Tensor | None = None,
    min_p_B: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Which tokens top-k, min-p then top-p drop. Returns drop_BV (bool), or None when no filter is given.

    scaled_BV float32: logits already divided by the temperature. top_k_B int64: keep the k most
    likely, 0 or less for all. min_p_B float32 in [0, 1]: drop tokens whose probability is below
    min_p times the top one's. top_p_B float32 in (0, 1]: then keep the smallest set of the
    remaining tokens whose renormalised probability reaches top_p (vLLM's order). None: no row
    filters that way. A row whose own values are neutral gets an all-False row.
    """
    if top_p_B is None and top_k_B is None and min_p_B is None:
        return None
    sorted_BV, order_BV = scaled_BV.sort(dim=-1, descending=True)
    V = scaled_BV.shape[-1]
    rank_V = torch.arange(V, device=scaled_BV.device)
    drop_BV = torch.zeros_like(sorted_BV, dtype=torch.bool)
    if top_k_B is not None:
        k_B = torch.where(top_k_B > 0, top_k_B.clamp(max=V), V)
        drop_BV |= rank_V[None, :] >= k_B[:, None]
    if min_p_B is not None:
        # p < min_p * p_max  <=>  logit - logit_max < log(min_p); log(0) = -inf drops nothing.
        drop_BV |= (sorted_BV - sorted_BV[:, :1]) < min_p_B.float().log()[:, None]
    if top_p_B is not None:
        probs_BV = sorted_BV.masked_fill(drop_BV, float("-inf")).softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        drop_BV |= ((probs_BV.cumsum(dim=-1) - probs_BV) >= top_p_B[:, None]) & (top_p_B < 1)[:, None]
    return torch.empty_like(drop_BV).scatter_(1, order_BV, drop_BV)


def filtered_probs(
    scaled_BV: torch.Tensor,
    top_p_B: torch.Tensor | None = None,
    top_k_B: torch.Tensor | None = None,
    min_p_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distribution a row draws from: softmax(scaled_BV) without the tokens filter_mask drops,
    renormalised. Returns probs_BV (float32); arguments as filter_mask."""
    probs_BV = scaled_BV.float().softmax(dim=-1)
    drop_BV = filter_mask(scaled_BV, top_p_B, top_k_B, min_p_B)
    if drop_BV is None:
        return probs_BV
    probs_BV = probs_BV.masked_fill(drop_BV, 0.0)
    return probs_BV / probs_BV.sum(dim=-1, keepdim=True)


def uniforms(generators: list[torch.Generator | None] | None, B: int, device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row (float32): a seeded row's from its own generator (one value per call,
    so its draws do not depend on the rest of the batch), the others' from the global generator."""
    gens = generators or [None] * B
    u_B = torch.empty(B, device=device)
    unseeded = [i for i, g in enumerate(gens) if g is None]
    if unseeded:
        u_B[unseeded] = torch.rand(len(unseeded), device=device)
    for i, g in enumerate(gens):
        if g is not None:
            u_B[i] = torch.rand(1, generator=g, device=device)[0]
    return u_B


def _inverse_cdf(cdf_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """Positions where each row's running sum of weights (cdf_BV, non-decreasing, last > 0) first
    exceeds u times its total: token j with probability weight_j / total, one uniform per row. The
    target stays below the total, so a zero-weight token (a flat step of the sum) is never taken."""
    total_B1 = cdf_BV[:, -1:]
    target_B1 = torch.minimum(u_B[:, None] * total_B1, torch.nextafter(total_B1, torch.zeros_like(total_B1)))
    return torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(1)


def _draw_plain(scaled_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """Draw from rows with no filter, in vocabulary order; scaled_BV (ours) becomes their running sum."""
    cdf_BV = scaled_BV.sub_(scaled_BV.max(dim=-1, keepdim=True).values).exp_().cumsum_(-1)
    return _inverse_cdf(cdf_BV, u_B)


def _is_filtering(B: int, V: int, top_p_B, top_k_B, min_p_B, device) -> torch.Tensor:
    """Rows whose own top-k, top-p or min-p drops anything (bool_B)."""
    out = torch.zeros(B, dtype=torch.bool, device=device)
    if top_k_B is not None:
        out |= (top_k_B > 0) & (top_k_B < V)
    if top_p_B is not None:
        out |= top_p_B < 1
    if min_p_B is not None:
        out |= min_p_B > 0
    return out


def _kept_prefix(vals_Fk: torch.Tensor, scaled_FV: torch.Tensor, top_p_F, top_k_F, min_p_F
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the k largest scaled logits of each row (vals_Fk, descending), which filter_mask keeps
    (keep_Fk), whether that is all it keeps in the row (covered_F: the k-th is dropped, or k is the
    vocabulary), and for a row that is not, at least how many candidates it needs (need_F: exact
    for top-k and min-p, a lower bound for top-p). Top-p's normaliser is what top-k and min-p keep
    in the whole row; a row whose top-k reaches past the candidates has none yet."""
    F, k = vals_Fk.shape
    V = scaled_FV.shape[-1]
    rank_k = torch.arange(k, device=vals_Fk.device)
    keep_Fk = torch.ones_like(vals_Fk, dtype=torch.bool)
    covered_F = torch.full((F,), k == V, dtype=torch.bool, device=vals_Fk.device)
    need_F = torch.full((F,), float(V), device=vals_Fk.device)
    lead_F1 = vals_Fk[:, :1]
    normaliser_known_F = torch.ones_like(covered_F)
    if top_k_F is not None:
        k_F = torch.where(top_k_F > 0, top_k_F.clamp(max=V), V)
        keep_Fk &= rank_k[None, :] < k_F[:, None]
        covered_F |= k_F <= k
        need_F = torch.minimum(need_F, k_F.float())
        normaliser_known_F = covered_F | (k_F >= V)
    full_FV = None
    if min_p_F is not None:
        log_min_F1 = min_p_F.float().log()[:, None]  # log(0) = -inf drops nothing
        keep_Fk &= (vals_Fk - lead_F1) >= log_min_F1
        covered_F |= ((vals_Fk[:, -1:] - lead_F1) < log_min_F1).squeeze(1)
        if not bool(covered_F.all()):
            full_FV = scaled_FV - lead_F1
            below_FV = full_FV < log_min_F1
            need_F = torch.minimum(need_F, (V - below_FV.sum(-1) + 1).float())
    if top_p_F is not None:
        e_Fk = (vals_Fk - lead_F1).exp() * keep_Fk
        z_F = e_Fk.sum(-1)
        if not bool(covered_F.all()):  # the kept set may reach past the candidates
            full_FV = (scaled_FV - lead_F1 if full_FV is None else full_FV).exp_()
            if min_p_F is not None:
                full_FV.masked_fill_(below_FV, 0.0)
            z_F = torch.where(covered_F, z_F, full_FV.sum(-1))
        probs_Fk = e_Fk / z_F[:, None]
        mass_Fk = probs_Fk.cumsum(-1)
        drop_Fk = ((mass_Fk - probs_Fk) >= top_p_F[:, None]) & (top_p_F < 1)[:, None]
        keep_Fk &= ~drop_Fk
        covered_F |= normaliser_known_F & drop_Fk[:, -1]
        # Every token past the candidates is at most as likely as the k-th.
        short_F = (top_p_F - mass_Fk[:, -1]).clamp(min=0) / probs_Fk[:, -1].clamp(min=1e-30)
        need_F = torch.where(normaliser_known_F & (top_p_F < 1), torch.minimum(need_F, k + short_F), need_F)
    return keep_Fk, covered_F, need_F


def _draw_filtered(scaled_FV: torch.Tensor, top_p_F, top_k_F, min_p_F, u_F: torch.Tensor) -> torch.Tensor:
    """Draw from rows that filter. What filter_mask keeps is a prefix of the row's descending order,
    and usually a short one: so the candidates are the row's 256 largest (then more, as many as the
    rows not yet covered need, or all: the sort the whole row would have had), not a sort of the
    vocabulary, and the draw runs down that order (the prefix is the same whatever the batch made k)."""
    V = scaled_FV.shape[-1]
    k = min(V, 256)
    while True:
        vals_Fk, idx_Fk = scaled_FV.topk(k, dim=-1)
        keep_Fk, covered_F, need_F = _kept_prefix(vals_Fk, scaled_FV, top_p_F, top_k_F, min_p_F)
        if k == V or bool(covered_F.all()):
            break
        k = max(4 * k, int(1.5 * float(need_F[~covered_F].max())))
        k = V if k > V // 4 else k
    cdf_Fk = (vals_Fk - vals_Fk[:, :1]).exp_().masked_fill_(~keep_Fk, 0.0).cumsum_(-1)
    return idx_Fk.gather(1, _inverse_cdf(cdf_Fk, u_F)[:, None]).squeeze(1)


def sample(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor | None,
    top_k_B: torch.Tensor | None,
    generators: list[torch.Generator | None] | None = None,
    min_p_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row. Returns ids_B (int64).

    logits_BV: any float dtype, penalties already applied. temperature_B float32: 0 means greedy
    (argmax of logits_BV). top_p_B, top_k_B, min_p_B: see filter_mask (the reference of what is
    kept); None when no row uses that filter. generators: see uniforms.

    Each sampled row takes one uniform and inverts the cumulative sum of its weights (exp of the
    tempered logits less their max): one exp and one running sum over the vocabulary, in place. (An
    exponential race, argmax p / q with V exponentials q per row, spent 15 ns a value on a CPU:
    235 ms a step at batch 64 and a 151,936-token vocabulary.) A row with no filter of its own draws
    in vocabulary order; a filtering row down its descending order (_draw_filtered), so neither
    depends on the other rows of the batch.
    """
    logits_BV = logits_BV.float()
    greedy_B = temperature_B <= 0
    argmax_B = greedy(logits_BV)
    if bool(greedy_B.all()):
        return argmax_B
    B, V = logits_BV.shape
    scaled_BV = logits_BV / torch.where(greedy_B, 1.0, temperature_B)[:, None]  # new: ours to change
    u_B = uniforms(generators, B, logits_BV.device)
    filtering_B = _is_filtering(B, V, top_p_B, top_k_B, min_p_B, logits_BV.device)
    if not bool(filtering_B.any()):  # the common case: no row copied out
        return torch.where(greedy_B, argmax_B, _draw_plain(scaled_BV, u_B))
    ids_B = argmax_B.clone()
    f = filtering_B.nonzero().squeeze(1)
    pick = (lambda t: None if t is None else t[f])
    ids_B[f] = _draw_filtered(scaled_BV[f], pick(top_p_B), pick(top_k_B), pick(min_p_B), u_B[f])
    plain = (~filtering_B).nonzero().squeeze(1)
    if plain.numel():
        ids_B[plain] = _draw_plain(scaled_BV[plain], u_B[plain])
    return torch.where(greedy_B, argmax_B, ids_B)


def compute_logprobs(
    logits_BV: torch.Tensor, token_ids_B: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the chosen tokens and the most likely alternatives, from log_softmax(logits_BV).

    Pass the raw logits (before penalties and temperature), as vLLM does by default. token_ids_B
    int64. Returns chosen_logprob_B float32, chosen_rank_B int64 (1 + the number of ids with a
    strictly larger logprob, so 1 is the most likely), top_logprobs_BL float32 sorted descending
    and top_ids_BL int64, with L = min(num_top, V) (0 gives empty (B, 0) tensors).
    """
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top!r}")
    logprobs_BV = logits_BV.float().log_softmax(dim=-1)
    chosen_B = logprobs_BV.gather(1, token_ids_B[:, None].long()).squeeze(1)
    rank_B = (logprobs_BV > chosen_B[:, None]).sum(dim=-1) + 1
    top_logprobs_BL, top_ids_BL = logprobs_BV.topk(min(num_top, logprobs_BV.shape[-1]), dim=-1)
    return chosen_B, rank_B, top_logprobs_BL, top_ids_BL


def apply_token_bitmask_(logits_BV: torch.Tensor, bitmask_BW: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Set to -inf, in place, every logit whose bit is 0 in its row of a packed token bitmask.

    logits_BV float: V columns (the vocabulary; bits beyond V are ignored). bitmask_BW int32, W =
    ceil(V / 32): bit j of word w allows token 32 w + j (xgrammar's layout). rows: the rows to mask
    (the others are left alone). One unpack and one masked fill for all rows: xgrammar's own CPU
    kernel took about 11 ms for 32 x 4096 on our 2-core machine, this about 0.3 ms.
    """
    if not rows:
        return logits_BV
    V, device = logits_BV.shape[1], logits_BV.device
    rows_R = torch.tensor(rows, device=device)
    words_RW = bitmask_BW.to(device, non_blocking=True)[rows_R]
    bits_RW32 = (words_RW[:, :, None] >> torch.arange(32, dtype=torch.int32, device=device)) & 1
    allowed_RV = bits_RW32.flatten(1)[:, :V].bool()
    logits_BV[rows_R] = logits_BV[rows_R].masked_fill(~allowed_RV, float("-inf"))
    return logits_BV
