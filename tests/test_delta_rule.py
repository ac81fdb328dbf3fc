"""Gated delta rule and causal conv (kernels/delta_rule.py) against transformers' Qwen3-Next reference
functions, plus the properties serving relies on: padding rows are no-ops, pieces with a carried
state equal the whole, decode steps equal one-token prefills, gradients flow. The Triton versions
(kernels/delta_rule_triton.py) are checked against the torch ones, interpreted on the CPU
(TRITON_INTERPRET=1, set in conftest), compiled on CUDA.

Odd sizes throughout: Hk 3 q/k heads serving Hv 6 value heads, K 20, V 12, chunks of 8 over 21 tokens.
"""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (causal_conv1d_fn, causal_conv1d_update,
                                                                 torch_chunk_gated_delta_rule,
                                                                 torch_recurrent_gated_delta_rule)

from kernels.delta_rule import causal_conv1d, gated_delta_rule_chunked, gated_delta_rule_recurrent
from tests.conftest import TRITON_DEVICE

TOL = dict(rtol=1e-4, atol=1e-4)


def rule_inputs(B, L, Hk=3, Hv=6, K=20, V=12, seed=0, device="cpu"):
    """q, k, v, g (log decay <= 0), beta in (0, 1), and a non-zero initial state."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    xs = (r(B, L, Hk, K), r(B, L, Hk, K), r(B, L, Hv, V), -F.softplus(r(B, L, Hv) - 1), torch.sigmoid(r(B, L, Hv)),
          0.5 * r(B, Hv, K, V))
    return tuple(x.to(device) for x in xs)


def hf(fn, q, k, v, g, beta, state, **kw):
    return fn(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)


def pad_short(xs, lens, seed=1):
    """Sequence 1 of the batch keeps its first lens[1] rows; the rest become garbage q/k/v with beta = g = 0."""
    q, k, v, g, beta, state = (x.clone() for x in xs)
    n = lens[1]
    junk = rule_inputs(*q.shape[:2], q.shape[2], v.shape[2], q.shape[3], v.shape[3], seed=seed)
    for x, j in ((q, junk[0]), (k, junk[1]), (v, junk[2])):
        x[1, n:] = j[1, n:].to(x.device)
    g[1, n:], beta[1, n:] = 0, 0
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [8, 64])
def test_chunked_matches_transformers(chunk):
    xs = rule_inputs(2, 21)
    o, S = gated_delta_rule_chunked(*xs, chunk=chunk)
    for fn, kw in ((torch_chunk_gated_delta_rule, dict(chunk_size=chunk)), (torch_recurrent_gated_delta_rule, {})):
        o_ref, S_ref = hf(fn, *xs, **kw)
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(S, S_ref, **TOL)


def test_padding_rows_are_no_ops():
    lens = (21, 9)
    q, k, v, g, beta, state = pad_short(rule_inputs(2, 21), lens)
    o, S = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk=8)
    n = lens[1]
    o1, S1 = gated_delta_rule_chunked(q[1:, :n], k[1:, :n], v[1:, :n], g[1:, :n], beta[1:, :n], state[1:], chunk=8)
    torch.testing.assert_close(o[1:, :n], o1, rtol=0, atol=1e-6)
    torch.testing.assert_close(S[1:], S1, rtol=0, atol=1e-6)
    o0, S0 = gated_delta_rule_chunked(*(x[:1] for x in (q, k, v, g, beta, state)), chunk=8)
    torch.testing.assert_close(o[:1], o0, rtol=0, atol=1e-6)
    torch.testing.assert_close(S[:1], S0, rtol=0, atol=1e-6)


def test_recurrent_step_equals_one_token_chunked():
    q, k, v, g, beta, state = rule_inputs(3, 1)
    o, S = gated_delta_rule_recurrent(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    o_ref, S_ref = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk=8)
    torch.testing.assert_close(o, o_ref[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=1e-6)
    assert o.dtype == S.dtype == torch.float32


def test_pieces_with_carried_state_equal_the_whole():
    """Chunked prefill of 13 then 8 tokens, then 3 decode steps, against all 24 at once."""
    q, k, v, g, beta, state = rule_inputs(2, 24)
    o_all, S_all = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk=8)
    outs, S = [], state
    for a, b in ((0, 13), (13, 21)):
        o, S = gated_delta_rule_chunked(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], S, chunk=8)
        outs.append(o)
    for t in range(21, 24):
        o, S = gated_delta_rule_recurrent(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o[:, None])
    torch.testing.assert_close(torch.cat(outs, 1), o_all, **TOL)
    torch.testing.assert_close(S, S_all, **TOL)


def test_gradients_flow_and_match_transformers():
    xs = [x.requires_grad_() for x in rule_inputs(2, 21)]
    inputs_before = [x.detach().clone() for x in xs]
    o, S = gated_delta_rule_chunked(*xs, chunk=8)
    w_o, w_S = torch.randn_like(o), torch.randn_like(S)
    grads = torch.autograd.grad((o * w_o).sum() + (S * w_S).sum(), xs)
    assert all(torch.isfinite(gr).all() for gr in grads)
    assert all(torch.equal(x, x0) for x, x0 in zip(xs, inputs_before))  # nothing written in place
    o_ref, S_ref = hf(torch_recurrent_gated_delta_rule, *xs)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (S_ref * w_S).sum(), xs)
    for gr, gr_ref in zip(grads, grads_ref):
        torch.testing.assert_close(gr, gr_ref, rtol=1e-4, atol=1e-4)


def conv_inputs(B, L, C=10, W=3, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=gen).to(device) for s in ((B, L, C), (B, C, W), (C, W + 1)))


@pytest.mark.parametrize("native_kernels", [True, False], ids=["native", "torch"])
def test_decode_in_place_equals_the_recurrent_step(native_kernels, monkeypatch):
    """gated_delta_rule_decode_: each sequence's state updated in its slot of the state cache (native:
    kernels/csrc/delta_rule.c; else gather, recurrent step, write back), fresh ones from zeros,
    other slots untouched; the output and states are gated_delta_rule_recurrent's."""
    from kernels import native
    from kernels.delta_rule import gated_delta_rule_decode_

    if native_kernels and not native.available():
        pytest.skip("no native kernels here")
    monkeypatch.setattr(native, "available", lambda: native_kernels and native._library() is not None)
    torch.manual_seed(3)
    B, Hk, Hv, K, V, S = 5, 3, 6, 20, 12, 9
    q, k, v = torch.randn(B, Hk, K), torch.randn(B, Hk, K), torch.randn(B, Hv, V)
    g, beta = -torch.rand(B, Hv) * 2, torch.rand(B, Hv)
    states, slots = torch.randn(S, Hv, K, V), torch.tensor([7, 2, 0, 5, 3])
    fresh = torch.tensor([False, True, False, False, True])
    want_o, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, states[slots] * (~fresh)[:, None, None, None])
    cache = states.clone()
    o = gated_delta_rule_decode_(q, k, v, g, beta, cache, slots, fresh)
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache[slots], want_s, atol=1e-5, rtol=1e-5)
    others = [i for i in range(S) if i not in slots.tolist()]
    assert torch.equal(cache[others], states[others])


