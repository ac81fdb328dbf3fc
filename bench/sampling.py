"""Random sampling on the CPU: kernels.sampling.sample against the exponential race it replaced
(argmax p / q, V exponentials q per row, and a full sort of the vocabulary for top-k / top-p /
min-p), in one process, interleaved.

    python bench/sampling.py [--quick] [--threads N]

Rows: batch x vocabulary (4,096: the benchmarks' models; 151,936: Qwen's) x what the requests ask
(temperature only; top-p 0.9; top-k 50), on logits shaped like a trained model's (a few tokens far
ahead: a Gumbel-ish spread of scale 3 over a standard normal bulk) or flat ones (a random model's).
Writes bench/results/sampling.json (--quick: sampling_quick.json).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from kernels.sampling import filter_mask, sample  # noqa: E402


def race_baseline(logits_BV, temperature_B, top_p_B, top_k_B, min_p_B=None):
    """The previous sampler: softmax, filter_mask's full sort, V exponentials per row, argmax p / q."""
    scaled_BV = logits_BV.float() / temperature_B[:, None]
    weights_BV = scaled_BV.softmax(dim=-1)
    drop_BV = filter_mask(scaled_BV, top_p_B, top_k_B, min_p_B)
    if drop_BV is not None:
        weights_BV = weights_BV.masked_fill(drop_BV, 0.0)
    noise_BV = torch.empty_like(weights_BV).exponential_().clamp_(min=torch.finfo(torch.float32).tiny)
    return (weights_BV / noise_BV).argmax(dim=-1)


def logits(B: int, V: int, shape: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(B * V)
    bulk = torch.randn(B, V, generator=g)
    if shape == "flat":
        return bulk * 0.1
    lead = -torch.empty(B, V).exponential_(generator=g).log()  # Gumbel: a few large values per row
    return bulk + 3 * lead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = [(64, 4096), (16, 151936)] if args.quick else [(1, 4096), (64, 4096), (256, 4096), (1, 151936),
                                                            (16, 151936), (64, 151936)]
    rounds = 3 if args.quick else 5
    rows = []
    for B, V in cases:
        for shape in ("trained", "flat"):
            x = logits(B, V, shape)
            t = torch.ones(B)
            for ask, kw in (("temperature", {}), ("top-p 0.9", {"top_p_B": torch.full((B,), 0.9)}),
                            ("top-k 50", {"top_k_B": torch.full((B,), 50)})):
                if shape == "flat" and ask == "temperature":
                    continue  # the unfiltered path does not look at the shape
                new = lambda: sample(x, t, kw.get("top_p_B"), kw.get("top_k_B"))
                old = lambda: race_baseline(x, t, kw.get("top_p_B"), kw.get("top_k_B"))
                times = {"new": [], "old": []}
                for fn in (new, old):
                    fn()  # warm-up
                for _ in range(rounds):  # interleaved: the host's speed drifts
                    for name, fn in (("new", new), ("old", old)):
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
                ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
                rows.append({"batch": B, "vocab": V, "logits": shape, "asks": ask, "race_ms": ms["old"],
                             "sample_ms": ms["new"], "speedup": ms["old"] / ms["new"]})
                print(f"batch {B} vocab {V} {shape} {ask}: race {ms['old']:.2f} ms, sample {ms['new']:.2f} ms", flush=True)
    print(f"\nrandom sampling per step, {args.threads} thread(s), median of {rounds} interleaved rounds")
    print_table(rows, ["batch", "vocab", "logits", "asks", "race_ms", "sample_ms", "speedup"])
    path = save("sampling_quick" if args.quick else "sampling", {"threads": args.threads, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
