"""The engine's throughput: continuous against static batching, against transformers, and decode
against this machine's memory roofline.

    python bench/engine.py [--quick]

Part 1, mixed-length workload (float32 checkpoint, hidden 512, 4 layers, 8 experts top-2):
  64 requests, prompts of 8..96 tokens, 8..128 new tokens each (EOS ignored), at most 16 in flight.
  continuous = every request submitted at once to one engine (requests join and leave each step);
  static     = the same engine fed batches of 16, each waiting until its longest request ends;
  transformers = generate() on the same batches of 16 (left-padded, run to the batch's longest).
  Throughput counts only the requested output tokens.
Part 2, decode in bfloat16 on a Mixtral-shaped checkpoint of ~425M parameters (hidden 1024, 8 layers,
  16 heads, 4 KV heads, 8 experts of 2048, top-2), 32-token prompts, 64 new tokens, batch 1/16/64:
  decode step time of the engine and of transformers' generate. Memory floor: the weight bytes a
  decode step must read (the active experts' and every other layer's weights, the LM head) over the
  copy bandwidth measured in this run (bytes read plus written per second of a 1 GiB copy); compute
  floor: the step's matmul FLOPs over a 2048^3 bf16 matmul's rate measured in this run. "mem_roof"
  is memory floor / measured step; "read_roof" the same with the bandwidth of a pure read (a sum over
  1 GiB), which on some machines is well below the copy rate; "roof" is max(read floor, compute
  floor) / measured step.
Writes bench/results/engine.json.
"""
import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import best_of, print_table, save  # noqa: E402
from models.builtin import make_random_checkpoint  # noqa: E402
from server import LLM, SamplingParams  # noqa: E402


def mixtral(out: Path, dtype: str, hidden: int, inter: int, layers: int, heads: int, kv: int) -> Path:
    from transformers import MixtralConfig

    cfg = MixtralConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv, num_local_experts=8,
                        num_experts_per_tok=2, max_position_embeddings=1024, bos_token_id=0, eos_token_id=0)
    return make_random_checkpoint(out, cfg, seed=0, dtype=dtype, tokenizer_dir=None)


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 1 GiB tensor copy (best of 5)."""
    src = torch.ones(1 << 28, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_of(lambda: dst.copy_(src), 5)


def read_bandwidth() -> float:
    """Bytes read per second by summing a 1 GiB tensor (best of 5): what streaming weights can reach."""
    src = torch.ones(1 << 28, dtype=torch.float32)
    return src.numel() * 4 / best_of(src.sum, 5)


def matmul_rate(dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of a 2048^3 matmul in dtype (best of 5): the compute ceiling of this machine."""
    a = torch.randn(2048, 2048, dtype=dtype)
    return 2 * 2048 ** 3 / best_of(lambda: a @ a, 5)


def step_flops(llm: LLM, B: int, context: int) -> float:
    """Matmul FLOPs of one decode step of B tokens: every non-expert weight, K experts per token, and
    attention over `context` keys."""
    cfg, sizes = llm.cfg, llm.engine.runner.weight_bytes
    elem = llm.engine.runner.dtype.itemsize
    per_token = sizes["other"] / elem + sizes["experts"] / elem * cfg.top_k / cfg.num_experts
    attention = 4 * context * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return 2 * B * per_token + B * attention


