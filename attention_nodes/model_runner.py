"""ModelRunner: the model, its KV cache and one batched forward-and-sample step.

An attention worker's compute core. It sees token ids only (never text): the server detokenizes
and checks stop strings.
"""
from pathlib import Path

import torch

from attention_nodes.sampling_params import SamplingParams
from kernels.sampling import sample
from models.config import ModelConfig
from models.kv_cache import AttentionBatch, DenseKVCache
from models.loader import load_model


class ModelRunner:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype | None = None, device: str = "cpu"):
        self.cfg = ModelConfig.from_pretrained(model_dir)
        self.device = torch.device(device)
        self.model = load_model(model_dir, self.cfg, dtype=dtype, device=self.device)
        self.dtype = self.model.lm_head.weight.dtype
        self.cache: DenseKVCache | None = None

    def allocate_cache(self, num_slots: int, max_len: int) -> None:
        cfg = self.cfg
        self.cache = DenseKVCache(cfg.num_layers, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim,
                                  self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, chunks: list[list[int]], ctx_lens: list[int], slots: list[int],
                all_logits: bool = False) -> torch.Tensor:
        """Run sequence b's new tokens chunks[b] (after ctx_lens[b] cached ones) through the model.

        Returns float32 logits of the last token of each chunk (B, V), or of every token (T, V)
        when all_logits is set.
        """
        assert self.cache is not None, "allocate_cache first"
        batch = AttentionBatch.build([len(c) for c in chunks], ctx_lens, slots, self.device)
        ids_T = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=self.device)
        hidden_TD = self.model(ids_T, batch, self.cache)
        if not all_logits:
            last_B = torch.cumsum(torch.tensor([len(c) for c in chunks], device=self.device), 0) - 1
            hidden_TD = hidden_TD[last_B]
        return self.model.logits(hidden_TD)

    def sample(self, logits_BV: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> list[int]:
        dev = logits_BV.device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        return sample(logits_BV, temperature, top_p, top_k, generators).tolist()
