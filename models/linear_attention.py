"""Gated DeltaNet: Qwen3-Next's and Qwen3.5-MoE's linear-attention layers, and the per-sequence state they keep.

Legend: T tokens of the flat batch, B sequences, L the longest chunk of one sequence in this call,
D hidden, Hk query/key heads, Hv value heads (r = Hv / Hk per key head), K key head dim, V value
head dim, C = 2 Hk K + Hv V convolved channels, W = conv_kernel - 1, S state slots.

Instead of a KV cache growing with the context, each sequence carries per layer the last W inputs
of a depthwise causal convolution over q, k and v, and a (Hv, K, V) float32 matrix that the gated
delta rule decays and corrects token by token (kernels/delta_rule.py). A step computes decodes
(one token per sequence) by the recurrent update and prefill chunks (several tokens) by the
chunked form over the chunk padded to L, starting from the sequence's state; a sequence at
position 0 starts from zeros, whatever its slot held before. The states live in
models/kv_cache.LinearStates beside the paged KV cache (make_paged_cache), indexed by the batch's
state_slots_B, which the block manager hands each running sequence (attention_nodes/block_manager.py).
A cache without states (training's CausalAttention) runs every sequence from zeros and keeps nothing.
"""
import torch
import torch.nn.functional as F
from torch import nn

