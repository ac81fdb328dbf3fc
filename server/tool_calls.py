"""Tool calling for chat completions: what each tool_choice makes the model generate, and how its text
becomes OpenAI's tool_calls (whole, or as stream deltas).

    none      the tools are shown to the template; the answer is text.
    auto      the model decides; its text is parsed by the --tool-call-parser of its family
              (hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen and Hermes templates).
    required  structured output: a JSON array of one or more {"name", "parameters"} calls, each
              valid for its function's parameters schema.
    {"type": "function", "function": {"name": N}}
              structured output: the arguments of N, valid for its parameters schema.
"""
import json
import re
import secrets
from dataclasses import dataclass, field

from attention_nodes.structured import StructuredOutputs

PARSERS = ("hermes",)


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolMode:
    """How one request's tools are used. mode: auto | required | named. functions: name ->
    parameters schema. name: the forced function (named)."""

    mode: str
    functions: dict[str, dict]
    name: str | None = None
    parallel: bool = True  # required may make several calls (parallel_tool_calls false: exactly one)

    def constraint(self) -> StructuredOutputs | None:
        """The grammar that enforces required and named calls (auto: none)."""
        if self.mode == "named":
            return StructuredOutputs("json", json.dumps(self.functions[self.name]))
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for n, p in self.functions.items()]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if self.parallel else {"maxItems": 1})}
            return StructuredOutputs("json", json.dumps(array))
        return None

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """The whole output as (content, tool_calls)."""
        if self.mode == "named":
            return None, [tool_call(self.name, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except ValueError:  # cut by max_tokens: what was generated is the content
                return text, []
            return None, [tool_call(c["name"], json.dumps(c["parameters"])) for c in calls]
        return parse_hermes(text)


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """Hermes/Qwen style: `<tool_call>{"name": N, "arguments": {...}}</tool_call>` blocks; the text
    before the first block is the content. A block that is not such JSON stays in the content."""
    calls, content_end = [], None
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            continue
        if not isinstance(name, str):
            continue
        calls.append(tool_call(name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        content_end = m.start() if content_end is None else content_end
    if not calls:
        return text, []
    content = text[:content_end].strip()
    return content or None, calls


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_OPEN = "<tool_call>"


@dataclass
class ToolStreamer:
    """Turns one choice's text deltas into OpenAI chat deltas: content while it is text, then a
    tool_calls delta per call (named: the arguments stream as they are generated)."""

    tools: ToolMode
    text: str = ""
    sent: int = 0  # characters of text already sent as content
    calls: int = 0  # tool calls already sent
    done: bool = False
    _named_started: bool = field(default=False)

    def feed(self, delta: str, finished: bool) -> list[dict]:
        """The delta messages (without role) for the next piece of text."""
        self.text += delta
        if self.tools.mode == "named":
            out = []
            if not self._named_started:
                self._named_started, self.calls = True, 1
                call = tool_call(self.tools.name, "")
                out.append({"tool_calls": [{"index": 0, **call}]})
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        if self.tools.mode == "required":
            return self._calls_delta(*self.tools.parse(self.text)) if finished else []
        return self._auto(finished)

    def _auto(self, finished: bool) -> list[dict]:
        start = self.text.find(_OPEN)
        if start < 0:  # send the text, but hold back what may be the start of a <tool_call>
            hold = 0 if finished else _partial_suffix(self.text, _OPEN)
            return self._content(len(self.text) - hold)
        out = self._content(start)
        if finished or self.text.rstrip().endswith("</tool_call>"):
            content, calls = parse_hermes(self.text)
            new = calls[self.calls:]
            if new:
                out += [{"tool_calls": [{"index": self.calls + i, **c}]} for i, c in enumerate(new)]
                self.calls += len(new)
            elif finished and not calls:  # the block never closed or was not a call: it is content
                out += self._content(len(self.text))
        return out

    def _content(self, upto: int) -> list[dict]:
        if upto <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:upto], upto
        return [{"content": piece}]

    def _calls_delta(self, content: str | None, calls: list[dict]) -> list[dict]:
        if not calls:
            return [{"content": content}] if content else []
        self.calls = len(calls)
        return [{"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
