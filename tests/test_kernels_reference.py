"""Torch reference ops against independent formulations, on odd sizes and fresh random inputs."""
import pytest
import torch
import torch.nn.functional as F

from kernels import cached_attention, fused_moe, moe_gather_einsum, rms_norm, sample, topk_route
from kernels.rotary import RopeConfig, inv_freq_and_scale


def _hf_loop_moe(x, w13, w2, weights, ids):
    """transformers' formulation: loop over hit experts, index_add their weighted outputs."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, pos = torch.where(ids == e)
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        out.index_add_(0, tok, (F.linear(F.silu(gate) * up, w2[e]) * weights[tok, pos, None]).to(x.dtype))
    return out


@pytest.mark.parametrize("T,E,K", [(1, 4, 1), (7, 5, 2), (33, 16, 8), (130, 8, 2), (3, 128, 8)])
def test_fused_moe_matches_loop_and_einsum(T, E, K):
    D, I = 48, 40
    x = torch.randn(T, D)
    w13, w2 = torch.randn(E, 2 * I, D) / D ** 0.5, torch.randn(E, D, I) / I ** 0.5
    weights, ids = topk_route(torch.randn(T, E), K, "softmax", renormalize=True)
    got = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, _hf_loop_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, moe_gather_einsum(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_fused_moe_unused_experts_and_bf16():
    T, D, I, E = 20, 32, 24, 8
    x = torch.randn(T, D)
    w13, w2 = torch.randn(E, 2 * I, D) / D ** 0.5, torch.randn(E, D, I) / I ** 0.5
    ids = torch.tensor([[0, 5]] * T)  # six experts get nothing
    weights = torch.full((T, 2), 0.5)
    ref = _hf_loop_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), ref, rtol=1e-5, atol=1e-5)
    got16 = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert got16.dtype == torch.bfloat16
    assert (got16.float() - ref).abs().max() < 1e-2 * ref.abs().max() + 1e-2


def test_routing_softmax_and_sigmoid():
    logits = torch.randn(9, 6)
    w, i = topk_route(logits, 3, "softmax", renormalize=False)
    probs = logits.softmax(-1)
    torch.testing.assert_close(w, probs.gather(1, i))
    assert (i[:, 0] == probs.argmax(-1)).all()
    w, _ = topk_route(logits, 3, "softmax", renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(9))
    w, i = topk_route(logits, 2, "sigmoid", renormalize=False)
    torch.testing.assert_close(w, logits.sigmoid().gather(1, i))
    with pytest.raises(ValueError, match="unknown router scoring"):
        topk_route(logits, 2, "relu")


def test_rms_norm_against_float64():
    x, w = torch.randn(5, 37), torch.randn(37)
    ref = w.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(rms_norm(x, w, 1e-6).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_frequencies_equal_transformers(params):
    from transformers import MixtralConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = MixtralConfig(hidden_size=96, num_attention_heads=2, head_dim=48, max_position_embeddings=256,
                       rope_parameters={"rope_theta": 10000.0, **params})
    ours = RopeConfig(theta=10000.0, max_position_embeddings=256, **{
        {"rope_type": "rope_type"}.get(k, k): v for k, v in params.items()})
    for seq_len in (None, 700):
        exp_inv, exp_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, None, seq_len=seq_len)
        got_inv, got_scale = inv_freq_and_scale(ours, 48, seq_len)
        torch.testing.assert_close(got_inv, exp_inv, rtol=1e-6, atol=0)
        assert got_scale == pytest.approx(exp_scale)


def _naive_attention(q, k_cache, v_cache, seq_idx, positions, scale, window):
    out = torch.empty_like(q)
    groups = q.shape[1] // k_cache.shape[1]
    for t in range(q.shape[0]):
        b, p = int(seq_idx[t]), int(positions[t])
        lo = 0 if window is None else max(0, p - window + 1)
        k = k_cache[b, :, lo:p + 1].repeat_interleave(groups, 0)  # (N, S, H)
        v = v_cache[b, :, lo:p + 1].repeat_interleave(groups, 0)
        att = torch.softmax((k @ q[t][:, :, None]).squeeze(-1) * scale, -1)
        out[t] = (att[:, None, :] @ v).squeeze(1)
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_cached_attention_mixed_prefill_and_decode(window):
    N, K, H, S = 6, 2, 20, 17
    q_lens, ctx_lens = [5, 1, 1, 9], [0, 12, 3, 4]  # a new prompt, two decodes, a chunk after a cached prefix
    B = len(q_lens)
    k_cache, v_cache = torch.randn(B, K, S, H), torch.randn(B, K, S, H)
    seq_idx = torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens))
    tok_idx = torch.cat([torch.arange(n) for n in q_lens])
    positions = torch.tensor(ctx_lens)[seq_idx] + tok_idx
    q = torch.randn(len(seq_idx), N, H)
    got = cached_attention(q, k_cache, v_cache, seq_idx, tok_idx, positions, max(q_lens), H ** -0.5, window)
    ref = _naive_attention(q, k_cache, v_cache, seq_idx, positions, H ** -0.5, window)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_sampling_greedy_topk_topp():
    logits = torch.randn(6, 50)
    B = logits.shape[0]
    ones, zeros = torch.ones(B), torch.zeros(B, dtype=torch.long)
    argmax = logits.argmax(-1)
    assert torch.equal(sample(logits, torch.zeros(B), ones, zeros), argmax)
    assert torch.equal(sample(logits, ones, ones, torch.ones(B, dtype=torch.long)), argmax)  # top_k=1
    assert torch.equal(sample(logits, ones, torch.full((B,), 1e-6), zeros), argmax)  # tiny top_p
    top3 = logits.topk(3, -1).indices
    for _ in range(20):
        s = sample(logits, ones * 5, ones, torch.full((B,), 3, dtype=torch.long))
        assert (top3 == s[:, None]).any(-1).all()


def test_sampling_follows_the_distribution_and_seeds_are_batch_independent():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    n = len(logits)
    s = sample(logits, torch.ones(n), torch.ones(n), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(s, minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.03
    # top_p=0.8 keeps {0.5, 0.3}: renormalised to 0.625 / 0.375
    s = sample(logits, torch.ones(n), torch.full((n,), 0.8), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(s, minlength=4).float() / n
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.625) < 0.03
    # a seeded row gives the same token alone or in any batch
    row = torch.randn(1, 100)
    alone = [sample(row, torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.long),
                    [torch.Generator().manual_seed(7)]).item() for _ in range(3)]
    batch = torch.cat([torch.randn(3, 100), row])
    gens = [None, torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(7)]
    mixed = sample(batch, torch.ones(4), torch.ones(4), torch.zeros(4, dtype=torch.long), gens)
    assert alone == [alone[0]] * 3 and mixed[3].item() == alone[0]


@pytest.mark.parametrize("version,kw", [
    ("V3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
                routed_scaling_factor=2.5)),
    ("V3", dict(n_routed_experts=12, num_experts_per_tok=3, n_group=1, topk_group=1, norm_topk_prob=False,
                routed_scaling_factor=1.0)),
    ("V2", dict(n_routed_experts=12, num_experts_per_tok=3, topk_method="greedy", routed_scaling_factor=1.5)),
    ("V2", dict(n_routed_experts=12, num_experts_per_tok=3, n_group=3, topk_group=2,
                topk_method="group_limited_greedy", routed_scaling_factor=1.0)),
])
def test_routing_equals_transformers_deepseek_routers(version, kw):
    """topk_route with a DeepSeek RouterConfig chooses the same experts with the same weights as
    transformers' DeepseekV3TopkRouter / DeepseekV2TopkRouter (a non-zero correction bias for V3)."""
    import transformers
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    from models.config import _router

    cfg = getattr(transformers, f"Deepseek{version}Config")(hidden_size=32, num_attention_heads=4, **kw)
    hf = (v3.DeepseekV3TopkRouter if version == "V3" else v2.DeepseekV2TopkRouter)(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        hf.weight.normal_()
        bias = None
        if version == "V3":
            hf.e_score_correction_bias.uniform_(0, 0.3)
            bias = hf.e_score_correction_bias
        x = torch.randn(40, 32)
        _, want_w, want_ids = hf(x)
    r = _router({**cfg.to_dict(), "model_type": f"deepseek_{version.lower()}"}, f"deepseek_{version.lower()}",
                kw["n_routed_experts"], kw["num_experts_per_tok"], "test")
    w, ids = topk_route(x @ hf.weight.T, r.top_k, r.scoring, r.renormalize, correction_bias_E=bias,
                        **r.route_kwargs())
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices))


