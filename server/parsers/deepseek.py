"""DeepSeek's markup: tool calls of DeepSeek-V3 / R1 (deepseek_v3) and DeepSeek-V3.1 (deepseek_v31),
reasoning of R1 (deepseek_r1); and SectionToolParser, the shape both families share with Kimi K2.

The calls come as one section holding one or more calls (vLLM's formats, the markers are single
tokens of the tokenizer but not special ones, so they survive skip_special_tokens):

    deepseek_v3:  <｜tool▁calls▁begin｜>
                  <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{ARGS}\\n```<｜tool▁call▁end｜>
                  \\n<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>
                  <｜tool▁calls▁end｜><｜end▁of▁sentence｜>
    deepseek_v31: <｜tool▁calls▁begin｜>
                  <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>...
                  <｜tool▁calls▁end｜>
    (written here on several lines: the markup has no newlines but those shown as \\n)

A section is one Block; it is valid when it holds at least one call, every call parses (a name, a
JSON object of arguments) and only whitespace lies between the calls; otherwise the whole section
is content (vLLM keeps the calls its regex finds and drops the rest). Unlike vLLM, which drops
text after the section, that text is content (the shared rule of base.py).
"""
import re
from typing import ClassVar

from server.parsers.base import Block, Call, ReasoningParser, ToolParser, first_of, json_arguments, partial_arguments
from server.parsers.forced import Markup, args, seq


