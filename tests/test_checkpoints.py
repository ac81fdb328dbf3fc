"""Checkpoint loading: sharded and single files, tied embeddings, partial loading, and clear errors."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import ConfigError, ModelConfig
from models.checkpoint import CheckpointError, CheckpointReader
from models.loader import load_model
from models.moe_decoder import MoEForCausalLM


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite(d, fn):
    f = d / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _params_equal(a: MoEForCausalLM, b: MoEForCausalLM) -> None:
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert torch.equal(p, pb[name]), name


def test_sharded_checkpoint_with_index_loads_identically(make_checkpoint, tmp_path):
    src = make_checkpoint("qwen2_moe")
    d = _copy(src, tmp_path)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = [names[0::3], names[1::3], names[2::3]]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in shard}, d / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _params_equal(load_model(d), load_model(src))


def test_tied_embeddings_share_one_tensor(make_checkpoint):
    d = make_checkpoint("mixtral", tie_word_embeddings=True)
    model = load_model(d)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_missing_tensor_names_it(make_checkpoint, tmp_path):
    d = _copy(make_checkpoint("mixtral"), tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load_model(d)


def test_missing_expert_tensor_names_it(make_checkpoint, tmp_path):
    d = _copy(make_checkpoint("mixtral"), tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.0.block_sparse_moe.experts.3.w3.weight"))
    with pytest.raises(CheckpointError, match=r"block_sparse_moe\.experts\.3\.w3\.weight"):
        load_model(d)


def test_wrong_shape_names_file_and_tensor(make_checkpoint, tmp_path):
    d = _copy(make_checkpoint("olmoe"), tmp_path)
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.mlp.experts.2.up_proj.weight", torch.zeros(3, 5)))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.experts\.2\."
                                              r"up_proj\.weight' has shape \[3, 5\], expected \[32, 64\]"):
        load_model(d)


def test_unexpected_tensor_is_an_error(make_checkpoint, tmp_path):
    d = _copy(make_checkpoint("qwen3_moe"), tmp_path)
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.mlp.experts.99.up_proj.weight", torch.zeros(24, 64)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.99\.up_proj"):
        load_model(d)


def test_unknown_architecture_lists_supported(make_checkpoint, tmp_path):
    d = _copy(make_checkpoint("mixtral"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM.*supported: DeepseekV2ForCausalLM, DeepseekV32ForCausalLM, "
                                          r"DeepseekV3ForCausalLM, DeepseekV4ForCausalLM, Glm4MoeForCausalLM, GlmMoeDsaForCausalLM, "
                                          r"GptOssForCausalLM, Llama4ForCausalLM, Llama4ForConditionalGeneration, "
                                          r"MiMoV2FlashForCausalLM, MiniMaxM2ForCausalLM, MixtralForCausalLM, "
                                          r"OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, "
                                          r"Qwen3NextForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration"):
        ModelConfig.from_pretrained(d)


def test_missing_files(make_checkpoint, tmp_path):
    d = _copy(make_checkpoint("mixtral"), tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        load_model(d)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config\.json: file not found"):
        load_model(d)


def test_index_pointing_to_missing_shard(make_checkpoint, tmp_path):
    d = _copy(make_checkpoint("mixtral"), tmp_path)
    names = load_file(d / "model.safetensors").keys()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00002-of-00002.safetensors" for n in names}}))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: file listed in"):
        load_model(d)


def test_attention_worker_share_reads_no_expert_tensor(make_checkpoint, monkeypatch):
    d = make_checkpoint("qwen2_moe")
    read: list[str] = []
    orig = CheckpointReader.read

    def spy(self, wanted, shapes, *rest):
        read.extend(wanted)
        return orig(self, wanted, shapes, *rest)

    monkeypatch.setattr(CheckpointReader, "read", spy)
    model = load_model(d, with_experts=False)
    assert read and not any(".experts." in n for n in read)
    assert any("shared_expert" in n for n in read)  # the shared expert is dense: it stays with attention
    assert all(layer.mlp.experts is None for layer in model.model.layers)
    full = load_model(d)
    pf = dict(full.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, pf[name])
