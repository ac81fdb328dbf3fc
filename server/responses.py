"""POST /v1/responses: OpenAI's Responses API (as vLLM serves it) over the chat machinery.

A request's `input` (a string, or a list of items: messages, earlier function calls and their
outputs) becomes a chat conversation, `instructions` a system message in front of it, and the
conversation is rendered by the chat template as /v1/chat/completions renders it (tools,
tool_choice and the --reasoning-parser / --tool-call-parser work the same way). The answer comes
back as output items: `reasoning` (the reasoning parser's reasoning), `message` (output_text) and
`function_call` (call_id, name, arguments), whole or streamed as OpenAI's typed server-sent events
(response.created, response.in_progress, response.output_item.added, ... with a sequence_number
each, ending with response.completed, or response.incomplete when max_output_tokens cut the
answer short).

previous_response_id continues a stored conversation: the server keeps the last MAX_STORED
responses' conversations (input and output, not their instructions, as OpenAI does) in memory;
`store: false` keeps nothing. An unknown id is a 400 with code previous_response_not_found, as
OpenAI answers. Reasoning items sent back as input are accepted and left out of the prompt (chat
templates drop earlier turns' reasoning).

Not supported (400 or ignored as unknown fields): built-in tools (web search, file search, ...),
images and files in the input, background responses, item references, logprobs
(top_logprobs / include). GET and DELETE /v1/responses/{id} read and forget a stored response.
"""
import dataclasses
import json
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pydantic import ValidationError

from attention_nodes.sampling_params import SamplingParams
from server.async_llm import Admission
from server.openai_protocol import ChatCompletionRequest, ChatMessage, FunctionCallIn, OpenAIError, ToolCallIn
from server.openai_serving import OpenAIServing, as_openai_error
from server.outputs import CompletionOutput, RequestOutput
from server.parsers.output import ChatOutput
from server.responses_protocol import (ResponsesFunctionCallItem, ResponsesFunctionCallOutputItem, ResponsesMessageItem,
                                       ResponsesRequest, ResponsesTextFormat, ResponsesToolChoiceFunction)
from server.tool_calls import ToolMode, ToolStreamer

MAX_STORED = 1000  # responses whose conversation previous_response_id can continue


# -- the conversation ------------------------------------------------------------------------------------
def input_messages(items: str | list, history: list[ChatMessage]) -> list[ChatMessage]:
    """The conversation after `history` (a previous response's) with the request's input items:
    function calls join the assistant turn before them, outputs become tool messages."""
    if isinstance(items, str):
        return [*history, ChatMessage(role="user", content=items)]
    messages = list(history)
    names: dict[str, str] = {c.id: c.function.name for m in history for c in m.tool_calls or []}
    for item in items:
        if isinstance(item, ResponsesMessageItem):
            messages.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, ResponsesFunctionCallItem):
            call = ToolCallIn(id=item.call_id, function=FunctionCallIn(name=item.name, arguments=item.arguments))
            names[item.call_id] = item.name
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, ResponsesFunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output,
                                        name=names.get(item.call_id)))
        # reasoning items: not rendered (templates drop earlier turns' reasoning)
    return messages


def _output_message(items: list[dict]) -> ChatMessage:
    """A response's output items as the assistant turn that continues its conversation."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [ToolCallIn(id=it["call_id"], function=FunctionCallIn(name=it["name"], arguments=it["arguments"]))
             for it in items if it["type"] == "function_call"]
    return ChatMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)


class ResponseStore:
    """The last `capacity` responses (oldest dropped first): each one's conversation (instructions
    not included), what a later previous_response_id continues, and its response object (GET)."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._stored: OrderedDict[str, tuple[list[ChatMessage], dict]] = OrderedDict()

    def put(self, response_id: str, conversation: list[ChatMessage], body: dict) -> None:
        self._stored[response_id] = (conversation, body)
        while len(self._stored) > self.capacity:
            self._stored.popitem(last=False)

    def get(self, response_id: str) -> list[ChatMessage] | None:
        found = self._stored.get(response_id)
        return found[0] if found else None

    def body(self, response_id: str) -> dict | None:
        found = self._stored.get(response_id)
        return found[1] if found else None

    def delete(self, response_id: str) -> bool:
        return self._stored.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._stored)


