"""Llama 4's and MiMo-V2-Flash's own checks (tests/test_more_families.py runs them against
transformers with the other new families: logits, greedy ids through LLM and pools, training): their
config.json as published and as transformers fills it, refusals naming the field, Llama 4's
multimodal checkpoint and chunked attention on every path of the paged cache, MiMo's skipped MTP
layers."""
import pytest
import torch

from models.config import ConfigError, ModelConfig
from models.kv_cache import AttentionBatch, PagedKVCache
from tests.conftest import PROMPTS, assert_close_to_transformers, our_logits
from tests.test_planner_shapes import LLAMA4_MAVERICK, LLAMA4_SCOUT, MIMO_V2_FLASH


def test_published_configs_read_as_transformers_fills_them():
    import transformers

    for raw in (LLAMA4_SCOUT, LLAMA4_MAVERICK):
        c = ModelConfig.from_dict(raw)
        theirs = transformers.Llama4TextConfig(**{k: v for k, v in raw["text_config"].items() if k != "model_type"})
        assert c.family == "llama4" and c.dtype == torch.bfloat16 and c.top_k == 1
        assert [i for i, m in enumerate(c.moe_layers) if m] == theirs.moe_layers
        assert list(c.rope_layers) == [bool(r) for r in theirs.no_rope_layers]  # (1: the layer ropes)
        assert [("chunked_attention" if k else "full_attention") for k in c.attention_chunks] == theirs.layer_types
        assert set(c.attention_chunks) == {8192, None} and c.attn_temperature == (8192.0, 0.1)
        assert (c.intermediate_size, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (16384, 8192, 8192)
        assert c.router.scoring == "sigmoid" and not c.router.renormalize and c.router_scales_input
        assert c.rope_interleave and c.rope.theta == 500000.0 and c.eos_token_ids == (200001, 200007, 200008)
    scout, maverick = ModelConfig.from_dict(LLAMA4_SCOUT), ModelConfig.from_dict(LLAMA4_MAVERICK)
    assert scout.qk_norm == "l2" and maverick.qk_norm == "none"
    assert scout.rope.rope_type == "llama3" and maverick.rope.rope_type == "default"
    assert (scout.num_dense_layers, maverick.num_dense_layers) == (0, 24)
    # left out, fields default as Llama4TextConfig's; chunk size null: every layer global
    minimal = {"architectures": ["Llama4ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 8,
               "num_attention_heads": 16, "vocab_size": 512}
    c, theirs = ModelConfig.from_dict(minimal), transformers.Llama4TextConfig(**minimal)
    assert (c.head_dim, c.num_kv_heads, c.num_experts, c.intermediate_size, c.rms_norm_eps, c.rope.theta) == (
        theirs.head_dim, theirs.num_key_value_heads, theirs.num_local_experts, theirs.intermediate_size_mlp,
        theirs.rms_norm_eps, theirs.rope_parameters["rope_theta"])
    assert c.rope_layers == (True, True, True, False) * 2
    assert c.attention_chunks == ((8192,) * 3 + (None,)) * 2
    assert ModelConfig.from_dict({**minimal, "attention_chunk_size": None}).attention_chunks == (None,) * 8


@pytest.mark.parametrize("change,match", [
    ({"num_experts_per_tok": 2}, "num_experts_per_tok=2 is not supported by llama4: its router weighs each expert's"),
    ({"attention_chunk_size": None, "layer_types": ["chunked_attention"] * 8},
     "attention_chunk_size must be a positive int"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers must list 0 or 1 for each of num_hidden_layers=8"),
    ({"moe_layers": [8]}, r"moe_layers must list layer indices in \[0, num_hidden_layers=8\)"),
    ({"layer_types": ["sliding_attention"] * 8}, "layer_types must list num_hidden_layers=8 entries"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
    ({"text_config": 3}, "text_config must be an object"),
])
def test_refusals_name_the_field(change, match):
    raw = {"architectures": ["Llama4ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 8,
           "num_attention_heads": 16, "vocab_size": 512, **change}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """A Llama4ForConditionalGeneration checkpoint (text_config, tensors under language_model., a
    vision tower beside them) loads the language model only; its logits are transformers'."""
    import transformers

    from models.loader import load_experts, load_model
    from tests.conftest import BASE, FAMILIES

    text = {**BASE, **FAMILIES["llama4"][1]}
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  vision_output_dim=32, image_size=28, patch_size=14, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    ref = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text,
                                                                                vision_config=vision)).eval()
    ref.save_pretrained(str(tmp_path))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.architecture == "Llama4ForConditionalGeneration" and cfg.num_layers == 4
    model = load_model(tmp_path, kernels="torch")
    # (transformers 5.24's multimodal forward fails without an image: its language model is the oracle)
    assert_close_to_transformers(our_logits(model, PROMPTS), ref.language_model, PROMPTS)
    mine = load_experts(tmp_path, [4, 2])  # an expert worker's share
    assert torch.equal(mine[1].w2[0], model.model.layers[1].mlp.experts.w2[4])


def _chunk_reference(q_TNH, k_BSKH, v_BSKH, seqs, positions, scale, chunk):
    """Each query over the keys of its chunk, one at a time."""
    out = []
    for q_NH, b, p in zip(q_TNH, seqs, positions):
        start = p - p % chunk
        k_SNH = k_BSKH[b, start:p + 1].repeat_interleave(q_TNH.shape[1] // k_BSKH.shape[2], dim=1)
        v_SNH = v_BSKH[b, start:p + 1].repeat_interleave(q_TNH.shape[1] // k_BSKH.shape[2], dim=1)
        w_NS = torch.softmax(torch.einsum("nh,snh->ns", q_NH, k_SNH) * scale, dim=-1)
        out.append(torch.einsum("ns,snh->nh", w_NS, v_SNH))
    return torch.stack(out)


@pytest.mark.parametrize("V", [10, 6])  # values as wide as keys, or narrower (MiMo-V2-Flash's shape)
@pytest.mark.parametrize("chunk", [8, 5])  # whole pages of 4, or not: decode reads in place from each chunk's start
def test_chunked_attention_on_every_paged_path(chunk, V):
    """Prefill, decode and mixed steps (a 1-token prefill chunk beside decodes) over the paged cache
    equal attention over each query's chunk computed one query at a time."""
    torch.manual_seed(chunk)
    N, K, H, S, lens = 6, 2, 10, 4, [19, 3, 11]
    k_BSKH, v_BSKH = torch.randn(3, 24, K, H), torch.randn(3, 24, K, V)
    tables = [list(range(6 * b, 6 * b + 6)) for b in range(3)]
    cache = PagedKVCache(1, 18, S, K, H, torch.float32, v_head_dim=V)
    steps = [(lens, [0, 0, 0]), ([1, 1, 1], lens), ([1, 1, 1], [n + 1 for n in lens]),  # prefill, 2 decodes
             ([1, 1, 2], [n + 2 for n in lens])]  # decodes beside a prefill chunk
    for q_lens, ctx in steps:
        batch = AttentionBatch.build_paged(q_lens, ctx, tables, S)
        seqs = batch.seq_idx_T.tolist()
        pos = batch.positions_T.tolist()
        q = torch.randn(len(seqs), N, H)
        got = cache.attend(0, q, k_BSKH[seqs, pos], v_BSKH[seqs, pos], batch, H ** -0.5, None, chunk=chunk)
        want = _chunk_reference(q, k_BSKH, v_BSKH, seqs, pos, H ** -0.5, chunk)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- MiMo-V2-Flash ---

def test_mimo_config_reads_as_transformers_fills_it():
    import transformers

    minimal = {"architectures": ["MiMoV2FlashForCausalLM"], "hidden_size": 64, "num_hidden_layers": 13,
               "num_attention_heads": 16, "vocab_size": 512}
    for raw in (minimal, MIMO_V2_FLASH):
        c = ModelConfig.from_dict(raw)
        theirs = transformers.MiMoV2FlashConfig(**{k: v for k, v in raw.items() if k not in ("architectures",
                                                                                             "model_type")})
        sliding = [t == "sliding_attention" for t in theirs.layer_types]
        assert list(c.sliding_windows) == [theirs.sliding_window if s else None for s in sliding]
        assert list(c.layer_kv_heads) == [theirs.num_key_value_heads * (1 + s) for s in sliding]
        assert list(c.sink_layers) == sliding and c.attention_sinks
        assert list(c.moe_layers) == [m == "sparse" for m in theirs.mlp_layer_types]
        assert (c.head_dim, c.v_dim, c.v_scale, c.num_experts, c.top_k) == (
            theirs.head_dim, theirs.v_head_dim, theirs.attention_value_scale, theirs.n_routed_experts,
            theirs.num_experts_per_tok)
        for rope, dim, kind in ((c.rope, c.rope_dim, "full_attention"), (c.sliding_rope, c.sliding_rotary_dim,
                                                                        "sliding_attention")):
            params = theirs.rope_parameters[kind]
            assert (rope.rope_type, rope.theta, dim) == (params["rope_type"], params["rope_theta"],
                                                        int(c.head_dim * params["partial_rotary_factor"]))
        assert c.router.scoring == "sigmoid" and c.router.correction_bias and c.router.scaling == 1.0
        assert c.shared_expert_intermediate_size == 0 and c.num_mtp_layers == 0
    c = ModelConfig.from_dict(MIMO_V2_FLASH)
    # the cache per token: 9 full layers of 4 kv heads, 39 sliding of 8, keys of 192 and values of 128
    assert c.kv_bytes_per_token(torch.bfloat16) == (9 * 4 + 39 * 8) * (192 + 128) * 2
    assert ModelConfig.from_dict({**minimal, "sliding_window_size": 127}).sliding_windows[1] == 128


@pytest.mark.parametrize("change,match", [
    ({"layer_types": ["sliding_attention"]}, "layer_types must list num_hidden_layers=4 entries"),
    ({"mlp_layer_types": ["moe"] * 4}, "mlp_layer_types must list num_hidden_layers=4 entries of 'dense' / 'sparse'"),
    ({"sliding_window": None}, "sliding_window must be a positive int"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2},
     r"multiple of the sliding layers' 2 x num_key_value_heads \(4\)"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}}}, "'sliding_attention' has none"),
    ({"rope_parameters": {k: {"rope_theta": 1e4, "partial_rotary_factor": 0.5} for k in
                          ("full_attention", "sliding_attention")}, "head_dim": 14}, "gives 7 rotary dims"),
    ({"attention_dropout": 0.5}, "attention_dropout=0.5 is not supported"),
])
def test_mimo_refusals_name_the_field(change, match):
    raw = {"architectures": ["MiMoV2FlashForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 16, "vocab_size": 512, **change}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_mimo_mtp_layers_are_skipped(make_checkpoint, tmp_path):
    """Published MiMo-V2-Flash checkpoints carry multi-token-prediction layers under model.mtp.,
    which transformers skips: so does the loader (serving and expert workers)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from models.loader import load_experts, load_model

    src = make_checkpoint("mimo_v2_flash")
    shutil.copytree(src, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(f)
    tensors["model.mtp.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, f, metadata={"format": "pt"})
    ours, plain = load_model(tmp_path / "ckpt"), load_model(src)
    for (n, a), (_, b) in zip(ours.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), n
    assert torch.equal(load_experts(tmp_path / "ckpt", [7])[2].w13[0], plain.model.layers[2].mlp.experts.w13[7])
