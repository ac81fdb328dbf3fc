"""ModelConfig: one frozen description of a supported MoE decoder, read from a Hugging Face config.json.

Both writers are understood: transformers 4 (`torch_dtype`, top-level `rope_theta`, `rope_scaling`)
and transformers 5 (`dtype`, `rope_parameters`, `layer_types`). Errors name the file and the field.
DeepSeek-V2/V3 (and Kimi K2, which declares the V3 architecture) add Multi-head Latent Attention
(models/attention_config.MLAConfig), grouped routing (kernels.routing.RouterConfig), ungated shared experts and dense
layers before first_k_dense_replace; DeepSeek-V3.2 and GLM-5 (glm_moe_dsa) add DeepSeek Sparse
Attention (MLAConfig.index_*; GLM-5: only its indexer_types "full" layers run an indexer).
GLM-4.5/4.6/4.7 is DeepSeek-V3's MoE block behind grouped-query attention with q/k/v biases,
optional per-head q/k norm and partial rotary; MiniMax-M2 routes like V3 without groups, norms q and k over the whole projection and ropes part of each head; gpt-oss
has attention sinks, alternating sliding-window layers, biased router and experts, a clamped
SwiGLU and yarn rope, and is published with MXFP4 experts (quantization_config mxfp4). Llama 4
and MiMo-V2-Flash lay their layers out their own way, and Qwen3-Next and Qwen3.5-MoE interleave gated
DeltaNet (linear attention, attention_config.LinearAttentionConfig) with gated full-attention layers: models/families.py
reads them (and holds every family's defaults).
`planning=True` also reads families that are planned for but not served (PLANNED_ARCHITECTURES:
DBRX, whose config.json names its fields its own way); ModelConfig's sizes and per-token costs are
what `shuttle plan` and `shuttle simulate` compute with.
"""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.moe import SILU, SwiGLU
from kernels.rotary import RopeConfig
from kernels.routing import RouterConfig
from models import families
from models.attention_config import (DSA_FAMILIES, MLA_FAMILIES, LinearAttentionConfig, MLAConfig, read_mla,
                                     read_rope, read_rotary_dim, read_sliding_windows, with_mla_scale)
from models.errors import ConfigError
from models.quant_config import is_mxfp4, read_fp8_block, read_fp8_formats
from models.v4_config import V4Config, v4_attention_params, v4_attention_weights, v4_context_flops, v4_wide_params

# architectures entry -> family; each family's semantics follow transformers' definition of it.
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",  # GLM-5
    "Glm4MoeForCausalLM": "glm4_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "GptOssForCausalLM": "gpt_oss",
    "Llama4ForCausalLM": "llama4",
    "Llama4ForConditionalGeneration": "llama4",  # its language model (text_config; tensors under language_model.)
    "MiMoV2FlashForCausalLM": "mimo_v2_flash",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",  # its language model (text_config; under language_model.)
    "DeepseekV4ForCausalLM": "deepseek_v4",
}
# model_type -> architectures entry, for a config.json that lists no known architecture
MODEL_TYPES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
               "deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
               "kimi_k2": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
               "minimax_m2": "MiniMaxM2ForCausalLM", "gpt_oss": "GptOssForCausalLM",
               "llama4": "Llama4ForConditionalGeneration", "llama4_text": "Llama4ForCausalLM",
               "mimo_v2_flash": "MiMoV2FlashForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
               "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
               "deepseek_v4": "DeepseekV4ForCausalLM"}
