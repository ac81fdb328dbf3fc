"""Tool calling for chat completions: what each tool_choice makes the model generate, and how its text
becomes OpenAI's tool_calls (whole, or as stream deltas).

    none      the tools are shown to the template; the answer is text.
    auto      the model decides; its text is parsed by the --tool-call-parser of its family
              (server/parsers: server/parsers/output.ChatOutput, whole and streamed).
    required  structured output: one or more calls, each valid for its function's parameters
              schema; with a --tool-call-parser in the family's markup (server/parsers/forced.py)
              and parsed as under auto, else a JSON array of {"name", "parameters"} objects.
    {"type": "function", "function": {"name": N}}
              structured output: one call of N, in the family's markup with a parser, else the
              arguments of N as JSON.
"""
import json
from dataclasses import dataclass, field

from attention_nodes.structured import StructuredOutputs
from server.parsers.base import ToolParser
from server.parsers.forced import Markup, forced_calls
from server.parsers.output import call_id


def tool_call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolMode:
    """How one request's tools are used. mode: auto | required | named. functions: name ->
    parameters schema. name: the forced function (named). parser: the server's --tool-call-parser
    (None: required and named write JSON)."""

    mode: str
    functions: dict[str, dict]
    name: str | None = None
    parallel: bool = True  # required may make several calls (parallel_tool_calls false: exactly one)
    parser: type[ToolParser] | None = None

    def constraint(self, markup: Markup | None = None, prefix: dict | None = None) -> StructuredOutputs | None:
        """The grammar that enforces required and named calls (auto: none); in the parser's markup,
        after `prefix` (the family's reasoning), where there is a parser."""
        if self.mode == "auto":
            return None
        if self.parser is not None:
            names = [self.name] if self.mode == "named" else list(self.functions)
            return StructuredOutputs("structural_tag", forced_calls(
                self.parser(self.functions), names, self.parallel and self.mode == "required", markup or Markup(), prefix))
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
        """The whole output of a named or required choice as (content, tool_calls)."""
        if self.mode == "named":
            return None, [tool_call(self.name, text)]
        try:
            calls = json.loads(text)
        except ValueError:  # cut by max_tokens: what was generated is the content
            return text, []
        return None, [tool_call(c["name"], json.dumps(c["parameters"])) for c in calls]


@dataclass
class ToolStreamer:
    """Turns one choice's text deltas of a named or required choice into OpenAI chat deltas (named:
    the arguments stream as they are generated; required: the calls at the end)."""

    tools: ToolMode
    text: str = ""
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
        return self._calls_delta(*self.tools.parse(self.text)) if finished else []

    def _calls_delta(self, content: str | None, calls: list[dict]) -> list[dict]:
        if not calls:
            return [{"content": content}] if content else []
        self.calls = len(calls)
        return [{"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}]

