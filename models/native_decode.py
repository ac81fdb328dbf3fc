"""A colocated bf16 decode step's layers as one native call (kernels/csrc/decode_step.c).

The eager CPU decode step runs every heavy op natively already, but between them each layer spends
~100 us in Python and small torch ops (module calls, argument checks, views, allocations, the
routing's softmax and top-k): ~1 ms of a ~6 ms step at batch 1 on the 425M shapes. `NativeDecode`
replays the same kernels in the same order from C, on buffers allocated once per batch size, as a
captured graph replays a GPU's step. The model keeps every other path: prefill and mixed steps, the
pools (their experts are remote), micro-batches, compiled stages, and every model this does not take.

It takes a model (`NativeDecode.build`) where every layer is: MoE with the fused native experts
(bf16 SiLU experts on panels) and no shared experts; a softmax router on panels without groups,
bias or correction bias; attention with fused q/k/v and o on panels, no biases, no sinks, no clamp,
q/k norm none / per head / full; a bf16 paged cache. That is Mixtral, Qwen3-MoE and OLMoE served in
bf16 on a CPU with AVX-512 BF16; the rest keep the eager path. `enforce_native_decode=False`
(EngineConfig) turns it off; the eager path stays the oracle (tests/test_native_decode.py).

It gives the eager step's bits up to the routing weights (the softmax's exp differs in a float32
weight's last bit: see decode_step.c).
"""
import ctypes

import torch

from kernels import native
from kernels.attention import _native_layout
from models.cpu_inference import PackedExperts
from models.dispatcher import LocalDispatcher
from models.kv_cache import AttentionBatch, PagedKVCache
from models.stages import EAGER

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
QK_NORMS = {"none": 0, "per_head": 1, "full": 2}
MAX_BUFFER_SETS = 8  # batch sizes whose buffers are kept (steady decode sees few)


class _Layer(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("in_norm", "post_norm", "qkv", "o", "router", "q_norm", "k_norm", "w13", "w2",
                                  "k_cache", "v_cache")] + [("window", _I)]


class _Step(ctypes.Structure):
    _fields_ = ([(n, _I) for n in ("B", "D", "N", "K", "H", "R", "E", "top_k", "I16", "S", "M", "qk_norm",
                                   "renormalize", "weights_bf16", "threads")]
                + [(n, _F) for n in ("eps", "qk_eps", "scale", "scaling")]
                + [(n, _P) for n in ("final_norm", "x", "cos", "sin", "slots", "table", "len", "start", "h", "r0",
                                     "r1", "qkv", "q", "o", "a", "logits", "moe", "scratch", "y", "lse", "wk", "ids")])


def why_not(model, cache) -> str | None:
    """Why `model` with `cache` cannot take the native decode step, or None where it can."""
    from models.cpu_inference import PackedLinear
    from models.moe_decoder import Attention, SparseMoE

    cfg = model.cfg
    if not native.avx512_bf16():
        return "no AVX-512 BF16 (or no native kernels)"
    if model.model.norm.weight.dtype != torch.bfloat16 or cfg.mla is not None:
        return "not a bf16 model with per-head attention"
    if not isinstance(cache, PagedKVCache) or cache.k[0].dtype != torch.bfloat16 or not cache.k[0].is_contiguous():
        return "not a contiguous bf16 paged cache"
    if cfg.hidden_size % 2 or cfg.rope_dim % 2:
        return "odd hidden size or rotary dims"
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, Attention) or not isinstance(mlp, SparseMoE):
            return f"layer {i} is not attention + MoE"
        if not all(isinstance(p, PackedLinear) and p.weight.panels is not None and p.bias is None
                   for p in (attn.qkv_proj, attn.o_proj)):
            return f"layer {i}: q/k/v or o not on bias-free bf16 panels"
        if attn.sinks is not None or attn.head_spec.clip_qkv is not None or attn.stages is not EAGER:
            return f"layer {i}: attention sinks, a qkv clamp or compiled stages"
        gate, experts, r = mlp.gate, mlp.experts, cfg.router
        if mlp.shared_name is not None or not isinstance(experts, PackedExperts) or experts.native is None:
            return f"layer {i}: shared experts or experts outside the fused native kernel"
        if (gate.cpu_weight is None or gate.cpu_weight.panels is None or gate.bias is not None
                or gate.e_score_correction_bias is not None or r.scoring != "softmax" or r.num_groups != 1
                or mlp.stages is not EAGER):
            return f"layer {i}: a router other than softmax top-k on bf16 panels"
    return None