# families `shuttle plan` sizes (ModelConfig.from_dict(..., planning=True)) that the engine does not build
PLANNED_ARCHITECTURES = {"DbrxForCausalLM": "dbrx"}
PLANNED_MODEL_TYPES = {"dbrx": "DbrxForCausalLM"}
V3_ROUTER_FAMILIES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe", "mimo_v2_flash")  # sigmoid + correction bias + groups of top-2 sums
# family -> default partial_rotary_factor
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of one MoE decoder. Per-layer fields are tuples of length num_layers."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers (mlp_only_layers, decoder_sparse_step)
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    shared_expert_gate: bool  # Qwen2-MoE gates its shared expert with a sigmoid; DeepSeek's are ungated
    num_experts: int
    router: RouterConfig
    moe_layers: tuple[bool, ...]
    sliding_windows: tuple[int | None, ...]
    qkv_bias: bool  # MLA: q_a_proj and kv_a_proj_with_mqa
    o_bias: bool
    mlp_bias: bool  # dense MLPs and shared experts (DeepSeek-V2's mlp_bias)
    qk_norm: str  # "none", "per_head" (Qwen3-MoE), "full" (OLMoE: the whole projection), "l2" (Llama 4: no weight)
    clip_qkv: float | None
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype  # the checkpoint's dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    mla: MLAConfig | None = None
    num_mtp_layers: int = 0  # multi-token-prediction layers stored after the last layer (speculative method mtp)
    fp8_block: tuple[int, int] | None = None  # FP8 block-quantised weights: (rows, cols) per weight_scale_inv
    # quantization_config's scale_fmt: "float" (float32 scales) or "ue8m0" (one byte per scale, 2 ** (e - 127));
    # expert_dtype "fp4" (DeepSeek-V4): routed experts stored as packed FP4 with a scale per 32 inputs
    fp8_scale_fmt: str = "float"
    fp4_experts: bool = False
    rotary_dim: int | None = None  # partial rotary (GLM, MiniMax-M2): rope the first rotary_dim of each head
    attention_sinks: bool = False  # gpt-oss: one learned sink logit per query head (self_attn.sinks)
    expert_bias: bool = False  # gpt-oss: experts have biases (w13 and w2 rows)
    expert_act: SwiGLU = SILU  # the experts' activation (gpt-oss: clamped, alpha 1.702, up + 1)
    mxfp4: bool = False  # quantization_config.quant_method mxfp4: expert weights as *_blocks + *_scales
    # Llama 4 (models/families.py): layers without rope (False; None: every layer ropes), chunked local
    # attention (a query at p sees keys from p - p % C on; None: none), rope on the pairs (0, 1), (2, 3), ...
    # instead of the two halves, the no-rope layers' query temperature (floor_scale, attn_scale), and the
    # router's weight multiplying the expert's input instead of its output
    rope_layers: tuple[bool, ...] | None = None
    attention_chunks: tuple[int | None, ...] | None = None
    rope_interleave: bool = False
    attn_temperature: tuple[float, float] | None = None
    router_scales_input: bool = False
    # MiMo-V2-Flash (models/families.py): value heads narrower than query/key heads (None: head_dim),
    # kv heads per layer (None: num_kv_heads everywhere), the layers with sinks (None: every layer when
    # attention_sinks), a factor on the values, and the sliding layers' own rope and rotary dims
    v_head_dim: int | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    sink_layers: tuple[bool, ...] | None = None
    v_scale: float = 1.0
    sliding_rope: RopeConfig | None = None
    sliding_rotary_dim: int | None = None
    # Qwen3-Next, Qwen3.5-MoE (models/families.py): the gated DeltaNet layers (True) among full-attention
    # ones, their shape, a sigmoid gate on each full-attention head's output (q_proj gives it beside the
    # query), and RMSNorms that scale by 1 + weight (checkpoints store weight - 1: models/loader.py adds the 1)
    linear_layers: tuple[bool, ...] | None = None
    linear_attention: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    norm_offset: float = 0.0
    # DeepSeek-V4 (models/deepseek_v4.py): its attention layers, caches, mHC and hash-routed layers
    v4: V4Config | None = None

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a linear-attention (gated DeltaNet) layer: no KV cache, a state per sequence."""
        return self.linear_layers is not None and self.linear_layers[layer]

    @property
    def num_linear_layers(self) -> int:
        return 0 if self.linear_layers is None else sum(self.linear_layers)

    @property
    def has_sequence_state(self) -> bool:
        """Whether a running sequence keeps a state outside its KV blocks (a state slot): the linear-attention
        layers' (Qwen3-Next), DeepSeek-V4's window and compressors'."""
        return self.linear_layers is not None or self.v4 is not None

    def state_bytes_per_sequence(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state over all layers (0 without one): linear attention's, or
        DeepSeek-V4's sliding window and pending compressor rows."""
        if self.v4 is not None:
            return self.v4.state_bytes(self.head_dim, dtype)
        la = self.linear_attention
        return 0 if la is None else self.num_linear_layers * la.state_bytes(dtype)

    @property
    def rope_dim(self) -> int:
        """Dims of each head that are rotated (the first ones; the rest pass through)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def top_k(self) -> int:
        return self.router.top_k

    @property
    def v_dim(self) -> int:
        """Size of each value head (MiMo-V2-Flash's are narrower than its query/key heads)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def kv_heads(self, layer: int) -> int:
        """Key/value heads of one layer (MiMo-V2-Flash's sliding layers have twice its full layers')."""
        return self.num_kv_heads if self.layer_kv_heads is None else self.layer_kv_heads[layer]

    def has_sinks(self, layer: int) -> bool:
        return self.attention_sinks and (self.sink_layers is None or self.sink_layers[layer])

    def kv_values(self, layer: int) -> int:
        """Values the KV cache keeps per token in one layer: keys and values of every kv head, or MLA's
        latent plus its roped key (576 for DeepSeek-V3's shape instead of 2 x 128 x 128 = 32,768)."""
        if self.mla is not None:
            return self.mla.cache_width + self.mla.index_head_dim * self.mla.runs_indexer(layer)
        if self.v4 is not None:  # its entries (and index entries) in pages of 16 tokens (V4Config.page_values)
            r, width = self.v4.rate(layer), self.head_dim + self.v4.index_head_dim * self.v4.is_csa(layer)
            return 0 if not r else self.v4.entries_per_page(r, 16) * width // 16
        if self.is_linear(layer):
            return 0
        return self.kv_heads(layer) * (self.head_dim + self.v_dim)

    @property
    def kv_values_per_token_layer(self) -> int:
        """kv_values of the first layer: of every layer, but in MiMo-V2-Flash's."""
        return self.kv_values(0)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV cache bytes per token over all layers (what a KV budget divides by; the planner's input)."""
        return sum(self.kv_values(i) for i in range(self.num_layers)) * dtype.itemsize

    # -- sizes and per-token costs: counted as MoEForCausalLM builds the model (models/moe_decoder.py,
    # models/mla.py), they are the planner's inputs (planner/perf.py, planner/search.py) --

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is routed experts."""
        return sum(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        """Layers with a dense MLP instead (first_k_dense_replace, mlp_only_layers, decoder_sparse_step)."""
        return self.num_layers - self.num_moe_layers

    def attention_weights(self, layer: int) -> int:
        """Matmul weights one token passes through in one layer's attention: q, k, v and o
        projections, or MLA's query, latent, absorbed up-projection (kv_b_proj) and output."""
        D, N = self.hidden_size, self.num_heads
        if self.v4 is not None:
            return v4_attention_weights(self.v4, layer, D, N, self.head_dim)
        if self.is_linear(layer):  # (the convolution and the gated norm are not matmuls)
            la = self.linear_attention
            v = la.value_heads * la.value_dim
            return D * (la.conv_dim + v + 2 * la.value_heads) + v * D
        if self.mla is None:
            return D * (self.q_size * (1 + self.attn_output_gate) + self._kv_width(layer)) + N * self.v_dim * D
        m = self.mla
        q = D * N * m.qk_head_dim if m.q_lora_rank is None else D * m.q_lora_rank + m.q_lora_rank * N * m.qk_head_dim
        index = (m.q_lora_rank * m.index_heads * m.index_head_dim + D * (m.index_head_dim + m.index_heads)
                 if m.runs_indexer(layer) else 0)  # (DSA's indexer: wq_b, wk, weights_proj)
        return (q + D * m.cache_width + N * m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim) + N * m.v_head_dim * D
                + index)

    def _kv_width(self, layer: int) -> int:
        """Outputs of one layer's k and v projections together."""
        return self.kv_heads(layer) * (self.head_dim + self.v_dim)

    def attention_params(self, layer: int) -> int:
        """Parameters of one layer's attention: projections and their biases, q/k norms (MLA: the
        latent norms) and the sinks of gpt-oss and MiMo-V2-Flash."""
        if self.is_linear(layer):
            return self.linear_attention.params(self.hidden_size)
        if self.v4 is not None:
            return v4_attention_params(self.v4, layer, self.hidden_size, self.num_heads, self.head_dim)
        n = self.attention_weights(layer)
        if self.mla is None:
            n += ((self.q_size * (1 + self.attn_output_gate) + self._kv_width(layer)) * self.qkv_bias
                  + self.hidden_size * self.o_bias)
            n += {"per_head": 2 * self.head_dim, "full": self.q_size + self.kv_size}.get(self.qk_norm, 0)
            return n + self.num_heads * self.has_sinks(layer)
        m = self.mla
        if m.q_lora_rank is not None:
            n += m.q_lora_rank * (1 + self.qkv_bias)  # q_a_layernorm, q_a_proj's bias
        n += 2 * m.index_head_dim * m.runs_indexer(layer)  # the indexer's k_norm (LayerNorm: weight, bias)
        return n + m.cache_width * self.qkv_bias + m.kv_lora_rank + self.hidden_size * self.o_bias

    def _mlp_params(self, inter: int) -> int:
        """A SwiGLU MLP of `inter` (a dense layer's or a shared expert), biases with mlp_bias."""
        return 3 * self.hidden_size * inter + (2 * inter + self.hidden_size) * self.mlp_bias

    def dense_mlp_params(self) -> int:
        """One dense layer's MLP."""
        return self._mlp_params(self.intermediate_size)

    def moe_block_params(self) -> int:
        """What one MoE layer holds besides its routed experts: the router (weight, gpt-oss's bias,
        the correction bias) and the shared expert with Qwen2-MoE's gate."""
        D, E, S = self.hidden_size, self.num_experts, self.shared_expert_intermediate_size
        router = E * D + E * self.router.bias + E * self.router.correction_bias
        return router + (self._mlp_params(S) + D * self.shared_expert_gate if S else 0)

    def expert_params(self) -> int:
        """One routed expert of one layer: gate, up and down (and gpt-oss's biases)."""
        D, I = self.hidden_size, self.moe_intermediate_size
        return 3 * D * I + (2 * I + D) * self.expert_bias

    def embedding_params(self) -> int:
        """Token embedding and LM head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def non_expert_params(self) -> int:
        """Everything but the routed experts (what an attention worker holds): embeddings, LM head,
        final norm and every layer's norms, attention, dense MLP or router and shared expert."""
        layers = sum(2 * self.hidden_size + self.attention_params(i) for i in range(self.num_layers))
        head = 0
        if self.v4 is not None:  # hc_head; hash-routed layers hold tid2eid (V, K) instead of the correction bias
            head = (self.v4.hc_mult * (self.v4.hc_mult * self.hidden_size + 1) + 1
                    + sum(self.v4.hash_layers) * (self.vocab_size * self.top_k - self.num_experts))
        return (self.embedding_params() + self.hidden_size + layers + head
                + self.num_dense_layers * self.dense_mlp_params() + self.num_moe_layers * self.moe_block_params())

    def total_params(self) -> int:
        return self.non_expert_params() + self.num_moe_layers * self.num_experts * self.expert_params()

    def non_expert_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of non_expert_params in `dtype`; the correction bias stays float32 (Router._apply), and so
        do DeepSeek-V4's norms, mHC and compressors (v4_wide_params; its token tables are int64)."""
        fp32_bias = self.num_moe_layers * self.num_experts * self.router.correction_bias
        wide = 0
        if self.v4 is not None:
            fp32, int64 = v4_wide_params(self.v4, self.hidden_size, self.num_heads, self.head_dim, self.vocab_size,
                                         self.top_k)
            fp32_bias -= sum(self.v4.hash_layers) * self.num_experts  # (hash layers have none)
            wide = fp32 * (4 - dtype.itemsize) + int64 * (8 - dtype.itemsize)
        return self.non_expert_params() * dtype.itemsize + fp32_bias * (4 - dtype.itemsize) + wide

    def expert_bytes(self, dtype: torch.dtype, quantization: str | None = None) -> int:
        """Bytes of one routed expert in `dtype` (FP8 and MXFP4 checkpoints are dequantised on load).
        quantization="int8" or "w8a8_int8" (EngineConfig.quantization): one byte per weight plus a float32 scale per
        output channel of gate and up (2 x moe_intermediate_size) and down (hidden_size), biases in
        `dtype`; kernels/int8.py pads each matrix to panels of 16 channels and an even input on top.
        "fp8": one byte per weight plus a float32 scale per 16 output rows (a panel) per block of
        inputs (kernels/fp8_weights.py; the checkpoint's blocks, or 128 x 128 quantised at load).
        "mxfp4": half a byte per weight plus an E8M0 byte per row and 32 inputs (kernels/
        mxfp4_weights.py; its panels pad rows to multiples of 16 on top)."""
        if quantization is None:
            return self.expert_params() * dtype.itemsize
        if quantization not in ("int8", "w8a8_int8", "fp8", "mxfp4"):
            raise ValueError(f"expert_bytes: quantization {quantization!r} is not supported "
                             "(int8, w8a8_int8, fp8, mxfp4 or None)")
        D, I = self.hidden_size, self.moe_intermediate_size
        channels = 2 * I + D
        biases = channels * self.expert_bias * dtype.itemsize
        if quantization in ("int8", "w8a8_int8"):
            return 3 * D * I + 4 * channels + biases
        if quantization == "mxfp4":
            return 3 * D * I // 2 + 3 * D * I // 32 + biases
        bi = (self.fp8_block or (128, 128))[1]
        panel_blocks = 2 * -(-I // 16) * -(-D // bi) + -(-D // 16) * -(-I // bi)
        return 3 * D * I + 4 * panel_blocks + biases

    def context_flops(self) -> int:
        """FLOPs of one query token against one cached token in one layer: scores and the weighted
        sum over per-head keys and values, or (MLA, absorbed) over the latent and roped key, plus
        DSA's index scores (averaged over the layers that run an indexer; the attention itself is
        counted over every cached token, an upper bound past index_topk). DeepSeek-V4: what grows with
        the context past its window and index_topk (HCA's entries, CSA's index scores), per cached token
        averaged over the layers (v4_context_flops has the whole cost)."""
        if self.v4 is not None:
            v4, N, H = self.v4, self.num_heads, self.head_dim
            per = sum(4 * N * H / v4.rate(i) if v4.layer_types[i] == "hca" else
                      2 * v4.index_heads * v4.index_head_dim / v4.rate(i) if v4.is_csa(i) else 0
                      for i in range(self.num_layers))
            return round(per / self.num_layers)
        if self.mla is None:
            return 2 * self.num_heads * (self.head_dim + self.v_dim)
        m = self.mla
        indexed = sum(m.runs_indexer(i) for i in range(self.num_layers)) / self.num_layers if m.index_topk else 0
        return 2 * self.num_heads * (m.cache_width + m.kv_lora_rank) + round(indexed * 2 * m.index_heads * m.index_head_dim)

    def attention_flops_per_token(self, context: int) -> int:
        """FLOPs (multiply-adds x 2) of one decoded token's attention over all layers, projections
        included, against `context` cached tokens: MLA decodes in the latent space (the absorbed
        query and output projections, then scores over latent + roped key and a weighted sum of
        latents), other families attend with per-head keys and values; linear-attention layers
        update and read their state whatever the context."""
        if self.v4 is not None:
            return sum(2 * self.attention_weights(i) + v4_context_flops(self.v4, i, context, self.num_heads,
                                                                        self.head_dim) for i in range(self.num_layers))
        la, linear = self.linear_attention, self.num_linear_layers
        state = 0 if la is None else 2 * 3 * la.value_heads * la.key_dim * la.value_dim  # decay, read, write, output
        return (sum(2 * self.attention_weights(i) for i in range(self.num_layers))
                + (self.num_layers - linear) * context * self.context_flops() + linear * state)

    def non_expert_flops_per_token(self, context: int = 0) -> int:
        """FLOPs of one token through every layer but its routed experts (an attention worker's
        compute): attention as attention_flops_per_token, dense MLPs, routers and shared experts.
        The LM head is not included."""
        D, S = self.hidden_size, self.shared_expert_intermediate_size
        moe = self.num_experts * D + 3 * D * S + D * (self.shared_expert_gate and S > 0)
        return (self.attention_flops_per_token(context) + 2 * self.num_dense_layers * 3 * D * self.intermediate_size
                + 2 * self.num_moe_layers * moe)

    def expert_flops_per_pair(self) -> int:
        """FLOPs of one (token, expert) pair through one routed expert."""
        return 2 * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest context served: max_position_embeddings, extended by linear, dynamic and yarn
        scaling (as vLLM derives it)."""
        r = self.rope
        if r.rope_type in ("linear", "dynamic") and r.factor:
            return max(self.max_position_embeddings, int(self.max_position_embeddings * r.factor))
        if r.rope_type == "yarn" and r.factor:
            base = r.original_max_position_embeddings or self.max_position_embeddings
            return max(self.max_position_embeddings, int(base * r.factor))
        return self.max_position_embeddings

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, planning: bool = False) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: file not found (a checkpoint directory needs config.json)")
        return cls.from_dict(read_config_json(path), source=str(path), planning=planning)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json", planning: bool = False) -> "ModelConfig":
        """planning: also accept PLANNED_ARCHITECTURES (sizes for the planner; the engine cannot build them)."""
        return _parse(raw, source, planning)


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A config.json as a dict; ConfigError naming the file if it is not a JSON object."""
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return raw


def _parse(raw: dict[str, Any], src: str, planning: bool = False) -> ModelConfig:
    def get(key: str, default: Any = None, *aliases: str) -> Any:
        for k in (key, *aliases):
            if raw.get(k) is not None:
                return raw[k]
        return default

    def need(key: str, *aliases: str) -> Any:
        value = get(key, None, *aliases)
        if value is None:
            raise ConfigError(f"{src}: required field '{key}' is missing")
        return value

    archs = raw.get("architectures") or []
    known = {**ARCHITECTURES, **PLANNED_ARCHITECTURES} if planning else ARCHITECTURES
    types = {**MODEL_TYPES, **PLANNED_MODEL_TYPES} if planning else MODEL_TYPES
    arch = next((a for a in archs if a in known), types.get(raw.get("model_type")))
    if arch is None:
        raise ConfigError(
            f"{src}: architectures {archs} is not supported; supported: {', '.join(sorted(known))}"
        )
    family = known[arch]
    if family == "dbrx":
        raw = families.dbrx_fields(raw, src)
    if family in ("llama4", "qwen3_5_moe"):
        raw = families.text_config(raw, family, src)
    raw = {**families.DEFAULTS.get(family, {}), **raw}  # (a field present as null keeps its generic default)
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{src}: hidden_act={act!r} is not supported (only 'silu')")

    hidden, layers, heads = int(need("hidden_size")), int(need("num_hidden_layers")), int(need("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads", heads))
    mla = read_mla(raw, family, layers, src) if family in MLA_FAMILIES else None
    head_dim = mla.qk_rope_head_dim if mla else int(get("head_dim", hidden // heads))  # MLA: the rotary dim
    if heads % kv_heads:
        raise ConfigError(f"{src}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if head_dim % 2:
        raise ConfigError(f"{src}: head_dim ({head_dim}) must be even for rotary embeddings")
    num_experts = int(need("num_local_experts", "num_experts", "n_routed_experts"))
    top_k = int(need("num_experts_per_tok"))
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"{src}: num_experts_per_tok ({top_k}) must be in [1, num_experts={num_experts}]")
    router = _router(raw, family, num_experts, top_k, src)
    max_pos = int(get("max_position_embeddings", 4096))
    rope_of = lambda params: read_rope({"rope_parameters": params}, family, max_pos, src)  # noqa: E731
    extra = families.FIELDS[family](raw, layers, src, rope_of) if family in families.FIELDS else {}
    if "linear_attention" in extra:
        extra["linear_attention"] = LinearAttentionConfig(**extra["linear_attention"])
    if "v4" in extra:
        extra["v4"] = V4Config(**extra["v4"])

    shared_inter = int(get("shared_expert_intermediate_size", 0)) if family == "qwen2_moe" else 0
    if extra:
        moe_layers, moe_inter = extra["moe_layers"], extra["moe_intermediate_size"]
    elif family in ("mixtral", "minimax_m2", "gpt_oss", "dbrx"):
        moe_layers = (True,) * layers
        moe_inter = int(need("intermediate_size"))
    elif mla or family == "glm4_moe":  # dense MLPs before first_k_dense_replace, MoE after (as transformers builds them)
        first_dense = int(get("first_k_dense_replace", 3 if family in DSA_FAMILIES else 1 if family == "glm4_moe"
                                  else 0))
        moe_layers = tuple(i >= first_dense for i in range(layers))
        if family in DSA_FAMILIES and raw.get("mlp_layer_types") is not None:  # (it wins over first_k_dense_replace)
            types = families.layer_types(raw, "mlp_layer_types", ["dense"] * layers, ("dense", "sparse"), src)
            moe_layers = tuple(t == "sparse" for t in types)
        moe_inter = int(need("moe_intermediate_size"))
        shared_inter = moe_inter * int(get("n_shared_experts", 2 if family == "deepseek_v2" else 1))
    else:
        step = int(get("decoder_sparse_step", 1))
        mlp_only = set(get("mlp_only_layers", []))
        moe_layers = tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(layers))
        moe_inter = int(need("moe_intermediate_size")) if family != "olmoe" else int(need("intermediate_size"))
    dtype_name = str(get("dtype", "float32", "torch_dtype")).replace("torch.", "")
    if dtype_name not in DTYPES:
        raise ConfigError(f"{src}: dtype {dtype_name!r} is not supported; supported: {', '.join(DTYPES)}")
    eos = get("eos_token_id", [])
    rope = extra.pop("rope") if "rope" in extra else read_rope(raw, family, max_pos, src)
    rotary_dim = extra.pop("rotary_dim") if "rotary_dim" in extra else read_rotary_dim(raw, family, head_dim, src)
    oss = family == "gpt_oss"
    bias = bool(get("attention_bias", oss))  # gpt-oss's default is True
    mxfp4 = is_mxfp4(raw.get("quantization_config"), family, src)
    if mxfp4 and (hidden % 32 or moe_inter % 32):  # (each block packs 32 values along the input dim)
        raise ConfigError(f"{src}: MXFP4 experts need hidden_size ({hidden}) and intermediate_size ({moe_inter}) "
                          f"to be multiples of 32")
    return ModelConfig(**{**dict(
        architecture=arch,
        family=family,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(get("intermediate_size", moe_inter)),
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared_inter,
        shared_expert_gate=family == "qwen2_moe",
        num_experts=num_experts,
        router=router,
        moe_layers=moe_layers,
        sliding_windows=read_sliding_windows(raw, family, layers, src),
        qkv_bias=bool(get("qkv_bias", True)) if family == "qwen2_moe" else bias,
        o_bias=family in ("qwen3_moe", "olmoe", "gpt_oss", "llama4", *MLA_FAMILIES) and bias,  # GLM: q/k/v only
        mlp_bias=family == "deepseek_v2" and bool(get("mlp_bias", False)),
        qk_norm=("per_head" if get("use_qk_norm", False) else "none") if family == "glm4_moe" else
                {"qwen3_moe": "per_head", "olmoe": "full", "minimax_m2": "full"}.get(family, "none"),
        clip_qkv=get("clip_qkv") if family in ("olmoe", "dbrx") else None,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope=rope,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        dtype=DTYPES[dtype_name],
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
        bos_token_id=get("bos_token_id"),
        mla=with_mla_scale(mla, rope) if mla else None,
        # any family: `shuttle train --mtp-layers 1` gives a Mixtral, Qwen3, ... checkpoint one
        num_mtp_layers=int(get("num_nextn_predict_layers", 0, "num_mtp_layers")),
        fp8_block=read_fp8_block(raw.get("quantization_config"), src),
        **read_fp8_formats(raw, family, src),
        rotary_dim=rotary_dim,
        attention_sinks=oss,
        expert_bias=oss,
        expert_act=SwiGLU(float(get("swiglu_alpha", 1.702)), float(get("swiglu_limit", 7.0)), 1.0) if oss else SILU,
        mxfp4=mxfp4,
    ), **extra})


def _router(raw: dict[str, Any], family: str, num_experts: int, top_k: int, src: str) -> RouterConfig:
    """The router of a family as transformers defines it (DeepSeek fields as V2/V3 configs spell them)."""
    if family == "minimax_m2":  # sigmoid, chosen with the correction bias, always renormalised
        # (use_routing_bias false: checkpoints without the bias, which transformers then reads as zeros)
        return RouterConfig(top_k, "sigmoid", renormalize=True, correction_bias=bool(raw.get("use_routing_bias", True)),
                            weights_fp32=True)
    if family == "llama4":  # sigmoid of the top-k logits, not renormalised, in the activations' dtype
        return RouterConfig(top_k, "sigmoid")
    if family == "gpt_oss":  # softmax of the top-k biased logits, weights in the activations' dtype
        return RouterConfig(top_k, "softmax", renormalize=True, bias=True)
    if family not in (*MLA_FAMILIES, *V3_ROUTER_FAMILIES):
        # (Qwen3.5-MoE's router always renormalises: transformers does not read norm_topk_prob)
        return RouterConfig(top_k, "softmax", renormalize=family in ("mixtral", "qwen3_5_moe")
                            or bool(raw.get("norm_topk_prob", False)),
                            weights_fp32=family == "mixtral")
    v3 = family in V3_ROUTER_FAMILIES
    # (transformers reads neither field: always sigmoid, noaux_tc)
    glm = family in ("glm4_moe", "glm_moe_dsa", "mimo_v2_flash")
    scoring = (None if glm else raw.get("scoring_func")) or ("sigmoid" if v3 else "softmax")
    method = (None if glm else raw.get("topk_method")) or ("noaux_tc" if v3 else "greedy")
    known = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"{src}: scoring_func={scoring!r} is not supported; supported: softmax, sigmoid")
    if method not in known:
        raise ConfigError(f"{src}: topk_method={method!r} is not supported by {family}; supported: {', '.join(known)}")
    grouped = v3 or method == "group_limited_greedy"
    groups = int(raw.get("n_group") or 1) if grouped else 1
    topk_groups = int(raw.get("topk_group") or 1) if grouped else 1
    if num_experts % groups:
        raise ConfigError(f"{src}: n_group ({groups}) must divide n_routed_experts ({num_experts})")
    if not 1 <= topk_groups <= groups:
        raise ConfigError(f"{src}: topk_group ({topk_groups}) must be in [1, n_group={groups}]")
    if v3 and groups > 1 and num_experts // groups < 2:  # a group scores as the sum of its top 2 experts
        raise ConfigError(f"{src}: n_group ({groups}) leaves {num_experts // groups} expert per group of "
                          f"n_routed_experts={num_experts}; each group's score sums its top 2, so groups need >= 2")
    if top_k > topk_groups * (num_experts // groups):
        raise ConfigError(f"{src}: num_experts_per_tok ({top_k}) exceeds the {topk_groups * (num_experts // groups)} "
                          f"experts of topk_group={topk_groups} groups of {num_experts // groups}")
    # transformers' V2 router never renormalises (norm_topk_prob is read by V3 only)
    return RouterConfig(top_k, scoring, renormalize=v3 and bool(raw.get("norm_topk_prob", True)), num_groups=groups,
                        topk_groups=topk_groups, group_score="top2_sum" if v3 else "max",
                        scaling=float(raw.get("routed_scaling_factor") or (2.5 if family in ("deepseek_v3", *DSA_FAMILIES) else 1.0)),
                        correction_bias=v3, logits_fp32=True, weights_fp32=True)
