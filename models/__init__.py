"""One MoE decoder definition (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) and Hugging Face checkpoint loading."""
from models.config import ARCHITECTURES, ConfigError, ModelConfig
from models.loader import CheckpointError, load_model
from models.moe_decoder import MoEForCausalLM

__all__ = ["ARCHITECTURES", "ConfigError", "ModelConfig", "CheckpointError", "load_model", "MoEForCausalLM"]