class NativeDecode:
    """The native decode step of one model and cache (build() says whether it applies)."""

    def __init__(self, model, cache: PagedKVCache):
        cfg, spec = model.cfg, model.model.layers[0].self_attn.head_spec
        self.cfg, self.num_layers = cfg, cfg.num_layers
        self._keep = []  # tensors whose pointers the tables hold
        layers = (_Layer * self.num_layers)()
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if spec.qk_norm != "none" else (None, None)
            w13, w2, self.inter_padded = mlp.experts.native
            self._keep += [w13, w2]
            layers[i] = _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                               attn.qkv_proj.weight.panels.data_ptr(), attn.o_proj.weight.panels.data_ptr(),
                               mlp.gate.cpu_weight.panels.data_ptr(), qn.data_ptr() if qn is not None else None,
                               kn.data_ptr() if kn is not None else None, w13.data_ptr(), w2.data_ptr(),
                               cache.k[i].data_ptr(), cache.v[i].data_ptr(), attn.window or 0)
        self.layers = layers
        self.final_norm = model.model.norm.weight
        self.cache_slots = cache.k[0].shape[1]
        route = model.model.layers[0].mlp.route_spec(torch.bfloat16)
        self.route = route
        self.spec = spec
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}

    @classmethod
    def build(cls, model, cache) -> "NativeDecode | None":
        return None if why_not(model, cache) is not None else cls(model, cache)

    @staticmethod
    def takes(batch: AttentionBatch, dispatcher) -> bool:
        """Whether this step is one the native call computes: decode only, experts in this process."""
        return (batch.max_q_len == 1 and batch.parts is None and batch.block_table_BM is not None
                and type(dispatcher) is LocalDispatcher and not torch.is_grad_enabled())

    def _buffers_for(self, B: int) -> dict[str, torch.Tensor]:
        bufs = self._buffers.get(B)
        if bufs is None:
            if len(self._buffers) >= MAX_BUFFER_SETS:
                self._buffers.clear()
            cfg, bf = self.cfg, torch.bfloat16
            D, Q, C, K = cfg.hidden_size, cfg.q_size, cfg.kv_size, self.route.top_k
            bufs = {"h": torch.empty(B, D, dtype=bf), "r0": torch.empty(B, D, dtype=bf),
                    "r1": torch.empty(B, D, dtype=bf), "qkv": torch.empty(B, Q + 2 * C, dtype=bf),
                    "q": torch.empty(B, Q, dtype=bf), "o": torch.empty(B, Q, dtype=bf), "a": torch.empty(B, D, dtype=bf),
                    "logits": torch.empty(B, cfg.num_experts, dtype=bf), "moe": torch.empty(B, D, dtype=bf),
                    "scratch": torch.empty(B * K, self.inter_padded, dtype=bf),
                    "lse": torch.empty(B, cfg.num_heads, dtype=torch.float32),
                    "wk": torch.empty(B, K, dtype=torch.float32), "start": torch.empty(B, dtype=torch.int64)}
            self._buffers[B] = bufs
        return bufs

    def __call__(self, x_BD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
                 dispatcher: LocalDispatcher) -> torch.Tensor:
        """The final norm's output (B, D) for the embeddings x_BD of a decode step (takes() is True)."""
        cfg, spec, route = self.cfg, self.spec, self.route
        B = x_BD.shape[0]
        bufs = self._buffers_for(B)
        table_BM, _, len_B = _native_layout(batch.block_table_BM, batch.kv_lens_B, None)
        x_BD, slots = x_BD.contiguous(), batch.slot_mapping_T.long().contiguous()
        cos, sin = (t.contiguous() for t in cos_sin)
        y_BD = torch.empty(B, cfg.hidden_size, dtype=torch.bfloat16)
        ids_LBK = torch.empty(self.num_layers, B, route.top_k, dtype=torch.int64)
        step = _Step(B, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, spec.rope_dim, cfg.num_experts,
                     route.top_k, self.inter_padded, self.cache_slots, table_BM.shape[1], QK_NORMS[spec.qk_norm],
                     int(route.renormalize), int(route.weights_dtype is not None), native.threads(),
                     cfg.rms_norm_eps, spec.eps, spec.head_dim ** -0.5, route.scaling,
                     self.final_norm.data_ptr(), x_BD.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                     table_BM.data_ptr(), len_B.data_ptr(), *(bufs[n].data_ptr() for n in (
                         "start", "h", "r0", "r1", "qkv", "q", "o", "a", "logits", "moe", "scratch")),
                     y_BD.data_ptr(), bufs["lse"].data_ptr(), bufs["wk"].data_ptr(), ids_LBK.data_ptr())
        native.decode_step(ctypes.byref(step), self.layers, self.num_layers)
        dispatcher.record(ids_LBK)
        return y_BD
