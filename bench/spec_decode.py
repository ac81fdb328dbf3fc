"""Speculative decoding (n-gram drafts and the built-in model's MTP head, or --model's) against plain
decoding, side by side in one process.

The built-in model (models/builtin, trained on stdlib docstrings, with its MTP head) serves B prompts cut
from its held-out documents, greedy, EOS ignored, --output-len new tokens each, through `LLM.generate`:
- "copy": a document's first --doc-tokens tokens, a blank line, then its first 8 tokens again, so
  the continuation can copy the prompt (the case prompt lookup is for: code edits, quoting);
- "plain": the document's first --doc-tokens tokens alone (n-gram drafts come only from repeats).
Batch 1 is --solo-prompts prompts (4), each generated alone, one after another. Per workload and batch:
output tokens/s of the whole generate (prefill included) and TPOT (time per output token of a sequence:
(the generate's time - a 1-token generate's, prefill only) / (output-len - 1)), the median of --rounds rounds after a warm-up run of each, every engine alternated within a
round: "off" (no speculation), ngram with k = --ks drafts (prompt_lookup 1..3) and mtp (the
checkpoint's MTP layer, chained) with k = --mtp-ks, both never switched off (disable_by_batch_size
above the batch); beside each mtp k, "mtp+map": the same drafting from --token-map's tokens only (the
built-in model's models/builtin/mtp_token_map.json by default: its 1024 most frequent training tokens);
and "auto": the best k of each method (mtp: with or without the map) at the first batch (ngram: on
copy, mtp: on plain) with the default disable_by_batch_size (what a user gets). Beside each: acceptance (accepted /
draft tokens) and mean acceptance length (1 + accepted / drafts: the tokens a drafted sequence gains
per verify step, vLLM's definition). Greedy outputs are checked to equal "off"'s in float32 (in bf16
the verify pass rounds differently, so near-ties may differ: reported, not failed). --temperature T > 0
samples instead (unseeded: MTP drafts are drawn from the head's q and verified by rejection sampling) and
writes spec_decode_t<T>.json; with --seed S each request samples with seed S (its tokens those of plain
decoding: MTP drafts are point masses) and the file is spec_decode_t<T>_seed.json.

    python bench/spec_decode.py [--quick] [--methods ngram mtp] [--batches 1 16 64] [--ks 1 2 3]
                                [--mtp-ks 1 2 3] [--rounds 3] [--solo-prompts 4] [--token-map auto|none|PATH]
                                [--dtype float32] [--quantization int8]
    python bench/spec_decode.py --breakdown [--mtp-ks 1 2 3] [--dtype float32] [--rounds 5]
    python bench/spec_decode.py --served [--batches 1 16] [--mtp-ks 2 3] [--dtype bfloat16] [--rounds 3]

Writes bench/results/spec_decode.json (--quick: spec_decode_quick.json), with the host named.

--breakdown: where a step's time goes at batch 1 (plain workload, the solo prompts): for "off" and mtp (and
mtp+map) with each k, the fastest of --rounds (at least 5) generates, its steps, and per step the target's forward (a plain decode
step's one row, or the verify step's 1 + k rows: ModelRunner.execute), the MTP drafting
(ModelRunner.mtp_draft: the layer over the kept rows, chained k - 1 times, and its head) and the rest
of the engine step (scheduling, sampling, verification); then each mtp k's tokens/s against off's as
measured and with drafting free (the forward and the rest only: what a faster drafter could reach).
Writes spec_decode_breakdown.json (spec_decode_breakdown_<dtype>.json for another --dtype).

--served: the same engines as `shuttle serve --colocated` servers (--torch-threads 2, --dtype, no prefix
caching), loaded by
`shuttle bench serve` (greedy, EOS ignored) with the plain workload's prompts as text, at each batch as
the max concurrency (--solo-prompts x 4 prompts at batch 1, 4 x the batch above): output tokens/s, mean
TTFT and TPOT and the server's acceptance length, per engine the median over --rounds rounds (one server
per engine and round, engines alternated, the order reversed every other round), vs_off the median of the
rounds' ratios to "off". Writes spec_decode_served.json (spec_decode_served_<dtype>.json for another).
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


def spec(method: str, k: int, disable: int, token_map: str | None = None) -> dict:
    if method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": disable,
                **({"token_map": token_map} if token_map else {})}
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": disable}


def batches_of(tok, batch: int, doc_tokens: int, copy: bool, solo: int) -> list[list[list[int]]]:
    """The generates of one measurement: `batch` prompts in one generate, or at batch 1 `solo`
    prompts one generate after another (one prompt's acceptance is that document's luck)."""
    if batch == 1:
        return [[p] for p in prompts(tok, solo, doc_tokens, copy)]
    return [prompts(tok, batch, doc_tokens, copy)]


def run(llm: LLM, groups: list[list[list[int]]], params: SamplingParams) -> tuple[float, float, list[list[int]]]:
    """(output tokens/s, seconds, greedy ids) of the groups' generates, one after another."""
    t0 = time.perf_counter()
    outs = [o for ps in groups for o in llm.generate(ps, params)]
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt, dt, [o.outputs[0].token_ids for o in outs]


