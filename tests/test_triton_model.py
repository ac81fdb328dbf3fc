"""The whole model on the Triton op table (interpreted on the CPU) equals the model on the torch
references: proof that the kernels plug in through kernels.ops with the same signatures."""
import pytest
import torch

from kernels.ops import choose_backend, select_ops
from models.kv_cache import AttentionBatch, DenseKVCache
from models.loader import load_model
from tests.conftest import PROMPTS, TRITON_DEVICE

DEV = TRITON_DEVICE


def test_backend_choice_and_override(monkeypatch):
    monkeypatch.delenv("SHUTTLE_KERNELS", raising=False)
    assert choose_backend("cpu") == "torch" and choose_backend("cuda") == "triton"
    assert choose_backend("cuda", "torch") == "torch"
    monkeypatch.setenv("SHUTTLE_KERNELS", "triton")
    assert choose_backend("cpu") == "triton"
    monkeypatch.setenv("SHUTTLE_KERNELS", "cutlass")
    with pytest.raises(ValueError, match="SHUTTLE_KERNELS"):
        select_ops("cpu")


def _prefill_then_decode(model, cfg):
    cache = DenseKVCache(cfg.num_layers, len(PROMPTS), 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEV)
    slots = list(range(len(PROMPTS)))
    batch = AttentionBatch.build([len(p) for p in PROMPTS], [0] * len(PROMPTS), slots, DEV)
    ids = torch.tensor([t for p in PROMPTS for t in p], device=DEV)
    prefill = model.logits(model(ids, batch, cache))
    batch = AttentionBatch.build([1] * len(PROMPTS), [len(p) for p in PROMPTS], slots, DEV)
    decode = model.logits(model(torch.tensor([3, 5, 7, 9], device=DEV), batch, cache))
    return prefill, decode


@pytest.mark.gpu
@pytest.mark.parametrize("family,overrides", [("mixtral", {}), ("qwen2_moe", {}), ("olmoe", {}),
                                              ("qwen3_moe", dict(head_dim=24, num_experts=5, num_experts_per_tok=3)),
                                              ("glm4_moe", {})])  # partial rotary, grouped sigmoid router
@torch.inference_mode()
def test_model_on_triton_ops_matches_torch_ops(make_checkpoint, family, overrides):
    ckpt = make_checkpoint(family, **overrides)
    ref = load_model(ckpt, device=DEV, kernels="torch")
    tri = load_model(ckpt, device=DEV, kernels="triton")
    assert tri.ops.backend == "triton" and ref.ops.backend == "torch"
    for got, want in zip(_prefill_then_decode(tri, tri.cfg), _prefill_then_decode(ref, ref.cfg)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("family,overrides", [("deepseek_v3", {}), ("deepseek_v2", dict(
    topk_method="group_limited_greedy", n_group=3, topk_group=2))])
@torch.inference_mode()
def test_mla_model_on_triton_ops_matches_torch_ops(make_checkpoint, family, overrides):
    """MLA over the latent paged cache: prefill (expanded) then two decode steps (the latent decode
    kernel), with the grouped router kernel, on both op tables."""
    from models.kv_cache import make_paged_cache

    ckpt = make_checkpoint(family, **overrides)
    outs = []
    for backend in ("torch", "triton"):
        model = load_model(ckpt, device=DEV, kernels=backend)
        cache = make_paged_cache(model.cfg, 32, 4, torch.float32, DEV, model.ops)
        tables = [list(range(8 * b, 8 * b + 8)) for b in range(len(PROMPTS))]
        lens = [len(p) for p in PROMPTS]
        batch = AttentionBatch.build_paged(lens, [0] * len(PROMPTS), tables, 4, DEV)
        got = [model.logits(model(torch.tensor([t for p in PROMPTS for t in p], device=DEV), batch, cache))]
        for step in range(2):
            batch = AttentionBatch.build_paged([1] * len(PROMPTS), [n + step for n in lens], tables, 4, DEV)
            got.append(model.logits(model(torch.tensor([3, 5, 7, 9], device=DEV), batch, cache)))
        outs.append(got)
    for want, got in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
