"""Block-quantised FP8 weights (the format DeepSeek-V3/R1 and Kimi K2 are published in).

Legend: O output features, I input features; a weight (O, I) is cut into blocks of bo x bi (128 x 128
in those checkpoints; edge blocks are partial when O or I is not a multiple), each with one float32
`weight_scale_inv`: the real weight is fp8_value * scale_inv.
"""
import torch

TRITON_QUANTIZATIONS = ("fp8", "mxfp4")  # the formats kernels/quant_triton.py serves (models/triton_quant.py)
FP8_BLOCK = (128, 128)  # --quantization fp8 of a float checkpoint: DeepSeek-V3's and Qwen3 FP8's blocks


def triton_fp8_supported(device: torch.device | str) -> bool:
    """Whether the Triton kernels can convert FP8 codes on `device`: compiled, on CUDA of sm_89 or newer
    (False where this process sees no CUDA: a front without the GPU); interpreted (TRITON_INTERPRET=1), on
    the CPU. (MXFP4 decodes by arithmetic on bits: any device.)"""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)  # (unknown: False)


FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def fp8_block_scale_shape(shape_OI: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """(ceil(O / bo), ceil(I / bi)): the shape of a weight's scale_inv tensor."""
    return -(-shape_OI[0] // block[0]), -(-shape_OI[1] // block[1])


def dequantize_fp8_blocks(w_OI: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w (O, I) in an FP8 dtype times its per-block scale_inv (ceil(O/bo), ceil(I/bi)) -> `dtype`.
    The product is formed in float32 (as DeepSeek's reference weight_dequant does)."""
    O, I = w_OI.shape
    s_OI = scale_inv.float().repeat_interleave(block[0], 0)[:O].repeat_interleave(block[1], 1)[:, :I]
    return (w_OI.float() * s_OI).to(dtype)


def quantize_fp8_blocks(w_OI: torch.Tensor, block: tuple[int, int] = (128, 128),
                        dtype: torch.dtype = FP8_DTYPES[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tests and tools: (fp8 weight (O, I), float32 scale_inv) with each block's
    largest magnitude mapped to the FP8 dtype's largest finite value."""
    O, I = w_OI.shape
    bo, bi = fp8_block_scale_shape((O, I), block)
    padded = w_OI.float().new_zeros(bo * block[0], bi * block[1])
    padded[:O, :I] = w_OI.float()
    blocks = padded.view(bo, block[0], bi, block[1])
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(dtype).max
    q = (blocks / scale_inv[:, None, :, None]).view_as(padded)[:O, :I].to(dtype)
    return q, scale_inv


# --- MXFP4 (OCP microscaling FP4: gpt-oss's published expert weights) ---
# Each block of 32 values along the input dim is 16 bytes of E2M1 nibbles (element 2i in the low
# nibble of byte i, 2i+1 in the high one) and one uint8 E8M0 scale: value = FP4 * 2 ** (scale - 127).
MXFP4_BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantised shape (..., G * 32) of blocks (..., G, 16)."""
    return (*blocks_shape[:-2], blocks_shape[-2] * blocks_shape[-1] * 2)


def dequantize_mxfp4(blocks_XGB: torch.Tensor, scales_XG: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (..., G, 16) uint8 and scales (..., G) uint8 -> (..., G * 32) in `dtype`: a table
    lookup per nibble and one ldexp per block (vectorised over every block at once)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks_XGB.device)
    b = blocks_XGB.to(torch.uint8)
    vals = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1)  # (..., G, 16, 2)
    vals = torch.ldexp(vals.flatten(-2), (scales_XG.to(torch.int32) - 127)[..., None].float())
    return vals.flatten(-2).to(dtype)


def quantize_mxfp4(w_XI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tests and tools: w (..., I), I a multiple of 32 -> (blocks (..., I/32, 16)
    uint8, scales (..., I/32) uint8). Each block's scale is the smallest power of two that maps its
    largest magnitude into FP4's range (6); values round to the nearest FP4 value."""
    if w_XI.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"quantize_mxfp4: the last dim ({w_XI.shape[-1]}) must be a multiple of {MXFP4_BLOCK}")
    x = w_XI.float().unflatten(-1, (-1, MXFP4_BLOCK))  # (..., G, 32)
    amax = x.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exp)[..., None]
    # the nearest magnitude's code, a tie to the smaller one (bucketize: boundaries[i - 1] < m <= boundaries[i]);
    # negative values get the sign bit, but those that round to zero are +0 (code 0)
    idx = torch.bucketize(scaled.abs(), _FP4_MIDPOINTS).to(torch.uint8)
    idx |= ((scaled < 0) & (idx > 0)).to(torch.uint8) << 3
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


# midpoints between FP4's neighbouring magnitudes (FP4_VALUES[:8]): where rounding to nearest changes code
_FP4_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in zip(FP4_VALUES[:7], FP4_VALUES[1:8])])


# --- DeepSeek-V4's released formats (quantization_config scale_fmt / expert_dtype) ---
# scale_fmt "ue8m0": each scale is one byte e, the power of two 2 ** (e - 127) (torch.float8_e8m0fnu,
# or uint8 holding the same bytes; 0xFF is NaN). expert_dtype "fp4": a routed expert's weight (O, I)
# is stored int8 (O, I / 2), two E2M1 values per byte (column 2j in the low nibble of byte j, 2j + 1
# in the high one), with one scale per row per FP4_GROUP inputs: scale_inv (O, ceil(I / 32)).
E8M0 = getattr(torch, "float8_e8m0fnu", None)
FP4_GROUP = 32


def decode_scales(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: UE8M0 bytes (float8_e8m0fnu or uint8) as 2 ** (byte - 127), float ones as they are."""
    if scale.dtype == torch.uint8 or (E8M0 is not None and scale.dtype == E8M0):
        exp = scale.view(torch.uint8).to(torch.int32) - 127
        return torch.ldexp(torch.ones(exp.shape, dtype=torch.float32, device=exp.device), exp)
    return scale.float()


def has_nan_e8m0(scale: torch.Tensor) -> bool:
    """Whether UE8M0 scales (float8_e8m0fnu or uint8) hold the NaN byte 0xFF."""
    return bool(scale.view(torch.uint8).eq(0xFF).any())


def fp4_scale_shape(packed_shape_OH: tuple[int, ...]) -> tuple[int, int]:
    """(O, ceil(I / 32)) of a packed FP4 weight (O, I / 2): its scale_inv's shape."""
    return packed_shape_OH[0], -(-2 * packed_shape_OH[1] // FP4_GROUP)


def dequantize_fp4_packed(packed_OH: torch.Tensor, scale_inv: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed FP4 (O, I / 2) int8 (or uint8) with scale_inv (O, ceil(I / 32)) (float32 or UE8M0)
    -> (O, I) in `dtype`: each E2M1 value times its group's scale, the product in float32 (as
    transformers' Fp8Dequantize and DeepSeek's reference cast)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed_OH.device)
    b = packed_OH.contiguous().view(torch.uint8)
    vals = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1).flatten(-2)  # (O, I)
    s = decode_scales(scale_inv).repeat_interleave(FP4_GROUP, -1)[..., :vals.shape[-1]]
    return (vals * s).to(dtype)
