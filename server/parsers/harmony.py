"""openai / openai_gptoss (gpt-oss): OpenAI's harmony format (github.com/openai/harmony, docs/format.md).

The output is a run of messages `<|start|>{header}<|message|>{body}{terminator}`; the prompt ends with
`<|start|>assistant`, so the first message comes without it. A header holds the role, `<|channel|>`
and the channel (analysis: the chain of thought; final: the answer; commentary: function calls and
preambles), a recipient `to=functions.NAME` (before or after the channel) and a content type
(`json` or `<|constrain|>json`). A body ends at `<|end|>`, `<|call|>` (a call: the model waits for
the result) or `<|return|>` (done). For example:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The markup is special tokens: the text must be decoded with them kept (needs_special_tokens).

GptOssReasoningParser (openai_gptoss, vLLM's name) splits the text into reasoning (the analysis
messages' bodies, one per line) and the answer: the final and preamble messages' bodies (one per
line), with every function-call message kept whole, as `<|start|>assistant{header}<|message|>{body}
{terminator}`, where the tool parser finds it. A call message that ends without a terminator (the
next message starts, or the text ends after valid arguments: the serving layer cut the stop token
off) gets `<|call|>`; one cut short (max_tokens) stays open, so its text is content.
HarmonyToolParser (openai) finds those call messages, in that answer or in the raw text.
"""
import re
from dataclasses import dataclass
from typing import ClassVar

from server.parsers.base import Block, Call, ReasoningParser, ToolParser, _partial_suffix, json_arguments, partial_arguments
from server.parsers.forced import Markup, args, free_text, optional, seq

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ROLE = "assistant"
FUNCTIONS = "functions."
BODY_STOPS = (END, CALL, RETURN, START)  # what ends a body (a new message ends one that lacks a terminator)
_BODY_STOP = re.compile("|".join(re.escape(s) for s in BODY_STOPS))
_HEADER_STOP = re.compile("|".join(re.escape(s) for s in (MESSAGE,) + BODY_STOPS))
_HEADS = (CHANNEL, "to=")  # how the first message's header begins (the prompt wrote `<|start|>assistant`)

_REASONING, _CONTENT, _CALL = "reasoning", "content", "call"


@dataclass(frozen=True)
class _Message:
    start: int  # its `<|start|>`, or 0 for the output's first message
    header: str | None  # None: the header is still arriving
    body: int = 0  # where the body begins
    body_end: int | None = None  # where it ends (None: still open)
    end: int | None = None  # after its terminator (body_end where the next message cut it short)


def _messages(text: str, opened: bool, final: bool) -> list[_Message] | None:
    """The messages of `text`, in order; the last may be open. None while the text may still become
    the first message's header (not final). opened: the prompt left the model in an analysis body.
    Text that is neither a header nor inside a message (between a terminator and the next
    `<|start|>`) belongs to no message. A first message without a header is a body of its own (the
    prompt opened it, or the text is not harmony)."""
    out: list[_Message] = []
    lead = text.lstrip()
    if opened:
        first = _Message(0, CHANNEL + "analysis")
    elif lead.startswith(_HEADS):
        first = _Message(0, None)
    elif not final and any(h.startswith(lead) for h in _HEADS):
        return None
    else:
        first = _Message(0, "")
    msg = first
    while True:
        if msg.header is None:  # read the header (the first message's begins at 0, others after <|start|>)
            head_at = msg.start if msg is first else msg.start + len(START)
            m = _HEADER_STOP.search(text, head_at)
            if m is None:
                out.append(msg)
                return out
            if m.group() != MESSAGE:  # a header with no body: skip it
                msg = _next(text, m.start() if m.group() == START else m.end())
                if msg is None:
                    return out
                continue
            msg = _Message(msg.start, text[head_at:m.start()], m.end())
        m = _BODY_STOP.search(text, msg.body)
        if m is None:
            out.append(msg)
            return out
        cut = m.group() == START
        msg = _Message(msg.start, msg.header, msg.body, m.start(), m.start() if cut else m.end())
        out.append(msg)
        msg = _next(text, msg.end)
        if msg is None:
            return out


def _next(text: str, pos: int) -> _Message | None:
    i = text.find(START, pos)
    return None if i < 0 else _Message(i, None)


def _header(header: str) -> tuple[str | None, str | None, str | None]:
    """(channel, recipient, content type) of a header, as harmony reads it."""
    channel = None
    i = header.find(CHANNEL)
    if i >= 0:
        channel = re.match(r"[^\s<]*", header[i + len(CHANNEL):]).group()
        header = header[:i] + " " + header[i + len(CHANNEL) + len(channel):]
    parts = header.replace(CONSTRAIN, " " + CONSTRAIN).split()
    recipient = next((p[3:] for p in parts if p.startswith("to=")), None)
    rest = [p for p in parts if not p.startswith("to=") and p != ROLE]
    return channel, recipient, " ".join(rest) or None