from kernels.delta_rule import gated_delta_rule_decode_
from kernels.ops import KernelOps
from models.attention_config import LinearAttentionConfig
from models.config import ModelConfig
from models.kv_cache import AttentionBatch, LinearStates


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, scaled by weight, times SiLU of the gate z (transformers'
    Qwen3NextRMSNormGated: normalised in float32, cast, weighted, gated in float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x_XV: torch.Tensor, z_XV: torch.Tensor) -> torch.Tensor:
        x32 = x_XV.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x_XV.dtype)
        return (self.weight * normed * F.silu(z_XV.float())).to(x_XV.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; parameter names follow the checkpoints, so the loader maps them 1:1
    and training saves them back unchanged. Qwen3-Next (transformers' Qwen3NextGatedDeltaNet):
    in_proj_qkvz gives, per key head, [q (K), k (K), v (r V), z (r V)], in_proj_ba per key head
    [b (r), a (r)]. Qwen3.5-MoE (LinearAttentionConfig.split_projections; Qwen3_5MoeGatedDeltaNet):
    in_proj_qkv gives q of every key head, then k, then v (the convolution's channel order), and
    in_proj_z, in_proj_b, in_proj_a one value head after another. Then beta = sigmoid(b) and the log
    decay g = -exp(A_log) softplus(a + dt_bias)."""

    def __init__(self, cfg: ModelConfig, layer: int, ops: KernelOps):
        super().__init__()
        la: LinearAttentionConfig = cfg.linear_attention
        self.layer, self.la, self.ops = layer, la, ops
        D, Hk, Hv, K, V = cfg.hidden_size, la.key_heads, la.value_heads, la.key_dim, la.value_dim
        if la.split_projections:
            self.in_proj_qkv = nn.Linear(D, la.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(D, Hv * V, bias=False)
            self.in_proj_b = nn.Linear(D, Hv, bias=False)
            self.in_proj_a = nn.Linear(D, Hv, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(D, 2 * Hk * K + 2 * Hv * V, bias=False)
            self.in_proj_ba = nn.Linear(D, 2 * Hv, bias=False)
        self.conv1d = nn.Conv1d(la.conv_dim, la.conv_dim, la.conv_kernel, groups=la.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.zeros(Hv))
        self.norm = GatedRMSNorm(V, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(Hv * V, D, bias=False)

    def _inputs(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed_TC: q, k, v of every head in the convolution's order, z_TX (T, Hv V), b_TH, a_TH)
        from the checkpoint's projections, whichever layout they have."""
        la, T = self.la, x_TD.shape[0]
        if la.split_projections:
            return self.in_proj_qkv(x_TD), self.in_proj_z(x_TD), self.in_proj_b(x_TD), self.in_proj_a(x_TD)
        Hk, Hv, K, V, r = la.key_heads, la.value_heads, la.key_dim, la.value_dim, la.value_heads // la.key_heads
        q, k, v, z = self.in_proj_qkvz(x_TD).view(T, Hk, -1).split((K, K, r * V, r * V), dim=-1)
        b, a = self.in_proj_ba(x_TD).view(T, Hk, 2 * r).split((r, r), dim=-1)
        mixed_TC = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
        return mixed_TC, z.reshape(T, Hv * V), b.reshape(T, Hv), a.reshape(T, Hv)

    def forward(self, x_TD: torch.Tensor, cache, batch: AttentionBatch) -> torch.Tensor:
        la, T = self.la, x_TD.shape[0]
        Hv, V = la.value_heads, la.value_dim
        mixed_TC, z_TX, b_TH, a_TH = self._inputs(x_TD)
        beta_TH = torch.sigmoid(b_TH)
        g_TH = -self.A_log.float().exp() * F.softplus(a_TH.float() + self.dt_bias)
        states = getattr(cache, "linear_states", None)
        if batch.parts is None:
            o_THV = self._mix(mixed_TC, beta_TH, g_TH, batch, states)
        else:  # decodes by the recurrent update, prefill chunks by the chunked form
            decode_T, decode_B, prefill_T, prefill = batch.parts
            o_THV = mixed_TC.new_empty(T, Hv, V, dtype=torch.float32)
            o_THV[decode_T] = self._mix(mixed_TC[decode_T], beta_TH[decode_T], g_TH[decode_T], batch, states,
                                        decode_B)
            o_THV[prefill_T] = self._mix(mixed_TC[prefill_T], beta_TH[prefill_T], g_TH[prefill_T], prefill, states)
        o = self.norm(o_THV.to(x_TD.dtype).reshape(T * Hv, V), z_TX.reshape(T * Hv, V))
        return self.out_proj(o.view(T, Hv * V))

    def _mix(self, mixed_TC: torch.Tensor, beta_TH: torch.Tensor, g_TH: torch.Tensor, batch: AttentionBatch,
             states: LinearStates | None, decode_B: torch.Tensor | None = None) -> torch.Tensor:
        """The convolution and the delta rule of one group of sequences (the batch's: all decodes, or
        chunks padded to L; or, decode_B given, those sequences of a mixed batch, one token each):
        o_THV float32; their states read from and written back to `states`."""
        la, T = self.la, mixed_TC.shape[0]
        Hk, Hv, K, V = la.key_heads, la.value_heads, la.key_dim, la.value_dim
        kv_lens_B, slots_B = batch.kv_lens_B, batch.state_slots_B
        if decode_B is not None:
            kv_lens_B, slots_B = kv_lens_B[decode_B], slots_B[decode_B]
        B, L = kv_lens_B.numel(), 1 if decode_B is not None else batch.max_q_len
        q_lens_B = torch.bincount(batch.seq_idx_T, minlength=B) if L > 1 else torch.ones(B, dtype=torch.long)
        if states is None:  # no cache: every sequence from position 0, nothing kept
            if int(batch.max_kv_len) != L:
                raise ValueError("linear attention without a state cache: every sequence must start at position 0")
            conv_BCW = mixed_TC.new_zeros(B, la.conv_dim, la.conv_kernel - 1)
            rec_BHKV = mixed_TC.new_zeros(B, Hv, K, V, dtype=torch.float32)
        else:
            going_B = (kv_lens_B.to(slots_B.device) - q_lens_B > 0)  # False: from position 0, from zeros
            conv_BCW = states.conv[self.layer][slots_B] * going_B[:, None, None]
            rec_BHKV = None if L == 1 else states.rec[self.layer][slots_B] * going_B[:, None, None, None]
        weight_CK = self.conv1d.weight[:, 0]
        if L == 1:  # one token per sequence, in sequence order
            y_TC, conv_BCW = self.ops.causal_conv1d(mixed_TC[:, None], q_lens_B, conv_BCW, weight_CK)
            q, k, v = y_TC[:, 0].split((Hk * K, Hk * K, Hv * V), dim=-1)
            q, k, v = q.view(T, Hk, K), k.view(T, Hk, K), v.view(T, Hv, V)
            if states is None:
                o_THV, rec_BHKV = self.ops.gated_delta_rule_recurrent(q, k, v, g_TH, beta_TH, rec_BHKV)
            else:  # the states updated where they are (kernels/delta_rule.gated_delta_rule_decode_)
                o_THV = gated_delta_rule_decode_(q, k, v, g_TH, beta_TH, states.rec[self.layer], slots_B, ~going_B,
                                                 self.ops.gated_delta_rule_recurrent)
        else:
            where = (batch.seq_idx_T, batch.tok_idx_T)
            x_BLC = mixed_TC.new_zeros(B, L, la.conv_dim).index_put_(where, mixed_TC)
            y_BLC, conv_BCW = self.ops.causal_conv1d(x_BLC, q_lens_B, conv_BCW, weight_CK)
            q, k, v = y_BLC.split((Hk * K, Hk * K, Hv * V), dim=-1)
            # padding rows: beta 0 and g 0 leave the state exactly as the sequence's last token left it
            beta_BLH = beta_TH.new_zeros(B, L, Hv).index_put_(where, beta_TH)
            g_BLH = g_TH.new_zeros(B, L, Hv).index_put_(where, g_TH)
            o_BLHV, rec_BHKV = self.ops.gated_delta_rule_chunked(q.view(B, L, Hk, K), k.view(B, L, Hk, K),
                                                                 v.view(B, L, Hv, V), g_BLH, beta_BLH, rec_BHKV)
            o_THV = o_BLHV[where]
        if states is not None:
            states.conv[self.layer].index_copy_(0, slots_B, conv_BCW.to(states.conv[self.layer].dtype))
            if rec_BHKV is not None:
                states.rec[self.layer].index_copy_(0, slots_B, rec_BHKV)
        return o_THV
