"""--quantization int8, w8a8_int8, fp8 and mxfp4 against the same checkpoint served unquantised: decode speed,
memory, quality.

Speed: a Mixtral-shaped checkpoint with random weights (hidden 1024, 8 layers, 16 query / 4 KV heads,
8 experts of 2048, top-2; ~428M parameters, the shape of the CPU throughput issue), served colocated
by `LLM` in --dtype unquantised ("base"), with `quantization="int8"`, with "w8a8_int8" ("w8a8": int8
weights and per-token int8 activations), with "fp8" (FP8 128 x 128
blocks quantised at load: the layout and kernels an FP8 checkpoint is served with) and with "mxfp4"
(E2M1 codes, an E8M0 scale per 32 inputs: gpt-oss's format, quantised at load), and int8 and fp8
with quantize_linears ("int8_linears", "fp8_linears": the attention projections in that format too),
and "base_again", a second unquantised engine of the same checkpoint (its ratio to base is the run's
noise: how far two identical engines differ), all loaded in this process. Per batch B:
B prompts of 32 tokens, --output-len new tokens, greedy, EOS ignored; output tokens/s of the whole
generate (prefill included), and decode tokens/s: the tokens after the first over the generate's time
less that of a 1-token generate of the same prompts timed just before it (prefill and first token),
as vLLM's TPOT leaves out the first token; each the median of --rounds rounds, the configurations
alternated within a round. Beside it each configuration's memory floor at that batch: its resident weight bytes that a
decode step reads (everything but the embedding table, and of the experts the expected share B
tokens touch, 1 - (1 - K/E)^B) over this machine's read bandwidth, as tokens/s.

Memory: a checkpoint whose experts dominate its size, as those of real MoE releases do (the same
shape with --memory-experts experts, 48 unless --quick: 4.5 GiB of bf16 experts, against which the
~0.3 GiB that torch and the worker keep resident whatever the weights are small), served by 1 + 1
pools in each configuration: the expert worker's resident set (VmRSS, by its process title
shuttle-expert-e0) after a short generate, beside the expert bytes its start-up log reports.

Quality: the built-in model (bf16 weights) in --dtype in each configuration: perplexity on
its held-out documents (the first --ppl-tokens tokens of each, from prompt log-probabilities) and
greedy agreement over --agree-prompts prompts cut from the same documents (share of sequences whose
--agree-tokens generated tokens are identical, and share of tokens before the first difference).

    python bench/quant.py [--quick] [--batch-sizes 1 16 64 256] [--dtype bfloat16] [--memory-experts 48]
                          [--no-pools-memory] [--no-quality] [--configs int8 w8a8 fp8 mxfp4 int8_linears ...]

--quick: batches 1 and 16, 16 new tokens, 2 rounds, fewer quality prompts. Writes
bench/results/quant.json (quant_quick.json).
"""
import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from bench.engine import mixtral, read_bandwidth  # noqa: E402
from bench.soak import rss_bytes  # noqa: E402
from bench.soak_faults import process_title  # noqa: E402
from server import LLM, SamplingParams  # noqa: E402

CONFIGS = {"base": {}, "base_again": {}, "int8": {"quantization": "int8"}, "w8a8": {"quantization": "w8a8_int8"},
           "fp8": {"quantization": "fp8"}, "mxfp4": {"quantization": "mxfp4"},
           "int8_linears": {"quantization": "int8", "quantize_linears": True},
           "fp8_linears": {"quantization": "fp8", "quantize_linears": True}}


def quantized(args: argparse.Namespace, again: bool = True) -> list[str]:
    """The configurations run besides "base" (again=False: less "base_again", which only speed runs: its
    weights and quality are base's)."""
    return [name for name in args.configs if name != "base" and (again or name != "base_again")]


def weights_configs(args: argparse.Namespace) -> dict:
    """args.configs less "base_again" (for memory and quality)."""
    return {name: q for name, q in args.configs.items() if name != "base_again"}


def step_bytes(llm: LLM, batch: int) -> float:
    """Weight bytes one decode step of `batch` tokens reads: all but the embedding table, and of the
    experts the expected share the batch's tokens route to."""
    r, cfg = llm.engine.runner.resident_bytes, llm.cfg
    touched = 1 - (1 - cfg.top_k / cfg.num_experts) ** batch
    return r["other"] + r["experts"] * touched


