"""Expert workers: hold the experts of every MoE layer placed on them and serve M2N slots.
Built by the disaggregation issue; the expert math lives in kernels.moe and models.moe_decoder.Experts."""