def _token(words: str) -> str:
    """A DeepSeek marker: '<｜tool calls begin｜>' spelled with U+FF5C bars and U+2581 for spaces."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


CALLS_BEGIN, CALLS_END = _token("tool calls begin"), _token("tool calls end")
CALL_BEGIN, CALL_END, SEP = _token("tool call begin"), _token("tool call end"), _token("tool sep")
END_OF_SENTENCE = _token("end of sentence")

_NAME = re.compile(r"[^\s<>]+")


class SectionToolParser(ToolParser):
    """Calls inside a section: `begins` open it (any of them), `ends` close it (any of them); inside,
    each call runs from `call_begin` to `call_end` and `parse_call` reads what lies between.

    `end_of_text`: the family's end-of-turn tokens. They are in the text when special tokens are
    kept (a request's skip_special_tokens false, or a parser that needs them); after a valid section
    each becomes an empty block (no calls) so it never reaches the content. Before any call they are
    left alone: a block without calls there would take the content before it (the server cuts the
    end-of-sequence token off the text in that case)."""

    begins: ClassVar[tuple[str, ...]]
    ends: ClassVar[tuple[str, ...]]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]
    end_of_text: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if hasattr(cls, "begins"):
            cls.markers = cls.begins + cls.end_of_text

    def parse_call(self, inner: str) -> Call | None:
        """The call written between call_begin and call_end, or None when it is not valid."""
        raise NotImplementedError

    def partial_call(self, inner: str) -> Call | None:
        """A call still being written after call_begin: its name (and id) once they are whole and
        its arguments so far (partial_arguments), or None while the name is still arriving."""
        raise NotImplementedError

    def pending(self, text: str, block: Block) -> list[Call]:
        opener = next(b for b in self.begins if text.startswith(b, block.start))
        body, calls, pos = text[block.start + len(opener):], [], 0
        while (start := body.find(self.call_begin, pos)) >= 0 and not body[pos:start].strip():
            stop = body.find(self.call_end, start)
            inner = body[start + len(self.call_begin):len(body) if stop < 0 else stop]
            call = self.parse_call(inner) if stop >= 0 else self.partial_call(inner)
            if call is None:
                break
            calls.append(call)
            if stop < 0:
                break
            pos = stop + len(self.call_end)
        return calls

    def blocks(self, text: str) -> list[Block]:
        out, pos, called = [], 0, False
        while True:
            at, opener = first_of(text, self.begins + (self.end_of_text if called else ()), pos)
            if at < 0:
                return out
            if opener in self.end_of_text:
                out.append(Block(at, at + len(opener), ()))
                pos = at + len(opener)
                continue
            close, closer = first_of(text, self.ends, at + len(opener))
            if close < 0:
                out.append(Block(at, None))
                return out
            calls = self._section(text[at + len(opener):close])
            out.append(Block(at, close + len(closer), calls))
            called = called or calls is not None
            pos = close + len(closer)

    def _section(self, body: str) -> tuple[Call, ...] | None:
        calls, pos = [], 0
        while True:
            start = body.find(self.call_begin, pos)
            if start < 0:
                break
            stop = body.find(self.call_end, start)
            if body[pos:start].strip() or stop < 0:
                return None
            inner = body[start + len(self.call_begin):stop]
            call = None if self.call_begin in inner else self.parse_call(inner)
            if call is None:
                return None
            calls.append(call)
            pos = stop + len(self.call_end)
        if body[pos:].strip() or not calls:
            return None
        return tuple(calls)


def make_call(name: str, arguments: str) -> Call | None:
    """A Call when `name` is a plain name and `arguments` a JSON object (kept as written), else None."""
    name, arguments = name.strip(), json_arguments(arguments)
    if not _NAME.fullmatch(name) or arguments is None:
        return None
    return Call(name, arguments)


# TYPE<sep>NAME, then the arguments in a ```json fence (the type is "function"; vLLM passes any)
_V3_CALL = re.compile(r"\s*[^\s<>]*\s*" + re.escape(SEP)
                      + r"(?P<name>[^\n]*)\n\s*```(?:json)?\s*(?P<args>.*?)\s*```\s*", re.S)
_V3_HEAD = re.compile(r"\s*[^\s<>]*\s*" + re.escape(SEP) + r"(?P<name>[^\n]*)\n\s*```json\s")


class DeepSeekV3ToolParser(SectionToolParser):
    name = "deepseek_v3"
    begins, ends = (CALLS_BEGIN,), (CALLS_END,)
    call_begin, call_end = CALL_BEGIN, CALL_END
    end_of_text = (END_OF_SENTENCE,)
    section, separator = (CALLS_BEGIN, CALLS_END), "\n"

    def call_format(self, name: str, schema: dict, markup: Markup) -> dict:
        return seq(markup.lit(f"{CALL_BEGIN}function{SEP}{name}\n```json\n"), args(schema),
                   markup.lit(f"\n```{CALL_END}"))

    def parse_call(self, inner: str) -> Call | None:
        m = _V3_CALL.fullmatch(inner)
        return make_call(m["name"], m["args"]) if m else None

    def partial_call(self, inner: str) -> Call | None:
        m = _V3_HEAD.match(inner)
        if m is None or not _NAME.fullmatch(m["name"].strip()):
            return None
        return Call(m["name"].strip(), partial_arguments(inner[m.end():], ("```", CALL_END)))


class DeepSeekV31ToolParser(SectionToolParser):
    name = "deepseek_v31"
    begins, ends = (CALLS_BEGIN,), (CALLS_END,)
    call_begin, call_end = CALL_BEGIN, CALL_END
    end_of_text = (END_OF_SENTENCE,)
    section = (CALLS_BEGIN, CALLS_END)

    def call_format(self, name: str, schema: dict, markup: Markup) -> dict:
        return seq(markup.lit(f"{CALL_BEGIN}{name}{SEP}"), args(schema), markup.lit(CALL_END))

    def parse_call(self, inner: str) -> Call | None:
        name, sep, args = inner.partition(SEP)
        return make_call(name, args) if sep else None

    def partial_call(self, inner: str) -> Call | None:
        name, sep, args = inner.partition(SEP)
        if not sep or not _NAME.fullmatch(name.strip()):
            return None
        return Call(name.strip(), partial_arguments(args, (CALL_END,)))


class DeepSeekR1ReasoningParser(ReasoningParser):
    """`<think>`...`</think>` (plain tokens, not special ones). The R1 templates (and V3.1's with
    thinking on) end the prompt with `<think>\\n`, so the output starts inside the reasoning:
    starts_in_reasoning of the rendered prompt says so (vLLM assumes it always); the older R1
    template left `<think>` to the model. A `<think>` written again after the prompt's is dropped."""

    name = "deepseek_r1"

