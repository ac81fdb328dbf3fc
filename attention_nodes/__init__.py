"""Attention workers: embedding, attention, norms, router, LM head, KV cache and sampling.

The engine (engine.py: LLMEngine) runs schedule -> execute -> update each step: the Scheduler
(scheduler.py) picks sequences and token counts within the budget, the BlockManager
(block_manager.py) hands out paged KV blocks with prefix caching, the ModelRunner (model_runner.py)
runs the model over the paged cache, and the Sampler (sampler.py) picks tokens. engine.py also
defines Engine, the interface every front drives (LLMEngine here; pools/engine.py's PoolEngine
over worker pools). In a pool deployment, worker.py runs an attention worker: the same engine with
its experts behind M2N, its batch split into micro-batches that ping-pong with the expert workers.
"""
