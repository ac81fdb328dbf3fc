"""Engine configuration: small frozen dataclasses, checked when built, composed in EngineConfig."""
import json
import os
from dataclasses import dataclass, field

import torch

from kernels.ops import choose_backend
from kernels.quant import TRITON_QUANTIZATIONS
from m2n_comm.transport import BACKENDS

M2N_DTYPES = ("auto", "fp8")  # ParallelConfig.m2n_dtype
QUANTIZATIONS = ("int8", "w8a8_int8", "fp8", "mxfp4")  # EngineConfig.quantization ("none" too: served in dtype)
LINEAR_QUANTIZATIONS = ("int8", "fp8")  # those that EngineConfig.quantize_linears applies to the linears too
SPEC_METHODS = ("ngram", "mtp", "draft_model")  # SpeculativeConfig.method
# SpeculativeConfig.disable_by_batch_size when not given: bench/spec_decode.py on the built-in model lost
# 4-28% with drafts at batch 16 on both CPUs measured (AMX Xeon, AVX-512 BF16 EPYC), won 1.1-1.5x at 1-4
# and lost up to 20% at 8 (the planner's served batch 8: 0.73x) on the EPYC
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


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
class SpeculativeConfig:
    """Speculative decoding, as vLLM's --speculative-config spells it. method "ngram": the drafts of
    a sequence are the tokens that followed the latest earlier occurrence of its longest suffix of
    prompt_lookup_min..prompt_lookup_max tokens (prompt lookup; both default to 5, one given sets
    the other, as vLLM; method mtp ignores them); method "mtp": the greedy drafts of the checkpoint's
    multi-token-prediction layer (DeepSeek-V3, GLM-4.5: num_nextn_predict_layers; models/mtp.py),
    chained for k > 1; method "draft_model": the greedy drafts of the checkpoint at `model`, a smaller
    model sharing the target's tokenizer (attention_nodes/draft_model.py); num_speculative_tokens:
    drafts per sequence and step. Each step verifies
    every draft of the batch in one forward pass (attention_nodes/speculative.py). Above
    disable_by_batch_size running sequences a step drafts nothing (None: DEFAULT_DISABLE_BY_BATCH_SIZE).
    token_map (method mtp; SGLang's --speculative-token-map, FR-Spec): a file of the token ids the MTP
    head drafts from (models/mtp.load_token_map), the head cut to those rows: fewer bytes a draft, the
    same verified output (a token outside the map is never drafted, so it is never accepted early)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    model: str | None = None
    token_map: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not supported; choose from "
                             f"{', '.join(SPEC_METHODS)}")
        if (self.model is None) == (self.method == "draft_model"):
            raise ValueError("speculative_config method draft_model needs 'model' (the draft checkpoint's directory)"
                             if self.model is None else
                             f"speculative_config 'model' is for method draft_model, not {self.method!r}")
        if self.model is not None:
            if not isinstance(self.model, (str, os.PathLike)):
                raise ValueError(f"speculative_config model must be a directory's path, got {self.model!r}")
            object.__setattr__(self, "model", str(self.model))
        if self.token_map is not None:
            if self.method != "mtp":
                raise ValueError(f"speculative_config 'token_map' is for method mtp, not {self.method!r}")
            if not isinstance(self.token_map, (str, os.PathLike)):
                raise ValueError(f"speculative_config token_map must be a file's path, got {self.token_map!r}")
            object.__setattr__(self, "token_map", str(self.token_map))
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"speculative_config {name} must be a positive integer, got {v!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (lo or hi or 5), (hi or lo or 5)
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.disable_by_batch_size is None:
            object.__setattr__(self, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From a SpeculativeConfig, a dict or JSON object text (None: no speculation); ValueError
        naming the key for anything else."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config must be a JSON object such as "
                                 f'{{"method": "ngram", "num_speculative_tokens": 3}}: {e}') from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(cls.__dataclass_fields__)})")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**value)

    def to_dict(self) -> dict:
        """vLLM's keys as set (`model` only for method draft_model, `token_map` only where given, the
        prompt lookup's bounds only for method ngram)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__
                if (k not in ("model", "token_map") or getattr(self, k) is not None)
                and (self.method == "ngram" or not k.startswith("prompt_lookup_"))}


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


