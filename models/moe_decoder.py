"""The MoE decoder: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4.5, MiniMax-M2,
gpt-oss, Llama 4, MiMo-V2-Flash and Qwen3-Next in one definition, single device.

Legend: T tokens (a flat batch of all sequences), D hidden, N query heads, K kv heads, H head dim,
R rotary dims of a head (R <= H), E experts, I expert intermediate size, V vocabulary.
Family differences are ModelConfig fields: q/k/v and o biases (qkv_bias, o_bias), q/k norm per head
or over the whole projection (qk_norm), partial rotary (rotary_dim: the first R dims of each head are
roped, the rest pass), per-head attention sinks (attention_sinks), per-layer sliding windows
(sliding_windows), Llama 4's chunked attention, no-rope layers with query temperature, interleaved
rope pairs and L2 q/k norm, MiMo-V2-Flash's kv heads per layer, narrower scaled values (V) and second
rope, shared experts (gated or not), dense layers, the router (RouterConfig: scoring,
correction bias, groups, renormalisation, scaling, a biased router), expert biases and the expert
activation (expert_bias, expert_act: kernels.moe.SwiGLU), MLA (MLAConfig: DeepSeek's attention lives
in models/mla.py), Qwen3-Next's sigmoid gate on each attention head's output (attn_output_gate) and
its gated DeltaNet layers (linear_layers: models/linear_attention.py, in place of self_attn);
the KV cache and the expert dispatcher are injected, so serving and training share this code.
The compute ops (torch references or Triton kernels) come from one KernelOps table chosen at
construction. Layers pass (hidden, residual) pairs so each norm fuses the residual add.
Parameter names follow the Hugging Face checkpoints (see models/loader.py for the mapping).
"""
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe import SILU, SwiGLU
from kernels.ops import KernelOps, select_ops
from kernels.rotary import RotaryEmbedding
from kernels.routing import hash_route
from models.config import ModelConfig
from models.deepseek_v4 import HyperConnection, HyperHead, V4Attention, expand
from models.dispatcher import Dispatcher, LocalDispatcher
from models.kv_cache import AttentionBatch, KVCache
from models.linear_attention import GatedDeltaNet
from models.mla import MLAttention
from models.norm import RMSNorm
from models.stages import EAGER, DecodeStages, HeadSpec, RouteSpec, interned


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: KernelOps):
        super().__init__()
        self.layer, self.cfg, self.ops = layer, cfg, ops
        self.window, self.scale = cfg.sliding_windows[layer], cfg.head_dim ** -0.5
        # MiMo-V2-Flash's sliding layers rope with their own theta and rotary dims (cos_sin: the model's other table)
        self.sliding_rope = cfg.sliding_rope is not None and self.window is not None
        self.rope_dim = cfg.sliding_rotary_dim if self.sliding_rope else cfg.rope_dim
        ropes = cfg.rope_layers is None or cfg.rope_layers[layer]
        self.chunk = cfg.attention_chunks[layer] if cfg.attention_chunks else None  # Llama 4's local chunks
        self.temperature = None if ropes else cfg.attn_temperature  # Llama 4's no-rope layers
        D, K, V = cfg.hidden_size, cfg.kv_heads(layer), cfg.v_dim
        # Qwen3-Next: q_proj gives each head's query and then its output gate, (N, 2H)
        self.gated = cfg.attn_output_gate
        self.q_proj = nn.Linear(D, cfg.q_size * (1 + self.gated), bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(D, K * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(D, K * V, bias=cfg.qkv_bias)
        # CPU inference fuses q/k/v into one packed GEMM (models/cpu_inference.py) and drops the three
        self.qkv_proj: nn.Module | None = None
        self.qkv_split = (cfg.q_size * (1 + self.gated), K * cfg.head_dim, K * V)
        self.o_proj = nn.Linear(cfg.num_heads * V, D, bias=cfg.o_bias)
        if cfg.qk_norm == "per_head":  # Qwen3-MoE: over each head's H values
            self.q_norm, self.k_norm = (RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops),
                                        RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops))
        elif cfg.qk_norm == "full":  # OLMoE: over the whole projection
            self.q_norm, self.k_norm = (RMSNorm(cfg.q_size, cfg.rms_norm_eps, ops),
                                        RMSNorm(cfg.kv_size, cfg.rms_norm_eps, ops))
        # gpt-oss, MiMo-V2-Flash: one logit per query head joins every softmax as an extra column (N,)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.has_sinks(layer) else None
        qk_norm = "none" if cfg.qk_norm == "l2" and not ropes else cfg.qk_norm  # (Llama 4: on rope layers only)
        self.head_spec = interned(HeadSpec(cfg.num_heads, K, cfg.head_dim, self.rope_dim if ropes else 0, qk_norm,
                                           cfg.rms_norm_eps, cfg.clip_qkv, cfg.rope_interleave, V))
        self.stages: DecodeStages = EAGER  # models/stages.py: compile_stages swaps in compiled ones

    def forward(self, x_TD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache, batch: AttentionBatch) -> torch.Tensor:
        T = x_TD.shape[0]
        q_norm_w, k_norm_w = (self.q_norm.weight, self.k_norm.weight) if hasattr(self, "q_norm") else (None, None)
        q_TQ, k_TC, v_TC = self._projections(x_TD)
        if self.gated:
            q_TNH2 = q_TQ.view(T, self.cfg.num_heads, 2 * self.cfg.head_dim)
            q_TQ, gate_TQ = q_TNH2.chunk(2, dim=-1)
            q_TQ, gate_TQ = q_TQ.reshape(T, -1), gate_TQ.reshape(T, -1)
        q_TNH, k_TKH, v_TKH = self.stages.q_k_v_heads(q_TQ, k_TC, v_TC, *cos_sin, q_norm_w, k_norm_w, self.head_spec,
                                                      self.ops)
        if self.temperature is not None:  # q * (log1p(floor((p + 1) / floor_scale)) * attn_scale + 1), in float32
            floor_scale, attn_scale = self.temperature
            t_T = torch.log1p(torch.floor((batch.positions_T.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q_TNH = (q_TNH * t_T[:, None, None]).to(q_TNH.dtype)
        if self.cfg.v_scale != 1.0:  # MiMo-V2-Flash's attention_value_scale, on the values it caches
            v_TKH = v_TKH * self.cfg.v_scale
        o_TNV = cache.attend(self.layer, q_TNH, k_TKH, v_TKH, batch, self.scale, self.window, self.sinks,
                             chunk=self.chunk)
        if self.gated:
            return self.o_proj(o_TNV.reshape(T, -1) * torch.sigmoid(gate_TQ))
        return self.o_proj(o_TNV.reshape(T, -1))

    def _projections(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_TQ, k_TC, v_TC: with a fused qkv_proj, column slices of its one (T, Q + 2C) output."""
        if self.qkv_proj is not None:
            return self.qkv_proj(x_TD).split(self.qkv_split, dim=-1)
        return self.q_proj(x_TD), self.k_proj(x_TD), self.v_proj(x_TD)

    def warm_up_stages(self, T: int, dtype: torch.dtype, device: torch.device) -> None:
        """Run the stages on T synthetic rows shaped (and strided) as forward passes them (models/stages.py)."""
        cfg = self.cfg
        q, k, v = torch.zeros(T, sum(self.qkv_split), dtype=dtype, device=device).split(self.qkv_split, dim=-1)
        if self.qkv_proj is None:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if self.gated:  # (forward passes the query half as a contiguous copy)
            q = q[:, :cfg.q_size].contiguous()
        cos, sin = (torch.ones(T, self.rope_dim, dtype=dtype, device=device),
                    torch.zeros(T, self.rope_dim, dtype=dtype, device=device))
        q_norm_w, k_norm_w = (self.q_norm.weight, self.k_norm.weight) if hasattr(self, "q_norm") else (None, None)
        self.stages.q_k_v_heads(q, k, v, cos, sin, q_norm_w, k_norm_w, self.head_spec, self.ops)


class MLP(nn.Module):
    """SwiGLU feed-forward: dense layers and shared experts (act: DeepSeek-V4's are clamped)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False, act: SwiGLU = SILU):
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.act.is_silu:
            return self.down_proj(F.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD))
        return self.down_proj(self.act(self.gate_proj(x_TD), self.up_proj(x_TD)))


class Experts(nn.Module):
    """All experts of one layer as stacked weights: w13 (E, 2I, D) gate then up, w2 (E, D, I); with
    bias=True also b13 (E, 2I) and b2 (E, D) (gpt-oss). act: the SwiGLU variant (kernels.moe)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, ops: KernelOps, bias: bool = False,
                 act: SwiGLU = SILU):
        super().__init__()
        self.ops, self.act = ops, act
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * inter)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None

    @classmethod
    def of(cls, cfg: ModelConfig, num_experts: int, ops: KernelOps) -> "Experts":
        """num_experts experts of the shape and kind `cfg` describes."""
        return cls(num_experts, cfg.hidden_size, cfg.moe_intermediate_size, ops, cfg.expert_bias, cfg.expert_act)

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        if self.b13 is None and self.act.is_silu:
            return self.ops.fused_moe(x_TD, self.w13, self.w2, topk_weights_TK, topk_ids_TK)
        return self.ops.fused_moe(x_TD, self.w13, self.w2, topk_weights_TK, topk_ids_TK, b13_EI2=self.b13,
                                  b2_ED=self.b2, act=self.act)


class Router(nn.Module):
    """The router's weight (E, D), gpt-oss's bias (E), and the e_score_correction_bias of DeepSeek-V3,
    GLM and MiniMax-M2 (E, float32, added to the scores to choose experts only; not trained by
    gradients, as transformers keeps it a buffer). Returns the logits (T, E);
    kernels.routing.topk_route turns them into choices (RouterConfig). A DeepSeek-V4 hash-routed
    layer's router has tid2eid (V, K) int64 instead of the correction bias: each token id's experts."""

    def __init__(self, cfg: ModelConfig, hashed: bool = False):
        super().__init__()
        self.logits_fp32 = cfg.router.logits_fp32
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router.bias else None
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
                                        if cfg.router.correction_bias and not hashed else None)
        self.tid2eid = (nn.Parameter(torch.zeros(cfg.vocab_size, cfg.top_k, dtype=torch.long), requires_grad=False)
                        if hashed else None)
        # CPU inference only (models/cpu_inference.py): the weight prepared for kernels.cpu_linear, in
        # the dtype the logits are computed in (a 1-16 row bf16 F.linear cost 35-105 us a call)
        self.cpu_weight = None

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.cpu_weight is not None:
            from kernels.cpu_linear import cpu_linear

            x = x_TD.float() if self.logits_fp32 else x_TD
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return cpu_linear(x.reshape(-1, x.shape[-1]), self.cpu_weight, bias).view(*x.shape[:-1], -1)
        if self.logits_fp32:
            return F.linear(x_TD.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return F.linear(x_TD, self.weight, self.bias)

    def _apply(self, fn, recurse: bool = True):
        """Keep the correction bias in float32 whatever dtype the model is cast to (transformers
        keeps it in float32 too: bf16 would merge close expert scores)."""
        out = super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias is not None and bias.is_floating_point() and bias.dtype != torch.float32:
            bias.data = bias.data.float()
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, with_experts: bool, ops: KernelOps):
        super().__init__()
        self.layer, self.cfg, self.ops = layer, cfg, ops
        self.hashed = cfg.v4 is not None and cfg.v4.hash_layers[layer]
        self.gate = Router(cfg, self.hashed)
        self.stages: DecodeStages = EAGER  # models/stages.py: compile_stages swaps in compiled ones
        self.experts = Experts.of(cfg, cfg.num_experts, ops) if with_experts else None
        self.shared_name = None  # named as in the checkpoints: Qwen2-MoE's gated shared_expert, DeepSeek's shared_experts
        if cfg.shared_expert_intermediate_size:
            self.shared_name = "shared_expert" if cfg.shared_expert_gate else "shared_experts"
            self.add_module(self.shared_name, MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.mlp_bias,
                                                  cfg.expert_act if cfg.v4 is not None else SILU))
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def start(self, x_TD: torch.Tensor, dispatcher: Dispatcher, mb: int = 0,
              token_ids_T: torch.Tensor | None = None) -> tuple:
        """Route and dispatch (non-blocking for remote dispatchers); the shared expert runs while
        the routed experts work. `finish` turns the returned state into y_TD. token_ids_T: the
        tokens' ids, which a hash-routed layer's experts are looked up by."""
        weights_TK, ids_TK = self.route(x_TD, token_ids_T)
        routed_TD = x_TD
        if self.cfg.router_scales_input:
            # Llama 4 weighs the expert's input, expert(w * x), which differs from w * expert(x) (SwiGLU
            # is not linear). With one expert per token (config.py refuses more) the row a token sends
            # is scaled here, on the attention side, and sent with weight 1: expert workers and every
            # transport compute as for any family.
            routed_TD, weights_TK = x_TD * weights_TK, torch.ones_like(weights_TK)
        handle = dispatcher.dispatch(self.layer, self.experts, routed_TD, ids_TK, weights_TK, mb=mb)
        shared_TD = None
        if self.shared_name is not None:
            shared_TD = getattr(self, self.shared_name)(x_TD)
            if self.cfg.shared_expert_gate:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
        return dispatcher, handle, shared_TD

    def route(self, x_TD: torch.Tensor, token_ids_T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights_TK, ids_TK) of the router's choice (kernels.routing.topk_route, or hash_route)."""
        if self.hashed:
            if token_ids_T is None:
                raise ValueError(f"layer {self.layer} routes by token id (DeepSeek-V4's hash layers): pass token_ids_T")
            r = self.cfg.router
            weights_TK, ids_TK = hash_route(self.gate(x_TD), self.gate.tid2eid[token_ids_T], r.scoring, r.renormalize,
                                            r.scaling)
            return weights_TK if r.weights_fp32 else weights_TK.to(x_TD.dtype), ids_TK
        return self.stages.route(self.gate(x_TD), self.gate.e_score_correction_bias, self.route_spec(x_TD.dtype),
                                 self.ops)

    def route_spec(self, dtype: torch.dtype) -> RouteSpec:
        """The routing constants for activations of `dtype` (one object per distinct value)."""
        r = self.cfg.router
        return interned(RouteSpec(r.top_k, r.scoring, r.renormalize, r.num_groups, r.topk_groups, r.group_score,
                                  r.scaling, None if r.weights_fp32 else dtype))

    def warm_up_stages(self, T: int, dtype: torch.dtype, device: torch.device) -> None:
        if not self.hashed:  # (hash routing runs eagerly: no stage)
            self.route(torch.zeros(T, self.cfg.hidden_size, dtype=dtype, device=device))

    def start_empty(self, x_TD: torch.Tensor, dispatcher: Dispatcher, mb: int) -> tuple:
        """An empty micro-batch still takes its (empty) turn, so remote experts see every slot."""
        K = self.cfg.top_k
        ids_TK = torch.empty((0, K), dtype=torch.long, device=x_TD.device)
        weights_TK = torch.empty((0, K), dtype=torch.float32 if self.cfg.router.weights_fp32 else x_TD.dtype,
                                 device=x_TD.device)
        return dispatcher, dispatcher.dispatch(self.layer, self.experts, x_TD, ids_TK, weights_TK, mb=mb), None

    @staticmethod
    def finish(state: tuple) -> torch.Tensor:
        dispatcher, handle, shared_TD = state
        y_TD = dispatcher.combine(handle)
        return y_TD if shared_TD is None else y_TD + shared_TD

    def forward(self, x_TD: torch.Tensor, dispatcher: Dispatcher) -> torch.Tensor:
        return self.finish(self.start(x_TD, dispatcher))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, with_experts: bool, ops: KernelOps):
        super().__init__()
        # a linear-attention layer has linear_attn instead (self_attn None)
        self.linear_attn = GatedDeltaNet(cfg, layer, ops) if cfg.is_linear(layer) else None
        self.self_attn = (None if self.linear_attn is not None else V4Attention(cfg, layer, ops) if cfg.v4 is not None
                          else Attention(cfg, layer, ops) if cfg.mla is None else MLAttention(cfg, layer, ops))
        self.is_moe = cfg.moe_layers[layer]
        self.mlp = (SparseMoE(cfg, layer, with_experts, ops) if self.is_moe
                    else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        if cfg.v4 is not None:  # DeepSeek-V4's hyper-connections in place of the residual add
            v4 = cfg.v4
            self.attn_hc, self.ffn_hc = (HyperConnection(cfg.hidden_size, v4.hc_mult, v4.hc_iters, v4.hc_eps,
                                                         cfg.rms_norm_eps) for _ in range(2))

    def attention(self, x_TD: torch.Tensor, residual_TD: torch.Tensor | None, cos_sin: tuple[torch.Tensor, torch.Tensor],
                  cache: KVCache, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (the MLP's input, residual): the residual stream is x + residual. With
        hyper-connections (DeepSeek-V4) the residual is (streams, post, comb) of the last MLP, whose
        output x they take in (the first layer's: None, x the embeddings)."""
        if hasattr(self, "attn_hc"):
            return self._hyper_attention(x_TD, residual_TD, cos_sin, cache, batch)
        h_TD, residual_TD = self.input_layernorm.add_and_norm(x_TD, residual_TD)
        if self.linear_attn is not None:
            h_TD = self.linear_attn(h_TD, cache, batch)
        else:
            h_TD = self.self_attn(h_TD, cos_sin, cache, batch)
        return self.post_attention_layernorm.add_and_norm(h_TD, residual_TD)

    def _hyper_attention(self, x_TD, residual, cos_sin, cache, batch):
        if residual is None:
            streams = x_TD.unsqueeze(1).expand(-1, self.attn_hc.n, -1).contiguous()
        else:
            streams = expand(*residual, x_TD)
        post, comb, collapsed = self.attn_hc(streams)
        streams = expand(streams, post, comb, self.self_attn(self.input_layernorm(collapsed), cos_sin, cache, batch))
        post, comb, collapsed = self.ffn_hc(streams)
        return self.post_attention_layernorm(collapsed), (streams, post, comb)

    def stage_key(self) -> tuple:
        """Layers of one key call the same stages with the same shapes (models/stages.py: warm_up)."""
        return type(self.linear_attn or self.self_attn).__name__, self.is_moe

    def warm_up_stages(self, T: int) -> None:
        w = self.input_layernorm.weight
        x = torch.zeros(T, w.shape[0], dtype=w.dtype, device=w.device)
        self.input_layernorm.add_and_norm(x, x.clone())
        if isinstance(self.self_attn, Attention):
            self.self_attn.warm_up_stages(T, w.dtype, w.device)
        if self.is_moe:
            self.mlp.warm_up_stages(T, w.dtype, w.device)

    def start_mlp(self, h_TD: torch.Tensor, dispatcher: Dispatcher, mb: int, empty: bool = False,
                  token_ids_T: torch.Tensor | None = None) -> tuple:
        """Begin the MLP; `SparseMoE.finish` of the result gives its output. Dense layers compute now.
        token_ids_T: the tokens' ids (hash-routed layers)."""
        if not self.is_moe:
            return _Done(), h_TD if empty else self.mlp(h_TD), None
        return (self.mlp.start_empty(h_TD, dispatcher, mb) if empty
                else self.mlp.start(h_TD, dispatcher, mb, token_ids_T))


class _Done:
    """The 'dispatcher' of a dense layer's already computed output."""

    @staticmethod
    def combine(y_TD: torch.Tensor) -> torch.Tensor:
        return y_TD


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, with_experts: bool, ops: KernelOps):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, with_experts, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        if cfg.v4 is not None:
            self.hc_head = HyperHead(cfg.hidden_size, cfg.v4.hc_mult, cfg.v4.hc_eps, cfg.rms_norm_eps)

    def final_norm(self, x_TD: torch.Tensor, residual) -> torch.Tensor:
        """The last MLP's output x with the residual, normed: norm(x + residual), or with
        hyper-connections norm(hc_head(streams taking in x))."""
        if hasattr(self, "hc_head"):
            return self.norm(self.hc_head(expand(*residual, x_TD)))
        return self.norm.add_and_norm(x_TD, residual)[0]


class MoEForCausalLM(nn.Module):
    """input_ids_T + AttentionBatch -> hidden_TD; `logits` maps chosen rows to vocabulary scores.

    with_experts=False builds everything but the expert weights (an attention worker's share).
    ops: the compute ops (default: chosen for the current default device, see kernels.ops).
    """

    def __init__(self, cfg: ModelConfig, with_experts: bool = True, ops: KernelOps | None = None):
        super().__init__()
        self.cfg = cfg
        self.ops = ops or select_ops(torch.get_default_device())
        self.model = DecoderModel(cfg, with_experts, self.ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.native_decode = None  # models/native_decode.NativeDecode, set by the CPU runner where it applies
        self._rotary: RotaryEmbedding | None = None  # built on first use, on the weights' device
        self._sliding_rotary: RotaryEmbedding | None = None  # (MiMo-V2-Flash's sliding layers)

    def forward(self, input_ids_T: torch.Tensor, batch: AttentionBatch, cache: KVCache) -> torch.Tensor:
        return self.forward_micro_batches([(input_ids_T, batch)], cache)[0]

    def forward_micro_batches(self, inputs: list[tuple[torch.Tensor, AttentionBatch] | None], cache: KVCache,
                              head: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Ping-pong over micro-batches (disjoint sets of sequences): at each layer, micro-batch i's
        experts run (through the dispatcher) while attention computes micro-batch i+1; each MoE
        output is combined only when that micro-batch's next layer needs it. None is an empty
        micro-batch: it computes nothing but still takes its turn at every MoE layer.
        Returns hidden_TD per micro-batch ((0, D) for an empty one), or head(i, hidden_TD) when a
        head is given: it runs on micro-batch i while the experts finish micro-batch i+1."""
        D = self.cfg.hidden_size
        xs, residuals, cos_sins, sliding_cos_sins = [], [], [], {}
        for inp in inputs:
            if inp is None:
                emb = self.model.embed_tokens.weight
                xs.append(torch.empty((0, D), dtype=emb.dtype, device=emb.device))
                cos_sins.append(None)
            else:
                ids_T, batch = inp
                xs.append(self.model.embed_tokens(ids_T))
                if self._rotary is None:
                    self._rotary = RotaryEmbedding(self.cfg.rope, self.cfg.rope_dim, xs[-1].device)
                    if self.cfg.sliding_rope is not None:
                        self._sliding_rotary = RotaryEmbedding(self.cfg.sliding_rope, self.cfg.sliding_rotary_dim,
                                                               xs[-1].device)
                lens_T = batch.kv_lens_B[batch.seq_idx_T]
                cos_sins.append(self._rotary(batch.positions_T, xs[-1].dtype, lens_T))
                if self.cfg.sliding_rope is not None:
                    sliding_cos_sins[len(cos_sins) - 1] = self._sliding_rotary(batch.positions_T, xs[-1].dtype, lens_T)
            residuals.append(None)
        mode = None if self.native_decode is None else self.native_decode.mode(inputs, self.dispatcher, cache)
        if mode == "step":  # every layer and its experts in one native call
            x_TD = self.native_decode(xs[0], cos_sins[0], inputs[0][1], self.dispatcher)
            return [x_TD if head is None else head(0, x_TD)]
        if mode == "layers":  # each layer's attention side in one native call, the experts dispatched
            return self.native_decode.layers_of(self, xs, cos_sins, inputs, head)
        pending: list[tuple | None] = [None] * len(inputs)
        for layer in self.model.layers:
            for i, inp in enumerate(inputs):
                if pending[i] is not None:
                    xs[i] = SparseMoE.finish(pending[i])
                if inp is None:
                    pending[i] = layer.start_mlp(xs[i], self.dispatcher, i, empty=True)
                    continue
                cos_sin = sliding_cos_sins[i] if getattr(layer.self_attn, "sliding_rope", False) else cos_sins[i]
                h_TD, residuals[i] = layer.attention(xs[i], residuals[i], cos_sin, cache, inp[1])
                pending[i] = layer.start_mlp(h_TD, self.dispatcher, i, token_ids_T=inp[0])
        outs = []
        for i, inp in enumerate(inputs):
            x_TD = SparseMoE.finish(pending[i])
            if inp is not None:
                x_TD = self.model.final_norm(x_TD, residuals[i])
                x_TD = x_TD if head is None else head(i, x_TD)
            outs.append(x_TD)
        return outs

    def logits(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32) of the given rows."""
        return self.lm_head(hidden_TD).float()
