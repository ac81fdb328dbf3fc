"""Rotary position embedding (RoPE) with the scaling types of Hugging Face checkpoints.

Legend: T tokens, N heads, H head dim.
Inverse frequencies are computed in float32 exactly as transformers computes them, so cos/sin
tables match bit for bit and greedy decoding agrees with the reference.
"""
import math
from dataclasses import dataclass

import torch

from kernels import native

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters as read from config.json (`rope_parameters`, or `rope_theta` + `rope_scaling`).

    rope_type: one of ROPE_TYPES. factor: the scaling factor (linear, dynamic, yarn, llama3).
    max_position_embeddings: the model's context length (dynamic NTK scales beyond it).
    original_max_position_embeddings: the pre-extension context (yarn, llama3).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    max_position_embeddings: int = 2048
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None


def _base_inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(cfg: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    orig = cfg.original_max_position_embeddings or cfg.max_position_embeddings
    factor = cfg.factor if cfg.factor is not None else cfg.max_position_embeddings / orig

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = cfg.attention_factor
    if attention_factor is None:
        if cfg.mscale and cfg.mscale_all_dim:
            attention_factor = get_mscale(factor, cfg.mscale) / get_mscale(factor, cfg.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = cfg.beta_fast or 32, cfg.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(cfg.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = cfg.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def _llama3(cfg: RopeConfig, dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(cfg.theta, dim)
    factor, low_ff, high_ff = cfg.factor, cfg.low_freq_factor, cfg.high_freq_factor
    old_ctx = cfg.original_max_position_embeddings or cfg.max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_ctx / low_ff, old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def inv_freq_and_scale(cfg: RopeConfig, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, dim/2) and the factor that multiplies cos and sin.

    seq_len matters only for "dynamic" (NTK-aware scaling grows theta past the trained context).
    """
    if cfg.rope_type == "default":
        return _base_inv_freq(cfg.theta, dim), 1.0
    if cfg.rope_type == "linear":
        return _base_inv_freq(cfg.theta, dim) / cfg.factor, 1.0
    if cfg.rope_type == "dynamic":
        max_pos = cfg.max_position_embeddings
        if seq_len is None or seq_len <= max_pos:
            return _base_inv_freq(cfg.theta, dim), 1.0
        n = torch.tensor(seq_len)  # tensor math in float32, as transformers does
        base = cfg.theta * ((cfg.factor * n / max_pos) - (cfg.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if cfg.rope_type == "yarn":
        return _yarn(cfg, dim)
    if cfg.rope_type == "llama3":
        return _llama3(cfg, dim), 1.0
    raise ValueError(f"unsupported rope type {cfg.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


class RotaryEmbedding:
    """cos/sin lookup by position. Tables are float32 and grow on demand (doubling); "dynamic"
    scaling depends on the sequence's length, so it is computed per call instead.
    """

    def __init__(self, cfg: RopeConfig, head_dim: int, device: torch.device | str = "cpu"):
        self.cfg, self.dim, self.device = cfg, head_dim, torch.device(device)
        self._cos = self._sin = torch.empty(0, head_dim, device=self.device)

    def _table(self, positions: torch.Tensor, seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scale = inv_freq_and_scale(self.cfg, self.dim, seq_len)
        freqs = positions.float().cpu()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1).to(self.device)
        return emb.cos() * scale, emb.sin() * scale

    def tables(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The float32 (positions, head_dim) cos and sin tables, grown to hold positions < max_pos, that
        __call__ indexes (None for "dynamic" scaling, which has none)."""
        if self.cfg.rope_type == "dynamic":
            return None
        if max_pos > self._cos.shape[0]:
            self._cos, self._sin = self._table(torch.arange(max(max_pos, 2 * self._cos.shape[0], 256)), None)
        return self._cos, self._sin

    def __call__(self, positions_T: torch.Tensor, dtype: torch.dtype,
                 seq_lens_T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (cos_TH, sin_TH) in `dtype` for the given int64 positions.

        seq_lens_T: the length of each token's sequence; "dynamic" scaling depends on it, so each
        sequence gets the frequencies of its own length, whatever else is in the batch.
        """
        if self.cfg.rope_type == "dynamic" and positions_T.numel():
            seq_lens_T = positions_T + 1 if seq_lens_T is None else seq_lens_T
            cos = torch.empty(positions_T.shape[0], self.dim, device=self.device)
            sin = torch.empty_like(cos)
            for n in seq_lens_T.unique().tolist():  # one group per distinct sequence length
                sel = seq_lens_T == n
                cos[sel], sin[sel] = self._table(positions_T[sel], n)
            return cos.to(dtype), sin.to(dtype)
        if not positions_T.numel():
            return (torch.empty(0, self.dim, device=self.device, dtype=dtype),) * 2
        cos, sin = self.tables(int(positions_T.max()) + 1)
        return cos[positions_T].to(dtype), sin[positions_T].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    q_TNH: torch.Tensor, k_TKH: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (neox layout: the two halves of the head dim pair up). Returns new tensors."""
    cos, sin = cos_TH[:, None, :], sin_TH[:, None, :]
    return q_TNH * cos + _rotate_half(q_TNH) * sin, k_TKH * cos + _rotate_half(k_TKH) * sin


def _native(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return native.eager_cpu(q, k, cos, sin) and native.rotary_takes(q, k, cos, sin)


def apply_rotary_(
    q_TNH: torch.Tensor, k_TKH: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary, written back into q and k (which may be strided views). Returns (q, k).

    On the CPU, outside autograd and torch.compile, bf16/float32 tensors of one dtype go to one native
    call (kernels/native.rotary_, kernels/csrc/rotary.c) that rounds where these ops round."""
    if _native(q_TNH, k_TKH, cos_TH, sin_TH):
        native.rotary_(q_TNH, k_TKH, cos_TH, sin_TH)
        # written through their data pointers: say so, as copy_ would, so that autograd refuses a
        # backward that saved q or k before they were rotated
        torch.autograd.graph.increment_version((q_TNH, k_TKH))
        return q_TNH, k_TKH
    q_rot, k_rot = apply_rotary(q_TNH, k_TKH, cos_TH, sin_TH)
    return q_TNH.copy_(q_rot), k_TKH.copy_(k_rot)
