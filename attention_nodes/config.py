"""Engine configuration: small frozen dataclasses, checked when built, composed in EngineConfig."""
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: sequences in flight at once. max_num_batched_tokens: tokens per step (prefill
    chunks plus decodes). enable_chunked_prefill: split prompts longer than the step budget over
    several steps (else such a prompt waits for a step with room for it whole)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"scheduler.{name} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class CacheConfig:
    """block_size: tokens per KV block. num_blocks: KV blocks (None: sized from kv_cache_gib, or on
    CUDA from the free memory after the weights). enable_prefix_caching: share full blocks of equal
    prefixes between requests."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_gib: float | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"cache.block_size must be a power of two, got {self.block_size!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"cache.num_blocks must be a positive integer, got {self.num_blocks!r}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"cache.kv_cache_gib must be positive, got {self.kv_cache_gib!r}")


@dataclass(frozen=True)
class EngineConfig:
    """model: checkpoint directory. dtype: None for the checkpoint's. device: "cpu" or "cuda".
    kernels: "torch" or "triton" to override the device's default (see kernels.ops)."""

    model: str
    dtype: torch.dtype | None = None
    device: str = "cpu"
    kernels: str | None = None
    seed: int = 0  # for requests without a seed
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
