"""Shuttle's fronts: offline `LLM` and `AsyncLLM`, the OpenAI-compatible HTTP server, the gRPC server
and the `shuttle` command. They drive an Engine (attention_nodes/engine.py) and validate each
request once, where it enters."""
from attention_nodes.sampling_params import SamplingParams
from server.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