def test_conv_matches_transformers():
    x, state, w = conv_inputs(2, 11)
    lens = torch.tensor([11, 11])
    y, new_state = causal_conv1d(x, lens, torch.zeros_like(state), w)
    y_ref = causal_conv1d_fn(x.transpose(1, 2), w, activation="silu").transpose(1, 2)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_state, x[:, -3:].transpose(1, 2), rtol=0, atol=0)
    # decode: one-token steps from a random state against causal_conv1d_update (which writes its state)
    hf_state = state.clone()
    for t in range(4):
        y, state = causal_conv1d(x[:, t:t + 1], torch.tensor([1, 1]), state, w)
        y_ref = causal_conv1d_update(x[:, t:t + 1].transpose(1, 2), hf_state, w, activation="silu").transpose(1, 2)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state, hf_state, rtol=0, atol=0)


def test_conv_pieces_and_padding():
    x, state, w = conv_inputs(2, 11)
    y_all, s_all = causal_conv1d(x, torch.tensor([11, 11]), state, w)
    ys, s = [], state
    for a, b in ((0, 4), (4, 10), (10, 11)):
        y, s = causal_conv1d(x[:, a:b], torch.tensor([b - a] * 2), s, w)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 1), y_all, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, s_all, rtol=0, atol=0)
    # right-padded batch: lens 11 and 2 (shorter than W, so part of the new state is the old state)
    y, s = causal_conv1d(x, torch.tensor([11, 2]), state, w)
    y1, s1 = causal_conv1d(x[1:, :2], torch.tensor([2]), state[1:], w)
    torch.testing.assert_close(y[1:, :2], y1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s[1:], s1, rtol=0, atol=0)
    torch.testing.assert_close(s[1:], torch.cat([state[1:, :, 2:], x[1:, :2].transpose(1, 2)], -1), rtol=0, atol=0)


# --- Triton (interpreted on the CPU: tiny sizes) ---

@pytest.mark.gpu
@pytest.mark.parametrize("K,V", [(20, 12), (130, 40)])  # (130, 40): a 256 x 16 state tile, 3 blocks of V
def test_triton_recurrent(poison, K, V):
    from kernels import delta_rule_triton

    *xs, state = rule_inputs(2, 1, 2, 4, K, V, device=TRITON_DEVICE)
    q, k, v, g, beta = (x[:, 0] for x in xs)
    state_before = state.clone()
    o, S = delta_rule_triton.gated_delta_rule_recurrent(q, k, v, g, beta, state)
    o_ref, S_ref = gated_delta_rule_recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(state, state_before)


@pytest.mark.gpu
def test_triton_chunked_with_padding(poison):
    from kernels import delta_rule_triton

    lens = (9, 5)
    xs = pad_short(rule_inputs(2, 9, 2, 4, 20, 12), lens)
    xs = tuple(x.to(TRITON_DEVICE) for x in xs)
    o, S = delta_rule_triton.gated_delta_rule_chunked(*xs, chunk=4)
    o_ref, S_ref = gated_delta_rule_chunked(*xs, chunk=4)
    torch.testing.assert_close(o[0], o_ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o[1, :5], o_ref[1, :5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=1e-5)
    # the padding rows leave the short sequence's state bit for bit as its real rows left it
    _, S1 = delta_rule_triton.gated_delta_rule_chunked(*(x[1:, :5] for x in xs[:5]), xs[5][1:])
    assert torch.equal(S[1:], S1)


@pytest.mark.gpu
@pytest.mark.parametrize("L,C", [(9, 10), (40, 150)])  # (40, 150): 2 x 2 tiles of tokens x channels
def test_triton_conv(poison, L, C):
    from kernels import delta_rule_triton

    x, state, w = conv_inputs(2, L, C=C, W=3, device=TRITON_DEVICE)
    lens = torch.tensor([L, 2], device=TRITON_DEVICE)
    y, s = delta_rule_triton.causal_conv1d(x, lens, state, w)
    y_ref, s_ref = causal_conv1d(x, lens, state, w)
    torch.testing.assert_close(y[0], y_ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y[1, :2], y_ref[1, :2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