# -- running --------------------------------------------------------------------------------------------
@dataclass
class ResponsesJob:
    """One /v1/responses request as it runs."""

    id: str
    req: ResponsesRequest
    ids: list[int]
    params: SamplingParams
    conversation: list[ChatMessage]  # without the instructions: what a later previous_response_id continues
    tools: ToolMode | None = None  # tool_choice required / named / auto
    output: Callable[[], ChatOutput] | None = None  # a reasoning or tool-call parser reads the text
    end_texts: tuple[str, ...] = ()
    created_at: int = field(default_factory=lambda: int(time.time()))
    admission: Admission | None = None  # the request's place in the waiting queue, reserved up front


_RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


def _renamed(e: OpenAIError) -> OpenAIError:
    """An error of the chat machinery with the Responses API's field names."""
    if e.param in _RENAMED or e.param == "max_completion_tokens":
        e.param = _RENAMED.get(e.param, "max_output_tokens")
    e.message = re.sub(r"\bmax_(?:completion_)?tokens\b", "max_output_tokens", e.message)
    e.message = re.sub(r"(tools\[\d+\])\.function\.", r"\1.", e.message)  # the tools are flat here
    e.args = (e.message,)
    return e


class ResponsesServing:
    """The logic behind /v1/responses, on the chat machinery of `serving`."""

    def __init__(self, serving: OpenAIServing, max_stored: int = MAX_STORED):
        self.serving, self.llm = serving, serving.llm
        self.store = ResponseStore(max_stored)

    def job(self, req: ResponsesRequest) -> ResponsesJob:
        try:
            return self._job(req)
        except OpenAIError as e:
            raise _renamed(e) from None

    def _job(self, req: ResponsesRequest) -> ResponsesJob:
        s = self.serving
        s.check_model(req.model)
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            found = self.store.get(req.previous_response_id)
            if found is None:
                raise OpenAIError(f"Previous response with id '{req.previous_response_id}' not found.",
                                  param="previous_response_id", code="previous_response_not_found")
            history = found
        conversation = input_messages(req.input, history)
        messages = ([ChatMessage(role="system", content=req.instructions)] if req.instructions else []) + conversation
        chat = self._chat_request(req, messages)
        tools = chat.tool_mode(s.tool_call_parser)
        extra: dict[str, Any] = {"tools": [t.model_dump(exclude_none=True) for t in chat.tools]} if chat.tools else {}
        if chat.reasoning_effort is not None:
            extra["reasoning_effort"] = chat.reasoning_effort
        text, ids = s._render(messages, True, False, None, **extra)
        ids = s._check_prompt(ids, "input")
        structured = chat.structured()
        forced = s.tool_constraint(tools, text)
        if forced is not None:
            if structured is not None:
                raise OpenAIError(f"tool_choice {tools.mode} is itself an output constraint: drop text.format",
                                  param="text")
            structured = (forced, "tool_choice")
        params = chat.sampling_params(s._max_tokens(req.max_output_tokens, len(ids), "max_output_tokens"), None,
                                      structured=structured[0] if structured else None)
        output, end_texts = s.chat_output(text, tools, False)
        if end_texts:
            params = dataclasses.replace(params, skip_special_tokens=False)
        s._check_params(params)
        return ResponsesJob(f"resp_{secrets.token_hex(24)}", req, ids, params, conversation, tools, output, end_texts)

    @staticmethod
    def _chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request whose tool, sampling and output-format rules apply to `req`."""
        fields: dict[str, Any] = {"messages": messages, "model": req.model}
        for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop",
                     "parallel_tool_calls"):
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        fields["ignore_eos"] = req.ignore_eos
        if req.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in req.tools]
        if isinstance(req.tool_choice, ResponsesToolChoiceFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
        elif req.tool_choice is not None:
            fields["tool_choice"] = req.tool_choice
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise OpenAIError("text.format json_schema needs schema", param="text")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, **({"strict": fmt.strict} if fmt.strict is not None else {})}}
        if req.reasoning is not None and req.reasoning.effort is not None:
            fields["reasoning_effort"] = req.reasoning.effort
        try:
            return ChatCompletionRequest.model_validate(fields, strict=False)
        except ValidationError as e:  # the fields were checked already: not expected
            err = e.errors(include_url=False)[0]
            raise OpenAIError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None

    async def _generate(self, job: ResponsesJob) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self.llm.generate(job.ids, job.params, request_id=job.id, admission=job.admission,
                                               validated=True):
                yield out
        except OpenAIError:
            raise
        except Exception as e:
            raise as_openai_error(e) from None

    def _streamer(self, job: ResponsesJob) -> "ChatOutput | ToolStreamer | None":
        if job.output is not None:
            return job.output()
        if job.tools is not None:
            return ToolStreamer(job.tools)
        return None

    def _feed(self, job: ResponsesJob, streamer, c: CompletionOutput, items: "_Items", delta: str) -> None:
        """Hand the choice's new text to `items` as reasoning, content and function calls."""
        if streamer is None:
            if delta:
                items.content(delta)
            return
        if isinstance(streamer, ToolStreamer):
            pieces = streamer.feed(delta, c.finished)
        else:
            pieces = streamer.feed_delta(delta, c.finished, job.end_texts)
        for piece in pieces:
            if piece.get("reasoning_content"):
                items.reasoning(piece["reasoning_content"])
            if piece.get("content"):
                items.content(piece["content"])
            for call in piece.get("tool_calls") or []:
                fn = call.get("function") or {}
                if "id" in call:
                    items.call(call["index"], call["id"], fn.get("name", ""), fn.get("arguments") or "")
                elif fn.get("arguments"):
                    items.arguments(call["index"], fn["arguments"])

    async def full_response(self, job: ResponsesJob) -> dict:
        final = None
        async for out in self._generate(job):
            final = out
        c = final.outputs[0]
        items = _Items(sse=False)
        self._feed(job, self._streamer(job), c, items, c.text)
        return self._finish(job, final, items)

    async def stream(self, job: ResponsesJob) -> AsyncIterator[str]:
        """Server-sent events of the response; the caller cancels it when the client goes away."""
        items = _Items(sse=True)
        items.emit("response.created", response=self._body(job, "in_progress", [], None))
        items.emit("response.in_progress", response=self._body(job, "in_progress", [], None))
        for event in items.drain():
            yield event
        try:
            streamer, final = self._streamer(job), None
            async for out in self._generate(job):
                final, c = out, out.outputs[0]
                self._feed(job, streamer, c, items, c.delta_text)
                for event in items.drain():
                    yield event
            body = self._finish(job, final, items)
            items.emit("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
        except OpenAIError as e:
            items.emit("error", code=e.code, message=e.message, param=e.param)
            body = self._body(job, "failed", items.items, None)
            body["error"] = {"code": "server_error", "message": e.message}
            items.emit("response.failed", response=body)
        for event in items.drain():
            yield event

    def _finish(self, job: ResponsesJob, final: RequestOutput, items: "_Items") -> dict:
        """Close the output, store the conversation (unless store is false) and build the response."""
        c = final.outputs[0]
        status = "incomplete" if c.finish_reason == "length" else "completed"
        items.finish(status)
        reasoning = "".join(p["text"] for it in items.items if it["type"] == "reasoning" for p in it["content"])
        reasoning_tokens = min(len(c.token_ids), len(self.llm.tokenizer.encode(reasoning, add_special_tokens=False))) \
            if reasoning and self.llm.tokenizer is not None else 0
        usage = {"input_tokens": len(job.ids),
                 "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
                 "output_tokens": len(c.token_ids), "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                 "total_tokens": len(job.ids) + len(c.token_ids)}
        body = self._body(job, status, items.items, usage)
        if job.req.store is not False:
            self.store.put(job.id, [*job.conversation, _output_message(items.items)], body)
        return body

    def retrieve(self, response_id: str) -> dict:
        """GET /v1/responses/{id}: the stored response object; 404 when unknown (never stored,
        store false, deleted, or dropped as the oldest)."""
        body = self.store.body(response_id)
        if body is None:
            raise _not_found(response_id)
        return body

    def delete(self, response_id: str) -> dict:
        """DELETE /v1/responses/{id}: forget a stored response (a later previous_response_id naming
        it is a 400, as for any unknown id); 404 when unknown."""
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _body(self, job: ResponsesJob, status: str, output: list[dict], usage: dict | None) -> dict:
        req = job.req
        tool_choice: Any = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if isinstance(tool_choice, ResponsesToolChoiceFunction):
            tool_choice = tool_choice.model_dump()
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": job.id, "object": "response", "created_at": job.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "model": self.serving.model_name, "output": list(output),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False, "temperature": req.temperature,
            "text": {"format": _format_echo(fmt)},
            "tool_choice": tool_choice,
            "tools": [t.model_dump() for t in req.tools or []],
            "top_p": req.top_p, "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
        }


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", status=404, param="response_id",
                       code="response_not_found")


