"""config.json as transformers 4 and 5 write it, and the errors of a config Shuttle cannot serve."""
import json
import shutil

import pytest
import torch

from models.config import ConfigError, ModelConfig
from models.kv_cache import AttentionBatch, DenseKVCache
from models.loader import load_model
from tests.conftest import PROMPTS, hf_model


def _as_transformers4(cfg: dict) -> dict:
    """Rewrite a transformers-5 config.json the way transformers 4 (and most hub checkpoints) wrote it."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("layer_types", None)
    return cfg


@pytest.mark.parametrize("family,overrides", [
    ("qwen2_moe", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
                   "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ("mixtral", {}),
    ("olmoe", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 128}}),
])
def test_transformers4_config_reads_like_transformers5(make_checkpoint, tmp_path, family, overrides):
    src = make_checkpoint(family, **overrides)
    d = tmp_path / "v4"
    shutil.copytree(src, d)
    v5 = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(_as_transformers4(v5)))
    assert ModelConfig.from_pretrained(d) == ModelConfig.from_pretrained(src)
    # and transformers itself reads the old form the same way: logits still agree
    cfg = ModelConfig.from_pretrained(d)
    ours, ref = load_model(d), hf_model(d)
    p = PROMPTS[0]
    cache = DenseKVCache(cfg.num_layers, 1, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    with torch.no_grad():
        got = ours.logits(ours(torch.tensor(p), AttentionBatch.build([len(p)], [0], [0]), cache))
        expected = ref(torch.tensor([p])).logits[0]
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()


def test_dtype_fields():
    base = {"architectures": ["MixtralForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 8, "num_local_experts": 2, "num_experts_per_tok": 1}
    assert ModelConfig.from_dict(base).dtype == torch.float32
    assert ModelConfig.from_dict({**base, "torch_dtype": "bfloat16"}).dtype == torch.bfloat16
    assert ModelConfig.from_dict({**base, "dtype": "float16"}).dtype == torch.float16
    assert ModelConfig.from_dict(base).rope.theta == 1e6  # Mixtral's default theta
    with pytest.raises(ConfigError, match="dtype 'int8' is not supported"):
        ModelConfig.from_dict({**base, "dtype": "int8"})
    with pytest.raises(ConfigError, match="required field 'hidden_size' is missing"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match=r"num_attention_heads \(2\) must be a multiple of num_key_value_heads \(3\)"):
        ModelConfig.from_dict({**base, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(3\) must be in \[1, num_experts=2\]"):
        ModelConfig.from_dict({**base, "num_experts_per_tok": 3})
    with pytest.raises(ConfigError, match="rope type 'mrope' is not supported"):
        ModelConfig.from_dict({**base, "rope_scaling": {"type": "mrope"}})
    with pytest.raises(ConfigError, match=r"rope_parameters\.factor is required"):
        ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "linear"}})
    with pytest.raises(ConfigError, match="hidden_act='gelu' is not supported"):
        ModelConfig.from_dict({**base, "hidden_act": "gelu"})
