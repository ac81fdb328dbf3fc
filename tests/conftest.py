"""Shared fixtures: a locally trained tokenizer and tiny random checkpoints of every family.

Checkpoints are built with transformers' own classes (fixed seeds, never a hub) and saved with
save_pretrained, so their files are exactly what real checkpoints of that family look like.
"""
import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch

# Triton decides when a kernel is decorated (imported) whether to compile or interpret it, so this
# must come before any kernels/*_triton.py import: without CUDA, every Triton kernel is interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Every engine the tests build runs eagerly (the oracle) unless a test asks for the compiled decode
# stages (tests/test_compiled.py): compiling costs seconds per distinct layer kind.
os.environ.setdefault("SHUTTLE_ENFORCE_EAGER", "1")
# The ops with a native kernel and a torch path take the native one in every test (and server the
# tests start): timed on a loaded CI host the choice could flip per bucket and per run, and tests
# that check which path ran (or the native decode step) would follow the noise.
# tests/test_kernel_choice.py measures and forces them itself.
os.environ.setdefault("SHUTTLE_KERNEL_CHOICE", "attention=native,rmsnorm=native,routing=native")

from models.builtin import (make_random_checkpoint, randomize_biases, randomize_correction_bias, randomize_norms,
                            randomize_v4, train_tokenizer)
from models.kv_cache import AttentionBatch, make_paged_cache

