"""What grammar masks (structured outputs) cost: throughput at batch 32 with and without them.

    python bench/structured.py [--batch 32] [--repeats 1]

Engine: the built-in model, colocated, 32 requests at once, each constrained to its own JSON schema
(bench/json_schemas.py: 32 distinct grammars, compiled once each), greedy. The baseline runs the same
prompts unconstrained for exactly the number of tokens each constrained request produced (eos
ignored), so both runs generate the same tokens per request; the ratio is the cost of compiling,
filling the bitmasks (xgrammar, per row) and applying them (one masked fill over the batch).
Sampler: one sampling step of a (32, vocab) logits batch alone, with and without the 32 masks.
Writes bench/results/structured.json.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_nodes.sampler import Sampler, SamplingRow  # noqa: E402
from attention_nodes.structured import GrammarCache, StructuredOutputs  # noqa: E402
from bench.common import best_of, print_table, save  # noqa: E402
from server import LLM, SamplingParams  # noqa: E402
from bench.json_schemas import schemas  # noqa: E402

PROMPT = 'A JSON object such as {"name": "spam"}:'


def engine_rows(llm: LLM, batch: int, repeats: int) -> list[dict]:
    specs = [StructuredOutputs("json", json.dumps(s)) for s in schemas(batch, seed=1)]
    constrained = [SamplingParams(max_tokens=192, temperature=0, structured_outputs=s) for s in specs]
    lengths: list[int] = []

    def run_constrained() -> None:
        outs = llm.generate([PROMPT] * batch, constrained)
        lengths[:] = [len(o.outputs[0].token_ids) for o in outs]

    t_constrained = best_of(run_constrained, repeats)
    free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    t_free = best_of(lambda: llm.generate([PROMPT] * batch, free), repeats)
    tokens = sum(lengths)
    return [{"run": "engine, no grammar", "batch": batch, "tokens": tokens, "seconds": t_free,
             "tok_per_s": tokens / t_free, "vs_baseline": 1.0},
            {"run": "engine, 32 JSON grammars", "batch": batch, "tokens": tokens, "seconds": t_constrained,
             "tok_per_s": tokens / t_constrained, "vs_baseline": t_free / t_constrained}]


def sampler_rows(llm: LLM, batch: int) -> list[dict]:
    vocab = llm.cfg.vocab_size
    sampler = Sampler(vocab, {0})
    grammars = GrammarCache(llm.tokenizer, vocab, {0})
    specs = [StructuredOutputs("json", json.dumps(s)) for s in schemas(batch, seed=1)]
    logits = torch.randn(batch, vocab)
    params = SamplingParams(max_tokens=16, temperature=1.0)
    free = [SamplingRow(params, [], []) for _ in range(batch)]
    masked = [SamplingRow(params, [], [], grammar=grammars.matcher(s)) for s in specs]
    t_free = best_of(lambda: sampler(logits, free), 50)
    t_masked = best_of(lambda: sampler(logits, masked), 50)
    return [{"run": "sampler step, no grammar", "batch": batch, "seconds": t_free, "vs_baseline": 1.0},
            {"run": "sampler step, 32 masks", "batch": batch, "seconds": t_masked, "vs_baseline": t_free / t_masked}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    llm = LLM(None, max_num_seqs=max(args.batch, 32))
    try:
        t0 = time.perf_counter()
        rows = engine_rows(llm, args.batch, args.repeats) + sampler_rows(llm, args.batch)
    finally:
        llm.shutdown()
    print_table(rows, ["run", "batch", "tokens", "seconds", "tok_per_s", "vs_baseline"])
    path = save("structured", {"batch": args.batch, "repeats": args.repeats, "model": "built-in",
                               "wall_s": time.perf_counter() - t0, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
