"""The engine's throughput: continuous against static batching, against transformers, and decode
against this machine's memory roofline.

    python bench/engine.py [--quick] [--rounds 3]

Part 1, mixed-length workload (float32 checkpoint, hidden 512, 4 layers, 8 experts top-2):
  64 requests, prompts of 8..96 tokens, 8..128 new tokens each (EOS ignored), at most 16 in flight.
  continuous = every request submitted at once to one engine (requests join and leave each step);
  static     = the same engine fed batches of 16, each waiting until its longest request ends;
  transformers = generate() on the same batches of 16 (left-padded, run to the batch's longest).
  Throughput counts only the requested output tokens.
Part 2, decode on a Mixtral-shaped checkpoint of ~425M parameters stored in bfloat16 (hidden 1024,
  8 layers, 16 heads, 4 KV heads, 8 experts of 2048, top-2), run in bfloat16 and in float32 (the same
  weights upcast; --quick: in the dtype `--dtype auto` resolves to here, float32 on a CPU that
  emulates bf16 GEMMs, and the JSON's dtype_resolution says which and why), 32-token prompts, batch 1/16/64/256: the median decode step time of the eager
  engine and of the compiled one (models/stages.py, --no-enforce-eager), side by side (--rounds
  passes of every engine in alternating order, the median over them; each pass's times kept), each against
  the step's floor = max(memory floor, compute floor), both measured in this run, again at the start
  of every round of every batch size, each round's steps set against its own floor (x_floor: the
  median of those ratios; this host's read bandwidth moves by half between phases). Memory floor: the
  weight bytes a step must read (every non-expert weight, the LM head, the experts B tokens x top-2
  are expected to hit) over the read bandwidth (a sum over 1 GiB). Compute floor: the step's matmul
  FLOPs over a 2048^3 matmul's rate in the run's dtype. "x_floor" is step / floor; the targets
  (1.5 / 1.3 / 1.4 / 1.25 at batch 1 / 16 / 64 / 256) are printed beside it. Served in
  float32, the memory floor counts float32 bytes; "ckpt_floor" counts the checkpoint's (bf16) bytes,
  the floor the targets are stated against, which a step can reach only by reading bf16 weights. Where the native
  kernels run (kernels/native.py: the bf16 GEMM for few rows when serving float32, the paged decode
  attention), "native_off" is the same engine with SHUTTLE_NATIVE_KERNELS=0 (oneDNN's packed GEMMs
  at every row count, torch's flash attention over gathered pages), and native_speedup its step
  time over eager's. "eager" is the engine as served: where the model takes it (bf16 on AVX-512
  BF16), its colocated decode steps run every layer in one native call (models/native_decode.py);
  "no_native_decode" is the same engine with --no-native-decode (each layer's kernels called from
  Python), and native_decode_speedup its step time over eager's. transformers' decode step
  (generate) at batch <= 64 for reference.
Part 3, chunked prefill: prompts of 1024 tokens in chunks of 512 tokens per step, prompt tokens/s of
  both engines against the compute floor (matmul rate / FLOPs per token at half the prompt's context).
The machine's matmul ISA (from /proc/cpuinfo) is printed and saved: without avx512_bf16 / amx_bf16,
bf16 matmuls are emulated and far slower than float32.
Writes bench/results/engine.json (--quick: engine_quick.json).
"""
import argparse
import contextlib
import os
import statistics
from dataclasses import replace
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import best_of, print_table, save  # noqa: E402
from kernels import native  # noqa: E402
from models.builtin import make_random_checkpoint  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.loader import auto_dtype  # noqa: E402
from server import LLM, SamplingParams  # noqa: E402


