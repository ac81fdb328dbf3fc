"""Attention workers: embedding, attention, norms, router, LM head, KV cache and sampling.

The engine (engine.py: LLMEngine) runs schedule -> execute -> update each step: the Scheduler
(scheduler.py) picks sequences and token counts within the budget, the BlockManager
(block_manager.py) hands out paged KV blocks with prefix caching, the ModelRunner (model_runner.py)
runs the model over the paged cache, and the Sampler (sampler.py) picks tokens. The ping-pong of
micro-batches over M2N comes with the disaggregation issue.
"""