VOCAB = 512
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0,
            pad_token_id=1)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=80, moe_intermediate_size=24, num_experts=8,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=40)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=80, moe_intermediate_size=24, num_experts=8,
                                         num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    # MLA with odd sizes (q_lora_rank 24, latent 20, rope 6, nope 10, v 14), 3 layers (the first dense)
    "deepseek_v3": ("DeepseekV3Config", dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48,
                                             moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                                             n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=2,
                                             kv_lora_rank=20, q_lora_rank=24, qk_rope_head_dim=6,
                                             qk_nope_head_dim=10, v_head_dim=14, routed_scaling_factor=2.5)),
    # DeepSeek-V3.2: V3's shape plus the indexer, 16 index heads of 12 (enough that scores do not tie)
    # choosing the top 5 tokens, so the prompts past 5 tokens take the sparse path
    "deepseek_v32": ("DeepseekV32Config", dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48,
                                               moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                                               n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                                               kv_lora_rank=20, q_lora_rank=24, qk_rope_head_dim=6,
                                               qk_nope_head_dim=10, v_head_dim=14, routed_scaling_factor=2.5,
                                               index_n_heads=16, index_head_dim=12, index_topk=5)),
    # GLM-5: V3.2's shape over 4 layers, its indexer roped in interleaved pairs, and layers 1 and 3
    # without one ("shared": index_topk_freq 2 from index_skip_topk_offset 1), which attend to the
    # tokens layers 0 and 2 chose
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(num_hidden_layers=4, num_key_value_heads=4, intermediate_size=48,
                                            moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                                            n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                                            kv_lora_rank=20, q_lora_rank=24, qk_rope_head_dim=6,
                                            qk_nope_head_dim=10, v_head_dim=14, routed_scaling_factor=2.5,
                                            index_n_heads=16, index_head_dim=12, index_topk=5, index_topk_freq=2,
                                            index_skip_topk_offset=1)),
    "deepseek_v2": ("DeepseekV2Config", dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48,
                                             moe_intermediate_size=24, n_routed_experts=6, num_experts_per_tok=2,
                                             first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=20,
                                             q_lora_rank=None, qk_rope_head_dim=6, qk_nope_head_dim=10,
                                             v_head_dim=14, routed_scaling_factor=1.0)),
    # GLM-4.5: 3 layers (the first dense), q/k/v biases, per-head q/k norm, 10 of 20 head dims roped,
    # V3 routing in 4 groups of 2 (top 2 groups), one shared expert
    "glm4_moe": ("Glm4MoeConfig", dict(num_hidden_layers=3, head_dim=20, intermediate_size=48,
                                       moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                                       n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                                       routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True)),
    # MiniMax-M2: q/k norm over the projections, rotary_dim 12 of head_dim 20, sigmoid + bias routing
    "minimax_m2": ("MiniMaxM2Config", dict(head_dim=20, rotary_dim=12, intermediate_size=24, num_local_experts=8,
                                           num_experts_per_tok=2)),
    # gpt-oss: 3 layers alternating sliding (window 5) and full, sinks, q/k/v/o and expert biases,
    # the clamped SwiGLU with a limit low enough to clamp, yarn rope, 5 experts top-3, head_dim 20;
    # experts of 32 (MXFP4 packs 32 values per block along D and I)
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=3, head_dim=20, intermediate_size=32, num_local_experts=5,
                                     num_experts_per_tok=3, sliding_window=5, swiglu_limit=0.6)),
    # Llama 4: 6 heads of 10 over 2 kv heads, layers 1 and 3 MoE (5 experts, top-1 scaling the input,
    # a shared expert), 0 and 2 dense (intermediate_size_mlp); rope layers 0 and 2 attend in chunks of 8
    # (2 pages of 4: the decode op's path) with the L2 q/k norm, 1 and 3 are global and without rope,
    # with a temperature that changes every 3 positions; llama3 rope
    "llama4": ("Llama4TextConfig", dict(num_hidden_layers=4, num_attention_heads=6, head_dim=10, intermediate_size=24,
                                        intermediate_size_mlp=40, num_local_experts=5, interleave_moe_layer_step=2,
                                        attention_chunk_size=8, no_rope_layer_interval=2, floor_scale=3, attn_scale=0.5,
                                        rope_parameters={"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 16})),
    # MiMo-V2-Flash: 6 heads of 14 (values of 10, scaled by 0.707) over 1 kv head in full layers 0 and 3,
    # 2 with sinks and a window of 5 in sliding layers 1 and 2; 8 of 14 dims roped at theta 50000
    # there, 4 at 1000 here; layer 0 dense; V3 routing in 4 groups of 2 (top 2 groups), no shared expert
    "mimo_v2_flash": ("MiMoV2FlashConfig", dict(
        num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=1, head_dim=14, v_head_dim=10,
        intermediate_size=40, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, sliding_window=5, layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                     "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0,
                                            "partial_rotary_factor": 0.6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0,
                                               "partial_rotary_factor": 0.3}})),
    # Qwen3-Next: gated DeltaNet layers 0 and 2 (3 key heads of 10, 6 value heads of 14, 4 conv taps)
    # around a gated full-attention layer 1 (4 heads of 24 over 2, 6 dims roped) whose MLP is dense
    # (mlp_only_layers); 8 experts top-2 beside a gated shared expert
    "qwen3_next": ("Qwen3NextConfig", dict(num_hidden_layers=3, head_dim=24, intermediate_size=48,
                                           moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                                           shared_expert_intermediate_size=40, mlp_only_layers=[1],
                                           layer_types=["linear_attention", "full_attention", "linear_attention"],
                                           linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=10,
                                           linear_value_head_dim=14)),
    # Qwen3.5-MoE (text): its split projections, gated DeltaNet layers 0 and 2 (2 key heads of 10, 6
    # value heads of 14: 3 per key head) around a gated full-attention layer 1 (4 heads of 20 over 2,
    # 6 dims roped: partial_rotary_factor 0.3, multimodal rope sections as published); 6 experts
    # top-3 in every layer beside a gated shared expert
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=3, head_dim=20, moe_intermediate_size=20,
                                                 num_experts=6, num_experts_per_tok=3,
                                                 shared_expert_intermediate_size=36, full_attention_interval=2,
                                                 linear_num_key_heads=2, linear_num_value_heads=6,
                                                 linear_key_head_dim=10, linear_value_head_dim=14,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "partial_rotary_factor": 0.3,
                                                                  "mrope_section": [1, 1, 1],
                                                                  "mrope_interleaved": True})),
    # DeepSeek-V4: one layer of each attention kind (sliding; compressed sparse every 4 tokens with 16 index
    # heads of 12 choosing the top 3 entries; heavily compressed every 8), a window of 6, one kv head of 24
    # (6 dims roped), 2 output groups, 3 hyper-connection streams, hash-routed layers 0 and 2
    "deepseek_v4": ("DeepseekV4Config", dict(
        num_hidden_layers=4, num_key_value_heads=1, head_dim=24, q_lora_rank=20, moe_intermediate_size=24,
        n_routed_experts=6, num_experts_per_tok=2, partial_rotary_factor=0.25, sliding_window=6, o_groups=2,
        o_lora_rank=20, index_n_heads=16, index_head_dim=12, index_topk=3, hc_mult=3, hc_sinkhorn_iters=4,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"])),
}
BIASED = ("glm4_moe", "minimax_m2", "gpt_oss", "mimo_v2_flash")  # families whose biases and sinks are made non-zero


def hf_config(family: str, **overrides):
    import transformers

    cls_name, extra = FAMILIES[family]
    return getattr(transformers, cls_name)(**{**BASE, **extra, **overrides})


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(d, vocab_size=VOCAB)
    return d


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory, tokenizer_dir):
    """make_checkpoint(family, dtype="float32", seed=0, **config_overrides) -> checkpoint dir (cached)."""
    cache: dict[str, Path] = {}

    def make(family: str, dtype: str = "float32", seed: int = 0, **overrides) -> Path:
        key = hashlib.sha1(json.dumps([family, dtype, seed, overrides], sort_keys=True, default=str).encode()).hexdigest()[:12]
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{family}-{key}")
            cache[key] = make_random_checkpoint(out, hf_config(family, **overrides), seed=seed, dtype=dtype,
                                                tokenizer_dir=tokenizer_dir)
            if family in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
                randomize_correction_bias(out, seed)
            elif family in BIASED:
                randomize_biases(out, seed)
            elif family == "deepseek_v4":
                randomize_v4(out, seed)
            elif family in ("qwen3_next", "qwen3_5_moe"):  # (norms stored as weight - 1, zeros; dt_bias ones)
                randomize_biases(out, seed)
                randomize_norms(out, seed)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def gpt_oss_mxfp4(make_checkpoint, tmp_path_factory) -> Path:
    """A tiny gpt-oss (hidden 128, experts of 64: biases, clamped SwiGLU) saved with MXFP4 experts."""
    from tests.test_more_families import _write_mxfp4

    d = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "mxfp4"
    _write_mxfp4(make_checkpoint("gpt_oss", hidden_size=128, intermediate_size=64), d)
    return d


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


