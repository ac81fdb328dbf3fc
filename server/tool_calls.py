"""Tool calling for chat completions: what each tool_choice makes the model generate, and how its text
becomes OpenAI's tool_calls (whole, or as stream deltas).

    none      the tools are shown to the template; the answer is text.
    auto      the model decides; its text is parsed by the --tool-call-parser of its family
              (server/parsers: server/parsers/output.ChatOutput, whole and streamed).
    required  structured output: a JSON array of one or more {"name", "parameters"} calls, each
              valid for its function's parameters schema.
    {"type": "function", "function": {"name": N}}
              structured output: the arguments of N, valid for its parameters schema.
"""
import json
from dataclasses import dataclass, field

from attention_nodes.structured import StructuredOutputs
from server.parsers.output import call_id


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

