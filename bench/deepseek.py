"""DeepSeek-V3-shaped decode: Shuttle's engine (MLA over the latent paged cache, absorbed decode)
against transformers' generate on the same bfloat16 checkpoint, with the KV bytes per token of both.

    python bench/deepseek.py [--quick] [--batches 1 16 64] [--new-tokens 32]

The checkpoint (random weights, built here with transformers, about 300M parameters): hidden 1024,
6 layers (the first dense, intermediate 2816), 16 heads, q_lora_rank 384, kv_lora_rank 256,
qk_nope 64 + qk_rope 32, v_head 64, 32 routed experts of 512 (top-4 in 2 of 4 groups, sigmoid with
a correction bias, routed_scaling_factor 2.5) plus 1 shared expert, vocabulary 8192.
For each batch size: B prompts of 32 tokens, then the median engine step time while all B sequences
decode (Shuttle) and (time of generate(N new tokens) - time of generate(1)) / (N - 1) (transformers).
KV bytes per token are measured from the caches after a run: Shuttle's paged cache (bytes of a page
over its token slots) and transformers' DynamicCache (bytes of every layer's tensors over B x tokens);
"mha_equivalent" is what per-head keys and values would take (N x (qk_head_dim + v_head_dim)).
Writes bench/results/deepseek.json. Machine load changes absolute numbers; compare the ratios.
"""
import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from bench.engine import decode_step_time, hf_generate  # noqa: E402
from models.builtin import make_random_checkpoint, randomize_correction_bias  # noqa: E402
from server import LLM  # noqa: E402

SHAPE = dict(vocab_size=8192, hidden_size=1024, num_hidden_layers=6, first_k_dense_replace=1, intermediate_size=2816,
             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
             qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, moe_intermediate_size=512, num_experts_per_tok=4,
             n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=2048,
             bos_token_id=0, eos_token_id=0)


def checkpoint(out: Path, quick: bool) -> Path:
    from transformers import DeepseekV3Config

    shape = {**SHAPE, "num_hidden_layers": 2, "n_routed_experts": 8} if quick else SHAPE
    ckpt = make_random_checkpoint(out, DeepseekV3Config(**shape), seed=0, dtype="bfloat16")
    randomize_correction_bias(ckpt, 0)  # trained checkpoints have non-zero ones
    return ckpt


def hf_kv_bytes_per_token(hf, B: int) -> float:
    """Bytes transformers' cache holds per token (all layers) after a generate of B sequences."""
    ids = torch.randint(10, 4000, (B, 32))
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=1,
                          return_dict_in_generate=True)
    cache = out.past_key_values
    total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                if t is not None)
    return total / (B * cache.get_seq_length())


def run(ckpt: Path, batches: list[int], new_tokens: int) -> tuple[list[dict], dict]:
    from transformers import AutoModelForCausalLM

    llm = LLM(ckpt, max_num_seqs=max(batches), max_num_batched_tokens=4096)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    rows = []
    for B in batches:
        decode_step_time(llm, B, 32, 4)  # warm-up
        ours = decode_step_time(llm, B, 32, new_tokens)
        prompts = [[random.randrange(10, 4000) for _ in range(32)] for _ in range(B)]
        hf_generate(hf, prompts, 2)  # warm-up
        t0 = time.perf_counter()
        hf_generate(hf, prompts, 1)
        t1 = time.perf_counter()
        hf_generate(hf, prompts, new_tokens)
        theirs = (time.perf_counter() - t1 - (t1 - t0)) / (new_tokens - 1)
        rows.append({"batch": B, "shuttle_step_ms": 1e3 * ours, "transformers_step_ms": 1e3 * theirs,
                     "shuttle_tok_s": B / ours, "transformers_tok_s": B / theirs, "speedup": theirs / ours})
        print(rows[-1], flush=True)
    cfg, runner = llm.cfg, llm.engine.runner
    page = runner.cache.kv[0]
    m = cfg.mla
    kv = {"shuttle_kv_bytes_per_token": len(runner.cache.kv) * page[0].numel() * page.element_size() / page.shape[1],
          "shuttle_kv_bytes_per_token_config": cfg.kv_bytes_per_token(runner.dtype),
          "transformers_kv_bytes_per_token": hf_kv_bytes_per_token(hf, 2),
          "mha_equivalent_kv_bytes_per_token": cfg.num_layers * cfg.num_heads * (m.qk_head_dim + m.v_head_dim) * 2,
          "parameters": sum(p.numel() for p in hf.parameters())}
    return rows, kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 2-layer, 8-expert model (a smoke run, not for results)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    load_before = os.getloadavg()[0]  # the machine is shared: a busy one slows both sides
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = checkpoint(Path(tmp) / "ds3", args.quick)
        rows, kv = run(ckpt, args.batches, args.new_tokens)
    kv["load_avg_1min"] = [load_before, os.getloadavg()[0]]
    print_table(rows, ["batch", "shuttle_step_ms", "transformers_step_ms", "shuttle_tok_s", "transformers_tok_s",
                       "speedup"])
    for k, v in kv.items():
        print(f"{k}: {v}")
    if not args.quick:
        path = save("deepseek", {"shape": SHAPE, "new_tokens": args.new_tokens, "decode_bf16": rows, **kv,
                                 "date": time.strftime("%Y-%m-%d")})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
