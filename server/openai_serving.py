"""/v1/completions and /v1/chat/completions over AsyncLLM: prompts in, OpenAI's response shapes out.

A request's prompts (a completion may carry a batch of them) run as separate engine requests
together; their choices are numbered prompt * n + sample, as OpenAI does. Streams are server-sent
events: a chunk per engine step that changed a choice (its text delta, the logprobs of its new
tokens, finish_reason once it ends), the usage chunk when stream_options.include_usage asks, and
`data: [DONE]`. An error after the stream began is sent as an `error` event before [DONE].
"""
import asyncio
import dataclasses
import functools
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from attention_nodes.engine import check_params, check_prompt
from attention_nodes.sampling_params import SamplingParams
from attention_nodes.structured import StructuredOutputs
from server.async_llm import Admission, AsyncLLM, QueueFullError
from server.openai_protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                                    OpenAIError, TokenizeChatRequest, TokenizeCompletionRequest)
from server.outputs import CompletionOutput, Logprob, RequestOutput
from server.parsers import REASONING_PARSERS, TOOL_PARSERS, ReasoningParser
from server.parsers.forced import Markup
from server.parsers.output import ChatOutput, cut_end
from server.tool_calls import ToolMode, ToolStreamer

DONE = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0


@dataclass
class _Job:
    """One request of the API (all its prompts) as it runs."""

    kind: str  # "text_completion" or "chat.completion"
    id: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    echo: list[str] | None = None  # completions with echo: each prompt's text
    echo_logprobs: bool = False  # completions with echo and logprobs: the prompt's logprobs lead
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in the response
    tools: ToolMode | None = None  # chat with tools: the text becomes tool_calls
    # chat with a reasoning parser or tool_choice auto: a ChatOutput per choice parses its text
    output: Callable[[], ChatOutput] | None = None
    end_texts: tuple[str, ...] = ()  # with special tokens kept: the end-of-sequence tokens' text, cut off
    created: int = field(default_factory=lambda: int(time.time()))
    admission: Admission | None = None  # the prompts' places in the waiting queue, reserved up front

    def index(self, prompt: int, sample: int) -> int:
        return prompt * self.params.n + sample


