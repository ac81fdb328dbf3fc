"""Companion training module: trains models.MoEForCausalLM (the one model definition) with the torch
reference ops' autograd, data and expert parallelism over torch.distributed, atomic Hugging Face
checkpoints that the server loads, and exact resumption under torchrun --max-restarts.

    model.py       the training op table, cache-less causal attention, init, router-logit capture
    losses.py      cross entropy, load-balancing (Switch/Mixtral) and router z-losses
    parallel.py    process groups, the all-to-all expert dispatcher, gradient reduction and clipping
    data.py        documents -> cached tokens -> packed samples -> seeded, resumable loader
    optim.py       AdamW and the warmup + cosine schedule
    checkpoint.py  HF-layout checkpoints with trainer state, written atomically
    metrics.py     FLOPs per token, measured peak, MFU, heartbeats, stragglers, the JSONL log
    trainer.py     the loop; train(cfg) runs one rank of a job
    source.py      which config, weights and tokenizer a run starts from
    config.py      TrainConfig
    cli.py         `shuttle train` / `python -m training`
    builtin.py     the built-in model's recipe
"""