def ray_resources(value: object, where: str) -> tuple[tuple[str, float], ...]:
    """Ray resources as sorted (name, amount) pairs, from a dict, JSON object text or pairs;
    ValueError naming `where` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{where} must be a JSON object of Ray resources such as {{\"H20\": 1}}: {e}") from None
    try:
        pairs = sorted((value or {}).items() if isinstance(value, dict) else (tuple(p) for p in value))
    except (TypeError, ValueError):
        pairs = None
    ok = pairs is not None and all(len(p) == 2 and isinstance(p[0], str) and p[0] and isinstance(p[1], (int, float))
                                   and not isinstance(p[1], bool) and p[1] >= 0 for p in pairs)
    if not ok:
        raise ValueError(f"{where} must map Ray resource names to amounts >= 0 (e.g. {{\"H20\": 1}}), got {value!r}")
    return tuple((k, float(v)) for k, v in pairs)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes. colocated: the experts run in the attention process
    with no transport (the reference). Otherwise `attention_workers` data-parallel attention
    processes and `expert_workers` expert processes exchange tokens over M2N (`transport`: shm on
    one host, tcp across hosts, nixl across hosts with RDMA), each step split into `micro_batches` (1 to 4) that ping-pong
    between the pools. placement: a JSON file {"expert": [workers]} (default: contiguous blocks).
    torch_threads: torch threads per worker process (None: torch's default). eplb: re-place the
    experts live from their measured load every `eplb_interval` steps, with `num_redundant_experts`
    extra copies per MoE layer (pools/eplb.py). m2n_dtype: "auto" sends tokens to the expert
    workers in the activations' dtype, "fp8" as float8 e4m3 with per-token scales (half of bf16's
    bytes; answers come back in the activations' dtype).
    max_worker_restarts: how many times the front restarts a dead or silent worker within
    `restart_window_s` seconds before it gives the deployment up (0: never; workers started
    elsewhere with --role are never restarted from the front)."""

    colocated: bool = True
    attention_workers: int = 1
    expert_workers: int = 1
    micro_batches: int = 1
    transport: str = "shm"
    placement: str | None = None
    torch_threads: int | None = None
    trace_dir: str | None = None  # each worker writes DIR/<worker>.trace.json (Chrome trace) when it stops
    expert_device: str | None = None  # the expert pool's device (None: the engine's device)
    eplb: bool = False
    eplb_interval: int = 3000
    num_redundant_experts: int = 0
    max_worker_restarts: int = 3
    restart_window_s: float = 600.0
    # How the pools start (pools/launchers.py): "spawn" (processes of this host) or "ray" (Ray
    # actors on the cluster at ray_address, each pool on nodes carrying its resources: (name, amount)
    # pairs, e.g. (("H20", 1.0),); a dict or JSON object text is accepted and normalised).
    launcher: str = "spawn"
    ray_address: str | None = None
    attention_resources: tuple[tuple[str, float], ...] = ()
    expert_resources: tuple[tuple[str, float], ...] = ()
    m2n_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("attention_workers", "expert_workers", "micro_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {v!r}")
        if self.micro_batches > 4:
            raise ValueError(f"parallel.micro_batches must be 1 to 4, got {self.micro_batches}")
        if self.m2n_dtype not in M2N_DTYPES:
            raise ValueError(f"parallel.m2n_dtype must be one of {', '.join(M2N_DTYPES)}, got {self.m2n_dtype!r}")
        if self.m2n_dtype != "auto" and self.colocated:
            raise ValueError("parallel.m2n_dtype sets what crosses M2N between worker pools; a colocated engine "
                             "has none (drop --m2n-dtype or give a pool flag)")
        if self.transport not in BACKENDS:
            raise ValueError(f"parallel.transport must be one of {', '.join(BACKENDS)}, got {self.transport!r}")
        if self.expert_device is not None and self.expert_device != "cpu" and not self.expert_device.startswith("cuda"):
            raise ValueError(f"parallel.expert_device must be cpu or cuda, got {self.expert_device!r}")
        if not isinstance(self.eplb_interval, int) or isinstance(self.eplb_interval, bool) or self.eplb_interval < 1:
            raise ValueError(f"parallel.eplb_interval must be a positive number of steps, got {self.eplb_interval!r}")
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ValueError(f"parallel.num_redundant_experts must be >= 0, got {self.num_redundant_experts!r}")
        if self.num_redundant_experts and not self.eplb:
            raise ValueError("parallel.num_redundant_experts: redundant copies are placed by EPLB; add --eplb")
        if not isinstance(self.max_worker_restarts, int) or isinstance(self.max_worker_restarts, bool) \
                or self.max_worker_restarts < 0:
            raise ValueError(f"parallel.max_worker_restarts must be an integer >= 0, got {self.max_worker_restarts!r}")
        if not isinstance(self.restart_window_s, (int, float)) or not self.restart_window_s > 0:
            raise ValueError(f"parallel.restart_window_s must be a positive number of seconds, "
                             f"got {self.restart_window_s!r}")
        if self.torch_threads is not None and (not isinstance(self.torch_threads, int) or self.torch_threads < 1):
            raise ValueError(f"parallel.torch_threads must be a positive integer, got {self.torch_threads!r}")
        if self.launcher not in ("spawn", "ray"):
            raise ValueError(f"parallel.launcher must be spawn or ray, got {self.launcher!r}")
        for name in ("attention_resources", "expert_resources"):
            object.__setattr__(self, name, ray_resources(getattr(self, name), f"parallel.{name}"))
        if self.launcher != "ray" and (self.ray_address or self.attention_resources or self.expert_resources):
            raise ValueError("parallel.ray_address and the pools' resources need parallel.launcher='ray'")


