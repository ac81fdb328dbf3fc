"""Speculative decoding with n-gram drafts against plain decoding, side by side in one process.

The built-in model (models/builtin, trained on stdlib docstrings) serves B prompts cut from its
held-out documents, greedy, EOS ignored, --output-len new tokens each, through `LLM.generate`:
- "copy": a document's first --doc-tokens tokens, a blank line, then its first 8 tokens again, so
  the continuation can copy the prompt (the case prompt lookup is for: code edits, quoting);
- "plain": the document's first --doc-tokens tokens alone (drafts come only from repeats).
Per workload and batch: output tokens/s of the whole generate (prefill included), the median of
--rounds rounds after a warm-up run of each, every engine alternated within a round: "off" (no speculation) and ngram with
k = --ks drafts (prompt_lookup 1..3) never switched off (disable_by_batch_size above the batch), and
"auto": the best k at batch 1 with the default disable_by_batch_size (what a user gets). Beside
each: acceptance (accepted / draft tokens) and mean acceptance length (1 + accepted / drafts: the
tokens a drafted sequence gains per verify step, vLLM's definition). Greedy outputs are checked to
equal "off"'s in float32 (in bf16 the verify pass rounds differently, so near-ties may differ:
reported, not failed).

    python bench/spec_decode.py [--quick] [--batches 1 16 64] [--ks 1 2 3 4] [--rounds 3]

Writes bench/results/spec_decode.json (--quick: spec_decode_quick.json), with the host named.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_nodes.config import DEFAULT_DISABLE_BY_BATCH_SIZE  # noqa: E402
from bench.common import print_table, save  # noqa: E402
from planner.hardware import describe_host  # noqa: E402
from server import LLM, SamplingParams  # noqa: E402


def prompts(tok, batch: int, doc_tokens: int, copy: bool) -> list[list[int]]:
    from training.builtin import documents, is_held_out

    docs = [ids for name, text in documents() if is_held_out(name)
            for ids in [tok.encode(text)] if len(ids) >= doc_tokens]
    out = []
    for i in range(batch):
        d = docs[i % len(docs)][:doc_tokens]
        out.append(d + tok.encode("\n\n") + d[:8] if copy else d)
    return out


def ngram(k: int, disable: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": disable}


def run(llm: LLM, ps: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate(ps, params)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="batches 1 and 16, k 1 and 3, 2 rounds, 32 new tokens")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--doc-tokens", type=int, default=96)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    if args.quick:
        args.batches, args.ks, args.rounds, args.output_len = [1, 16], [1, 3], 2, 32
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    never = 10 ** 6
    engines = {"off": LLM(None, dtype=args.dtype)}
    for k in args.ks:
        engines[f"k={k}"] = LLM(None, dtype=args.dtype, speculative_config=ngram(k, never))
    tok = engines["off"].tokenizer
    rows, per_round = [], {}
    try:
        for copy in (True, False):
            workload = "copy" if copy else "plain"
            for b in args.batches:
                ps = prompts(tok, b, args.doc_tokens, copy)
                names = list(engines)
                rates = {n: [] for n in names}
                before = {n: dict(e.engine.stats().get("spec_decode") or {}) for n, e in engines.items()}
                want, same = None, {}
                for n in names:  # warm-up: first calls, buffers and caches at this batch
                    run(engines[n], ps, params)
                for r in range(args.rounds):
                    for n in (names if r % 2 == 0 else names[::-1]):
                        rate, ids = run(engines[n], ps, params)
                        rates[n].append(rate)
                        if n == "off":
                            want = ids
                        else:
                            same.setdefault(n, []).append(ids)
                base = statistics.median(rates["off"])
                for n in names:
                    spec = engines[n].engine.stats().get("spec_decode") or {}
                    drafted = spec.get("num_draft_tokens", 0) - before[n].get("num_draft_tokens", 0)
                    accepted = spec.get("num_accepted_tokens", 0) - before[n].get("num_accepted_tokens", 0)
                    drafts = spec.get("num_drafts", 0) - before[n].get("num_drafts", 0)
                    tput = statistics.median(rates[n])
                    rows.append({"workload": workload, "batch": b, "engine": n, "tok_s": tput,
                                 "vs_off": tput / base, "acceptance": accepted / drafted if drafted else None,
                                 "mean_accept_len": 1 + accepted / drafts if drafts else None,
                                 "greedy_equal": None if n == "off" else all(ids == want for ids in same[n])})
                    per_round[f"{workload}/{b}/{n}"] = rates[n]
        # "auto": the best k of the copy workload at the first batch, switched off above the default size
        first = [r for r in rows if r["workload"] == "copy" and r["batch"] == args.batches[0] and r["engine"] != "off"]
        best = max(first, key=lambda r: r["tok_s"])["engine"]
        auto = LLM(None, dtype=args.dtype, speculative_config=ngram(int(best[2:]), DEFAULT_DISABLE_BY_BATCH_SIZE))
        for copy in (True, False):
            workload = "copy" if copy else "plain"
            for b in args.batches:
                ps = prompts(tok, b, args.doc_tokens, copy)
                both = {"off": [], "auto": []}
                run(auto, ps, params)
                for r in range(args.rounds):
                    for n in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
                        both[n].append(run(engines["off"] if n == "off" else auto, ps, params)[0])
                rows.append({"workload": workload, "batch": b, "engine": f"auto ({best})",
                             "tok_s": statistics.median(both["auto"]),
                             "vs_off": statistics.median(a / o for a, o in zip(both["auto"], both["off"])),
                             "acceptance": None, "mean_accept_len": None, "greedy_equal": None})
                per_round[f"{workload}/{b}/auto"] = both["auto"]
        auto.shutdown()
    finally:
        for e in engines.values():
            e.shutdown()
    print_table(rows, ["workload", "batch", "engine", "tok_s", "vs_off", "acceptance", "mean_accept_len",
                       "greedy_equal"])
    path = save("spec_decode_quick" if args.quick else "spec_decode",
                {"host": describe_host(), "config": vars(args), "default_disable_by_batch_size":
                 DEFAULT_DISABLE_BY_BATCH_SIZE, "rows": rows, "per_round": per_round})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