class OpenAIServing:
    """The logic behind the OpenAI routes; the FastAPI layer (server/api_server.py) only parses,
    authenticates and turns OpenAIError into responses."""

    def __init__(self, llm: AsyncLLM, model_name: str, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None):
        """tool_call_parser: how tool calls are read from the text under tool_choice auto;
        reasoning_parser: how reasoning is told from the answer (server/parsers: vLLM's names)."""
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_call_parser!r}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {reasoning_parser!r}")
        self.llm, self.model_name, self.tool_call_parser = llm, model_name, tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.max_model_len = llm.model_config.max_model_len

    def models(self) -> dict:
        """The served model; with speculative decoding, its config under vLLM's keys."""
        spec = getattr(getattr(self.llm, "engine_cfg", None), "speculative", None)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "shuttle", "root": str(self.llm.model_dir),
                                            "max_model_len": self.max_model_len,
                                            **({"speculative_config": spec.to_dict()} if spec else {})}]}

    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """vLLM's /tokenize: the prompt's (or the rendered conversation's) token ids."""
        self.check_model(req.model)
        if self.llm.tokenizer is None:
            raise OpenAIError("this model has no tokenizer", param="prompt")
        if isinstance(req, TokenizeChatRequest):
            _, ids = self._render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                  req.chat_template_kwargs)
        else:
            ids = self.llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = self.llm.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: the text of token ids (special tokens kept)."""
        self.check_model(req.model)
        vocab = self.llm.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        if self.llm.tokenizer is None:
            raise OpenAIError("this model has no tokenizer", param="tokens")
        return {"prompt": self.llm.tokenizer.decode(req.tokens)}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                              status=404, param="model", code="model_not_found")

    # -- building jobs ------------------------------------------------------------------------------
    def completion_job(self, req: CompletionRequest) -> _Job:
        self.check_model(req.model)
        prompts = [self._encode(p, "prompt") for p in req.prompts()]
        max_tokens = min(self._max_tokens(req.max_tokens, len(ids), "max_tokens") for ids in prompts)
        structured = req.structured()
        params = req.sampling_params(max_tokens, req.logprobs, _max_or_none(req.prompt_logprobs, req.echo_logprobs()),
                                     structured[0] if structured else None)
        self._check_params(params)
        echo = [self._decode(ids) if not isinstance(p, str) else p for p, ids in zip(req.prompts(), prompts)] \
            if req.echo else None
        return _Job("text_completion", f"cmpl-{secrets.token_hex(12)}", self.model_name, prompts, params, echo,
                    req.echo_logprobs() is not None, req.prompt_logprobs is not None)

    def chat_job(self, req: ChatCompletionRequest) -> _Job:
        self.check_model(req.model)
        tools = req.tool_mode(self.tool_call_parser)
        extra = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}
        if req.reasoning_effort is not None:
            extra["reasoning_effort"] = req.reasoning_effort
        text, ids = self._render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                 req.chat_template_kwargs, **extra)
        ids = self._check_prompt(ids, "messages")
        structured = req.structured()
        forced = self.tool_constraint(tools, text)
        if forced is not None:
            if structured is not None:
                raise OpenAIError(f"tool_choice {tools.mode} is itself an output constraint: drop {structured[1]}",
                                  param=structured[1])
            structured = (forced, "tool_choice")
        params = req.sampling_params(self._max_tokens(req.requested_max_tokens(), len(ids), "max_tokens"),
                                     req.requested_logprobs(), structured=structured[0] if structured else None)
        output, end_texts = self.chat_output(text, tools, "skip_special_tokens" in req.model_fields_set)
        if end_texts:
            params = dataclasses.replace(params, skip_special_tokens=False)
        self._check_params(params)
        return _Job("chat.completion", f"chatcmpl-{secrets.token_hex(12)}", self.model_name, [ids], params,
                    prompt_logprobs=req.prompt_logprobs is not None, tools=tools, output=output,
                    end_texts=end_texts)

    def tool_constraint(self, tools: ToolMode | None, prompt: str) -> StructuredOutputs | None:
        """The grammar of tool_choice required / named (None otherwise): with a tool parser, the
        family's markup after its reasoning, where the server parses reasoning."""
        if tools is None or tools.parser is None:
            return tools.constraint() if tools is not None else None
        splitter = self._splitter(tools)
        prefix = splitter().forced_prefix(splitter().starts_in_reasoning(prompt), self.markup) if splitter else None
        return tools.constraint(self.markup, prefix)

    @functools.cached_property
    def markup(self) -> Markup:
        return Markup.of(self.llm.tokenizer)

    def _splitter(self, tools: ToolMode | None) -> type[ReasoningParser] | None:
        """What tells reasoning from the answer: the --reasoning-parser, else the tool parser's own
        (gpt-oss's channels)."""
        if self.reasoning_parser:
            return REASONING_PARSERS[self.reasoning_parser]
        return tools.parser.reasoning_parser if tools is not None and tools.parser is not None else None

    def chat_output(self, prompt: str, tools: ToolMode | None, skip_given: bool
                    ) -> tuple[Callable[[], ChatOutput] | None, tuple[str, ...]]:
        """How a chat request's choices are parsed: a maker of ChatOutput (None: the text is the
        content, or tool_choice is required / named without a tool parser), and, where a parser's
        markup is special tokens (and the request did not set skip_special_tokens), the
        end-of-sequence tokens' texts to cut off the text (it is then decoded with special tokens kept)."""
        if tools is not None and tools.parser is None:
            return None, ()
        reasoning_cls = REASONING_PARSERS[self.reasoning_parser] if self.reasoning_parser else None
        tools_cls = tools.parser if tools is not None else None
        if reasoning_cls is None and tools_cls is None:
            return None, ()
        splitter = self._splitter(tools)
        opened = splitter is not None and splitter().starts_in_reasoning(prompt)

        def make() -> ChatOutput:
            return ChatOutput(reasoning_cls() if reasoning_cls else None,
                              tools_cls(tools.functions) if tools_cls else None, opened)

        special = any(c is not None and c.needs_special_tokens for c in (reasoning_cls, tools_cls))
        return make, (self._end_texts() if special and not skip_given else ())

    def _end_texts(self) -> tuple[str, ...]:
        tok = self.llm.tokenizer
        if tok is None:
            return ()
        ids = sorted(self.llm.engine.eos_token_ids)
        return tuple(t for t in tok.convert_ids_to_tokens(ids) if t)

    def _render(self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                template_kwargs: dict | None, **extra) -> tuple[str, list[int]]:
        """The conversation's text and token ids, rendered by the chat template; 400 if the template
        refuses."""
        try:
            return self.llm.render_chat([m.as_template_input() for m in messages], add_generation_prompt,
                                        continue_final_message, **{**(template_kwargs or {}), **extra})
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None

    def _check_params(self, params: SamplingParams) -> None:
        if self.llm.tokenizer is None and params.stop:  # as LLM._encode: stop strings need the text
            raise OpenAIError("this model has no tokenizer: stop strings cannot be matched", param="stop")
        try:
            check_params(params, self.llm.model_config)
        except ValueError as e:
            raise OpenAIError(str(e), param=str(e).split(" ", 1)[0]) from None

    def _encode(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            if self.llm.tokenizer is None:
                raise OpenAIError("this model has no tokenizer: send the prompt as token ids", param=param)
            prompt = self.llm.tokenizer.encode(prompt)
        return self._check_prompt(prompt, param)

    def _check_prompt(self, ids: list[int], param: str) -> list[int]:
        try:
            return check_prompt(ids, self.llm.model_config)
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
                                                 admission=job.admission, validated=True):
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
                choices.append(self._choice(job, final[i], c, c.text, c.token_ids, c.logprobs or [], full=True))
        body = {"id": job.id, "object": job.kind, "created": job.created, "model": job.model, "choices": choices,
                "usage": _usage(job, final.values())}
        if job.prompt_logprobs and job.kind == "chat.completion":  # vLLM: beside the choices
            body["prompt_logprobs"] = _prompt_logprobs(final[0].prompt_logprobs)
        return body

    async def stream(self, job: _Job, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
        """Server-sent events of the job; the caller cancels it when the client goes away."""
        chunk_kind = "chat.completion.chunk" if job.kind == "chat.completion" else "text_completion"
        started, ended = set(), set()  # choices that sent their first chunk, their finish_reason
        streamers: dict[int, ChatOutput | ToolStreamer] = {}  # chat: each choice's text -> message deltas
        offsets: dict[int, int] = {}  # completions' logprobs: each choice's text_offset so far, as vLLM runs it on
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
                    streamer = None
                    if job.output is not None:
                        streamer = streamers.setdefault(index, job.output())
                    elif job.tools is not None:
                        streamer = streamers.setdefault(index, ToolStreamer(job.tools))
                    choice = self._choice(job, out, c, text, c.delta_token_ids, lps, full=False, first=first,
                                          streamer=streamer, text_offset=offsets.get(index, 0))
                    if job.kind != "chat.completion" and choice["logprobs"]:
                        offsets[index] = offsets.get(index, 0) + sum(map(len, choice["logprobs"]["tokens"]))
                    choices.append(choice)
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

    def _choice(self, job: _Job, out: RequestOutput, c: CompletionOutput, text: str, token_ids: list[int],
                logprobs: list, full: bool, first: bool = False,
                streamer: ChatOutput | ToolStreamer | None = None, text_offset: int = 0) -> dict:
        """One choice of a response (full) or of a chunk (its deltas; first: the choice's first chunk;
        text_offset: a completion chunk's first token's text_offset, the length of the tokens before it)."""
        prompt = int(out.request_id.rsplit("-", 1)[1])
        index = job.index(prompt, c.index)
        lp = None
        if job.echo_logprobs and (full or first):  # the echoed prompt's tokens lead the logprobs
            head = {out.prompt_token_ids[0]: Logprob(None, None, self._decode(out.prompt_token_ids[:1]))}
            token_ids = out.prompt_token_ids + token_ids
            logprobs = [head] + (out.prompt_logprobs or [None])[1:] + logprobs
        if job.params.logprobs is not None:
            lp = _chat_logprobs(token_ids, logprobs, job.params.logprobs) if job.kind == "chat.completion" else \
                _completion_logprobs(token_ids, logprobs, job.params.logprobs, text_offset)
        if job.kind == "chat.completion":
            return self._chat_choice(job, index, c, text, lp, full, first, streamer)
        if full and job.echo is not None:
            text = job.echo[prompt] + text
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if job.prompt_logprobs and (full or first):
            choice["prompt_logprobs"] = _prompt_logprobs(out.prompt_logprobs)
        return choice


    @staticmethod
    def _chat_choice(job: _Job, index: int, c: CompletionOutput, text: str, lp: dict | None, full: bool, first: bool,
                     streamer: ChatOutput | ToolStreamer | None) -> dict:
        finish = c.finish_reason
        if job.output is not None:
            return _parsed_choice(job, index, c, text, lp, full, first, streamer)
        if job.tools is None:
            if full:
                return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                        "finish_reason": finish, "stop_reason": c.stop_reason}
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, "stop_reason": c.stop_reason}
        if full:
            content, calls = job.tools.parse(text)
            if calls and finish == "stop" and job.tools.mode != "named":
                finish = "tool_calls"  # as OpenAI: a named function's call ends with "stop"
            return {"index": index, "message": {"role": "assistant", "content": content, "tool_calls": calls},
                    "logprobs": lp, "finish_reason": finish, "stop_reason": c.stop_reason}
        delta: dict = {"role": "assistant"} if first else {}
        for piece in streamer.feed(text, c.finished):
            if "content" in piece:
                delta["content"] = delta.get("content", "") + piece["content"]
            delta.setdefault("tool_calls", []).extend(piece.get("tool_calls", []))
        if finish == "stop" and streamer.calls and job.tools.mode != "named":
            finish = "tool_calls"
        if not delta.get("tool_calls"):
            delta.pop("tool_calls", None)
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, "stop_reason": c.stop_reason}


