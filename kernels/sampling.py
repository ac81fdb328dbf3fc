"""Token sampling from logits: penalties, temperature, top-k, min-p, top-p, logprobs, with
optional per-row generators. Everything is vectorised over rows and vocabulary; the only Python
loop is over the rows that carry their own seeded generator.

Legend: B rows (one per sequence), V vocabulary, T tokens per row (padded), L top alternatives.
"""
import torch


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


def exponential_race(probs_BV: torch.Tensor, generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """Draw one id per row from probs_BV (float32, >= 0; rows need not sum to 1): argmax of p / q
    with q ~ Exp(1). Returns ids_B (int64).

    generators: per row, a torch.Generator on probs' device for a seeded row, or None. A seeded
    row's noise comes only from its own generator (V draws per call), so its draw does not depend
    on the rest of the batch; the unseeded rows share one draw from the global generator.
    """
    B, V = probs_BV.shape
    noise_BV = torch.empty_like(probs_BV)
    gens = generators or [None] * B
    unseeded = [i for i, g in enumerate(gens) if g is None]
    if unseeded:
        noise_BV[unseeded] = torch.empty(len(unseeded), V, device=probs_BV.device).exponential_()
    for i, g in enumerate(gens):
        if g is not None:
            noise_BV[i].exponential_(generator=g)
    # An exact 0 from exponential_ would make 0 / 0 = NaN for a dropped token, and argmax picks NaN.
    noise_BV.clamp_(min=torch.finfo(noise_BV.dtype).tiny)
    return (probs_BV / noise_BV).argmax(dim=-1)


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
    (argmax of logits_BV). top_p_B, top_k_B, min_p_B: see filter_mask; None when no row uses
    that filter. generators: see exponential_race.
    """
    logits_BV = logits_BV.float()
    greedy_B = temperature_B <= 0
    argmax_B = logits_BV.argmax(dim=-1)
    if bool(greedy_B.all()):
        return argmax_B
    scaled_BV = logits_BV / torch.where(greedy_B, 1.0, temperature_B)[:, None]
    # Not renormalised after filtering (the race is scale-invariant), so a row whose own filters
    # are neutral gets bit-identical weights whether or not other rows of the batch filter.
    weights_BV = scaled_BV.softmax(dim=-1)
    drop_BV = filter_mask(scaled_BV, top_p_B, top_k_B, min_p_B)
    if drop_BV is not None:
        weights_BV = weights_BV.masked_fill(drop_BV, 0.0)
    return torch.where(greedy_B, argmax_B, exponential_race(weights_BV, generators))


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
