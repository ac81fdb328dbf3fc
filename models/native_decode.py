"""A bf16 decode step's layers as native calls (kernels/csrc/decode_step.c).

The eager CPU decode step runs every heavy op natively already, but between them each layer spends
~100 us in Python and small torch ops (module calls, argument checks, views, allocations, the
routing's softmax and top-k): ~1 ms of a ~6 ms step at batch 1 on the 425M shapes. `NativeDecode`
replays the same kernels in the same order from C, on buffers allocated once per batch size, as a
captured graph replays a GPU's step:
- colocated (the experts in this process, one micro-batch): the whole step, every layer and its
  experts, in one call (`shuttle_decode_step`);
- an attention worker (experts remote, any micro-batches): each layer's attention side in one call
  (`shuttle_decode_attention`: norms, q/k/v, rotary, cache write, attention, o, router, routing),
  then the model's dispatcher sends the layer's rows through M2N as before.
- a speculative MTP layer (models/mtp.py) over one-token rows: that layer alone as the step's only
  layer (its keys and values in the cache's last layer; a dense MLP as one expert every token takes),
  its output before shared_head's norm returned; or a step's every pass, chained, with the layer's
  inputs (enorm, hnorm, eh_proj), the head and the argmax or the draw from q, in one call (`shuttle_mtp_draft`).
The model keeps every other path: prefill and mixed steps, compiled stages, and every model this
does not take.

It takes a model (`why_not` says what a model lacks) where every layer is: MoE without shared
experts, colocated with fused native experts (bf16 SiLU experts on panels, int8 / FP8 ones, or MXFP4
ones with any SwiGLU and biases); a softmax router on panels without groups, bias or correction bias;
attention with fused q/k/v and o without biases, both on bf16 panels or both int8 / FP8
(quantize_linears; every layer's of one kind, FP8 of one input block), no sinks, no clamp, q/k norm
none / per head / full; a bf16 paged cache. That is Mixtral,
Qwen3-MoE and OLMoE served in bf16 on a CPU with AVX-512 BF16; the rest keep the eager path.
`native_decode=False` (EngineConfig, --no-native-decode) turns it off; the eager path stays the
oracle: the kernels and their arguments are the same, so are the bits (tests/test_native_decode.py).
Of those kernels, attention, RMSNorm and routing also have torch paths, chosen per batch size by
measurement (kernels/choice.py); a step runs here only at batch sizes where all three picked the
native kernel, and eagerly, each op as picked, elsewhere (`chosen_native`).
"""
import ctypes

import torch

from kernels import fp8_weights, int8, mxfp4_weights, native
from kernels.attention import _native_layout
from models.cpu_inference import PackedExperts
from models.dispatcher import LocalDispatcher
from models.kv_cache import AttentionBatch, PagedKVCache
from models.stages import EAGER

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
QK_NORMS = {"none": 0, "per_head": 1, "full": 2}
MAX_BUFFER_SETS = 8  # (batch size, micro-batch) pairs whose buffers are kept (steady decode sees few)


class _Layer(ctypes.Structure):
    _fields_ = ([(n, _P) for n in ("in_norm", "post_norm", "qkv", "o", "router", "q_norm", "k_norm", "w13", "w2",
                                   "k_cache", "v_cache")] + [("window", _I)]
                + [(n, _P) for n in ("s13", "s2", "qkv_s", "o_s", "b13", "b2")])


class _Step(ctypes.Structure):
    _fields_ = ([(n, _I) for n in ("B", "D", "N", "K", "H", "R", "E", "top_k", "I16", "S", "M", "qk_norm",
                                   "renormalize", "weights_bf16", "threads")]
                + [(n, _F) for n in ("eps", "qk_eps", "scale", "scaling")]
                + [(n, _P) for n in ("final_norm", "x", "cos", "sin", "slots", "table", "len", "start", "h", "r",
                                     "qkv", "q", "o", "a", "logits", "moe", "scratch", "y", "lse", "wk", "ids")]
                + [(n, _I) for n in ("inter", "int8_kernel", "int8_big_kernel", "int8_big_rows", "int8_vnni_rows", "fp8_bpairs13",
                                     "fp8_bpairs2", "linear_kernel", "linear_bpairs", "mxfp4", "mx_kernel")]
                + [(n, _F) for n in ("mx_alpha", "mx_limit", "mx_offset")] + [("mx_rows", _P)])
