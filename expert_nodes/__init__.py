"""Expert workers: hold the experts of every MoE layer placed on them and serve M2N slots
(worker.py). The expert math is kernels.moe / models.moe_decoder.Experts, the same as colocated."""