def _kind(header: str) -> str:
    """A call (recipient functions.*); reasoning (the analysis channel, or a message to another
    recipient: a built-in tool's call, which this server does not run); otherwise content (final,
    commentary without a recipient (a preamble, shown to the user, as vLLM does), no channel)."""
    channel, recipient, _ = _header(header)
    if recipient is not None:
        return _CALL if recipient.startswith(FUNCTIONS) else _REASONING
    return _REASONING if channel == "analysis" else _CONTENT


def _calls(header: str, body: str) -> tuple[Call, ...] | None:
    """The call of a function-call message; None unless the body is a JSON object (whatever the
    content type says: arguments are JSON) and the recipient names a function."""
    name, args = _header(header)[1][len(FUNCTIONS):], json_arguments(body)
    if not name or args is None:
        return None
    return (Call(name, args),)


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    start = CHANNEL + "analysis" + MESSAGE
    end = END
    needs_special_tokens = True

    def starts_in_reasoning(self, prompt: str) -> bool:
        """Whether the prompt ends inside an analysis body (`<|start|>assistant<|channel|>analysis
        <|message|>...`); the published template ends with `<|start|>assistant` (False)."""
        i = prompt.rfind(START)
        if i < 0:
            return False
        header, sep, body = prompt[i + len(START):].partition(MESSAGE)
        return bool(sep) and _BODY_STOP.search(body) is None and _kind(header) == _REASONING \
            and _header(header)[1] is None

    def forced_prefix(self, starts_in_reasoning: bool, markup: Markup) -> dict:
        """An analysis message (its body, where the prompt opened it) before forced calls."""
        body = seq(free_text(END), markup.lit(END + START + ROLE))
        return body if starts_in_reasoning else optional(seq(markup.lit(self.start), body))

    def split(self, text: str, final: bool, starts_in_reasoning: bool) -> tuple[str, str]:
        msgs = _messages(text, starts_in_reasoning, final)
        if msgs is None:
            return "", ""
        reasoning, answer, after_content = "", "", False
        for m in msgs:
            if m.header is None:
                break  # a header still arriving: nothing of it shows yet
            body = text[m.body:m.body_end] if m.body_end is not None else text[m.body:]
            if m.body_end is None and not final:
                body = body[:len(body) - _partial_suffix(body, BODY_STOPS)]
            kind = _kind(m.header)
            if kind == _REASONING:
                reasoning += ("\n" if reasoning and body else "") + body
            elif kind == _CONTENT:
                answer += ("\n" if after_content and body else "") + body
                after_content = after_content or bool(body)
            else:
                head = text[m.start:m.body]  # the first message's lacks `<|start|>assistant`: add it
                answer += (head if head.startswith(START) else START + ROLE + head) + body
                if m.body_end is not None:
                    answer += text[m.body_end:m.end] if m.end > m.body_end else CALL
                elif final and _calls(m.header, body) is not None:
                    answer += CALL  # the text ends after a whole call: its stop token was cut off
                after_content = False
        return reasoning, answer


class HarmonyToolParser(ToolParser):
    """Blocks: the function-call messages (from their `<|start|>`, or 0 for the first message, to
    their terminator); a message whose header is still arriving is an open block (it may be a call).
    On the raw text (no reasoning parser) it finds the calls, but the other messages' headers and
    the analysis stay in the content: see `reasoning_parser`."""

    name = "openai"
    markers = (START, CHANNEL)
    needs_special_tokens = True
    # The parser that takes this family's answer out of its message markup: ChatOutput applies it
    # (dropping its reasoning) when no --reasoning-parser is given.
    reasoning_parser: ClassVar[type[ReasoningParser]] = GptOssReasoningParser
    parallel_calls = False  # a call message ends the turn (<|call|>: the model waits for the result)

    def call_format(self, name: str, schema: dict, markup: Markup) -> dict:
        """A commentary message to the function, its JSON arguments; the grammar ends there, so the
        end-of-sequence token (<|call|>) follows."""
        return seq(markup.lit(f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"), args(schema))

    def blocks(self, text: str) -> list[Block]:
        msgs = _messages(text, False, False)
        if msgs is None:
            return [Block(0, None)]
        out = []
        for m in msgs:
            if m.header is None:
                out.append(Block(m.start, None))
                break
            if _kind(m.header) != _CALL:
                continue
            if m.body_end is None:
                out.append(Block(m.start, None))
                break
            out.append(Block(m.start, m.end, _calls(m.header, text[m.body:m.body_end])))
        return out

    def pending(self, text: str, block: Block) -> list[Call]:
        msgs = _messages(text, False, False)
        m = msgs[-1] if msgs else None
        if m is None or m.start != block.start or m.header is None or _kind(m.header) != _CALL:
            return []
        name = _header(m.header)[1][len(FUNCTIONS):]
        return [Call(name, partial_arguments(text[m.body:], BODY_STOPS))] if name else []
