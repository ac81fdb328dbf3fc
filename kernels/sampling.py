"""Token sampling from logits: temperature, top-k, top-p, with optional per-row generators.

Legend: B rows (one per sequence), V vocabulary.
"""
import torch


def sample(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    top_k_B: torch.Tensor,
    generators: list[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """Pick one token per row. Returns ids_B (int64).

    temperature_B float32: 0 means greedy (argmax). top_p_B float32 in (0, 1]: keep the smallest
    set of tokens whose probability reaches top_p. top_k_B int64: keep the k most likely, 0 or
    less for all. generators: a torch.Generator for each row that asked for a seed (None for the
    rest); a seeded row draws only from its own generator, so its output does not depend on the
    rest of the batch.
    """
    logits_BV = logits_BV.float()
    greedy_B = temperature_B <= 0
    if bool(greedy_B.all()):
        return logits_BV.argmax(dim=-1)
    scaled_BV = logits_BV / torch.where(greedy_B, 1.0, temperature_B)[:, None]
    sorted_BV, order_BV = scaled_BV.sort(dim=-1, descending=True)
    V = logits_BV.shape[-1]
    rank_V = torch.arange(V, device=logits_BV.device)
    k_B = torch.where(top_k_B > 0, top_k_B.clamp(max=V), V)
    drop_BV = rank_V[None, :] >= k_B[:, None]
    probs_BV = sorted_BV.masked_fill(drop_BV, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
    drop_BV |= ((probs_BV.cumsum(dim=-1) - probs_BV) >= top_p_B[:, None]) & (top_p_B < 1)[:, None]
    sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
    probs_BV = torch.zeros_like(scaled_BV).scatter_(1, order_BV, sorted_BV.softmax(dim=-1))
    # Exponential race (argmax p/q with q ~ Exp(1)) draws from probs; per-row noise keeps seeds independent.
    noise_BV = torch.empty_like(probs_BV)
    gens = generators or [None] * len(probs_BV)
    unseeded = [i for i, g in enumerate(gens) if g is None]
    if unseeded:
        noise_BV[unseeded] = torch.empty(len(unseeded), V, device=probs_BV.device).exponential_()
    for i, g in enumerate(gens):
        if g is not None:
            noise_BV[i].exponential_(generator=g)
    sampled_B = (probs_BV / noise_BV).argmax(dim=-1)
    return torch.where(greedy_B, logits_BV.argmax(dim=-1), sampled_B)