def mixtral(out: Path, dtype: str, hidden: int, inter: int, layers: int, heads: int, kv: int,
            experts: int = 8) -> Path:
    """A Mixtral checkpoint with random weights (top-2 of `experts`); more than 8 experts are built
    in `dtype` directly (build_in_dtype: billions of parameters in half the memory)."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv, num_local_experts=experts,
                        num_experts_per_tok=2, max_position_embeddings=1024, bos_token_id=0, eos_token_id=0)
    return make_random_checkpoint(out, cfg, seed=0, dtype=dtype, tokenizer_dir=None, build_in_dtype=experts > 8)


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 1 GiB tensor copy (best of 5)."""
    src = torch.ones(1 << 28, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_of(lambda: dst.copy_(src), 5)


_READ_SRC: list[torch.Tensor] = []  # the 1 GiB tensor read_bandwidth sums, made once


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes read per second by summing a 1 GiB tensor (best of `repeats`): what streaming weights
    can reach."""
    if not _READ_SRC:
        _READ_SRC.append(torch.ones(1 << 28, dtype=torch.float32))
    src = _READ_SRC[0]
    return src.numel() * 4 / best_of(src.sum, repeats)


def matmul_rate(dtype: torch.dtype = torch.bfloat16, repeats: int = 5) -> float:
    """FLOP/s of a 2048^3 matmul in dtype (best of `repeats`): the compute ceiling of this machine."""
    a = torch.randn(2048, 2048, dtype=dtype)
    return 2 * 2048 ** 3 / best_of(lambda: a @ a, repeats)


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


def decode_step_time(llm: LLM, B: int, prompt_len: int, new_tokens: int, probe=None):
    """Median wall time of the engine steps in which every sequence decodes one token (about
    new_tokens of them: the prompts are prefilled in chunks, and the sequences prefilled first
    decode while the rest are prefilled, so they get that many more tokens to stay until then).
    probe: a callable returning a running total (seconds spent somewhere, say), or a tuple of them:
    then (that median, the median of the probe's growth over the same steps; per element for a tuple)."""
    rng = random.Random(B)
    engine = llm.engine
    chunk = engine.scheduler.cfg.max_num_batched_tokens
    params = SamplingParams(max_tokens=new_tokens + -(-B * prompt_len // chunk), temperature=0, ignore_eos=True)
    for b in range(B):
        engine.add_request(f"d{B}-{b}-{rng.random()}", [rng.randrange(10, 4000) for _ in range(prompt_len)], params)
    times, probed = [], []
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        decoding = (len(running) == B and not engine.scheduler.waiting
                    and all(s.num_computed_tokens >= s.num_prompt_tokens for s in running))
        p0 = probe() if probe else 0.0
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
            p1 = probe() if probe else 0.0
            probed.append(tuple(a - b for a, b in zip(p1, p0)) if isinstance(p1, tuple) else p1 - p0)
    if not times:
        raise RuntimeError(f"batch {B}: no step decoded all {B} sequences at once (too few KV blocks?)")
    median = sorted(times)[len(times) // 2]
    if probe and isinstance(probed[0], tuple):
        return median, tuple(statistics.median(p[i] for p in probed) for i in range(len(probed[0])))
    return (median, statistics.median(probed)) if probe else median


def prefill_tok_s(llm: LLM, n: int, prompt_len: int) -> float:
    """Prompt tokens per second of n prompts of prompt_len tokens prefilled in chunks of the
    engine's max_num_batched_tokens (one new token each, so the time is the prefill's)."""
    rng = random.Random(prompt_len)
    prompts = [[rng.randrange(10, 4000) for _ in range(prompt_len)] for _ in range(n)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return n * prompt_len / (time.perf_counter() - t0)


def step_weight_bytes(llm: LLM, B: int) -> float:
    """Bytes of weights one decode step of B tokens reads: all but the embedding table, with only the
    experts that B random tokens x top-k are expected to hit."""
    cfg, sizes = llm.cfg, llm.engine.runner.weight_bytes
    E, K = cfg.num_experts, cfg.top_k
    active = E * (1 - (1 - K / E) ** B)  # expected distinct experts hit
    lm_head = sizes["embedding"] if cfg.tie_word_embeddings else 0  # tied: the head reads the table
    return sizes["other"] + lm_head + sizes["experts"] * active / E


TARGETS = {1: 1.5, 16: 1.3, 64: 1.4, 256: 1.25}  # step time / floor at or under these


@contextlib.contextmanager
def native_off():
    """Everything inside runs without the native kernels (SHUTTLE_NATIVE_KERNELS=0)."""
    os.environ[native.ENV_VAR] = "0"
    native._library.cache_clear()
    try:
        yield
    finally:
        del os.environ[native.ENV_VAR]
        native._library.cache_clear()


def decode_roofline(ckpt: Path, dtype: str, batches: list[int], new_tokens: int, hf_batches: list[int],
                    prefill: tuple[int, int, int], rounds: int = 1) -> tuple[list[dict], list[dict]]:
    """Decode step time per batch size, eager and compiled side by side, against the floor
    max(weight bytes / read bandwidth, FLOPs / matmul rate), both measured again at the start of
    every round of every batch size: on this host the read bandwidth measured 45-49 GB/s in most
    runs and 75 in one, minutes apart, so a floor measured once at the start could be a different
    machine's. Each round's step times are set against that round's floor, and x_floor is the
    median of those ratios. Then chunked prefill tokens/s against its compute floor (the rate
    measured just before). prefill: (prompts, prompt length, chunk). transformers runs hf_batches."""
    # Decode batches prefill in one step (a budget of every prompt token); the prefill part runs
    # with the chunk as the step budget.
    def make(mode: str) -> LLM:
        return LLM(ckpt, dtype=dtype, max_num_seqs=max(batches), max_num_batched_tokens=32 * max(batches),
                   enforce_eager=mode != "compiled", native_decode=mode != "no_native_decode")

    llms = {mode: make(mode) for mode in ("eager", "compiled")}
    if llms["eager"].engine.runner.model.native_decode is not None:
        llms["no_native_decode"] = make("no_native_decode")
    if native.available():
        # The baseline: no native kernels (SHUTTLE_NATIVE_KERNELS=0): oneDNN's packed GEMMs at every
        # row count, torch's flash attention over gathered pages. The GEMMs are chosen when the
        # weights are packed, the attention at each call: both under native_off().
        with native_off():
            llms["native_off"] = make("native_off")
    ckpt_bytes = ModelConfig.from_pretrained(str(ckpt)).dtype.itemsize / llms["eager"].engine.runner.dtype.itemsize
    rows = []
    torch_dtype = getattr(torch, dtype)
    for B in batches:
        nbytes, flops = step_weight_bytes(llms["eager"], B), step_flops(llms["eager"], B, 32 + new_tokens // 2)
        # Rounds of every mode, the order reversed each round, and each mode's median over them: on a
        # host whose speed drifts by 10-30% within minutes, one pass per mode compared modes measured
        # at different speeds. (Within a pass the median step ignores the first steps' allocations.)
        steps: dict[str, list[float]] = {mode: [] for mode in llms}
        floors: list[tuple[float, float, float, float]] = []  # per round: read B/s, FLOP/s, memory, compute floor
        for r in range(rounds):
            read_bw, rate = read_bandwidth(3), matmul_rate(torch_dtype, 3)
            floors.append((read_bw, rate, nbytes / read_bw, flops / rate))
            for mode in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
                with native_off() if mode == "native_off" else contextlib.nullcontext():
                    steps[mode].append(decode_step_time(llms[mode], B, 32, new_tokens))
        floor_r = [max(mem, comp) for _, _, mem, comp in floors]
        ckpt_r = [max(mem * ckpt_bytes, comp) for _, _, mem, comp in floors]  # the targets' floor
        row = {"dtype": dtype, "batch": B, "mem_floor_ms": 1e3 * statistics.median(f[2] for f in floors),
               "compute_floor_ms": 1e3 * statistics.median(f[3] for f in floors),
               "ckpt_floor_ms": 1e3 * statistics.median(ckpt_r),
               "read_GBps_rounds": [round(f[0] / 1e9, 1) for f in floors],
               "matmul_GFLOPs_rounds": [round(f[1] / 1e9) for f in floors]}
        for mode, times in steps.items():
            row[f"{mode}_ms"] = 1e3 * statistics.median(times)
            row[f"{mode}_x_floor"] = statistics.median(t / f for t, f in zip(times, floor_r))
            row[f"{mode}_x_ckpt_floor"] = statistics.median(t / f for t, f in zip(times, ckpt_r))
            row[f"{mode}_rounds_ms"] = [round(1e3 * t, 2) for t in times]
            row[f"{mode}_rounds_x_floor"] = [round(t / f, 3) for t, f in zip(times, floor_r)]
        row["target_x_floor"] = TARGETS.get(B)
        row["compiled_speedup"] = row["eager_ms"] / row["compiled_ms"]
        if "native_off" in llms:
            row["native_speedup"] = row["native_off_ms"] / row["eager_ms"]
        if "no_native_decode" in llms:
            row["native_decode_speedup"] = row["no_native_decode_ms"] / row["eager_ms"]
        if B in hf_batches:
            row["transformers_ms"] = 1e3 * hf_step_time(ckpt, dtype, B, new_tokens)
        rows.append(row)
    _READ_SRC.clear()  # the 1 GiB read buffer: not needed past the decode rounds
    n, length, chunk = prefill
    pre = []
    for mode, llm in llms.items():
        sched = llm.engine.scheduler
        sched.cfg = replace(sched.cfg, max_num_batched_tokens=chunk)
        rate = matmul_rate(torch_dtype, 3)
        with native_off() if mode == "native_off" else contextlib.nullcontext():
            tok_s = prefill_tok_s(llm, n, length)
        floor_tok_s = rate / step_flops(llm, 1, length // 2)
        pre.append({"dtype": dtype, "mode": mode, "prompts": n, "prompt_len": length, "chunk": chunk,
                    "tok_s": tok_s, "compute_floor_tok_s": floor_tok_s, "x_floor": floor_tok_s / tok_s})
    for llm in llms.values():
        llm.shutdown()
    return rows, pre


def hf_step_time(ckpt: Path, dtype: str, B: int, new_tokens: int) -> float:
    """transformers' generate: decode step time from a 1-token and a new_tokens run."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None
    prompts = [[random.randrange(10, 4000) for _ in range(32)] for _ in range(B)]
    t0 = time.perf_counter()
    hf_generate(hf, prompts, 1)
    t1 = time.perf_counter()
    hf_generate(hf, prompts, new_tokens)
    return (time.perf_counter() - t1 - (t1 - t0)) / (new_tokens - 1)


def cpu_isa() -> list[str]:
    """The matmul-relevant ISA extensions /proc/cpuinfo lists (bf16 is emulated without avx512_bf16/amx)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile")
    return [f for f in wanted if f in flags.split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer tokens, no transformers, one dtype: auto, as shuttle serve resolves it (bfloat16 "
                         "where the CPU has bf16 matmuls, avx512_bf16 / amx_bf16, else float32)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--rounds", type=int, default=3,
                    help="decode passes per mode, interleaved in alternating order; the median is reported")
    ap.add_argument("--dtypes", nargs="+", default=None,
                    help="float32, bfloat16 or auto; default: bfloat16 float32 (--quick: auto)")
    ap.add_argument("--no-mixed", action="store_true", help="skip part 1 (the mixed-length workload)")
    args = ap.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    isa = cpu_isa()
    n, new_tokens = (16, 8) if args.quick else (64, 32)
    # auto resolves as shuttle serve does for this bf16 checkpoint on this CPU (models.loader.auto_dtype)
    auto, why = auto_dtype(torch.bfloat16, ["cpu"])
    resolution = {"checkpoint": "bfloat16", "auto": str(auto).removeprefix("torch."), "reason": why}
    dtypes = [resolution["auto"] if dt == "auto" else dt for dt in args.dtypes or (["auto"] if args.quick
                                                                                 else ["bfloat16", "float32"])]
    prefill = (2, 512, 256) if args.quick else (4, 1024, 512)
    hf_batches = [] if args.quick else [b for b in args.batches if b <= 64]
    bw, read_bw = copy_bandwidth(), read_bandwidth()
    rates = {dt: matmul_rate(getattr(torch, dt)) for dt in dtypes}
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write), read {read_bw / 1e9:.1f} GB/s, "
          + ", ".join(f"{dt} matmul {r / 1e9:.0f} GFLOP/s" for dt, r in rates.items())
          + f", {torch.get_num_threads()} threads, ISA: {' '.join(isa) or 'unknown'}; --dtype auto of the bf16 "
          f"checkpoint: {resolution['auto']}{' (' + why + ')' if why else ''}")
    mixed, decode, prefill_rows = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_mixed:
            small = mixtral(Path(tmp) / "small", "float32", 512, 1024, 4, 8, 2)
            mixed = mixed_workload(small, n, 16)
            print_table(mixed, ["mode", "seconds", "useful_tokens", "tok_per_s", "vs_continuous"])
        big = mixtral(Path(tmp) / "big", "bfloat16", 1024, 2048, 8, 16, 4)
        for dt in dtypes:
            rows, pre = decode_roofline(big, dt, args.batches, new_tokens, hf_batches, prefill, args.rounds)
            decode += rows
            prefill_rows += pre
    print_table(decode, ["dtype", "batch", "mem_floor_ms", "compute_floor_ms", "ckpt_floor_ms", "eager_ms",
                         "compiled_ms", "native_off_ms", "no_native_decode_ms", "eager_x_floor", "eager_x_ckpt_floor",
                         "compiled_x_floor", "no_native_decode_x_floor", "target_x_floor", "compiled_speedup",
                         "native_speedup", "native_decode_speedup", "transformers_ms"])
    print_table(prefill_rows, ["dtype", "mode", "prompts", "prompt_len", "chunk", "tok_s", "compute_floor_tok_s",
                               "x_floor"])
    path = save("engine_quick" if args.quick else "engine", {
        # read_GBps / matmul_GFLOPs: at the start (each decode row's floors use its rounds' own)
        "isa": isa, "dtype_resolution": resolution, "copy_GBps": bw / 1e9, "read_GBps": read_bw / 1e9,
        "matmul_GFLOPs": {dt: r / 1e9 for dt, r in rates.items()}, "mixed_workload": mixed,
        "decode_425M": decode, "prefill_425M": prefill_rows, "new_tokens": new_tokens,
        "date": time.strftime("%Y-%m-%d")})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