def worker_threads(par: ParallelConfig, cores: int) -> tuple[int, int]:
    """Torch threads of each attention worker and of each expert worker when the pools share one
    host of `cores` cores: par.torch_threads for both when given. Otherwise, at m = 1 the pools take
    turns (the attention workers wait while the experts compute, and the reverse), so each pool's
    workers split all the cores: cores // attention_workers and cores // expert_workers. With m >= 2
    both pools compute at once and the cores are split between all the workers, cores // (A + E):
    torch's default of every core in every process would oversubscribe the CPU, which slows
    OpenMP several-fold. Measured (bench/pingpong.py, 425M Mixtral-shaped model in float32, 2
    cores, 1 + 1, m = 1, waits passive: pools/launchers.py): 2 threads per worker gave 0.84 / 0.90
    of colocated's step at batch 16 / 64 against 0.61 / 0.64 with 1 thread each; at m = 2, 2
    threads each gave 0.48 / 0.56 (oversubscribed), below m = 1. At least 1 each."""
    if par.torch_threads:
        return par.torch_threads, par.torch_threads
    if par.micro_batches == 1:
        return max(1, cores // par.attention_workers), max(1, cores // par.expert_workers)
    shared = max(1, cores // (par.attention_workers + par.expert_workers))
    return shared, shared


@dataclass(frozen=True)
class EngineConfig:
    """model: checkpoint directory. dtype: None for the checkpoint's. device: "cpu" or "cuda".
    kernels: "torch" or "triton" to override the device's default (see kernels.ops).
    enforce_eager: run every op eagerly; False compiles the decoder's non-GEMM stages with
    torch.compile at start-up where that applies (CPU with torch kernels; models/stages.py).
    native_decode: run bf16 decode steps' layers from C where the model takes it: colocated the
    whole step in one call, on an attention worker each layer's attention side
    (models/native_decode.py); False keeps the eager layers.
    quantization: "int8" keeps the expert weights as int8 codes with per-output-channel scales,
    quantised at load from a float checkpoint (weight-only, except experts with as many rows in a step as
    kernels/choice.py measured VNNI >10% faster from: w8a8's arithmetic; kernels/int8.py), where the experts run
    on CPU workers with torch kernels (the attention pool may be on a GPU); None (or "none") serves
    them in `dtype`. vLLM's name "experts_int8" means the same. "w8a8_int8" (SGLang's name; same
    placement): the same int8 experts, and their activations quantised per token to int8 as well,
    multiplied int8 by int8 (AVX-512 VNNI; SiLU experts without biases only). "fp8" (same placement): FP8 E4M3 codes
    in 128 x 128 blocks (kernels/fp8_weights.py); an FP8 block checkpoint's experts and FP8 linears
    keep their codes and scales as shipped, a float checkpoint's experts are quantised at load;
    server.llm.engine_config picks "fp8" for FP8 checkpoints where this placement allows. "mxfp4"
    (same placement): the experts as MXFP4 E2M1 codes with an E8M0 scale per row and 32 inputs
    (kernels/mxfp4_weights.py); an MXFP4 checkpoint's (gpt-oss) kept as shipped, a float checkpoint's
    quantised at load (its experts' input counts multiples of 32). "fp8" and "mxfp4" also run on the
    Triton op table, wherever it serves the experts (models/triton_quant.py).
    quantize_linears: with quantization "int8" or "fp8", every other linear layer too in that format,
    quantised at load (weight-only: attention projections, dense and shared-expert MLPs; not the LM
    head, the routers, the embeddings or an MTP drafting layer's), where the attention side runs on the
    CPU with torch kernels (fp8: or on Triton): the bytes a small-batch decode step reads beside the experts' halve as well.
    speculative: SpeculativeConfig (or its dict or JSON text), None without speculative decoding."""

    model: str
    dtype: torch.dtype | None = None
    device: str = "cpu"
    kernels: str | None = None
    seed: int = 0  # for requests without a seed
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    enforce_eager: bool = True
    native_decode: bool = True
    quantization: str | None = None
    speculative: SpeculativeConfig | None = None
    quantize_linears: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        for name in ("enforce_eager", "native_decode", "quantize_linears"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.quantization in ("experts_int8", "none"):
            object.__setattr__(self, "quantization", {"experts_int8": "int8", "none": None}[self.quantization])
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization {self.quantization!r} is not supported; choose from none, "
                                 f"{', '.join(QUANTIZATIONS)} (or experts_int8, int8's vLLM name)")
            on_triton = self.experts_kernels == "triton" and self.quantization in TRITON_QUANTIZATIONS
            if not self.experts_on_cpu_torch and not on_triton:
                kernels = {"int8": "kernels/int8.py", "w8a8_int8": "kernels/int8.py", "fp8": "kernels/fp8_weights.py",
                           "mxfp4": "kernels/mxfp4_weights.py"}[self.quantization]
                where = (f"only on CPU workers with torch kernels ({kernels}; Triton serves "
                         f"{' and '.join(TRITON_QUANTIZATIONS)})" if self.quantization not in TRITON_QUANTIZATIONS
                         else f"on CPU workers with torch kernels ({kernels}) or with Triton kernels")
                raise ValueError(f"quantization {self.quantization!r} runs the experts {where}; got experts on "
                                 f"{self.experts_device!r}, kernels {self.kernels!r}")
        if self.quantize_linears:
            if self.quantization not in LINEAR_QUANTIZATIONS:
                raise ValueError(f"quantize_linears quantises the linear layers as --quantization "
                                 f"{' or '.join(LINEAR_QUANTIZATIONS)} does the experts; got quantization "
                                 f"{self.quantization!r} (give --quantization int8 or fp8 with it; an FP8 "
                                 f"checkpoint's is fp8)")
            triton = choose_backend(self.device, self.kernels) == "triton"
            if (self.device != "cpu" or triton) and not (triton and self.quantization == "fp8"):
                raise ValueError(f"quantize_linears runs the quantised linears on the CPU with torch kernels (or fp8 "
                                 f"with Triton kernels); got the attention side on {self.device!r}, kernels "
                                 f"{self.kernels!r}, quantization {self.quantization!r}")

    @property
    def experts_device(self) -> str:
        """The device that holds the experts: the engine's colocated, else the expert pool's."""
        return self.device if self.parallel.colocated else self.parallel.expert_device or self.device

    @property
    def experts_kernels(self) -> str:
        """The op table the experts run on: "triton" or "torch" (kernels.ops.choose_backend)."""
        return choose_backend(self.experts_device, self.kernels)

    @property
    def experts_on_cpu_torch(self) -> bool:
        """Whether the experts run on CPU workers with torch kernels (where every quantization runs)."""
        return self.experts_device == "cpu" and self.experts_kernels == "torch"