_BUFFERS = ("start", "h", "r", "qkv", "q", "o", "a", "logits", "moe", "scratch")


class _Mtp(ctypes.Structure):
    """kernels/csrc/decode_step.c's shuttle_mtp: an MTP layer's head and the rows of its drafting passes."""
    _fields_ = ([(n, _P) for n in ("embed", "enorm", "hnorm", "eh", "head", "cos", "sin")]
                + [(n, _I) for n in ("V", "Vh", "A", "M", "bs")]
                + [(n, _P) for n in ("pages", "tok0", "hrow", "pos0", "seq0", "h0", "pick", "drafting", "last", "count",
                                     "temp", "u", "q", "vocab")])




def linear_kind(w) -> str | tuple[str, int] | None:
    """What a packed linear's weight (kernels/cpu_linear.CpuWeight) is for the step: "bf16" (panels),
    "int8", ("fp8", input block), or None where the native kernels do not run it."""
    if w.panels is not None:
        return "bf16"
    if isinstance(w.int8, int8.Int8Weight):
        return "int8"
    if isinstance(w.int8, fp8_weights.Fp8Weight) and fp8_weights.available():
        return "fp8", w.int8.block_in
    return None


def why_not(model, cache, local: bool = True, cache_layer: int = 0) -> str | None:
    """Why `model` with `cache` cannot take the native decode step, or None where it can. local: the
    experts are in this process (colocated), else remote (an attention worker: no experts here).
    cache_layer: the cache layer of the model's first layer (an MTP layer's: the last)."""
    from models.cpu_inference import PackedLinear
    from models.moe_decoder import Attention, SparseMoE

    cfg = model.cfg
    if not native.avx512_bf16():
        return "no AVX-512 BF16 (or no native kernels)"
    if model.model.norm.weight.dtype != torch.bfloat16 or cfg.mla is not None:
        return "not a bf16 model with per-head attention"
    if cfg.linear_layers is not None or cfg.attn_output_gate:
        return "linear-attention layers or gated attention heads (Qwen3-Next)"
    k = cache.k[cache_layer] if isinstance(cache, PagedKVCache) else None
    if k is None or k.dtype != torch.bfloat16 or not k.is_contiguous():
        return "not a contiguous bf16 paged cache"
    if cfg.hidden_size % 2 or cfg.rope_dim % 2:
        return "odd hidden size or rotary dims"
    if cfg.v_dim != cfg.head_dim or cfg.layer_kv_heads is not None or cfg.v_scale != 1.0 or cfg.sliding_rope:
        return "MiMo-V2-Flash's narrower or scaled values, kv heads per layer or second rope"
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, Attention) or not isinstance(mlp, SparseMoE):
            return f"layer {i} is not attention + MoE"
        if not all(isinstance(p, PackedLinear) and p.bias is None for p in (attn.qkv_proj, attn.o_proj)):
            return f"layer {i}: q/k/v or o not bias-free packed linears"
        kinds = {linear_kind(p.weight) for p in (attn.qkv_proj, attn.o_proj)}
        if None in kinds:
            return f"layer {i}: q/k/v or o neither on bf16 panels nor int8 / FP8 that the native kernels run"
        if kinds != {linear_kind(model.model.layers[0].self_attn.o_proj.weight)}:
            return f"layer {i}: q/k/v and o not of one kind as layer 0's (bf16 panels, int8, or FP8 of one input block)"
        spec = attn.head_spec
        if attn.sinks is not None or spec.clip_qkv is not None or attn.stages is not EAGER:
            return f"layer {i}: attention sinks, a qkv clamp or compiled stages"
        if (attn.chunk or attn.temperature is not None or spec.qk_norm not in QK_NORMS or spec.rope_interleave
                or spec.rope_dim != cfg.rope_dim):
            return f"layer {i}: Llama 4's chunks, no-rope layers, L2 q/k norm or interleaved rope"
        gate, experts, r = mlp.gate, mlp.experts, cfg.router
        if mlp.shared_name is not None or (local and not (isinstance(experts, PackedExperts) and (
                experts.native is not None or (experts.int8 is not None
                                               and int8.moe_kernels(experts.int8, torch.bfloat16) is not None)
                or (experts.fp8 is not None and fp8_weights.moe_kernels(experts.fp8) is not None)
                or (experts.mxfp4 is not None and mxfp4_weights.available())))):
            return f"layer {i}: shared experts or experts outside the fused native (bf16, int8, FP8 or MXFP4) blocks"
        if (gate.cpu_weight is None or gate.cpu_weight.panels is None or gate.bias is not None
                or gate.e_score_correction_bias is not None or r.scoring != "softmax" or r.num_groups != 1
                or cfg.router_scales_input or mlp.stages is not EAGER):
            return f"layer {i}: a router other than softmax top-k on bf16 panels"
    return None


