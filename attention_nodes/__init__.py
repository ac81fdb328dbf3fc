"""Attention workers: embedding, attention, norms, router, LM head, KV cache and sampling.

Today: ModelRunner (the model, a dense KV cache, one batched forward and sample). The engine
(scheduler, paged cache) and the ping-pong over M2N come with the engine and disaggregation issues.
"""
