"""Gated delta rule (Qwen3-Next's linear attention) and its short causal convolution, in torch.

This is the CPU path and the training path (autograd flows; inputs are never written), and the
reference the Triton kernels (kernels/delta_rule_triton.py) are tested against.

Legend: B sequences, L tokens per sequence (right-padded), Hk query/key heads, Hv value heads (a
multiple of Hk: q/k head h serves value heads h*R .. h*R+R-1, R = Hv / Hk), K key head dim, V value
head dim, N chunks of M tokens; in causal_conv1d C channels, K = W + 1 taps (W the state width), T = W + L.

Per value head the state S (K x V, float32) evolves token by token:
    S = S * exp(g);  delta = beta * (v - S^T k);  S = S + k delta^T;  o = S^T q
with q, k L2-normalised over K (in float32) and q scaled by K**-0.5.

Chunked form (prefill): inside a chunk with cumulative log decay G_t = g_1 + .. + g_t, the state
after token t is exp(G_t) S0 + sum_{s<=t} exp(G_t - G_s) k_s delta_s^T, so the deltas solve the
unit-lower-triangular system (I + A) delta = beta v - beta exp(G) k S0, A_ts = beta_t exp(G_t - G_s)
k_t.k_s for s < t (the UT / WY transform). Everything but the S0 term is solved for all chunks at
once; only the products with the carried state walk the chunks. A padding row (beta = 0, g = 0)
has a zero row in A and in the right-hand side, so its delta is an exact zero: it adds nothing to
the state or to later rows, and the state after the padding is exactly the state before it.
"""
import torch
import torch.nn.functional as F


