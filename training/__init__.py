"""Companion training module: trains models.MoEForCausalLM with the same kernels; built by the training issue."""