def _parsed_choice(job: _Job, index: int, c: CompletionOutput, text: str, lp: dict | None, full: bool, first: bool,
                   streamer: ChatOutput | None) -> dict:
    """A chat choice through its ChatOutput: the whole message, or the deltas of this chunk's text
    (`text`: the detokenizer's delta); the end-of-sequence token's text cut off."""
    finish = c.finish_reason
    named = job.tools is not None and job.tools.mode == "named"  # as OpenAI: its call ends with "stop"
    if full:
        message = job.output().message(cut_end(text, job.end_texts) if c.finished else text)
        if message.get("tool_calls") and finish == "stop" and not named:
            finish = "tool_calls"
        return {"index": index, "message": {"role": "assistant", **message}, "logprobs": lp, "finish_reason": finish,
                "stop_reason": c.stop_reason}
    delta: dict = {"role": "assistant"} if first else {}
    for piece in streamer.feed_delta(text, c.finished, job.end_texts):
        for key, value in piece.items():
            if key == "tool_calls":
                delta.setdefault("tool_calls", []).extend(value)
            else:
                delta[key] = delta.get(key, "") + value
    if finish == "stop" and streamer.calls_sent and not named:
        finish = "tool_calls"
    return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, "stop_reason": c.stop_reason}


def _max_or_none(*values: int | None) -> int | None:
    given = [v for v in values if v is not None]
    return max(given) if given else None


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


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: a banned token's logprob is reported as vLLM does."""
    return max(logprob, MIN_LOGPROB)


def _prompt_logprobs(entries: list[dict | None] | None) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token {token id: {logprob, rank, decoded_token}}, null first."""
    return [None if e is None else {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries or []]


def _completion_logprobs(token_ids: list[int], logprobs: list[dict], k: int, offset: int = 0) -> dict:
    """OpenAI's legacy logprobs, text_offset counted from `offset`; a Logprob of None (the echoed prompt's
    first token) gives nulls."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        chosen = entry[tid]
        text = chosen.decoded_token or ""
        tokens.append(text)
        if chosen.logprob is None:  # the first prompt token: nothing predicts it
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_finite(chosen.logprob))
            tops.append({(lp.decoded_token or ""): _finite(lp.logprob) for _, lp in _ranked(entry, k)} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(token_ids: list[int], logprobs: list[dict], k: int) -> dict:
    def item(lp) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode("utf-8"))}

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
