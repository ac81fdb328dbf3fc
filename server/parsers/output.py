"""One chat choice's text as OpenAI's message: reasoning (with a --reasoning-parser), then tool
calls in the answer (tool_choice auto, with a --tool-call-parser), the rest content; whole, or as
stream deltas that add up to the whole."""
import secrets

from server.parsers.base import Call, Growing, ReasoningParser, ToolParser, pending_calls, split_tools


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_call(call: Call) -> dict:
    return {"id": call.id or call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class ChatOutput:
    """reasoning / tools: the parsers, or None. starts_in_reasoning: the prompt opened the reasoning
    (ReasoningParser.starts_in_reasoning of the rendered prompt)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, starts_in_reasoning: bool = False):
        self.reasoning, self.tools, self.starts_in_reasoning = reasoning, tools, starts_in_reasoning
        self._reasoning_sent, self._content_sent = Growing(), Growing()
        self._sent: list[list[str]] = []  # each call sent so far (stream index): [name, arguments sent]
        self._slots: list[int] = []       # the text's calls (finished, then pending) -> their stream index
        self.received = ""  # feed_delta's text so far

    @property
    def calls_sent(self) -> int:
        return len(self._sent)

    def parse(self, text: str, final: bool = True) -> tuple[str | None, str, list[Call]]:
        """(reasoning or None without a reasoning parser, content, calls) of the text so far."""
        reasoning, content, calls, _ = self._parse(text, final)
        return reasoning, content, calls

    def _parse(self, text: str, final: bool) -> tuple[str | None, str, list[Call], list[Call]]:
        """parse(), and on a prefix the calls still being written (pending_calls)."""
        reasoning, answer = None, text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.split(text, final, self.starts_in_reasoning)
        elif self.tools is not None and self.tools.reasoning_parser is not None:
            _, answer = self.tools.reasoning_parser().split(text, final, self.starts_in_reasoning)
        if self.tools is None:
            return reasoning, answer, [], []
        content, calls = split_tools(self.tools, answer, final)
        return reasoning, content, calls, ([] if final else pending_calls(self.tools, answer))

    def message(self, text: str) -> dict:
        """The whole choice's message fields: content (None when empty beside tool calls), tool_calls
        (only with a tool parser), reasoning_content and vLLM's alias reasoning (with a reasoning parser)."""
        reasoning, content, calls = self.parse(text)
        out: dict = {"content": content if content or not calls else None}
        if self.tools is not None:
            out["tool_calls"] = [tool_call(c) for c in calls]
        if self.reasoning is not None:
            out["reasoning_content"] = out["reasoning"] = reasoning or None
        return out

    def feed_delta(self, delta: str, final: bool, end_texts: tuple[str, ...] = ()) -> list[dict]:
        """feed() for text that arrives as deltas, as the detokenizer releases them (never a
        character still incomplete or a possible stop string, which the whole text may still
        hold); on the final delta the end-of-sequence token's text (end_texts) is cut off."""
        self.received += delta
        return self.feed(cut_end(self.received, end_texts) if final else self.received, final)

    def feed(self, text: str, final: bool) -> list[dict]:
        """The deltas (without role) for the choice's whole text so far; `final` on its last text."""
        reasoning, content, calls, pending = self._parse(text, final)
        out = []
        if reasoning is not None:
            new = self._reasoning_sent.take(reasoning)
            if new:
                out.append({"reasoning_content": new, "reasoning": new})
        new = self._content_sent.take(content)
        if new:
            out.append({"content": new})
        return out + self._calls_delta(calls + pending)

    def _calls_delta(self, calls: list[Call]) -> list[dict]:
        """A new call: its id, name and arguments so far; a call already sent: its new arguments. A
        call sent while pending whose block did not close valid is left as sent (its place in the
        text taken by the next call, or by none), and that next call gets a stream index of its own."""
        out = []
        for i, c in enumerate(calls):
            if i < len(self._slots):
                sent = self._sent[self._slots[i]]
                if sent[0] == c.name and c.arguments.startswith(sent[1]):
                    if len(c.arguments) > len(sent[1]):
                        out.append({"tool_calls": [{"index": self._slots[i],
                                                    "function": {"arguments": c.arguments[len(sent[1]):]}}]})
                        sent[1] = c.arguments
                    continue
                del self._slots[i:]
            self._slots.append(len(self._sent))
            self._sent.append([c.name, c.arguments])
            out.append({"tool_calls": [{"index": self._slots[i], **tool_call(c)}]})
        del self._slots[len(calls):]
        return out


def cut_end(text: str, end_texts: tuple[str, ...]) -> str:
    """The finished text without the end-of-sequence token that ended it (decoded with special
    tokens kept: end_texts are those tokens' texts)."""
    for end in end_texts:
        if end and text.endswith(end):
            return text[:-len(end)]
    return text