def speed(args: argparse.Namespace, ckpt: Path) -> tuple[list[dict], dict, float]:
    llms = {name: LLM(ckpt, dtype=args.dtype, **q, max_num_seqs=max(args.batch_sizes),
                      max_num_batched_tokens=max(2048, 32 * max(args.batch_sizes)))
            for name, q in args.configs.items()}
    bandwidth = read_bandwidth()
    rows = []
    try:
        for B in args.batch_sizes:
            prompts = torch.randint(10, 4000, (B, 32), generator=torch.Generator().manual_seed(B)).tolist()
            sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
            for llm in llms.values():  # warm-up: this batch's shapes once
                llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
            rates, decode = {name: [] for name in llms}, {name: [] for name in llms}
            for rnd in range(args.rounds):
                for name in (list(llms) if rnd % 2 == 0 else list(llms)[::-1]):
                    t0 = time.perf_counter()
                    llms[name].generate(prompts, first)
                    t1 = time.perf_counter()
                    llms[name].generate(prompts, sp)
                    t2 = time.perf_counter()
                    rates[name].append(B * args.output_len / (t2 - t1))
                    decode[name].append(B * (args.output_len - 1) / max(1e-9, (t2 - t1) - (t1 - t0)))
            row = {"batch": B}
            for name, llm in llms.items():
                row[f"{name}_tok_s"] = statistics.median(rates[name])
                row[f"{name}_rounds"] = [round(r, 1) for r in rates[name]]
                row[f"{name}_decode_tok_s"] = statistics.median(decode[name])
                row[f"{name}_decode_rounds"] = [round(r, 1) for r in decode[name]]
                row[f"{name}_floor_tok_s"] = B * bandwidth / step_bytes(llm, B)
            for name in quantized(args):
                row[f"{name}_vs_base"] = row[f"{name}_tok_s"] / row["base_tok_s"]
                row[f"{name}_decode_vs_base"] = row[f"{name}_decode_tok_s"] / row["base_decode_tok_s"]
            rows.append(row)
            print_table([row], ["batch", *(f"{n}_tok_s" for n in args.configs),
                                *(f"{n}_vs_base" for n in quantized(args)),
                                *(f"{n}_decode_vs_base" for n in quantized(args)),
                                *(f"{n}_floor_tok_s" for n in args.configs)])
        memory = {name: dict(llm.engine.runner.resident_bytes) for name, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.shutdown()
    return rows, memory, bandwidth


def _rss_mib(title: str) -> float | None:
    """VmRSS in MiB of the process whose title is `title` (this run's only one), or None."""
    pids = (int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit())
    pid = next((p for p in pids if process_title(p) == title), None)
    nbytes = None if pid is None else rss_bytes(pid)
    return None if nbytes is None else nbytes / 2 ** 20


def pools_memory(args: argparse.Namespace, ckpt: Path) -> dict:
    """The expert worker's RSS and reported expert bytes of every configuration (1 + 1 pools)."""
    out = {}
    for name, q in weights_configs(args).items():
        llm = LLM(ckpt, dtype=args.dtype, **q, colocated=False, attention_workers=1, expert_workers=1)
        try:
            llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            weights = {(r["pool"], r["kind"]): r["bytes"] for r in llm.engine.stats()["weights"]}
            out[name] = {"expert_rss_mib": _rss_mib("shuttle-expert-e0"),
                         "expert_weights_mib": weights.get(("expert", "experts"), 0) / 2 ** 20}
        finally:
            llm.shutdown()
    if all(v["expert_rss_mib"] for v in out.values()):
        for name in quantized(args, again=False):
            out[f"{name}_rss_vs_base"] = out[name]["expert_rss_mib"] / out["base"]["expert_rss_mib"]
            out[f"{name}_weights_vs_base"] = out[name]["expert_weights_mib"] / out["base"]["expert_weights_mib"]
    return out


def quality(args: argparse.Namespace) -> dict:
    from models.builtin import builtin_model_dir
    from training.builtin import documents, is_held_out

    llms = {name: LLM(builtin_model_dir(), dtype=args.dtype, **q) for name, q in weights_configs(args).items()}
    try:
        tok = llms["base"].tokenizer
        docs = [tok.encode(text)[:args.ppl_tokens] for name, text in documents() if is_held_out(name)]
        docs = [d for d in docs if len(d) > 16]
        out = {}
        for name, llm in llms.items():
            outs = llm.generate(docs, SamplingParams(max_tokens=1, prompt_logprobs=0))
            nll = [-o.prompt_logprobs[i][d[i]].logprob for o, d in zip(outs, docs) for i in range(1, len(d))]
            out[f"{name}_ppl"] = float(torch.tensor(nll).mean().exp())
        out["held_out_tokens"] = sum(len(d) - 1 for d in docs)
        for name in quantized(args, again=False):
            out[f"{name}_ppl_vs_base"] = out[f"{name}_ppl"] / out["base_ppl"]
        step = max(1, sum(map(len, docs)) // args.agree_prompts)
        flat = [t for d in docs for t in d]
        prompts = [flat[i:i + 16] for i in range(0, len(flat) - 16, step)][:args.agree_prompts]
        sp = SamplingParams(max_tokens=args.agree_tokens, temperature=0, ignore_eos=True)
        ids = {name: [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] for name, llm in llms.items()}
        out["agree_prompts"] = len(prompts)
        for name in quantized(args, again=False):
            same_prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                           for x, y in zip(ids["base"], ids[name])]
            out[f"{name}_greedy_identical_share"] = sum(n == args.agree_tokens for n in same_prefix) / len(prompts)
            out[f"{name}_greedy_tokens_before_first_difference_share"] = \
                sum(same_prefix) / (len(prompts) * args.agree_tokens)
    finally:
        for llm in llms.values():
            llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--dtype", default="bfloat16", help="the activations' (and the base weights') dtype")
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--ppl-tokens", type=int, default=512)
    ap.add_argument("--agree-prompts", type=int, default=None)
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--no-pools-memory", dest="pools_memory", action="store_false",
                    help="skip the 1 + 1 pools' expert worker RSS")
    ap.add_argument("--no-quality", dest="quality", action="store_false",
                    help="skip the built-in model's perplexity and greedy agreement")
    ap.add_argument("--memory-experts", type=int, default=None,
                    help="experts of the checkpoint whose expert worker's RSS is measured (default 48, --quick 8: "
                         "the speed checkpoint)")
    ap.add_argument("--configs", nargs="+", choices=[n for n in CONFIGS if n != "base"], default=None,
                    help="the configurations to run beside base (default all)")
    args = ap.parse_args()
    args.configs = {n: q for n, q in CONFIGS.items() if n == "base" or args.configs is None or n in args.configs}
    args.batch_sizes = args.batch_sizes or ([1, 16] if args.quick else [1, 16, 64, 256])
    args.output_len = args.output_len or (16 if args.quick else 64)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.agree_prompts = args.agree_prompts or (20 if args.quick else 100)
    args.memory_experts = args.memory_experts or (8 if args.quick else 48)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = mixtral(Path(tmp) / "mixtral", "bfloat16", 1024, 2048, 8, 16, 4)
        # speed first: after the pools' phase (worker processes, a 4.5 GiB checkpoint written and
        # removed) batch 1 and 16 measured 10-15% lower against bf16 for minutes
        rows, memory, bandwidth = speed(args, ckpt)
        pools = None
        if args.pools_memory:
            big = ckpt if args.memory_experts == 8 else mixtral(Path(tmp) / "mixtral_memory", "bfloat16", 1024, 2048,
                                                                8, 16, 4, experts=args.memory_experts)
            pools = pools_memory(args, big)
            if big != ckpt:
                shutil.rmtree(big)
    if pools:
        print({k: v for k, v in pools.items()})
    q = quality(args) if args.quality else None
    if q:
        names = quantized(args, again=False)
        print_table([q], ["base_ppl", *(f"{n}_ppl" for n in names), *(f"{n}_ppl_vs_base" for n in names),
                          *(f"{n}_greedy_identical_share" for n in names)])
    print({name: {k: f"{v / 2 ** 20:.1f} MiB" for k, v in m.items()} for name, m in memory.items()})
    path = save("quant_quick" if args.quick else "quant",
                {"config": {k: list(v) if k == "configs" else v for k, v in vars(args).items()},
                 "read_bandwidth_GBps": bandwidth / 1e9,
                 "resident_bytes": memory, "pools_memory": pools, "speed": rows, "quality": q})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
