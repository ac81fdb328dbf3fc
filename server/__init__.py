"""Shuttle's front end: offline `LLM`, the `shuttle` command, and (later) the HTTP and gRPC servers."""
from attention_nodes.sampling_params import SamplingParams
from server.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
