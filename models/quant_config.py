"""The quantization_config of a checkpoint's config.json, as ModelConfig reads it: FP8 block-quantised
weights (DeepSeek-V3/R1, Kimi K2, MiniMax-M2; DeepSeek-V4's UE8M0 scales and packed FP4 experts) and
gpt-oss's MXFP4 experts. Errors name the file and the field."""
from typing import Any

from models.errors import ConfigError


def is_mxfp4(quant: Any, family: str, src: str) -> bool:
    """quantization_config.quant_method mxfp4 (gpt-oss's published format: experts as *_blocks / *_scales)."""
    if not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4":
        return False
    if family != "gpt_oss":
        raise ConfigError(f"{src}: quantization_config.quant_method='mxfp4' is supported for gpt-oss checkpoints only")
    return True


def read_fp8_block(quant: Any, src: str) -> tuple[int, int] | None:
    """quantization_config of FP8 block-quantised checkpoints (quant_method fp8, weight_block_size)."""
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ConfigError(f"{src}: quantization_config must be an object")
    method = quant.get("quant_method")
    if method == "mxfp4":
        return None  # (see is_mxfp4)
    if method != "fp8":
        raise ConfigError(f"{src}: quantization_config.quant_method={method!r} is not supported (only 'fp8' with "
                          f"weight_block_size, and 'mxfp4' for gpt-oss)")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{src}: quantization_config.weight_block_size must be two positive ints, got {block!r} "
                          f"(per-tensor FP8 scales are not supported)")
    fmt = quant.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # (DeepSeek spells it e4m3, MiniMax-M2 float8_e4m3fn)
        raise ConfigError(f"{src}: quantization_config.fmt={fmt!r} is not supported (only 'e4m3')")
    return int(block[0]), int(block[1])


def read_fp8_formats(raw: dict[str, Any], family: str, src: str) -> dict[str, Any]:
    """An FP8 quantization_config's scale_fmt ("float" or "ue8m0") and expert_dtype ("fp8" or "fp4",
    DeepSeek-V4 only; V4's released config.json has it at the top level, V4.1's in quantization_config,
    as transformers reads both) as ModelConfig's fp8_scale_fmt and fp4_experts."""
    quant = raw.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return {}
    scale_fmt = quant.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise ConfigError(f"{src}: quantization_config.scale_fmt={scale_fmt!r} is not supported (only 'float' "
                          f"and 'ue8m0')")
    field, expert_dtype = "quantization_config.expert_dtype", quant.get("expert_dtype")
    if expert_dtype is None and family == "deepseek_v4":
        field, expert_dtype = "expert_dtype", raw.get("expert_dtype")
    expert_dtype = expert_dtype or "fp8"
    if expert_dtype not in ("fp8", "fp4"):
        raise ConfigError(f"{src}: {field}={expert_dtype!r} is not supported (only 'fp8' and 'fp4')")
    if expert_dtype == "fp4" and family != "deepseek_v4":
        raise ConfigError(f"{src}: {field}='fp4' (packed FP4 experts) is supported for DeepSeek-V4 checkpoints only")
    return {"fp8_scale_fmt": scale_fmt, "fp4_experts": expert_dtype == "fp4"}
