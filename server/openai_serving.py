"""/v1/completions and /v1/chat/completions over AsyncLLM: prompts in, OpenAI's response shapes out.

A request's prompts (a completion may carry a batch of them) run as separate engine requests
together; their choices are numbered prompt * n + sample, as OpenAI does. Streams are server-sent
events: a chunk per engine step that changed a choice (its text delta, the logprobs of its new
tokens, finish_reason once it ends), the usage chunk when stream_options.include_usage asks, and
`data: [DONE]`. An error after the stream began is sent as an `error` event before [DONE].
"""
import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from attention_nodes.sampling_params import SamplingParams
from server.async_llm import Admission, AsyncLLM, QueueFullError
from server.openai_protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from server.outputs import CompletionOutput, RequestOutput

DONE = "data: [DONE]\n\n"


@dataclass
class _Job:
    """One request of the API (all its prompts) as it runs."""

    kind: str  # "text_completion" or "chat.completion"
    id: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    echo: list[str] | None = None  # completions with echo: each prompt's text
    created: int = field(default_factory=lambda: int(time.time()))
    admission: Admission | None = None  # the prompts' places in the waiting queue, reserved up front

    def index(self, prompt: int, sample: int) -> int:
        return prompt * self.params.n + sample


class OpenAIServing:
    """The logic behind the OpenAI routes; the FastAPI layer (server/api_server.py) only parses,
    authenticates and turns OpenAIError into responses."""

    def __init__(self, llm: AsyncLLM, model_name: str):
        self.llm, self.model_name = llm, model_name
        self.max_model_len = llm.model_config.max_model_len

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "shuttle", "root": str(self.llm.model_dir),
                                            "max_model_len": self.max_model_len}]}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                              status=404, param="model", code="model_not_found")

    # -- building jobs ------------------------------------------------------------------------------
    def completion_job(self, req: CompletionRequest) -> _Job:
        self.check_model(req.model)
        prompts = [self._encode(p, "prompt") for p in req.prompts()]
        max_tokens = min(self._max_tokens(req.max_tokens, len(ids), "max_tokens") for ids in prompts)
        params = req.sampling_params(max_tokens, req.logprobs)
        echo = [self._decode(ids) if not isinstance(p, str) else p for p, ids in zip(req.prompts(), prompts)] \
            if req.echo else None
        return _Job("text_completion", f"cmpl-{secrets.token_hex(12)}", self.model_name, prompts, params, echo)

    def chat_job(self, req: ChatCompletionRequest) -> _Job:
        self.check_model(req.model)
        messages = [m.as_template_input() for m in req.messages]
        try:
            _, ids = self.llm.render_chat(messages, req.add_generation_prompt, req.continue_final_message,
                                          **(req.chat_template_kwargs or {}))
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None
        ids = self._check_prompt(ids, "messages")
        params = req.sampling_params(self._max_tokens(req.requested_max_tokens(), len(ids), "max_tokens"),
                                     req.requested_logprobs())
        return _Job("chat.completion", f"chatcmpl-{secrets.token_hex(12)}", self.model_name, [ids], params)

    def _encode(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            if self.llm.tokenizer is None:
                raise OpenAIError("this model has no tokenizer: send the prompt as token ids", param=param)
            prompt = self.llm.tokenizer.encode(prompt)
        return self._check_prompt(prompt, param)

    def _check_prompt(self, ids: list[int], param: str) -> list[int]:
        try:
            return self.llm.engine.check_prompt(ids)
        except ValueError as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            raise OpenAIError(str(e), param=param, code=code) from None

    def _decode(self, ids: list[int]) -> str:
        return "" if self.llm.tokenizer is None else self.llm.tokenizer.decode(ids)

    def _max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        """The request's max_tokens, checked against the room the prompt leaves in the context
        (None: all of that room)."""
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested > room:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                              f"for the completion). Please reduce the length of the prompt or {param}.",
                              param=param, code="context_length_exceeded")
        return requested

    # -- running ------------------------------------------------------------------------------------
    async def _outputs(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every prompt's request, in the order the steps produce them."""
        q: asyncio.Queue = asyncio.Queue()

        async def run(i: int) -> None:
            try:
                async for out in self.llm.generate(job.prompts[i], job.params, request_id=f"{job.id}-{i}",
                                                 admission=job.admission):
                    q.put_nowait((i, out))
            except BaseException as e:
                q.put_nowait((i, e))
                raise

        tasks = [asyncio.create_task(run(i)) for i in range(len(job.prompts))]
        try:
            done = 0
            while done < len(tasks):
                i, item = await q.get()
                if isinstance(item, BaseException):
                    raise as_openai_error(item)
                done += item.finished
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # each generate aborts its request

    async def full_response(self, job: _Job) -> dict:
        final: dict[int, RequestOutput] = {}
        async for i, out in self._outputs(job):
            final[i] = out
        choices = []
        for i in range(len(job.prompts)):
            for c in final[i].outputs:
                choices.append(self._choice(job, i, c, c.text, c.token_ids, c.logprobs or [], full=True))
        return {"id": job.id, "object": job.kind, "created": job.created, "model": job.model, "choices": choices,
                "usage": _usage(job, final.values())}

    async def stream(self, job: _Job, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
        """Server-sent events of the job; the caller cancels it when the client goes away."""
        chunk_kind = "chat.completion.chunk" if job.kind == "chat.completion" else "text_completion"
        started, ended = set(), set()  # choices that sent their first chunk, their finish_reason
        final: dict[int, RequestOutput] = {}
        try:
            async for i, out in self._outputs(job):
                final[i] = out
                choices = []
                for c in out.outputs:
                    index = job.index(i, c.index)
                    if index in ended or (not c.delta_token_ids and not c.delta_text and not c.finished
                                          and index in started):
                        continue
                    lps = (c.logprobs or [])[len(c.logprobs or []) - len(c.delta_token_ids):] if c.logprobs else []
                    text = c.delta_text
                    if job.echo is not None and index not in started:
                        text = job.echo[i] + text
                    first = index not in started
                    started.add(index)
                    if c.finished:
                        ended.add(index)
                    choices.append(self._choice(job, i, c, text, c.delta_token_ids, lps, full=False, first=first))
                for choice in choices:  # one choice per chunk, as OpenAI and vLLM send them
                    chunk = {"id": job.id, "object": chunk_kind, "created": job.created, "model": job.model,
                             "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = _usage(job, final.values()) if continuous_usage else None
                    yield _sse(chunk)
            if include_usage:
                yield _sse({"id": job.id, "object": chunk_kind, "created": job.created, "model": job.model,
                            "choices": [], "usage": _usage(job, final.values())})
        except OpenAIError as e:
            yield _sse(e.body())
        yield DONE

    def _choice(self, job: _Job, prompt: int, c: CompletionOutput, text: str, token_ids: list[int],
                logprobs: list, full: bool, first: bool = False) -> dict:
        index = job.index(prompt, c.index)
        lp = None
        if job.params.logprobs is not None:
            lp = _chat_logprobs(token_ids, logprobs, job.params.logprobs) if job.kind == "chat.completion" else \
                _completion_logprobs(token_ids, logprobs, job.params.logprobs)
        if job.kind == "chat.completion":
            if full:
                return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
        if full and job.echo is not None:
            text = job.echo[prompt] + text
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _usage(job: _Job, outputs) -> dict:
    outputs = list(outputs)
    prompt = sum(len(ids) for ids in job.prompts)
    completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _ranked(entry: dict, k: int) -> list:
    """The top-k alternatives of one position, most likely first."""
    return sorted((lp for lp in entry.items() if lp[1].rank is not None and lp[1].rank <= k),
                  key=lambda kv: kv[1].rank)[:k]


def _completion_logprobs(token_ids: list[int], logprobs: list[dict], k: int) -> dict:
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for tid, entry in zip(token_ids, logprobs):
        chosen = entry[tid]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_lps.append(chosen.logprob)
        tops.append({(lp.decoded_token or ""): lp.logprob for _, lp in _ranked(entry, k)} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(token_ids: list[int], logprobs: list[dict], k: int) -> dict:
    def item(lp) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(entry[tid]), "top_logprobs": [item(lp) for _, lp in _ranked(entry, k)]}
                        for tid, entry in zip(token_ids, logprobs)]}


def as_openai_error(e: BaseException) -> BaseException:
    """The error a request's generation raised, as the API reports it."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, QueueFullError):
        return OpenAIError(str(e), status=503, code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, ValueError):
        return OpenAIError(str(e), param="prompt")
    if isinstance(e, asyncio.CancelledError):
        return e
    return OpenAIError(f"the engine failed: {e}", status=500, type="server_error", code="engine_error")