def tpot_ms(full: list[float], first: list[float], output_len: int, generates: int = 1) -> float:
    """Time per output token of a sequence (ms): the median over rounds of (the whole generates - their
    1-token generates) / (output_len - 1) / the number of generates."""
    return 1e3 * statistics.median((f - p) / max(1, output_len - 1) / generates for f, p in zip(full, first))


def quant_suffix(args: argparse.Namespace) -> str:
    """The results file's name ending for --quantization ("" without one)."""
    return f"_{args.quantization}" if args.quantization else ""


def mtp_engines(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(name, token map) of the mtp engines of each k: the whole head, and with --token-map its rows."""
    return [("mtp", None)] + ([("mtp+map", args.token_map)] if args.token_map else [])


def breakdown(args: argparse.Namespace, params: SamplingParams) -> None:
    """--breakdown (module docstring)."""
    from attention_nodes.model_runner import ModelRunner

    spent: dict[str, float] = {}
    originals = {name: getattr(ModelRunner, name) for name in ("execute", "mtp_draft")}

    def timed(name: str):
        def call(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return originals[name](self, *a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
                spent[name + "_calls"] = spent.get(name + "_calls", 0) + 1
        return call

    rows = []
    try:
        for name in originals:
            setattr(ModelRunner, name, timed(name))
        engines = [("off", None)]
        for k in args.mtp_ks:
            engines += [(f"{name} k={k}", spec("mtp", k, 10 ** 6, tm)) for name, tm in mtp_engines(args)]
        for label, cfg in engines:
            llm = LLM(args.model, dtype=args.dtype, num_kv_blocks=args.kv_blocks, speculative_config=cfg,
                      quantization=args.quantization)
            try:
                groups = batches_of(llm.tokenizer, 1, args.doc_tokens, False, args.solo_prompts)
                run(llm, groups, params)  # warm-up
                best = None
                for _ in range(args.rounds):
                    spent.clear()
                    t0 = time.perf_counter()
                    run(llm, groups, params)
                    took = (time.perf_counter() - t0, dict(spent))
                    best = took if best is None or took[0] < best[0] else best
            finally:
                llm.shutdown()
            dt, s = best
            steps = int(s["execute_calls"])
            fwd, draft = s["execute"], s.get("mtp_draft", 0.0)
            rows.append({"engine": label, "generate_ms": 1e3 * dt, "steps": steps, "step_ms": 1e3 * dt / steps,
                         "forward_ms": 1e3 * fwd / steps, "draft_ms": 1e3 * draft / steps,
                         "rest_ms": 1e3 * (dt - fwd - draft) / steps, "tok_s": len(groups) * args.output_len / dt,
                         "tok_s_draft_free": len(groups) * args.output_len / (dt - draft)})
    finally:
        for name, f in originals.items():
            setattr(ModelRunner, name, f)
    off = rows[0]
    for r in rows:
        r["forward_vs_off_step"] = r["forward_ms"] / off["forward_ms"]
        r["vs_off"], r["vs_off_draft_free"] = r["tok_s"] / off["tok_s"], r["tok_s_draft_free"] / off["tok_s"]
    print_table(rows, ["engine", "steps", "step_ms", "forward_ms", "forward_vs_off_step", "draft_ms", "rest_ms",
                       "tok_s", "vs_off", "vs_off_draft_free"])
    name = "spec_decode_breakdown" + ("" if args.dtype == "float32" else f"_{args.dtype}") + quant_suffix(args)
    path = save(name, {"host": describe_host(), "config": vars(args), "rows": rows})
    print(f"wrote {path}")


def served(args: argparse.Namespace) -> None:
    """--served (module docstring)."""
    import json
    import tempfile

    from clients.bench_serve import run_bench
    from clients.live_server import LiveServer

    model = (["--model", args.model] if args.model else []) + (["--quantization", args.quantization]
                                                               if args.quantization else [])
    engines = {"off": []}
    for k in args.mtp_ks:
        for name, tm in mtp_engines(args):
            engines[f"{name} k={k}"] = ["--speculative-config", json.dumps(spec("mtp", k, 10 ** 6, tm))]
    llm = LLM(args.model, dtype=args.dtype, num_kv_blocks=64)  # (for its tokenizer)
    tok = llm.tokenizer
    llm.shutdown()
    rows, per_round = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for b in args.batches:
            n = args.solo_prompts * 4 if b == 1 else 4 * b
            data = Path(tmp) / f"prompts_{b}.jsonl"
            data.write_text("".join(json.dumps({"prompt": tok.decode(ids)}) + "\n"
                                    for ids in prompts(tok, n, args.doc_tokens, False)))
            got = {name: [] for name in engines}
            for r in range(args.rounds):
                for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                    with LiveServer([*model, "--colocated", "--torch-threads", "2", "--dtype", args.dtype,
                                     "--no-prefix-caching", *engines[name]]) as srv:
                        common = ["--base-url", srv.url, "--dataset", str(data), "--output-len", str(args.output_len),
                                  "--max-concurrency", str(b), "--ignore-eos", "--temperature", "0", "--disable-tqdm"]
                        run_bench([*common, "--num-prompts", str(b)])  # warm-up
                        got[name].append(run_bench([*common, "--num-prompts", str(n)]))
            for name, results in got.items():
                med = {k: statistics.median(x[k] for x in results)
                       for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")}
                accept = [x["spec_decode_acceptance_length"] for x in results if "spec_decode_acceptance_length" in x]
                rows.append({"batch": b, "engine": name, "tok_s": med["output_throughput"],
                             "vs_off": statistics.median(x["output_throughput"] / o["output_throughput"]
                                                         for x, o in zip(results, got["off"])),
                             "ttft_ms": med["mean_ttft_ms"], "tpot_ms": med["mean_tpot_ms"],
                             "tpot_vs_off": statistics.median(o["mean_tpot_ms"] / x["mean_tpot_ms"]
                                                              for x, o in zip(results, got["off"])),
                             "mean_accept_len": statistics.median(accept) if accept else None})
                per_round[f"{b}/{name}"] = [x["output_throughput"] for x in results]
    print_table(rows, ["batch", "engine", "tok_s", "vs_off", "ttft_ms", "tpot_ms", "tpot_vs_off", "mean_accept_len"])
    name = "spec_decode_served" + ("" if args.dtype == "float32" else f"_{args.dtype}") + quant_suffix(args)
    path = save(name, {"host": describe_host(), "config": vars(args), "rows": rows, "per_round": per_round})
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="batches 1 and 16, k 1 and 3, 2 rounds, 32 new tokens")
    p.add_argument("--methods", nargs="+", choices=["ngram", "mtp"], default=["ngram", "mtp"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="ngram drafts")
    p.add_argument("--mtp-ks", type=int, nargs="+", default=[1, 2, 3], help="mtp drafts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--solo-prompts", type=int, default=4, help="batch 1: this many prompts, one generate each")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--doc-tokens", type=int, default=96)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None, help="every engine's --quantization (int8, fp8, ...; default none): "
                                                        "the results file gets _<quantization> added to its name")
    p.add_argument("--model", default=None, help="a checkpoint with an MTP layer (default: the built-in model); the "
                                                 "prompts are the built-in corpus's held-out documents in its tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampling at T")
    p.add_argument("--seed", type=int, default=None, help="with --temperature: seeded requests")
    p.add_argument("--kv-blocks", type=int, default=1024, help="KV cache blocks of each engine (16 tokens each)")
    p.add_argument("--breakdown", action="store_true", help="per-step costs at batch 1 instead (module docstring)")
    p.add_argument("--served", action="store_true", help="mtp engines as `shuttle serve` under `shuttle bench serve` "
                                                       "instead (module docstring)")
    p.add_argument("--token-map", default="auto", help="mtp+map engines beside the mtp ones, drafting from this token "
                                                      "map's tokens (auto: the built-in model's "
                                                      "mtp_token_map.json, none with --model; none: no such engines)")
    args = p.parse_args()
    if args.token_map == "auto":
        from models.builtin import BUILTIN_DIR
        args.token_map = str(BUILTIN_DIR / "mtp_token_map.json") if args.model is None else None
    elif args.token_map == "none":
        args.token_map = None
    if args.solo_prompts < 1:
        p.error("--solo-prompts must be at least 1")
    if args.breakdown:
        args.rounds = max(args.rounds, 5)
        return breakdown(args, SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True))
    if args.served:
        return served(args)
    if args.quick:
        args.batches, args.ks, args.mtp_ks, args.rounds, args.output_len = [1, 16], [1, 3], [1, 3], 2, 32
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True,
                            seed=args.seed if args.temperature > 0 else None)
    first_only = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    never = 10 ** 6
    ks = {"ngram": args.ks, "mtp": args.mtp_ks}

    def llm(speculative: dict | None = None) -> LLM:
        return LLM(args.model, dtype=args.dtype, num_kv_blocks=args.kv_blocks, speculative_config=speculative,
                   quantization=args.quantization)

    engines = {"off": llm()}
    for method in args.methods:
        for k in ks[method]:
            for name, tm in (mtp_engines(args) if method == "mtp" else [(method, None)]):
                engines[f"{name} k={k}"] = llm(spec(method, k, never, tm))
    tok = engines["off"].tokenizer
    rows, per_round = [], {}
    try:
        for copy in (True, False):
            workload = "copy" if copy else "plain"
            for b in args.batches:
                ps = batches_of(tok, b, args.doc_tokens, copy, args.solo_prompts)
                names = list(engines)
                rates, secs, firsts = ({n: [] for n in names} for _ in range(3))
                before = {n: dict(e.engine.stats().get("spec_decode") or {}) for n, e in engines.items()}
                want, same = None, {}
                for n in names:  # warm-up: first calls, buffers and caches at this batch
                    run(engines[n], ps, params)
                for r in range(args.rounds):
                    for n in (names if r % 2 == 0 else names[::-1]):
                        rate, dt, ids = run(engines[n], ps, params)
                        firsts[n].append(run(engines[n], ps, first_only)[1])
                        rates[n].append(rate)
                        secs[n].append(dt)
                        if n == "off":
                            want = ids
                        else:
                            same.setdefault(n, []).append(ids)
                base = statistics.median(rates["off"])
                for n in names:
                    spec_stats = engines[n].engine.stats().get("spec_decode") or {}
                    drafted = spec_stats.get("num_draft_tokens", 0) - before[n].get("num_draft_tokens", 0)
                    accepted = spec_stats.get("num_accepted_tokens", 0) - before[n].get("num_accepted_tokens", 0)
                    drafts = spec_stats.get("num_drafts", 0) - before[n].get("num_drafts", 0)
                    tput = statistics.median(rates[n])
                    rows.append({"workload": workload, "batch": b, "engine": n, "tok_s": tput,
                                 "vs_off": tput / base, "tpot_ms": tpot_ms(secs[n], firsts[n], args.output_len, len(ps)),
                                 "acceptance": accepted / drafted if drafted else None,
                                 "mean_accept_len": 1 + accepted / drafts if drafts else None,
                                 "greedy_equal": None if n == "off" or args.temperature > 0
                                 else all(ids == want for ids in same[n])})
                    per_round[f"{workload}/{b}/{n}"] = rates[n]
        # "auto": each method's best k at the first batch (ngram: copy workload; mtp: plain), switched
        # off above the default size
        for method in args.methods:
            workload0 = "copy" if method == "ngram" else "plain"
            first = [r for r in rows if r["workload"] == workload0 and r["batch"] == args.batches[0]
                     and r["engine"].startswith(method)]
            top = max(first, key=lambda r: r["tok_s"])["engine"]  # (mtp: with or without the token map)
            kind, best = top.rpartition(" k=")[0], int(top.rpartition("=")[2])
            auto = llm(spec(method, best, DEFAULT_DISABLE_BY_BATCH_SIZE, args.token_map if kind == "mtp+map" else None))
            name = f"auto {kind} (k={best})"
            try:
                for copy in (True, False):
                    workload = "copy" if copy else "plain"
                    for b in args.batches:
                        ps = batches_of(tok, b, args.doc_tokens, copy, args.solo_prompts)
                        rates, secs, firsts = ({"off": [], "auto": []} for _ in range(3))
                        run(auto, ps, params)
                        for r in range(args.rounds):
                            for n in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
                                e = engines["off"] if n == "off" else auto
                                rate, dt, _ = run(e, ps, params)
                                rates[n].append(rate)
                                secs[n].append(dt)
                                firsts[n].append(run(e, ps, first_only)[1])
                        rows.append({"workload": workload, "batch": b, "engine": name,
                                     "tok_s": statistics.median(rates["auto"]),
                                     "vs_off": statistics.median(a / o for a, o in zip(rates["auto"], rates["off"])),
                                     "tpot_ms": tpot_ms(secs["auto"], firsts["auto"], args.output_len, len(ps)),
                                     "acceptance": None, "mean_accept_len": None, "greedy_equal": None})
                        per_round[f"{workload}/{b}/{name}"] = rates["auto"]
            finally:
                auto.shutdown()
    finally:
        for e in engines.values():
            e.shutdown()
    print_table(rows, ["workload", "batch", "engine", "tok_s", "vs_off", "tpot_ms", "acceptance", "mean_accept_len",
                       "greedy_equal"])
    name = ("spec_decode_quick" if args.quick else "spec_decode") + quant_suffix(args)
    path = save(name + (f"_t{args.temperature:g}" + ("_seed" if args.seed is not None else "")
                        if args.temperature > 0 else ""),
                {"host": describe_host(), "config": vars(args), "default_disable_by_batch_size":
                 DEFAULT_DISABLE_BY_BATCH_SIZE, "rows": rows, "per_round": per_round})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
