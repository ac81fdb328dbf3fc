"""--dtype auto: a bf16/fp16 checkpoint on a CPU that emulates those GEMMs is served in float32
(models.loader.auto_dtype, decided by kernels.cpu_linear.gemm_is_emulated); elsewhere auto keeps
the checkpoint's dtype, and an explicit --dtype always wins."""
import logging

import pytest
import torch

import models.loader as loader
from server import LLM, SamplingParams
from server.llm import engine_config


@pytest.fixture
def emulated(monkeypatch):
    """emulated(flag): make this CPU's bf16/fp16 GEMMs look emulated (True) or native (False)."""
    def set_(flag: bool) -> None:
        monkeypatch.setattr(loader, "gemm_is_emulated", lambda dtype: flag and dtype != torch.float32)
    return set_


@pytest.mark.parametrize("ckpt", [torch.bfloat16, torch.float16])
def test_auto_upcasts_only_where_emulated(emulated, ckpt):
    emulated(True)
    dtype, why = loader.auto_dtype(ckpt, ["cpu", "cpu"])
    assert dtype == torch.float32 and "float32" in why and str(ckpt).removeprefix("torch.") in why
    # A GPU anywhere in the deployment, or no device: the checkpoint's dtype.
    assert loader.auto_dtype(ckpt, ["cuda"]) == (ckpt, None)
    assert loader.auto_dtype(ckpt, ["cpu", "cuda:0"]) == (ckpt, None)
    assert loader.auto_dtype(torch.float32, ["cpu"]) == (torch.float32, None)
    emulated(False)  # native bf16/fp16 (AVX-512 BF16, AMX): keep it
    assert loader.auto_dtype(ckpt, ["cpu"]) == (ckpt, None)


def test_engine_config_resolves_auto_once(emulated, make_checkpoint, caplog):
    ckpt = make_checkpoint("mixtral", dtype="bfloat16")
    emulated(True)
    with caplog.at_level(logging.INFO, logger="shuttle"):
        cfg = engine_config(ckpt, "auto", "cpu")
    assert cfg.dtype == torch.float32
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype:")] == [
        f"dtype: {loader.auto_dtype(torch.bfloat16, ['cpu'])[1]}"]
    assert engine_config(ckpt, "bfloat16", "cpu").dtype == torch.bfloat16  # explicit: forced
    assert engine_config(ckpt, "auto", "cpu", colocated=False, expert_device="cuda").dtype == torch.bfloat16
    emulated(False)
    assert engine_config(ckpt, None, "cpu").dtype == torch.bfloat16


def test_auto_serves_bf16_checkpoint_as_float32(emulated, make_checkpoint):
    """End to end: weights, activations and the KV cache in float32, the same ids as --dtype float32."""
    ckpt = make_checkpoint("mixtral", dtype="bfloat16")
    emulated(True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    auto = LLM(ckpt, dtype="auto", device="cpu", num_kv_blocks=16)
    runner = auto.engine.runner
    assert runner.dtype == torch.float32
    assert {p.dtype for p in runner.model.parameters()} == {torch.float32}
    assert {t.dtype for t in runner.cache.k + runner.cache.v} == {torch.float32}
    got = [o.outputs[0].token_ids for o in auto.generate(prompts, params)]
    f32 = LLM(ckpt, dtype="float32", device="cpu", num_kv_blocks=16)
    assert got == [o.outputs[0].token_ids for o in f32.generate(prompts, params)]
    auto.shutdown()
    f32.shutdown()
