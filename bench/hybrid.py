"""Decode on a Qwen3-Next-shaped checkpoint (gated DeltaNet layers beside gated attention) against
this machine's floor, with the linear-attention state's cost broken out.

    python bench/hybrid.py [--quick] [--rounds 3] [--batches 1 64]

The checkpoint (random weights, bf16 on disk, served in the dtype `--dtype auto` resolves to here):
hidden 1024, 8 layers (every 4th full attention: 6 gated DeltaNet layers of 8 key heads and 16 value
heads of 64, conv 4; 2 attention layers of 8 gated heads of 128 over 2 kv heads, 32 of 128 dims
roped), 32 experts of 512 top-4 beside a gated shared expert of 512, vocabulary 8192 (~0.4B
parameters). 32-token prompts; the median step in which every sequence decodes one token
(bench/engine.decode_step_time), per round, against that round's floor = max(memory floor, compute
floor): memory = the weights the step reads (bench/engine.step_weight_bytes) plus each sequence's
state read and written once (ModelConfig.state_bytes_per_sequence x 2) over the read bandwidth;
compute = the step's matmul FLOPs (ModelConfig.non_expert_flops_per_token and the experts' pairs)
over a 2048^3 matmul's rate. "state_ms": the time the steps spent in the linear layers' convolution
and delta rule (GatedDeltaNet._mix, timed around each call), and "state_floor_ms" the state bytes'
share of the memory floor.
Writes bench/results/hybrid.json (--quick: hybrid_quick.json), with the host named.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from bench.engine import decode_step_time, matmul_rate, read_bandwidth, step_weight_bytes  # noqa: E402
from models.builtin import make_random_checkpoint  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.linear_attention import GatedDeltaNet  # noqa: E402
from models.loader import auto_dtype  # noqa: E402
from server import LLM  # noqa: E402


def qwen3_next(out: Path) -> Path:
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(vocab_size=8192, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
                          linear_key_head_dim=64, linear_value_head_dim=64, num_experts=32, num_experts_per_tok=4,
                          moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=2048,
                          max_position_embeddings=1024, bos_token_id=0, eos_token_id=0)
    return make_random_checkpoint(out, cfg, seed=0, dtype="bfloat16", tokenizer_dir=None)


class StateTimer:
    """Seconds spent in GatedDeltaNet._mix (the convolution and the delta rule) while active."""

    def __init__(self):
        self.seconds, self._mix = 0.0, GatedDeltaNet._mix

    def __enter__(self):
        timer, mix = self, self._mix

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return mix(*a, **k)
            finally:
                timer.seconds += time.perf_counter() - t0

        GatedDeltaNet._mix = timed
        return self

    def __exit__(self, *exc):
        GatedDeltaNet._mix = self._mix


def step_flops(cfg: ModelConfig, B: int, context: int) -> float:
    return B * (cfg.non_expert_flops_per_token(context) + cfg.num_moe_layers * cfg.top_k * cfg.expert_flops_per_pair()
                + 2 * cfg.hidden_size * cfg.vocab_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round, 16 decode steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    args = ap.parse_args()
    rounds, new_tokens = (1, 16) if args.quick else (args.rounds, 48)
    prompt = 32
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = qwen3_next(Path(tmp) / "qwen3-next")
        cfg = ModelConfig.from_pretrained(ckpt)
        dtype, why = auto_dtype(cfg.dtype, ["cpu"])
        llm = LLM(ckpt, dtype=str(dtype).removeprefix("torch."), max_num_seqs=max(args.batches),
                  max_num_batched_tokens=2048)
        state_bytes = 2 * cfg.state_bytes_per_sequence(dtype)  # read and written each step
        rows = []
        for B in args.batches:
            decode_step_time(llm, min(B, 4), prompt, 4)  # warm-up
            times, floors, state_ms, state_floor = [], [], [], []
            for _ in range(rounds):
                bw, rate = read_bandwidth(), matmul_rate(dtype)
                weights = step_weight_bytes(llm, B)
                mem = (weights + B * state_bytes) / bw
                floors.append(max(mem, step_flops(cfg, B, prompt + new_tokens // 2) / rate))
                state_floor.append(B * state_bytes / bw)
                steps_before = llm.engine.num_steps
                with StateTimer() as timer:
                    times.append(decode_step_time(llm, B, prompt, new_tokens))
                state_ms.append(1e3 * timer.seconds / max(1, llm.engine.num_steps - steps_before))
            step = statistics.median(times)
            rows.append({"batch": B, "step_ms": 1e3 * step, "tok_per_s": B / step,
                         "floor_ms": 1e3 * statistics.median(floors),
                         "x_floor": statistics.median(t / f for t, f in zip(times, floors)),
                         "state_ms": statistics.median(state_ms), "state_share": statistics.median(state_ms) / 1e3 / step,
                         "state_floor_ms": 1e3 * statistics.median(state_floor),
                         "state_mib_per_seq": cfg.state_bytes_per_sequence(dtype) / 2 ** 20})
        llm.shutdown()
    print(f"Qwen3-Next-shaped decode, {cfg.num_linear_layers} linear + {cfg.num_layers - cfg.num_linear_layers} "
          f"full layers, served in {dtype}" + (f" ({why})" if why else ""))
    print_table(rows, ["batch", "step_ms", "tok_per_s", "floor_ms", "x_floor", "state_ms", "state_share",
                       "state_floor_ms", "state_mib_per_seq"])
    path = save("hybrid_quick" if args.quick else "hybrid",
                {"config": {"rounds": rounds, "prompt_tokens": prompt, "new_tokens": new_tokens,
                            "dtype": str(dtype), "dtype_resolution": why, "params": cfg.total_params()},
                 "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