def normalize_qk(q_xHK: torch.Tensor, k_xHK: torch.Tensor, Hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise q and k over K in float32, scale q by K**-0.5, repeat heads Hk -> Hv."""
    q, k = q_xHK.float(), k_xHK.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    R = Hv // k.shape[-2]
    if R > 1:
        q, k = q.repeat_interleave(R, dim=-2), k.repeat_interleave(R, dim=-2)
    return q, k


def gated_delta_rule_recurrent(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor,
                               beta_BH: torch.Tensor, state_BHKV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step per sequence: returns (o_BHV float32, new state_BHKV float32). Hk q/k heads, Hv v heads."""
    q_BHK, k_BHK = normalize_qk(q_BHK, k_BHK, v_BHV.shape[-2])
    S_BHKV = state_BHKV.float() * g_BH.float().exp()[..., None, None]
    delta_BHV = (v_BHV.float() - torch.einsum("bhkv,bhk->bhv", S_BHKV, k_BHK)) * beta_BH.float()[..., None]
    S_BHKV = S_BHKV + k_BHK[..., :, None] * delta_BHV[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", S_BHKV, q_BHK), S_BHKV


def gated_delta_rule_chunked(q_BLHK: torch.Tensor, k_BLHK: torch.Tensor, v_BLHV: torch.Tensor, g_BLH: torch.Tensor,
                             beta_BLH: torch.Tensor, state_BHKV: torch.Tensor,
                             chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """B right-padded sequences of L tokens from state_BHKV: returns (o_BLHV float32, final state_BHKV float32).

    Padding rows must have beta = 0 and g = 0; they then leave the state exactly unchanged.
    """
    B, L, Hv, V = v_BLHV.shape
    q_BLHK, k_BLHK = normalize_qk(q_BLHK, k_BLHK, Hv)
    P = (-L) % chunk  # pad to whole chunks with rows that are exact no-ops
    N, M = (L + P) // chunk, chunk

    def chunks(x_BLHD: torch.Tensor) -> torch.Tensor:  # (B, L, H, D) -> (B, H, N, M, D)
        return F.pad(x_BLHD.float(), (0, 0, 0, 0, 0, P)).transpose(1, 2).reshape(B, Hv, N, M, -1)

    q_BHNMK, k_BHNMK, v_BHNMV = chunks(q_BLHK), chunks(k_BLHK), chunks(v_BLHV)
    g_BHNM, beta_BHNM = chunks(g_BLH[..., None])[..., 0], chunks(beta_BLH[..., None])[..., 0]

    G_BHNM = g_BHNM.cumsum(-1)
    causal_MM = torch.ones(M, M, dtype=torch.bool, device=q_BHNMK.device).tril()
    # decay from token s to token t (s <= t); masked before exp so that no exp overflows
    decay_BHNMM = (G_BHNM[..., :, None] - G_BHNM[..., None, :]).masked_fill(~causal_MM, float("-inf")).exp()
    A_BHNMM = (beta_BHNM[..., None] * (k_BHNMK @ k_BHNMK.transpose(-1, -2)) * decay_BHNMM).tril(-1)
    attn_BHNMM = (q_BHNMK @ k_BHNMK.transpose(-1, -2)) * decay_BHNMM
    gamma_BHNM = G_BHNM.exp()
    # (I + A)^-1 [beta v | beta exp(G) k]: delta = u - w S0 with S0 the state at the chunk's start
    rhs = torch.cat([v_BHNMV, k_BHNMK * gamma_BHNM[..., None]], -1) * beta_BHNM[..., None]
    uw = torch.linalg.solve_triangular(A_BHNMM, rhs, upper=False, unitriangular=True)
    u_BHNMV, w_BHNMK = uw[..., :V], uw[..., V:]
    qg_BHNMK = q_BHNMK * gamma_BHNM[..., None]  # reads the chunk's initial state
    kd_BHNMK = k_BHNMK * (G_BHNM[..., -1:] - G_BHNM).exp()[..., None]  # decays each write to the chunk's end
    last_BHN = gamma_BHNM[..., -1]

    S_BHKV = state_BHKV.float()
    outs = []
    for n in range(N):
        delta_BHMV = u_BHNMV[:, :, n] - w_BHNMK[:, :, n] @ S_BHKV
        outs.append(qg_BHNMK[:, :, n] @ S_BHKV + attn_BHNMM[:, :, n] @ delta_BHMV)
        S_BHKV = S_BHKV * last_BHN[:, :, n, None, None] + kd_BHNMK[:, :, n].transpose(-1, -2) @ delta_BHMV
    o_BHLV = torch.stack(outs, 2).reshape(B, Hv, N * M, V)[:, :, :L]
    return o_BHLV.transpose(1, 2).contiguous(), S_BHKV


def causal_conv1d(x_BLC: torch.Tensor, lens_B: torch.Tensor, state_BCW: torch.Tensor,
                  weight_CK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (no bias) + SiLU over each sequence's lens_B[b] new inputs after its W state inputs.

    Computes in weight's dtype (inputs cast to it, as transformers does); y in x's dtype (padding rows:
    garbage); new state (state's dtype) = the last W inputs of [state, first lens_B[b] inputs].
    """
    B, L, C = x_BLC.shape
    W = state_BCW.shape[-1]
    if L == 1:  # decode: the window is the state and the new input, no convolution call or gather
        xs_BCK = torch.cat([state_BCW.to(weight_CK.dtype), x_BLC.transpose(1, 2).to(weight_CK.dtype)], -1)
        y_BC = F.silu((xs_BCK.float() * weight_CK.float()).sum(-1).to(weight_CK.dtype))
        return y_BC[:, None].to(x_BLC.dtype), xs_BCK[..., 1:].to(state_BCW.dtype)
    xs_BCT = torch.cat([state_BCW.to(weight_CK.dtype), x_BLC.transpose(1, 2).to(weight_CK.dtype)], -1)  # T = W + L
    y_BCL = F.silu(F.conv1d(xs_BCT, weight_CK[:, None, :], groups=C))
    idx_BW = lens_B.to(device=x_BLC.device, dtype=torch.int64)[:, None] + torch.arange(W, device=x_BLC.device)
    new_state_BCW = xs_BCT.gather(-1, idx_BW[:, None, :].expand(B, C, W)).to(state_BCW.dtype)
    return y_BCL.transpose(1, 2).to(x_BLC.dtype), new_state_BCW


def gated_delta_rule_decode_(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor,
                             beta_BH: torch.Tensor, states_SHKV: torch.Tensor, slots_B: torch.Tensor,
                             fresh_B: torch.Tensor, recurrent=gated_delta_rule_recurrent) -> torch.Tensor:
    """One decode step whose states live in a state cache: row slots_B[b] of states_SHKV is sequence
    b's (zeros first where fresh_B), updated in place. On the CPU where the native kernels run,
    kernels/csrc/delta_rule.c reads and writes each state once; elsewhere `recurrent` (this module's,
    or the op table's) on the gathered states, written back. Returns o_BHV float32."""
    from kernels import native

    if states_SHKV.device.type == "cpu" and states_SHKV.dtype == torch.float32 and native.available():
        q, k = normalize_qk(q_BHK, k_BHK, v_BHV.shape[-2])
        return native.delta_rule_decode_(q, k, v_BHV, g_BH, beta_BH, states_SHKV, slots_B, fresh_B)
    o_BHV, new_BHKV = recurrent(q_BHK, k_BHK, v_BHV, g_BH, beta_BH,
                                states_SHKV[slots_B] * (~fresh_B)[:, None, None, None])
    states_SHKV.index_copy_(0, slots_B, new_BHKV)
    return o_BHV
