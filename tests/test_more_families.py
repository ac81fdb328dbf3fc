"""GLM-4.5, MiniMax-M2 and gpt-oss (with MXFP4 experts) against transformers: logits, greedy tokens
through LLM, the engine (preemption, prefix hits) and pools, training, and their chat templates."""
import pytest
import torch

from kernels.ops import torch_ops
from models.config import ModelConfig
from models.kv_cache import AttentionBatch, make_paged_cache
from models.loader import load_model
from tests.conftest import PROMPTS, hf_model

VARIANTS = [
    ("glm4_moe", {}),
    ("glm4_moe", {"use_qk_norm": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
                  "num_attention_heads": 3, "num_key_value_heads": 1, "partial_rotary_factor": 1.0}),
    ("minimax_m2", {}),
    ("gpt_oss", {}),
    ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"], "sliding_window": 3,
                 "swiglu_limit": 7.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
]
IDS = ["glm", "glm-plain-gqa3", "minimax", "gpt-oss", "gpt-oss-types-default-rope"]


def paged_batch(prompts: list[list[int]], block_size: int = 4) -> tuple[AttentionBatch, int]:
    tables, n = [], 0
    for p in prompts:
        k = -(-len(p) // block_size)
        tables.append(list(range(n, n + k)))
        n += k
    return AttentionBatch.build_paged([len(p) for p in prompts], [0] * len(prompts), tables, block_size), n


def our_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    batch, blocks = paged_batch(prompts)
    cache = make_paged_cache(model.cfg, blocks, 4, torch.float32, "cpu", model.ops)
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


@pytest.mark.parametrize("family,overrides", VARIANTS, ids=IDS)
def test_logits_equal_transformers(make_checkpoint, family, overrides):
    d = make_checkpoint(family, **overrides)
    model = load_model(d, kernels="torch")
    assert_close_to_transformers(our_logits(model, PROMPTS), hf_model(d), PROMPTS)
