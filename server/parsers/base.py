"""How a model's text becomes OpenAI's reasoning_content, content and tool_calls, whole or streamed.

A family writes tool calls and reasoning in its own markup. Each parser here only *finds* that
markup in the text so far; the splitting into content, reasoning and calls, and the stream deltas,
are computed here once for every family, so the streamed pieces always add up to the whole answer:

    reasoning, answer = reasoning_parser.split(text, final=True, starts_in_reasoning)
    content, calls = split_tools(tool_parser, answer, final=True)

On a prefix of the text (final=False) both functions return what is safe to show so far: every
string is a prefix of what the whole text gives and every call is final. ChatOutput (output.py)
turns growing texts into deltas by that rule (Growing). Where a family writes its arguments as JSON
(hermes, deepseek_v3 / v31, kimi_k2, openai), a call still being written also streams
(`pending_calls`): its name and id once written, its arguments as they arrive, the JSON text exactly
as the model writes it (which is also the whole response's `arguments`). Should its block then not
close as valid markup (malformed, or cut short by max_tokens), the stream has sent a call that the
whole response has as content; the XML formats send a call when its block closes.

Content around calls: with no valid call the content is the text as it is. With calls it is the
text before the first call with trailing whitespace removed, then each stretch of text between and
after calls, stripped, each on a new line. A block that closes but does not parse (malformed call)
is content, as is a block still open when the text ends.
"""
import json
from dataclasses import dataclass
from typing import ClassVar

from server.parsers.forced import Markup, blank, free_text, optional, seq


@dataclass(frozen=True)
class Call:
    """One function call: its name, its arguments as JSON text, and the id the model wrote for it
    where its format has one (Kimi K2's `functions.NAME:IDX`, which its template writes back)."""

    name: str
    arguments: str
    id: str | None = None


@dataclass(frozen=True)
class Block:
    """A stretch of tool-call markup in the text: [start, end); end None while it is not closed.
    calls: the calls it holds (in order), or None when it closed but is not valid markup of the
    family (then its text is content). Once closed, a block never changes as the text grows."""

    start: int
    end: int | None
    calls: tuple[Call, ...] | None = None


class ToolParser:
    """A family's tool-call markup. Subclasses set `name` (the --tool-call-parser value, vLLM's name)
    and `markers` (every string that opens a block: a text ending in a proper prefix of one is held
    back while streaming), and implement `blocks`. functions: the request's tools, name -> their
    `parameters` JSON schema, for formats whose argument values are text typed by the schema."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]
    # The markup is special tokens of the family's tokenizer (they must not be skipped when decoding).
    needs_special_tokens: ClassVar[bool] = False
    # Formats whose whole output is message markup (gpt-oss's channels): the parser that takes the
    # answer out of it, applied when the server has no --reasoning-parser (its reasoning dropped).
    reasoning_parser: ClassVar[type["ReasoningParser"] | None] = None
    # tool_choice required / named (forced.py): the markup around all calls, between two calls, and
    # whether one answer may hold several calls.
    section: ClassVar[tuple[str, str]] = ("", "")
    separator: ClassVar[str] = ""
    parallel_calls: ClassVar[bool] = True

    def __init__(self, functions: dict[str, dict] | None = None):
        self.functions = functions

    def call_format(self, name: str, schema: dict, markup: Markup) -> dict:
        """The structural-tag format of one call of `name` in this family's markup, its arguments
        held to `schema` (forced.args); markup knows the tokenizer's special tokens."""
        raise NotImplementedError

    def blocks(self, text: str) -> list[Block]:
        """The blocks in `text`, in order, not overlapping; at most the last is open."""
        raise NotImplementedError

    def pending(self, text: str, block: Block) -> list[Call]:
        """The calls of an open block so far, the last maybe unfinished: each one's name and id as
        they will be, its arguments a prefix of what they will be if the block closes valid. [] for
        formats whose arguments are rewritten when the block closes (the XML ones)."""
        return []


class DelimitedToolParser(ToolParser):
    """Markup whose blocks start at `open` and end at `close`. Subclasses implement `parse_body`
    (the calls between the two, None when malformed), or `scan` for a block whose end needs more
    than finding `close` (a value that may contain it). One instance parses one choice's growing
    text: a closed block depends only on the text up to its end, so the closed blocks found so far
    are kept and the next call scans only what follows them."""

    open: ClassVar[str]
    close: ClassVar[str]

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "open" in cls.__dict__:
            cls.markers = (cls.open,)

    def __init__(self, functions: dict[str, dict] | None = None):
        super().__init__(functions)
        self._closed: list[Block] = []
        self._closed_text = ""

    def parse_body(self, body: str) -> tuple[Call, ...] | None:
        raise NotImplementedError

    def scan(self, text: str, start: int) -> tuple[int | None, tuple[Call, ...] | None]:
        """(end, calls) of the block opening at `start`; end None while it is not closed."""
        close = text.find(self.close, start + len(self.open))
        if close < 0:
            return None, None
        return close + len(self.close), self.parse_body(text[start + len(self.open):close])

    def blocks(self, text: str) -> list[Block]:
        out, pos = [], 0
        if self._closed and text.startswith(self._closed_text):
            out, pos = list(self._closed), len(self._closed_text)
        while (start := text.find(self.open, pos)) >= 0:
            end, calls = self.scan(text, start)
            if end is None:
                break
            out.append(Block(start, end, calls))
            pos = end
        self._closed, self._closed_text = list(out), text[:pos]
        return out + [Block(start, None)] if start >= 0 else out


