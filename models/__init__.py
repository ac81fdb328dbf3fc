"""One MoE decoder definition for every family Shuttle serves (config.py: ARCHITECTURES), Hugging
Face checkpoint loading, and the CPU inference paths (packed weights, the native decode step)."""
from models.config import ARCHITECTURES, ConfigError, ModelConfig
from models.checkpoint import CheckpointError
from models.loader import load_model
from models.moe_decoder import MoEForCausalLM

__all__ = ["ARCHITECTURES", "ConfigError", "ModelConfig", "CheckpointError", "load_model", "MoEForCausalLM"]
