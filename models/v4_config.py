"""DeepSeek-V4's shape (V4Config: models/deepseek_v4.py builds its layers) and the planner's formulas
for its attention: weights, parameters and the FLOPs of attending at a given context."""
from dataclasses import dataclass

import torch

from kernels.rotary import RopeConfig


@dataclass(frozen=True)
class V4Config:
    """DeepSeek-V4's attention and residual: layer_types per layer ("sliding", "csa" or "hca"),
    their rates, the window, rope dims (the last rope_dim of each head), the query's low rank, the
    grouped output projection, the lightning indexer, the compressed layers' rope, mHC and the
    hash-routed layers (experts chosen by a token-id table, mlp.gate.tid2eid)."""

    layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    window: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    compress_rope: RopeConfig
    hc_mult: int
    hc_iters: int
    hc_eps: float
    hash_layers: tuple[bool, ...]

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of `layer` (0: a sliding layer, no compressor)."""
        return {"sliding": 0, "csa": self.csa_rate, "hca": self.hca_rate}[self.layer_types[layer]]

    def is_csa(self, layer: int) -> bool:
        return self.layer_types[layer] == "csa"

    @staticmethod
    def entries_per_page(rate: int, page_size: int) -> int:
        return max(1, page_size // rate)

    def page_values(self, head_dim: int, page_size: int) -> int:
        """Values one page holds over all layers: the entries (and CSA's index entries)."""
        return sum(self.entries_per_page(self.rate(i), page_size) * (head_dim + self.index_head_dim * self.is_csa(i))
                   for i in range(len(self.layer_types)) if self.rate(i))

    def state_rows(self, layer: int) -> int:
        """Compressor rows a sequence keeps in `layer`: the pending window, and CSA's last complete one."""
        return self.rate(layer) * (1 + self.is_csa(layer))

    def state_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        """One sequence's state over all layers: the window's rows in `dtype`, the compressors' rows
        (kv and gate, float32)."""
        n = 0
        for i in range(len(self.layer_types)):
            n += self.window * head_dim * dtype.itemsize
            if self.rate(i):
                width = 2 * head_dim if self.is_csa(i) else head_dim
                n += 2 * 4 * self.state_rows(i) * width
                if self.is_csa(i):
                    n += 2 * 4 * self.state_rows(i) * 2 * self.index_head_dim
        return n


def v4_attention_weights(v4: V4Config, layer: int, D: int, N: int, H: int) -> int:
    """Matmul weights one token passes through in one layer's attention and hyper-connections: q_a,
    q_b, kv, o_a, o_b, the compressor's kv and gate, the indexer's (CSA) and both mHC maps."""
    n, I, Hi = v4.hc_mult, v4.index_head_dim, v4.index_heads
    w = D * v4.q_lora_rank + v4.q_lora_rank * N * H + D * H + N * H * v4.o_lora_rank + v4.o_groups * v4.o_lora_rank * D
    if v4.rate(layer):
        w += 2 * D * H * (1 + v4.is_csa(layer))
    if v4.is_csa(layer):
        w += 4 * D * I + v4.q_lora_rank * Hi * I + D * Hi
    return w + 2 * (2 + n) * n * n * D


def v4_attention_params(v4: V4Config, layer: int, D: int, N: int, H: int) -> int:
    """Parameters of one layer's attention and mHC: v4_attention_weights plus the norms, sinks,
    position biases and the mHC biases and scales."""
    n, r, I = v4.hc_mult, v4.rate(layer), v4.index_head_dim
    p = v4_attention_weights(v4, layer, D, N, H) + v4.q_lora_rank + H + N + 2 * ((2 + n) * n + 3)
    if r:
        p += r * H * (1 + v4.is_csa(layer)) + H
    if v4.is_csa(layer):
        p += r * 2 * I + I
    return p


def v4_context_flops(v4: V4Config, layer: int, context: int, N: int, H: int) -> int:
    """FLOPs of one decoded token's attention in `layer` past its projections, at `context` cached
    tokens: scores and the weighted sum (keys are values) over the window and the entries it reads
    (HCA all, CSA at most index_topk), and the indexer's scores over every CSA entry."""
    r = v4.rate(layer)
    keys = min(v4.window, context + 1)
    entries = context // r if r else 0
    if v4.is_csa(layer):
        keys += min(v4.index_topk, entries)
        return 4 * N * H * keys + 2 * v4.index_heads * v4.index_head_dim * entries
    return 4 * N * H * (keys + entries)


def v4_wide_params(v4: V4Config, D: int, N: int, H: int, vocab: int, top_k: int) -> tuple[int, int]:
    """(float32 parameters, int64 ones) a DeepSeek-V4 model keeps whatever its dtype: the kv and q norms,
    sinks, mHC maps and hc_head, the compressors' and indexers' projections, position biases and norms,
    the indexers' weights_proj (transformers keeps them float32); the hash layers' tid2eid tables."""
    n, I = v4.hc_mult, v4.index_head_dim
    fp32 = n * n * D + n + 1  # hc_head
    for layer in range(len(v4.layer_types)):
        fp32 += v4.q_lora_rank + H + N + 2 * ((2 + n) * n * n * D + (2 + n) * n + 3)
        r = v4.rate(layer)
        if r:
            F = H * (1 + v4.is_csa(layer))
            fp32 += 2 * D * F + r * F + H
        if v4.is_csa(layer):
            fp32 += 2 * D * 2 * I + r * 2 * I + I + D * v4.index_heads
    return fp32, sum(v4.hash_layers) * vocab * top_k