@pytest.mark.parametrize("bias", [False, True])
def test_fused_moe_upcast_of_emulated_bf16(monkeypatch, bias):
    """Experts with >= upcast_min_rows rows compute in float32 where bf16 GEMMs are emulated (forced
    here, so the path runs on any CPU): close to the all-float32 result, closer than bf16 GEMMs are."""
    import kernels.moe as moe

    monkeypatch.setattr(moe, "_gemm_is_emulated", lambda dtype: True)
    torch.manual_seed(0)
    T, D, I, E = 24, 32, 24, 4
    x = torch.randn(T, D)
    w13, w2 = torch.randn(E, 2 * I, D) / D ** 0.5, torch.randn(E, D, I) / I ** 0.5
    kw = {}
    if bias:
        kw = dict(b13_EI2=torch.randn(E, 2 * I) / 4, b2_ED=torch.randn(E, D) / 4, act=moe.SwiGLU(1.702, 7.0, 1.0))
    ids = torch.tensor([[0, 1]] * 20 + [[2, 3]] * 4)  # experts 0 and 1 get 20 rows, 2 and 3 get 4
    weights = torch.rand(T, 2)
    bf = {k: v.bfloat16() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    args = (x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    as_float = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in bf.items()}
    exact = fused_moe(*(a.float() for a in args[:3]), weights, ids, **as_float)
    upcast = fused_moe(*args, **bf, upcast_min_rows=8)
    plain = fused_moe(*args, **bf, upcast_min_rows=None)
    assert upcast.dtype == torch.bfloat16
    torch.testing.assert_close(upcast[20:], plain[20:], rtol=0, atol=0)  # 4-row experts: bf16 GEMMs as before
    err_up, err_plain = ((y[:20].float() - exact[:20]).abs().max() for y in (upcast, plain))
    assert err_up <= 1e-2 * exact.abs().max() and err_up <= err_plain
