"""Block-quantised FP8 weights (the format DeepSeek-V3/R1 and Kimi K2 are published in).

Legend: O output features, I input features; a weight (O, I) is cut into blocks of bo x bi (128 x 128
in those checkpoints; edge blocks are partial when O or I is not a multiple), each with one float32
`weight_scale_inv`: the real weight is fp8_value * scale_inv.
"""
import torch

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