def _format_echo(fmt: ResponsesTextFormat | None) -> dict:
    if fmt is None or fmt.type != "json_schema":
        return {"type": fmt.type if fmt else "text"}
    return {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_, "description": fmt.description,
            "strict": fmt.strict}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


class _Items:
    """The output items of one response as its text arrives, and (sse) the stream events that build
    them, in OpenAI's order: an item is added, its content grows by deltas, and it is done before the
    next one is added. Reasoning, content and function calls each make an item of their own kind."""

    def __init__(self, sse: bool):
        self.sse, self.items, self.seq = sse, [], 0
        self._events: list[str] = []
        self._open: dict | None = None  # the item whose deltas are streaming
        self._calls: dict[int, dict] = {}  # the streamer's call index -> its item

    def emit(self, kind: str, **data) -> None:
        """Queue an event, serialized now (the items it shows keep growing)."""
        if self.sse:
            data = {"type": kind, **data, "sequence_number": self.seq}
            self.seq += 1
            text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
            self._events.append(f"event: {kind}\ndata: {text}\n\n")

    def drain(self) -> list[str]:
        events, self._events = self._events, []
        return events

    def finish(self, status: str) -> None:
        """The answer ended: close the open item; an answer with no item at all gets an empty message."""
        self.close(status)
        if not self.items:
            self.content("")
            self.close(status)

    def _add(self, item: dict) -> dict:
        self.close("completed")
        self.items.append(item)
        self._open = item
        self.emit("response.output_item.added", output_index=len(self.items) - 1, item=item)
        return item

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def reasoning(self, delta: str) -> None:
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = self._add({"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                              "status": "in_progress"})
            item["content"].append({"type": "reasoning_text", "text": ""})
            self.emit("response.content_part.added", **self._where(item), content_index=0,
                      part={"type": "reasoning_text", "text": ""})
        item["content"][0]["text"] += delta
        self.emit("response.reasoning_text.delta", **self._where(item), content_index=0, delta=delta)

    def content(self, delta: str) -> None:
        item = self._open
        if item is None or item["type"] != "message":
            item = self._add({"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                              "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            self.emit("response.content_part.added", **self._where(item), content_index=0, part=part)
        item["content"][0]["text"] += delta
        if delta:
            self.emit("response.output_text.delta", **self._where(item), content_index=0, delta=delta, logprobs=[])

    def call(self, index: int, call_id: str, name: str, arguments: str) -> None:
        """A new function call (its arguments may follow by `arguments`); it is done when the next
        item starts or the answer ends."""
        item = self._add({"id": _new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
                          "arguments": "", "status": "in_progress"})
        self._calls[index] = item
        if arguments:
            self.arguments(index, arguments)

    def arguments(self, index: int, delta: str) -> None:
        item = self._calls.get(index)
        if item is None or item is not self._open:
            return
        item["arguments"] += delta
        self.emit("response.function_call_arguments.delta", **self._where(item), delta=delta)

    def close(self, status: str) -> None:
        """Finish the open item, if any (status: completed, or incomplete when the answer was cut short)."""
        item, self._open = self._open, None
        if item is None:
            return
        where = self._where(item)
        if item["type"] == "message":
            part = item["content"][0]
            self.emit("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            self.emit("response.content_part.done", **where, content_index=0, part=part)
        elif item["type"] == "reasoning":
            part = item["content"][0]
            self.emit("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            self.emit("response.content_part.done", **where, content_index=0, part=part)
        else:
            self.emit("response.function_call_arguments.done", **where, arguments=item["arguments"])
        item["status"] = status
        self.emit("response.output_item.done", output_index=where["output_index"], item=item)