class ReasoningParser:
    """A family's reasoning markup: reasoning between `start` and `end` markers, at the beginning of
    the output (or from the first character when the prompt already opened it). Subclasses may
    override `split` for other layouts (gpt-oss's channels)."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Markup that also ends the reasoning and belongs to the answer (Kimi K2's tool-call section).
    also_ends: ClassVar[tuple[str, ...]] = ()
    needs_special_tokens: ClassVar[bool] = False

    def starts_in_reasoning(self, prompt: str) -> bool:
        """Whether the rendered prompt leaves the model inside its reasoning (the template wrote the
        start marker and no end after it)."""
        i = prompt.rfind(self.start)
        return i >= 0 and prompt.find(self.end, i) < 0

    def forced_prefix(self, starts_in_reasoning: bool, markup: Markup) -> dict:
        """The structural-tag format of the reasoning in front of forced tool calls: free text to the
        end marker (the prompt opened it), or an optional start ... end block; blank space after."""
        body = seq(free_text(self.end), markup.lit(self.end))
        return seq(body if starts_in_reasoning else optional(seq(markup.lit(self.start), body)), blank())

    def split(self, text: str, final: bool, starts_in_reasoning: bool) -> tuple[str, str]:
        """(reasoning, answer) of the text so far; on a prefix (final=False) each is a prefix of the
        whole text's. Reasoning runs from the start marker (or, starts_in_reasoning, the first
        character) to the end marker (or one of also_ends, which stays in the answer); the rest is
        the answer. Text that does not open with the start marker (leading whitespace aside) has no
        reasoning, unless the prompt opened it (then a start marker the model writes again is
        dropped, as vLLM does); reasoning never closed is all reasoning."""
        lead = len(text) - len(text.lstrip())
        rest, body = text[lead:], 0
        if rest.startswith(self.start):
            body = lead + len(self.start)
        elif not final and self.start.startswith(rest) and (rest or not starts_in_reasoning):
            return "", ""  # maybe the start marker, still arriving
        elif not starts_in_reasoning:
            return "", text
        closers = (self.end, *self.also_ends)
        close, closer = first_of(text, closers, body)
        if close < 0:
            reasoning = text[body:]
            if not final:
                reasoning = reasoning[:len(reasoning) - _partial_suffix(reasoning, closers)]
            return reasoning.strip(), ""
        if closer == self.end:
            return text[body:close].strip(), text[close + len(self.end):].lstrip()
        return text[body:close].strip(), text[close:]


def split_tools(parser: ToolParser, text: str, final: bool) -> tuple[str, list[Call]]:
    """(content, calls) of the answer text so far (see the module docstring)."""
    segments, calls, pos, open_at = [], [], 0, None
    for b in parser.blocks(text):
        if b.end is None:
            open_at = b.start
            break
        if b.calls is None:
            continue  # malformed: its text stays in the current stretch of content
        segments.append(text[pos:b.start])
        calls.extend(b.calls)
        pos = b.end
    tail = text[pos:] if open_at is None or final else text[pos:open_at]
    if not final:
        tail = tail[:len(tail) - _partial_suffix(tail, parser.markers)] if open_at is None else tail
        tail = tail.rstrip()
    if not calls:
        return tail, []
    parts = [segments[0].rstrip()] + [s.strip() for s in segments[1:]] + [tail.strip()]
    return "\n".join(p for p in parts if p), calls


def pending_calls(parser: ToolParser, text: str) -> list[Call]:
    """The calls of the answer's open block so far (ToolParser.pending), for streaming."""
    blocks = parser.blocks(text)
    return parser.pending(text, blocks[-1]) if blocks and blocks[-1].end is None else []


def json_arguments(text: str) -> str | None:
    """The arguments as the model wrote them (surrounding whitespace dropped) when they are a JSON
    object, else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return text.strip() if isinstance(value, dict) else None


def partial_arguments(text: str, closers: tuple[str, ...], hold: str = "") -> str:
    """What of arguments still arriving is surely theirs: leading whitespace dropped, and at the end
    whitespace, closing markers (whole or begun), and any of the characters in `hold` (what may close
    the markup around them) held back."""
    text, before = text.lstrip(), None
    while text != before:
        before, text = text, text.rstrip(" \t\r\n" + hold)
        text = text[:len(text) - _partial_suffix(text, closers)]
        text = next((text[:-len(c)] for c in closers if text.endswith(c)), text)
    return text


def first_of(text: str, needles: tuple[str, ...], pos: int) -> tuple[int, str]:
    """(index, needle) of the earliest of `needles` in text[pos:], or (-1, "")."""
    best, found = -1, ""
    for n in needles:
        i = text.find(n, pos)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, n
    return best, found


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of the markers."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class Growing:
    """Deltas of a string that only grows: `take(now)` returns what is new since the last call (a
    value that is not an extension of what was sent gives nothing: the parsers guarantee it is)."""

    def __init__(self):
        self.sent = ""

    def take(self, now: str) -> str:
        if len(now) <= len(self.sent) or not now.startswith(self.sent):
            return ""
        new, self.sent = now[len(self.sent):], now
        return new
