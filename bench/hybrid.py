"""Decode on the 2026 attention forms against this machine's floor, their own cost broken out: a
Qwen3-Next-shaped checkpoint (gated DeltaNet layers beside gated attention), a DeepSeek-V3.2-shaped
one (MLA with the sparse attention's indexer) and a DeepSeek-V4-shaped one (sliding window plus
compressed entries, mHC).

    python bench/hybrid.py [--quick] [--rounds 3] [--batches 1 64] [--models qwen3_next deepseek_v32 deepseek_v4]

Both checkpoints have random weights, bf16 on disk, served in the dtype `--dtype auto` resolves to
here, hidden 1024, 8 layers, 32 experts of 512 top-4 beside a shared expert of 512, vocabulary 8192:
- qwen3_next: every 4th layer full attention; 6 gated DeltaNet layers of 8 key heads and 16 value
  heads of 64, conv 4; 2 attention layers of 8 gated heads of 128 over 2 kv heads. 32-token prompts.
- deepseek_v32: MLA (16 heads, q latent 384, kv latent 256, 64 + 32 roped dims, values of 64), the
  first layer dense; an indexer of 16 heads of 64 picking the top 64 tokens. 96-token prompts, so
  every decode step is past index_topk and takes the sparse path.
- deepseek_v4: 16 heads of 256 over one key = value head (32 dims roped), q latent 384, 4 output
  groups of 256, a window of 64, 3 hyper-connection streams; layers sliding, then heavily compressed
  (every 32 tokens: the published 128 scaled to these prompts) and compressed sparse (every 4, an
  indexer of 16 heads of 64 keeping 16 entries) alternating, the last sliding; the first 2 layers
  hash-routed. 160-token prompts: past the window, 5 HCA and 40 CSA entries a sequence.
The median step in which every sequence decodes one token (bench/engine.decode_step_time), per
round, against that round's floor = max(memory floor, compute floor): memory = the weights the step
reads (bench/engine.step_weight_bytes) plus the cache it reads (the context's latents and index keys;
each sequence's linear-attention state read and written once) over the read bandwidth; compute =
the step's matmul FLOPs (ModelConfig.non_expert_flops_per_token and the experts' pairs) over a
2048^3 matmul's rate. "own_ms": the median over the same decode steps of the time spent in the
form's own code (qwen3_next: the convolution and delta rule, GatedDeltaNet._mix; deepseek_v32: the
Indexer and sparse_latent_attention's scoring, choice and attention; deepseek_v4: the attention
layers, each branch apart: "sliding_ms", "csa_ms", "hca_ms" the layers of each kind, of which
"compress_ms" the compressors' (and indexers' compression) and "index_ms" the indexers' scoring),
timed around each call; "own_floor_ms" the memory floor of the state or index bytes.
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


def deepseek_v32(out: Path) -> Path:
    from transformers import DeepseekV32Config

    cfg = DeepseekV32Config(vocab_size=8192, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                            num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_rope_head_dim=32,
                            qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=32, num_experts_per_tok=4,
                            moe_intermediate_size=512, n_shared_experts=1, intermediate_size=2048, n_group=4,
                            topk_group=2, first_k_dense_replace=1, index_n_heads=16, index_head_dim=64, index_topk=64,
                            max_position_embeddings=1024, bos_token_id=0, eos_token_id=0)
    return make_random_checkpoint(out, cfg, seed=0, dtype="bfloat16", tokenizer_dir=None)


def deepseek_v4(out: Path) -> Path:
    from transformers import DeepseekV4Config

    types = ["sliding_attention"] + ["heavily_compressed_attention", "compressed_sparse_attention"] * 3 + [
        "sliding_attention"]
    cfg = DeepseekV4Config(vocab_size=8192, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                           head_dim=256, q_lora_rank=384, partial_rotary_factor=0.125, o_groups=4, o_lora_rank=256,
                           sliding_window=64, hc_mult=3, n_routed_experts=32, num_experts_per_tok=4,
                           moe_intermediate_size=512, n_shared_experts=1, index_n_heads=16, index_head_dim=64,
                           index_topk=16, layer_types=types, mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6,
                           compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
                           max_position_embeddings=1024, bos_token_id=0, eos_token_id=0)
    return make_random_checkpoint(out, cfg, seed=0, dtype="bfloat16", tokenizer_dir=None)


MODELS = {"qwen3_next": (qwen3_next, 32), "deepseek_v32": (deepseek_v32, 96),  # name -> (checkpoint, prompt tokens)
          "deepseek_v4": (deepseek_v4, 160)}


class OwnTimer:
    """Seconds spent in the given (owner, attribute) functions while active (replaced by timed
    wrappers, put back on exit)."""

    def __init__(self, targets: list[tuple[object, str]]):
        self.seconds, self.targets = 0.0, [(o, a, getattr(o, a)) for o, a in targets]

    def __enter__(self):
        for owner, attr, fn in self.targets:
            setattr(owner, attr, self._timed(fn))
        return self

    def _timed(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed

    def __exit__(self, *exc):
        for owner, attr, fn in self.targets:
            setattr(owner, attr, fn)


class BranchTimer(OwnTimer):
    """DeepSeek-V4's attention layers timed per kind (seconds by "sliding" / "csa" / "hca"), and within
    them the compressors' ("compress") and the indexers' scoring ("index": V4Attention._entries less
    its compressions)."""

    def __init__(self):
        from models.deepseek_v4 import Compression, V4Attention

        super().__init__([])
        self.by = {k: 0.0 for k in ("sliding", "csa", "hca", "compress", "entries")}
        self.targets = [(V4Attention, "forward", V4Attention.forward), (Compression, "entries", Compression.entries),
                        (V4Attention, "_entries", V4Attention._entries)]

    def _timed(self, fn):
        by = self.by

        def timed(module, *a, **k):
            t0 = time.perf_counter()
            try:
                return fn(module, *a, **k)
            finally:
                dt = time.perf_counter() - t0
                name = fn.__name__
                key = (module.v4.layer_types[module.layer] if name == "forward" else
                       "compress" if name == "entries" else "entries")
                by[key] += dt
                if name == "forward":
                    self.seconds += dt
        return timed

    def totals(self) -> tuple[float, ...]:
        """(all layers, sliding, csa, hca, compressors, indexers' scoring) seconds so far."""
        b = self.by
        return self.seconds, b["sliding"], b["csa"], b["hca"], b["compress"], b["entries"] - b["compress"]


def own_code(name: str) -> list[tuple[object, str]]:
    import models.kv_cache as kv_cache
    from models.mla import Indexer

    if name == "qwen3_next":
        return [(GatedDeltaNet, "_mix")]
    return [(Indexer, "forward"), (kv_cache, "sparse_latent_attention")]


def own_bytes(cfg: ModelConfig, dtype: torch.dtype, B: int, context: int) -> float:
    """The bytes of the form's own cache a decode step reads: states read and written, or index keys."""
    if cfg.linear_attention is not None:
        return 2 * B * cfg.state_bytes_per_sequence(dtype)
    if cfg.v4 is not None:  # the windows' rows; the entries are in kv_bytes_per_token
        return B * cfg.num_layers * min(cfg.v4.window, context) * cfg.head_dim * dtype.itemsize
    indexed = sum(cfg.mla.runs_indexer(i) for i in range(cfg.num_layers))  # (GLM-5's shared layers cache none)
    return B * context * indexed * cfg.mla.index_head_dim * dtype.itemsize


def step_flops(cfg: ModelConfig, B: int, context: int) -> float:
    return B * (cfg.non_expert_flops_per_token(context) + cfg.num_moe_layers * cfg.top_k * cfg.expert_flops_per_pair()
                + 2 * cfg.hidden_size * cfg.vocab_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round, 16 decode steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = ap.parse_args()
    rounds, new_tokens = (1, 16) if args.quick else (args.rounds, 48)
    rows, shapes = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            make, prompt = MODELS[name]
            ckpt = make(Path(tmp) / name)
            cfg = ModelConfig.from_pretrained(ckpt)
            dtype, why = auto_dtype(cfg.dtype, ["cpu"])
            shapes[name] = {"params": cfg.total_params(), "prompt_tokens": prompt, "dtype": str(dtype),
                            "dtype_resolution": why}
            llm = LLM(ckpt, dtype=str(dtype).removeprefix("torch."), max_num_seqs=max(args.batches),
                      max_num_batched_tokens=2048)
            for B in args.batches:
                decode_step_time(llm, min(B, 4), prompt, 4)  # warm-up
                context = prompt + new_tokens // 2
                times, floors, own_ms, own_floor, branches = [], [], [], [], []
                for _ in range(rounds):
                    bw, rate = read_bandwidth(), matmul_rate(dtype)
                    cache = B * context * cfg.kv_bytes_per_token(dtype) + own_bytes(cfg, dtype, B, context) * (
                        cfg.linear_attention is not None)  # (index keys are in kv_bytes_per_token already)
                    floors.append(max((step_weight_bytes(llm, B) + cache) / bw, step_flops(cfg, B, context) / rate))
                    own_floor.append(own_bytes(cfg, dtype, B, context) / bw)
                    if name == "deepseek_v4":
                        with BranchTimer() as timer:
                            step, parts = decode_step_time(llm, B, prompt, new_tokens, probe=timer.totals)
                        own, branch = parts[0], parts[1:]
                        branches.append(branch)
                    else:
                        with OwnTimer(own_code(name)) as timer:
                            step, own = decode_step_time(llm, B, prompt, new_tokens, probe=lambda: timer.seconds)
                    times.append(step)
                    own_ms.append(1e3 * own)
                step = statistics.median(times)
                rows.append({"model": name, "batch": B, "step_ms": 1e3 * step, "tok_per_s": B / step,
                             "floor_ms": 1e3 * statistics.median(floors),
                             "x_floor": statistics.median(t / f for t, f in zip(times, floors)),
                             "own_ms": statistics.median(own_ms), "own_share": statistics.median(own_ms) / 1e3 / step,
                             "own_floor_ms": 1e3 * statistics.median(own_floor)})
                if branches:
                    rows[-1].update({f"{k}_ms": 1e3 * statistics.median(b[i] for b in branches)
                                     for i, k in enumerate(("sliding", "csa", "hca", "compress", "index"))})
            llm.shutdown()
    print(f"Decode steps of the 2026 attention forms, served in {', '.join(sorted({s['dtype'] for s in shapes.values()}))}")
    print_table(rows, ["model", "batch", "step_ms", "tok_per_s", "floor_ms", "x_floor", "own_ms", "own_share",
                       "own_floor_ms"])
    v4 = [r for r in rows if "csa_ms" in r]
    if v4:
        print("DeepSeek-V4's attention per decode step, by branch (ms; compress and index are inside csa / hca)")
        print_table(v4, ["model", "batch", "own_ms", "sliding_ms", "csa_ms", "hca_ms", "compress_ms", "index_ms"])
    path = save("hybrid_quick" if args.quick else "hybrid",
                {"config": {"rounds": rounds, "new_tokens": new_tokens, "models": shapes}, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