def transformers_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy new tokens for each prompt alone, EOS ignored: the oracle of the engine
    tests of each family."""
    ref = hf_model(model_dir)
    ref.generation_config.eos_token_id = None
    return [ref.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=1)[0, len(p):].tolist() for p in prompts]


PROMPTS = [
    [5, 17, 33, 100, 250, 7, 9, 11, 13, 200, 301, 45, 46, 47],
    [400, 3],
    [77, 78, 79, 80, 81, 82, 83],
    [12],
]


@pytest.fixture
def poison(monkeypatch):
    """While active, torch.empty / torch.empty_like return tensors filled with NaN (floating) or -7
    (integer), so an output element a kernel forgot to write fails the comparison."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t if t.dtype == torch.bool else t.fill_(-7)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))


def slow_steps(a, monkeypatch, seconds: float = 0.005) -> None:
    """Make every engine step of the AsyncLLM `a` take at least `seconds`, so that a long request
    is surely still running when the test acts on it."""
    step = a.engine.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(a.engine, "step", slow)


# --- our logits on a paged cache, against transformers (shared by the family tests) ---

def paged_batch(prompts: list[list[int]], block_size: int = 4) -> tuple[AttentionBatch, int]:
    tables, n = [], 0
    for p in prompts:
        k = -(-len(p) // block_size)
        tables.append(list(range(n, n + k)))
        n += k
    return AttentionBatch.build_paged([len(p) for p in prompts], [0] * len(prompts), tables, block_size,
                                      state_slots=list(range(len(prompts)))), n


def our_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    batch, blocks = paged_batch(prompts)
    cache = make_paged_cache(model.cfg, blocks, 4, torch.float32, "cpu", model.ops, state_slots=len(prompts))
    with torch.no_grad():
        return model.logits(model(torch.tensor([t for p in prompts for t in p]), batch, cache))


def assert_close_to_transformers(got: torch.Tensor, ref, prompts: list[list[int]]) -> None:
    start = 0
    with torch.no_grad():
        for p in prompts:
            expected = ref(torch.tensor([p])).logits[0].float()
            diff = (got[start:start + len(p)] - expected).abs().max().item()
            assert diff < 1e-4 * expected.abs().max().item(), f"prompt {p}: {diff}"
            start += len(p)


@pytest.fixture(autouse=True)
def _native_or_torch_tables():
    """Every test starts from, and leaves, the native-or-torch tables (kernels/native.py) as they were."""
    from kernels import native

    saved = {op: list(rows) for op, rows in native._NATIVE_ROWS.items()}
    yield
    for op, rows in saved.items():
        native.set_runs_native(op, rows)