class NativeDecode:
    """The native decode of one model and cache (build() says whether it applies). local: the
    experts are in this process, and a one-micro-batch step runs whole in C; else each layer's
    attention side does, the experts through the model's dispatcher. layer_by_layer forces the
    latter on a colocated engine too (the planner's profile and the tests compare the two)."""

    def __init__(self, model, cache: PagedKVCache, local: bool = True, cache_layer: int = 0):
        cfg, spec = model.cfg, model.model.layers[0].self_attn.head_spec
        self.cfg, self.num_layers, self.local, self.layer_by_layer = cfg, len(model.model.layers), local, False
        self._keep = []  # tensors whose pointers the tables hold
        self.inter_padded = self.inter = 0
        self.int8_kernels = (0, 0, 0, 0)  # fused_moe_int8's (kernel, big_kernel, big_rows, vnni_rows), int8 / FP8
        self.fp8_bpairs = (0, 0)  # FP8 experts: input pairs per scale block of w13, w2 (0: not FP8)
        self.mx_act = None  # MXFP4 experts: their activation (kernels/moe.SwiGLU); None: not MXFP4
        self.linears = linear_kind(model.model.layers[0].self_attn.o_proj.weight)  # q/k/v and o: bf16, int8, FP8
        layers = (_Layer * self.num_layers)()
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if spec.qk_norm != "none" else (None, None)
            w13 = w2 = s13 = s2 = b13 = b2 = None
            if local and mlp.experts.mxfp4 is not None:  # MXFP4 experts: codes, scales, biases (kernels/mxfp4_weights.py)
                m = mlp.experts.mxfp4
                w13, s13, w2, s2 = m.table
                b13, b2 = (None, None) if m.biases is None else m.biases
                self.inter, self.mx_act = m.inter, m.act
                self._keep += [m.table, m.biases]
            elif local and mlp.experts.int8 is not None:  # int8 experts: codes and scales (kernels/int8.py)
                table = mlp.experts.int8.table
                w13, s13, w2, s2 = table
                self.inter = mlp.experts.int8.inter
                self.int8_kernels = int8.moe_kernels(mlp.experts.int8, torch.bfloat16)
                self._keep.append(table)
            elif local and mlp.experts.fp8 is not None:  # FP8 experts: codes and block scales (kernels/fp8_weights.py)
                f = mlp.experts.fp8
                w13, s13, w2, s2 = f.table
                self.inter, self.fp8_bpairs = f.inter, (f.block13 // 2, f.block2 // 2)
                self.int8_kernels = fp8_weights.moe_kernels(f)
                self._keep.append(f.table)
            elif local:
                w13, w2, self.inter_padded = mlp.experts.native
                self._keep += [w13, w2]
            ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
            (qkv, qkv_s), (o, o_s) = (_codes_and_scales(p.weight) for p in (attn.qkv_proj, attn.o_proj))
            layers[i] = _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                               qkv.data_ptr(), o.data_ptr(), mlp.gate.cpu_weight.panels.data_ptr(), ptr(qn), ptr(kn),
                               ptr(w13), ptr(w2), cache.k[cache_layer + i].data_ptr(), cache.v[cache_layer + i].data_ptr(),
                               attn.window or 0, ptr(s13), ptr(s2), ptr(qkv_s), ptr(o_s), ptr(b13), ptr(b2))
        self.layers = layers
        self.cache = cache  # the pages the tables point at (a step for another cache runs eagerly)
        self.final_norm = model.model.norm.weight
        self.cache_slots = cache.k[cache_layer].shape[1]
        self.route = model.model.layers[0].mlp.route_spec(torch.bfloat16)
        self.spec = spec
        self._buffers: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    @classmethod
    def build(cls, model, cache, local: bool = True) -> "NativeDecode | None":
        return None if why_not(model, cache, local) is not None else cls(model, cache, local)

    def mode(self, inputs: list, dispatcher, cache) -> str | None:
        """How a step of these micro-batches over `cache` runs: "step" (whole, in C), "layers" (each
        layer's attention side in C) or None (eagerly: a prefill or mixed step, no sequences, or a
        cache other than the one the tables point at)."""
        if cache is not self.cache or torch.is_grad_enabled() or all(i is None for i in inputs):
            return None
        if any(i is not None and (i[1].max_q_len != 1 or i[1].parts is not None or i[1].block_table_BM is None
                                  or not self.chosen_native(i[1].block_table_BM.shape[0])) for i in inputs):
            return None
        whole = self.local and len(inputs) == 1 and type(dispatcher) is LocalDispatcher and not self.layer_by_layer
        return "step" if whole else "layers"

    def linear_kernel(self, B: int) -> int | None:
        """The kernel int8_linear / fp8_linear run int8 / FP8 q/k/v and o with at B bf16 rows (0 for bf16
        panels), or None where the eager path would take the torch reference instead."""
        if self.linears == "bf16":
            return 0
        if self.linears == "int8":
            return int8._default_kernel(torch.bfloat16, B, int8.kernels())
        here = fp8_weights._here_for(self.linears[1])
        kernel = int8._default_kernel(torch.bfloat16, B, here, "fp8")  # (fp8_linear's: the table measured on FP8)
        return kernel if kernel in here else None

    def chosen_native(self, B: int) -> bool:
        """Whether kernels/choice.py picked the native kernel at a batch of B for each op of the step
        that has a torch path (attention; the norms, at B rows and, per head, B N and B K; routing):
        the step runs those kernels, so it runs only where the eager layers would run them too."""
        rows = (B, B * self.cfg.num_heads, B * self.cfg.num_kv_heads) if self.spec.qk_norm == "per_head" else (B,)
        return (native.runs_native("attention", B) and native.runs_native("routing", B)
                and all(native.runs_native("rmsnorm", r) for r in rows) and self.linear_kernel(B) is not None)

    def _buffers_for(self, B: int, mb: int) -> dict[str, torch.Tensor]:
        bufs = self._buffers.get((B, mb))
        if bufs is None:
            if len(self._buffers) >= MAX_BUFFER_SETS:
                self._buffers.clear()
            cfg, bf = self.cfg, torch.bfloat16
            D, Q, C, K = cfg.hidden_size, cfg.q_size, cfg.kv_size, self.route.top_k
            bufs = {"h": torch.empty(B, D, dtype=bf), "r": torch.empty(B, D, dtype=bf),
                    "qkv": torch.empty(B, Q + 2 * C, dtype=bf), "q": torch.empty(B, Q, dtype=bf),
                    "o": torch.empty(B, Q, dtype=bf), "a": torch.empty(B, D, dtype=bf),
                    "logits": torch.empty(B, cfg.num_experts, dtype=bf), "moe": torch.empty(B, D, dtype=bf),
                    "scratch": torch.empty(B * K, self.inter_padded, dtype=bf),
                    "lse": torch.empty(B, cfg.num_heads, dtype=torch.float32), "start": torch.empty(B, dtype=torch.int64)}
            self._buffers[(B, mb)] = bufs
        return bufs

    def _step(self, x_BD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
              mb: int = 0) -> tuple[_Step, dict[str, torch.Tensor]]:
        """The step structure of one micro-batch and the tensors it points to (kept alive with it)."""
        table_BM, _, len_B = _native_layout(batch.block_table_BM, batch.kv_lens_B, None)
        return self.step_of(x_BD, *cos_sin, batch.slot_mapping_T.long().contiguous(), table_BM, len_B, mb)

    def step_of(self, x_BD: torch.Tensor, cos_BR: torch.Tensor, sin_BR: torch.Tensor, slots_B: torch.Tensor,
                table_BM: torch.Tensor, len_B: torch.Tensor, mb: int = 0) -> tuple[_Step, dict[str, torch.Tensor]]:
        """_step of B one-token rows given as the native kernels take them: each row's cache slot, its pages
        (B, M) and its length with the row, int64 and contiguous (as _native_layout makes them)."""
        cfg, spec, route = self.cfg, self.spec, self.route
        B, L, K = x_BD.shape[0], self.num_layers, route.top_k
        bufs = self._buffers_for(B, mb)
        t = {**bufs, "x": x_BD.contiguous(), "slots": slots_B, "table": table_BM, "len": len_B,
             "cos": cos_BR.contiguous(), "sin": sin_BR.contiguous(),
             "y": torch.empty(B, cfg.hidden_size, dtype=torch.bfloat16),
             "ids": torch.empty(L, B, K, dtype=torch.int64), "wk": torch.empty(L, B, K, dtype=torch.float32)}
        step = _Step(B, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, spec.rope_dim, cfg.num_experts,
                     K, self.inter_padded, self.cache_slots, table_BM.shape[1], QK_NORMS[spec.qk_norm],
                     int(route.renormalize), int(route.weights_dtype is not None), native.threads(),
                     cfg.rms_norm_eps, spec.eps, spec.head_dim ** -0.5, route.scaling, self.final_norm.data_ptr(),
                     *(t[n].data_ptr() for n in ("x", "cos", "sin", "slots", "table", "len", *_BUFFERS, "y", "lse",
                                                 "wk", "ids")), self.inter, *self.int8_kernels, *self.fp8_bpairs,
                     self.linear_kernel(B), self.linears[1] // 2 if isinstance(self.linears, tuple) else 0,
                     *self._mxfp4_args(t))
        return step, t

    def _mxfp4_args(self, t: dict) -> tuple:
        """The step's MXFP4 fields: (1, kernel, alpha, limit, up_offset, rows table) as fused_moe_mxfp4 runs
        them by default (the table kept alive in t), or zeros for other experts."""
        if self.mx_act is None:
            return 0, 0, 1.0, 0.0, 0.0, None
        kernel, t["mx_rows"] = mxfp4_weights.moe_kernels()
        act = self.mx_act
        return (1, kernel, act.alpha, float("inf") if act.limit is None else act.limit, act.up_offset,
                t["mx_rows"].data_ptr())

    def __call__(self, x_BD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
                 dispatcher: LocalDispatcher, before_norm: bool = False) -> torch.Tensor:
        """The whole step ("step" mode): the final norm's output (B, D) for the embeddings x_BD, or with
        before_norm its input, the last layer's output (a copy: the buffer is the next step's)."""
        step, t = self._step(x_BD, cos_sin, batch)
        native.decode_step(ctypes.byref(step), self.layers, self.num_layers)
        dispatcher.record(t["ids"])
        return t["r"].clone() if before_norm else t["y"]

    def layers_of(self, model, xs: list[torch.Tensor], cos_sins: list, inputs: list, head=None) -> list[torch.Tensor]:
        """"layers" mode: each layer's attention side natively for every micro-batch in turn, its rows
        dispatched to the experts as the eager layers do (the ping-pong of forward_micro_batches).
        Returns what forward_micro_batches returns."""
        from models.moe_decoder import SparseMoE

        dispatcher, wdt = model.dispatcher, self.route.weights_dtype
        steps = [None if inp is None else self._step(xs[i], cos_sins[i], inp[1], i) for i, inp in enumerate(inputs)]
        pending: list[tuple | None] = [None] * len(inputs)
        for l, layer in enumerate(model.model.layers):
            for i, st in enumerate(steps):
                if st is None:
                    if pending[i] is not None:
                        xs[i] = SparseMoE.finish(pending[i])
                    pending[i] = layer.start_mlp(xs[i], dispatcher, i, empty=True)
                    continue
                step, t = st
                x = t["x"] if l == 0 else _bf16_rows(SparseMoE.finish(pending[i]))
                t["in"] = x  # alive until the call below has read it
                native.decode_attention(ctypes.byref(step), ctypes.byref(self.layers, l * ctypes.sizeof(_Layer)), l,
                                        x.data_ptr())
                w = t["wk"][l] if wdt is None else t["wk"][l].to(wdt)
                pending[i] = (dispatcher, dispatcher.dispatch(l, layer.mlp.experts, t["h"], t["ids"][l], w, mb=i), None)
        outs = []
        for i, st in enumerate(steps):
            x = SparseMoE.finish(pending[i])
            if st is not None:
                x = model.model.norm.add_and_norm(_bf16_rows(x), st[1]["r"])[0]
                x = x if head is None else head(i, x)
            outs.append(x)
        return outs


def _codes_and_scales(w) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A packed linear's weight as the step's layer table takes it: its bf16 panels and no scales, or
    its int8 / FP8 panels and their scales."""
    return (w.panels, None) if w.panels is not None else (w.int8.panels, w.int8.scales)


def _bf16_rows(x: torch.Tensor) -> torch.Tensor:
    """A combined MoE output as the native calls read it: contiguous bf16 rows."""
    return x if x.dtype == torch.bfloat16 and x.is_contiguous() else x.to(torch.bfloat16).contiguous()