def hf_generate(hf, batch: list[list[int]], new_tokens: int) -> None:
    L = max(len(p) for p in batch)
    ids = torch.tensor([[1] * (L - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
    with torch.inference_mode():
        hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                    pad_token_id=1)


def mixed_workload(ckpt: Path, n: int, in_flight: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    reqs = [([rng.randrange(10, 4000) for _ in range(rng.randint(8, 96))], rng.randint(8, 128)) for _ in range(n)]
    useful = sum(m for _, m in reqs)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
    llm = LLM(ckpt, max_num_seqs=in_flight)
    llm.generate([p for p, _ in reqs[:4]], params[:4])  # warm-up
    rows = []
    t0 = time.perf_counter()
    llm.generate([p for p, _ in reqs], params)
    rows.append({"mode": "continuous (shuttle)", "seconds": time.perf_counter() - t0})
    t0 = time.perf_counter()
    for i in range(0, n, in_flight):
        batch = reqs[i:i + in_flight]
        llm.generate([p for p, _ in batch], [SamplingParams(max_tokens=max(m for _, m in batch), temperature=0,
                                                            ignore_eos=True)] * len(batch))
    rows.append({"mode": "static (shuttle engine)", "seconds": time.perf_counter() - t0})
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    t0 = time.perf_counter()
    for i in range(0, n, in_flight):
        batch = reqs[i:i + in_flight]
        hf_generate(hf, [p for p, _ in batch], max(m for _, m in batch))
    rows.append({"mode": "static (transformers)", "seconds": time.perf_counter() - t0})
    for r in rows:
        r["useful_tokens"] = useful
        r["tok_per_s"] = useful / r["seconds"]
        r["vs_continuous"] = rows[0]["seconds"] / r["seconds"]
    return rows


def decode_step_time(llm: LLM, B: int, prompt_len: int, new_tokens: int) -> float:
    """Median wall time of the engine steps in which every sequence decodes one token."""
    rng = random.Random(B)
    engine = llm.engine
    for b in range(B):
        engine.add_request(f"d{B}-{b}", [rng.randrange(10, 4000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        decoding = len(engine.scheduler.running) == B and not engine.scheduler.waiting
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def step_weight_bytes(llm: LLM, B: int) -> float:
    """Bytes of weights one decode step of B tokens reads: all but the embedding table, with only the
    experts that B random tokens x top-k are expected to hit."""
    cfg, sizes = llm.cfg, llm.engine.runner.weight_bytes
    E, K = cfg.num_experts, cfg.top_k
    active = E * (1 - (1 - K / E) ** B)  # expected distinct experts hit
    lm_head = sizes["embedding"] if cfg.tie_word_embeddings else 0  # tied: the head reads the table
    return sizes["other"] + lm_head + sizes["experts"] * active / E


def decode_roofline(ckpt: Path, batches: list[int], new_tokens: int, bw: float, read_bw: float,
                    rate: float) -> list[dict]:
    from transformers import AutoModelForCausalLM

    llm = LLM(ckpt, max_num_seqs=max(batches), max_num_batched_tokens=4096)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    rows = []
    for B in batches:
        decode_step_time(llm, B, 32, 4)  # warm-up
        ours = decode_step_time(llm, B, 32, new_tokens)
        prompts = [[random.randrange(10, 4000) for _ in range(32)] for _ in range(B)]
        t0 = time.perf_counter()
        hf_generate(hf, prompts, 1)
        t1 = time.perf_counter()
        hf_generate(hf, prompts, new_tokens)
        theirs = (time.perf_counter() - t1 - (t1 - t0)) / (new_tokens - 1)
        floor = step_weight_bytes(llm, B) / bw
        compute = step_flops(llm, B, 32 + new_tokens // 2) / rate
        rows.append({"batch": B, "shuttle_step_ms": 1e3 * ours, "transformers_step_ms": 1e3 * theirs,
                     "shuttle_tok_s": B / ours, "transformers_tok_s": B / theirs, "speedup": theirs / ours,
                     "mem_floor_ms": 1e3 * floor, "compute_floor_ms": 1e3 * compute,
                     "shuttle_mem_roof": floor / ours, "transformers_mem_roof": floor / theirs,
                     "shuttle_read_roof": floor * bw / read_bw / ours,
                     "shuttle_roof": max(floor * bw / read_bw, compute) / ours})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workload (a smoke run, not for results)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    n, new_tokens = (16, 16) if args.quick else (64, 64)
    bw, read_bw, rate = copy_bandwidth(), read_bandwidth(), matmul_rate()
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write), read {read_bw / 1e9:.1f} GB/s, "
          f"bf16 matmul {rate / 1e9:.0f} GFLOP/s, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        small = mixtral(Path(tmp) / "small", "float32", 512, 1024, 4, 8, 2)
        mixed = mixed_workload(small, n, 16)
        print_table(mixed, ["mode", "seconds", "useful_tokens", "tok_per_s", "vs_continuous"])
        big = mixtral(Path(tmp) / "big", "bfloat16", 1024, 2048, 8, 16, 4)
        decode = decode_roofline(big, args.batches, new_tokens, bw, read_bw, rate)
        print_table(decode, ["batch", "shuttle_step_ms", "transformers_step_ms", "shuttle_tok_s", "transformers_tok_s",
                             "speedup", "mem_floor_ms", "compute_floor_ms", "shuttle_mem_roof",
                             "transformers_mem_roof", "shuttle_read_roof", "shuttle_roof"])
    if not args.quick:
        path = save("engine", {"copy_GBps": bw / 1e9, "read_GBps": read_bw / 1e9, "bf16_matmul_GFLOPs": rate / 1e9, "mixed_workload": mixed, "decode_bf16_425M": decode,
                               "date": time.strftime("%Y-%m-%d")})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
