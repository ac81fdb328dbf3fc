"""LLM: offline batch generation, in the shape of vLLM's `LLM` class.

    from server import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(out[0].outputs[0].text)

It runs the continuous-batching engine (attention_nodes/engine.py) in this process until every
request of the call has finished; text, stop strings and output shapes are handled here.
"""
import itertools
from dataclasses import replace
import logging
import os
from pathlib import Path

import torch

from attention_nodes.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from attention_nodes.engine import Engine, LLMEngine, default_eos_ids, validate_request
from attention_nodes.sampling_params import SamplingParams
from kernels.quant import triton_fp8_supported
from models.config import DTYPES, ModelConfig
from server.outputs import CompletionOutput, RequestOutput, RequestTracker
from telemetry.trace import Tracer

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "resolve_dtype", "engine_config"]
log = logging.getLogger("shuttle")


# Compile the CPU decode stages (models/stages.py) unless told otherwise; tests set the variable
# to 1 (tests/conftest.py) so that only the tests of the compiled path pay for compiling.
ENFORCE_EAGER_ENV = "SHUTTLE_ENFORCE_EAGER"
DEFAULT_ENFORCE_EAGER = True


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """'auto' or None: the checkpoint's dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def serving_dtype(model: str | Path, dtype: str | torch.dtype | None, devices: tuple[str, ...]) -> torch.dtype:
    """The dtype the deployment computes and caches in: `dtype`, or for "auto"/None the checkpoint's
    unless the CPUs in `devices` would emulate its GEMMs (models.loader.auto_dtype: then float32,
    with one INFO line saying why)."""
    chosen = resolve_dtype(dtype)
    if chosen is not None:
        return chosen
    from models.loader import auto_dtype

    chosen, why = auto_dtype(ModelConfig.from_pretrained(model).dtype, devices)
    if why:
        log.info("dtype: %s", why)
    return chosen


def engine_config(model: str | Path | None, dtype: str | torch.dtype | None = "auto", device: str | None = None,
                  kernels: str | None = None, *, max_num_seqs: int = 128, max_num_batched_tokens: int = 2048,
                  enable_chunked_prefill: bool = True, block_size: int = 16, num_kv_blocks: int | None = None,
                  kv_cache_gib: float | None = None, enable_prefix_caching: bool = True, seed: int = 0,
                  colocated: bool = True, attention_workers: int = 1, expert_workers: int = 1, micro_batches: int = 1,
                  transport: str = "shm", placement: str | None = None,
                  torch_threads: int | None = None, expert_device: str | None = None, eplb: bool = False,
                  eplb_interval: int = 3000, num_redundant_experts: int = 0, max_worker_restarts: int = 3,
                  restart_window_s: float = 600.0, launcher: str = "spawn", ray_address: str | None = None,
                  attention_resources: object = (), expert_resources: object = (), m2n_dtype: str = "auto",
                  enforce_eager: bool | None = None, native_decode: bool = True,
                  trace_dir: str | None = None, quantization: str | None = None,
                  speculative_config: object = None, quantize_linears: bool = False) -> EngineConfig:
    """EngineConfig from the keyword arguments of LLM and the command line (None model: built-in).
    colocated=False runs attention_workers and expert_workers as separate processes (see
    attention_nodes.config.ParallelConfig); `device` is then the attention pool's, expert_device
    the expert pool's (default: the same). launcher="ray" starts them as Ray actors on the cluster
    at ray_address, each pool on nodes carrying its resources (dicts such as {"H20": 1}).
    m2n_dtype="fp8" sends tokens to the expert workers as float8 with per-token scales.
    enforce_eager: None takes $SHUTTLE_ENFORCE_EAGER ("1" or "0") if set, else DEFAULT_ENFORCE_EAGER.
    native_decode: False keeps colocated bf16 decode steps eager (models/native_decode.py).
    quantization: "int8" keeps the expert weights as int8 ("w8a8_int8": their activations quantised
    per token too), "fp8" as FP8 128 x 128 blocks, "mxfp4" as MXFP4 (see EngineConfig); refused for a checkpoint that is already quantised (MXFP4; FP8 block but for
    "fp8"). None: an FP8 block checkpoint is served in FP8 as shipped where its experts run on CPU
    workers with torch kernels or on Triton kernels that convert FP8 (a log line says so), else in `dtype`; "none": in `dtype` always
    (an FP8 checkpoint dequantised at load). quantize_linears: with "int8" or "fp8", the other linear
    layers in that format too (attention projections, dense MLPs; not the LM head or routers).
    speculative_config: speculative decoding as vLLM's (a dict or JSON text such as {"method": "ngram",
    "num_speculative_tokens": 3}; attention_nodes.config.SpeculativeConfig).
    trace_dir: each pool worker writes DIR/<worker>.trace.json (a Chrome trace) when it stops, and
    the engine's own loop (colocated: DIR/engine.trace.json, else the front's DIR/front.trace.json)
    when LLM or AsyncLLM shuts down."""
    if model is None:
        from models.builtin import builtin_model_dir
        model = builtin_model_dir()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if enforce_eager is None:
        env = os.environ.get(ENFORCE_EAGER_ENV)
        if env not in (None, "0", "1"):
            raise ValueError(f"{ENFORCE_EAGER_ENV} must be 0 or 1, got {env!r}")
        enforce_eager = DEFAULT_ENFORCE_EAGER if env is None else env == "1"
    cfg = EngineConfig(str(model), serving_dtype(model, dtype, (device, expert_device or device)), device, kernels, seed,
                        SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill),
                        CacheConfig(block_size, num_kv_blocks, kv_cache_gib, enable_prefix_caching),
                        ParallelConfig(colocated, attention_workers, expert_workers, micro_batches, transport, placement,
                                       torch_threads, expert_device=expert_device, eplb=eplb,
                                       eplb_interval=eplb_interval, num_redundant_experts=num_redundant_experts,
                                       max_worker_restarts=max_worker_restarts, restart_window_s=restart_window_s,
                                       launcher=launcher, ray_address=ray_address,
                                       attention_resources=attention_resources, expert_resources=expert_resources,
                                       trace_dir=None if trace_dir is None else str(trace_dir), m2n_dtype=m2n_dtype),
                        enforce_eager, native_decode, quantization, speculative_config, quantize_linears)
    model_cfg = ModelConfig.from_pretrained(cfg.model)
    if cfg.speculative is not None and cfg.speculative.method == "mtp":  # (here too: before any worker starts)
        from models.mtp import check_mtp_checkpoint
        check_mtp_checkpoint(cfg.model, model_cfg)
    return _checkpoint_quantization(cfg, model_cfg, quantization)


def _checkpoint_quantization(cfg: EngineConfig, model_cfg: ModelConfig, asked: str | None) -> EngineConfig:
    """cfg with the quantization the checkpoint takes. An FP8 block checkpoint is served in FP8 as
    shipped (quantization "fp8", as vLLM serves FP8 checkpoints) where its experts run on CPU
    workers with torch kernels or on Triton kernels that convert FP8, unless asked otherwise ("none": dequantised at load, as elsewhere);
    quantising an already quantised checkpoint again (int8 of FP8, int8 or FP8 of MXFP4) is refused.
    "mxfp4" keeps an MXFP4 checkpoint's experts as shipped and quantises a float one's, whose experts'
    input counts (hidden_size for w13, moe_intermediate_size for w2) must be multiples of 32."""
    shipped = "FP8 block" if model_cfg.fp8_block else "MXFP4" if model_cfg.mxfp4 else None
    if shipped and cfg.quantization is not None and (shipped, cfg.quantization) not in (("FP8 block", "fp8"),
                                                                                        ("MXFP4", "mxfp4")):
        keep = {"FP8 block": ", or with --quantization fp8 to keep its FP8 weights",
                "MXFP4": ", or with --quantization mxfp4 to keep its MXFP4 experts"}[shipped]
        raise ValueError(f"{cfg.model}: the checkpoint is already {shipped}-quantised; --quantization "
                         f"{cfg.quantization} quantises float checkpoints (serve this one without it{keep})")
    if cfg.quantization == "mxfp4" and not shipped:
        for tensor, size, field_name in (("w13 (E, 2I, D)", model_cfg.hidden_size, "hidden_size"),
                                         ("w2 (E, D, I)", model_cfg.moe_intermediate_size, "moe_intermediate_size")):
            if size % 32:
                raise ValueError(f"{cfg.model}: --quantization mxfp4 needs the experts' inputs in blocks of 32; "
                                 f"model.layers.*.mlp.experts.{tensor} has {size} inputs ({field_name})")
    if cfg.quantization == "mxfp4" and shipped:
        log.info("weights: the experts MXFP4 as shipped (E2M1 codes and E8M0 scales per 32 inputs)")
    if shipped != "FP8 block":
        return cfg
    if asked is None and (cfg.experts_on_cpu_torch or (cfg.experts_kernels == "triton"
                                                         and triton_fp8_supported(cfg.experts_device))):
        cfg = replace(cfg, quantization="fp8")
    dtype = str(cfg.dtype or model_cfg.dtype).removeprefix("torch.")
    if cfg.quantization == "fp8":
        log.info("weights: FP8 as shipped (E4M3 codes and %s block scales of the experts and FP8 linears; "
                 "--quantization none dequantises them to %s at load)", "x".join(map(str, model_cfg.fp8_block)),
                 dtype)
    else:
        log.info("weights: the FP8 checkpoint dequantised to %s at load (%s)", dtype,
                 "--quantization none" if asked == "none" else "FP8 weights are kept for experts on CPU workers "
                 "with torch kernels, or on Triton kernels where they convert FP8 (CUDA sm_89+, or the CPU)")
    return cfg


class LLM:
    """model: a checkpoint directory (config.json, *.safetensors, tokenizer files); None for the
    built-in model. dtype: "auto" (the checkpoint's; float32 for a bf16/fp16 checkpoint on a CPU
    that emulates those GEMMs, see models.loader.auto_dtype), "float32", "bfloat16" or "float16". device:
    "cpu" or "cuda" (default: cuda when present). The keyword arguments size the scheduler and the
    KV cache and choose the deployment (see engine_config): by default everything runs in this
    process; colocated=False starts attention and expert worker pools (pools/engine.py), or meets
    pools started elsewhere when rendezvous="HOST:PORT" is given. plan: a plan file from `shuttle
    plan` choosing the deployment (keyword arguments given here override it; a plan this host
    cannot run is refused with ValueError). deployment_token: the token every pool worker must prove
    (default: a random one; it never crosses the wire nor enters the rendezvous store: --role workers
    get it from SHUTTLE_DEPLOYMENT_TOKEN). Call shutdown() to stop them.
    """

    def __init__(self, model: str | Path | None = None, dtype: str | torch.dtype | None = "auto",
                 device: str | None = None, kernels: str | None = None, rendezvous: str | None = None,
                 plan: str | Path | None = None, deployment_token: str | None = None, **engine_kwargs):
        if plan is not None:
            from planner.plan import plan_engine_kwargs

            asked = {k: engine_kwargs[k] for k in ("quantization", "quantize_linears") if k in engine_kwargs}
            planned = plan_engine_kwargs(plan, None if model is None else str(model), **asked)
            model = model if model is not None else planned.pop("model")
            planned.pop("model", None)
            device = device if device is not None else planned.pop("device")
            planned.pop("device", None)
            engine_kwargs = {**planned, **engine_kwargs}
        cfg = engine_config(model, dtype, device, kernels, **engine_kwargs)
        self.model_dir, self.engine_cfg = Path(cfg.model), cfg
        self.cfg = ModelConfig.from_pretrained(self.model_dir)
        self.tokenizer = _load_tokenizer(self.model_dir)
        eos = default_eos_ids(self.model_dir, self.cfg)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        if cfg.parallel.colocated and rendezvous is None:
            if cfg.parallel.eplb:
                raise ValueError("eplb balances expert workers: it needs colocated=False (worker pools)")
            if cfg.parallel.torch_threads:  # the engine computes in this process: its threads are ours
                torch.set_num_threads(cfg.parallel.torch_threads)
            self.engine: Engine = LLMEngine(cfg, eos)
        else:
            from pools.engine import PoolEngine
            self.engine = PoolEngine(replace(cfg, parallel=replace(cfg.parallel, colocated=False)), eos, rendezvous,
                                     deployment_token)
        self._ids = itertools.count()
        # The engine loop's own spans (steps, admissions, deliveries), written at shutdown.
        self.trace_dir = cfg.parallel.trace_dir
        self.tracer = Tracer("engine" if cfg.parallel.colocated and rendezvous is None else "front",
                             enabled=self.trace_dir is not None)

    def step(self) -> list:
        """One engine step, traced (trace_dir) with what it ran."""
        t0 = Tracer.now()
        deltas = self.engine.step()
        if self.tracer.enabled:
            self.tracer.span("step", "step", t0, args=self.engine.step_summary())
        return deltas

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.engine.set_eos_token_ids(ids)

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids). Returns one RequestOutput per prompt,
        in order. All of a call's requests run together on the engine."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not prompts:
            return []
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        encoded = [self._encode(p, sp) for p, sp in zip(prompts, params_list)]  # all checked before any runs
        trackers: list[RequestTracker] = []
        try:
            for prompt, ids, sp in zip(prompts, encoded, params_list):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, ids, sp)
                trackers.append(RequestTracker(rid, prompt if isinstance(prompt, str) else None, ids, sp,
                                               self.tokenizer))
            self._run({t.output.request_id: t for t in trackers})
        except BaseException:
            for t in trackers:
                self.engine.abort_request(t.output.request_id)
            raise
        return [t.output for t in trackers]

    def _run(self, trackers: dict[str, RequestTracker]) -> None:
        stepped: list[RequestTracker] = []
        while any(not t.output.finished for t in trackers.values()):
            for t in stepped:  # outputs' deltas hold one step (nobody streams them here)
                t.clear_deltas()
            stepped.clear()
            for delta in self.step():
                tracker = trackers[delta.request_id]
                stop = tracker.apply(delta)
                stepped.append(tracker)
                if stop is not None:
                    self.engine.stop_sequence(delta.request_id, delta.index, stop)

    def shutdown(self) -> None:
        """Stop the worker pools (nothing to do when the engine runs in this process); with trace_dir,
        write the engine loop's trace."""
        self.engine.shutdown()
        if self.tracer.enabled:
            self.tracer.dump(self.trace_dir)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to each conversation and generate a reply."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [self.render_chat(c) for c in convs]
        outs = self.generate([ids for _, ids in rendered], sampling_params)
        for out, (text, _) in zip(outs, rendered):
            out.prompt = text
        return outs

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs) -> tuple[str, list[int]]:
        """The conversation rendered by the checkpoint's chat template, as text and token ids (the
        template writes any special tokens itself, so none are added). ValueError if there is no
        template or it rejects the conversation."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.model_dir}: the tokenizer has no chat template")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, **template_kwargs)
        except Exception as e:  # jinja's TemplateError (raise_exception in templates), bad kwargs
            raise ValueError(f"the chat template rejected the conversation: {e}") from None
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def _encode(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        if self.tokenizer is None and (isinstance(prompt, str) or params.stop):
            raise ValueError(f"{self.model_dir}: no tokenizer files; pass token ids and no stop strings")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return validate_request(ids, params, self.cfg)


def _load_tokenizer(model_dir: Path):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((model_dir / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
