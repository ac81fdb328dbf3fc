"""Decode throughput of Shuttle's LLM.generate against transformers' generate, same checkpoint.

    python bench/generate.py [--batch-sizes 1 16 64] [--dtype bfloat16] [--output-len 64]

Builds a Mixtral-shaped checkpoint with random weights (hidden 512, 4 layers, 8 experts, top-2)
large enough that matmuls dominate, then for each batch size times, in the same process:
  e2e    = generate(prompt_len=32 tokens, output_len new tokens), prefill included
  decode = (e2e - time of a 1-token generate) / (output_len - 1) per step
Greedy, EOS ignored, so both produce exactly B * output_len tokens. Prints a table and writes
bench/results/generate.json with the ratio shuttle / transformers.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import best_of, print_table, save  # noqa: E402
from models.builtin import make_random_checkpoint  # noqa: E402
from server import LLM, SamplingParams  # noqa: E402


def build_checkpoint(out: Path, dtype: str) -> Path:
    from transformers import MixtralConfig

    cfg = MixtralConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=1024, bos_token_id=0, eos_token_id=0)
    return make_random_checkpoint(out, cfg, seed=0, dtype=dtype)


def run(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint(Path(tmp), args.dtype)
        llm = LLM(ckpt)
        hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).eval()
        hf.generation_config.eos_token_id = None
        rows = []
        for B in args.batch_sizes:
            prompts = torch.randint(10, 4000, (B, args.prompt_len))

            def ours(n: int):
                return llm.generate(prompts.tolist(), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))

            def theirs(n: int):
                with torch.inference_mode():
                    return hf.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=1)

            out = ours(args.output_len)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in out)
            row = {"batch": B}
            for name, fn in (("shuttle", ours), ("transformers", theirs)):
                t_full = best_of(lambda: fn(args.output_len), args.repeats)
                t_one = best_of(lambda: fn(1), args.repeats)
                row[f"{name}_e2e_tok_s"] = B * args.output_len / t_full
                row[f"{name}_decode_tok_s"] = B * (args.output_len - 1) / max(t_full - t_one, 1e-9)
            row["e2e_ratio"] = row["shuttle_e2e_tok_s"] / row["transformers_e2e_tok_s"]
            row["decode_ratio"] = row["shuttle_decode_tok_s"] / row["transformers_decode_tok_s"]
            rows.append(row)
            print(f"batch {B}: decode {row['shuttle_decode_tok_s']:.0f} vs {row['transformers_decode_tok_s']:.0f} "
                  f"tok/s ({row['decode_ratio']:.2f}x)", flush=True)
    print(f"\nLLM.generate vs transformers generate, {args.dtype}, prompt {args.prompt_len}, "
          f"output {args.output_len}, {torch.get_num_threads()} threads")
    print_table(rows, ["batch", "shuttle_decode_tok_s", "transformers_decode_tok_s", "decode_ratio",
                       "shuttle_e2e_tok_s", "transformers_e2e_tok_s", "e2e_ratio"])
    path = save(f"generate_{args.dtype}" if args.dtype != "bfloat16" else "generate", {
        "benchmark": "generate", "dtype": args.dtype, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "model": "mixtral-shaped random: hidden 512, 4 layers, 8 experts top-2, inter 1024, vocab 4096",
        "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    print(f"wrote {path}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    run(p.parse_args())
