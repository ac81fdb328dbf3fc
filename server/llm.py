"""LLM: offline batch generation, in the shape of vLLM's `LLM` class.

    from server import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(out[0].outputs[0].text)

All prompts of a call are decoded together: one prefill of every prompt, then one batched decode
step per token while any request is unfinished. (The continuous-batching engine replaces this loop.)
"""
from dataclasses import dataclass, field
from pathlib import Path
import json
import logging

import torch

from attention_nodes.model_runner import ModelRunner
from attention_nodes.sampling_params import SamplingParams
from models.config import DTYPES

log = logging.getLogger("shuttle")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (eos, stop id or stop string) or "length"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


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


class LLM:
    """model: a checkpoint directory (config.json, *.safetensors, tokenizer files); None for the
    built-in model. dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16".
    """

    def __init__(self, model: str | Path | None = None, dtype: str | torch.dtype | None = "auto",
                 device: str = "cpu"):
        if model is None:
            from models.builtin import builtin_model_dir
            model = builtin_model_dir()
        self.model_dir = Path(model)
        self.runner = ModelRunner(self.model_dir, resolve_dtype(dtype), device)
        self.cfg = self.runner.cfg
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.eos_token_ids = _eos_ids(self.model_dir, self.cfg.eos_token_ids, self.tokenizer)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids). Returns one RequestOutput per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not prompts:
            return []
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self._encode(p) for p in prompts]
        outs = self._run(ids, params_list)
        return [RequestOutput(t, p, [o]) for t, p, o in zip(texts, ids, outs)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to each conversation and generate a reply."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.model_dir}: the tokenizer has no chat template")
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, sampling_params)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir}: no tokenizer files; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(ids) >= self.cfg.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room in the context of "
                             f"{self.cfg.max_model_len} tokens")
        return ids

    def _run(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[CompletionOutput]:
        max_ctx = self.cfg.max_model_len
        limits = [min(p.max_tokens, max_ctx - len(ids)) for ids, p in zip(prompts, params)]
        self.runner.allocate_cache(len(prompts), max(len(ids) + n for ids, n in zip(prompts, limits)))
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        outs = [CompletionOutput(0, "", [], None) for _ in prompts]
        active = list(range(len(prompts)))
        chunks, ctx = [list(p) for p in prompts], [0] * len(prompts)
        while active:
            logits = self.runner.forward([chunks[i] for i in active], [ctx[i] for i in active], active)
            new = self.runner.sample(logits, [params[i] for i in active], [gens[i] for i in active])
            still = []
            for i, tok in zip(active, new):
                ctx[i] += len(chunks[i])
                chunks[i] = [tok]
                outs[i].token_ids.append(tok)
                if not self._finished(outs[i], params[i], limits[i]):
                    still.append(i)
            active = still
        return outs

    def _finished(self, out: CompletionOutput, p: SamplingParams, limit: int) -> bool:
        tok = out.token_ids[-1]
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            out.finish_reason, out.stop_reason = "stop", (None if tok in self.eos_token_ids else tok)
        elif len(out.token_ids) >= limit:
            out.finish_reason = "length"
        if self.tokenizer is not None and (p.stop or out.finish_reason):  # detokenize only when needed
            out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            hits = [(out.text.find(s), s) for s in p.stop if s in out.text]
            if hits:
                pos, s = min(hits)
                out.text, out.finish_reason, out.stop_reason = out.text[:pos], "stop", s
        return out.finish_reason is not None


def _load_tokenizer(model_dir: Path):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((model_dir / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _eos_ids(model_dir: Path, from_config: tuple[int, ...], tokenizer) -> set[int]:
    """End-of-sequence ids: generation_config.json (as transformers' generate uses), else config.json,
    plus the tokenizer's."""
    ids = set(from_config)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids = set(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
