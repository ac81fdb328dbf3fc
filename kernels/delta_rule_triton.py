"""Gated delta rule and its causal conv in Triton, same signatures and semantics as kernels/delta_rule.py.

Legend: B sequences, L tokens per sequence (right-padded), Hk query/key heads, Hv value heads, R = Hv / Hk
value heads per q/k head, K key head dim, V value head dim, C conv channels, W = kernel_size - 1 conv
state width.

Both rules run one program per (sequence, value head, block of V columns) with the K x BLOCK_V state
tile in registers; q and k are L2-normalised in float32 in the program (each program of a q/k head
redoes this: K flops, nothing next to the K x V update). The chunked rule walks its sequence's
tokens one by one with the recurrent step rather than using the UT transform: the work per token is
the same O(K V) and the state never leaves registers, it is exact (a padding row, beta = 0 and g = 0,
leaves the state bit for bit as it was), and it runs under the interpreter; `chunk` is accepted for
the signature and ignored. Parallelism is B x Hv x V / BLOCK_V programs, enough at serving batch sizes;
a long single prefill would want the chunked (tensor core) form.
The conv runs one program per (sequence, tile of tokens, tile of channels): each output sums W + 1
shifted input tiles read from x or, before the sequence's first new token, from the state.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _l2norm(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _step(S, q, k, v, g, beta):
    """One token: decay, delta-rule write, read. S (BLOCK_K, BLOCK_V); q, k (BLOCK_K,); v (BLOCK_V,)."""
    S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
    S = S + k[:, None] * delta[None, :]
    return S, tl.sum(S * q[:, None], axis=0)


@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, s_out_ptr, L, Hv, R, K, V, q_scale,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """L tokens of one (sequence, value head, V block): q, k (B, L, Hk, K); v, o (B, L, Hv, V); g, beta (B, L, Hv)."""
    b = tl.program_id(0).to(tl.int64)  # int64: offsets of big batches pass 2**31
    h = tl.program_id(1)
    hk, Hk = h // R, Hv // R
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    km, vm = ks < K, vs < V
    s_off = ((b * Hv + h) * K + ks[:, None]) * V + vs[None, :]
    S = tl.load(s_ptr + s_off, mask=km[:, None] & vm[None, :], other=0.0).to(tl.float32)
    for t in range(L):
        bt = b * L + t
        q = tl.load(q_ptr + (bt * Hk + hk) * K + ks, mask=km, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + (bt * Hk + hk) * K + ks, mask=km, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (bt * Hv + h) * V + vs, mask=vm, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + bt * Hv + h).to(tl.float32)
        beta = tl.load(beta_ptr + bt * Hv + h).to(tl.float32)
        S, o = _step(S, _l2norm(q) * q_scale, _l2norm(k), v, g, beta)
        tl.store(o_ptr + (bt * Hv + h) * V + vs, o, mask=vm)
    tl.store(s_out_ptr + s_off, S, mask=km[:, None] & vm[None, :])


def _launch(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, L, Hk, K); v (B, L, Hv, V); g, beta (B, L, Hv); state (B, Hv, K, V)."""
    B, L, Hk, K = k.shape
    Hv, V = v.shape[-2:]
    if Hv % Hk or q.shape != k.shape or state.shape != (B, Hv, K, V):
        raise ValueError(f"delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"state {tuple(state.shape)} do not fit")
    o = torch.empty(B, L, Hv, V, dtype=torch.float32, device=v.device)
    s_out = torch.empty(B, Hv, K, V, dtype=torch.float32, device=v.device)
    if B == 0:
        return o, s_out
    BLOCK_K = triton.next_power_of_2(K)
    BLOCK_V = min(triton.next_power_of_2(V), max(16, 4096 // BLOCK_K))  # state tile <= 4096 floats
    q, k, v, g, beta, state = (x.contiguous() for x in (q, k, v, g, beta, state))
    _delta_rule_kernel[(B, Hv, triton.cdiv(V, BLOCK_V))](
        q, k, v, g, beta, state, o, s_out, L, Hv, Hv // Hk, K, V, K ** -0.5, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V)
    return o, s_out


def gated_delta_rule_recurrent(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor,
                               beta_BH: torch.Tensor, state_BHKV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step per sequence: returns (o_BHV float32, new state_BHKV float32); state is not written."""
    o_B1HV, s_BHKV = _launch(q_BHK[:, None], k_BHK[:, None], v_BHV[:, None], g_BH[:, None], beta_BH[:, None],
                             state_BHKV)
    return o_B1HV[:, 0], s_BHKV


def gated_delta_rule_chunked(q_BLHK: torch.Tensor, k_BLHK: torch.Tensor, v_BLHV: torch.Tensor, g_BLH: torch.Tensor,
                             beta_BLH: torch.Tensor, state_BHKV: torch.Tensor,
                             chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """B right-padded sequences of L tokens: returns (o_BLHV float32, final state_BHKV float32).

    Padding rows (beta = 0, g = 0) leave the state exactly unchanged. `chunk` is ignored (token by token).
    """
    return _launch(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, state_BHKV)


@triton.jit
def _conv_kernel(x_ptr, lens_ptr, s_ptr, w_ptr, y_ptr, s_out_ptr, L, C, W: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    """x, y (B, L, C); state in/out (B, C, W); weight (C, W + 1). Row p < 0 of x is state column W + p."""
    b = tl.program_id(0).to(tl.int64)
    ts = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    cs = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cs < C
    wdt = w_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_L, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W + 1):
        p = ts - W + j
        xv = tl.load(x_ptr + (b * L + p)[:, None] * C + cs[None, :], mask=((p >= 0) & (p < L))[:, None] & cm[None, :],
                     other=0.0).to(wdt)
        sv = tl.load(s_ptr + (b * C + cs[None, :]) * W + (W + p)[:, None], mask=(p < 0)[:, None] & cm[None, :],
                     other=0.0).to(wdt)
        w = tl.load(w_ptr + cs * (W + 1) + j, mask=cm, other=0.0)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w.to(tl.float32)[None, :]
    acc = acc.to(wdt).to(tl.float32)  # the conv's output in weight's dtype, then SiLU
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + (b * L + ts)[:, None] * C + cs[None, :], y.to(wdt).to(y_ptr.dtype.element_ty),
             mask=(ts < L)[:, None] & cm[None, :])
    if tl.program_id(1) == 0:  # new state: columns lens - W .. lens - 1 of [state, x]
        ws = tl.arange(0, BLOCK_W)
        p = tl.load(lens_ptr + b) - W + ws
        wm = (ws < W)[:, None] & cm[None, :]
        xv = tl.load(x_ptr + (b * L + p)[:, None] * C + cs[None, :], mask=(p >= 0)[:, None] & wm, other=0.0).to(wdt)
        sv = tl.load(s_ptr + (b * C + cs[None, :]) * W + (W + p)[:, None], mask=(p < 0)[:, None] & wm,
                     other=0.0).to(wdt)
        tl.store(s_out_ptr + (b * C + cs[None, :]) * W + ws[:, None], (xv.to(tl.float32) + sv.to(tl.float32)).to(wdt),
                 mask=wm)


def causal_conv1d(x_BLC: torch.Tensor, lens_B: torch.Tensor, state_BCW: torch.Tensor,
                  weight_CK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (no bias) + SiLU; see kernels.delta_rule.causal_conv1d. State is not written."""
    B, L, C = x_BLC.shape
    W = state_BCW.shape[-1]
    if weight_CK.shape != (C, W + 1) or state_BCW.shape != (B, C, W):
        raise ValueError(f"causal_conv1d: x {tuple(x_BLC.shape)}, state {tuple(state_BCW.shape)}, "
                         f"weight {tuple(weight_CK.shape)} do not fit")
    y = torch.empty_like(x_BLC)
    s_out = torch.empty_like(state_BCW)
    if B == 0 or L == 0:
        return y, s_out
    BLOCK_C = min(triton.next_power_of_2(C), 128)
    BLOCK_L = min(triton.next_power_of_2(L), 32)
    x, lens, state, weight = (t.contiguous() for t in (x_BLC, lens_B.to(x_BLC.device, torch.int64), state_BCW,
                                                        weight_CK))
    _conv_kernel[(B, triton.cdiv(L, BLOCK_L), triton.cdiv(C, BLOCK_C))](
        x, lens, state, weight, y, s_out, L, C, W=W, BLOCK_L=BLOCK_L, BLOCK_C=BLOCK_C,
        BLOCK_W=triton.next_power_of_2(max(W, 1)))
    return y, s_out
