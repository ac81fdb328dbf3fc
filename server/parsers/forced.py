"""tool_choice required / named with a --tool-call-parser: the family's own markup as a grammar.

The model is held to one call (named, or parallel_tool_calls false) or one or more calls (required)
written the way its tool parser reads them, so the answer goes through the same parser, whole and
streamed, as under tool_choice auto. The grammar is an xgrammar structural tag (kind
"structural_tag" of StructuredOutputs): literal markup, each call's arguments held to its function's
parameters schema (JSON, or the family's XML parameters), and in front of the calls the family's
reasoning, free text, when the server parses reasoning.

Markup that is a special token of the tokenizer (Kimi K2's and gpt-oss's markers) is matched as that
token (a grammar never spells a special token out of ordinary ones); elsewhere it is text.
"""
import functools
import json
import re
from dataclasses import dataclass, field

JSON_WHITESPACE = 1  # the longest run of whitespace inside JSON arguments (a small model may pad for ever)


@dataclass
class Markup:
    """Builds structural-tag formats (xgrammar's JSON form) for one tokenizer. special: its special
    tokens, text -> id."""

    special: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, tokenizer) -> "Markup":
        """The special tokens of a Hugging Face tokenizer (None: no tokenizer, none)."""
        if tokenizer is None:
            return cls()
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        return cls({t.content: i for i, t in decoder.items() if getattr(t, "special", False) and t.content})

    def lit(self, text: str) -> dict:
        """Exactly `text`; each special token in it as that token."""
        parts, pos = [], 0
        for m in (self._tokens.finditer(text) if self.special else ()):
            if m.start() > pos:
                parts.append({"type": "const_string", "value": text[pos:m.start()]})
            parts.append({"type": "token", "token": self.special[m.group()]})
            pos = m.end()
        if pos < len(text) or not parts:
            parts.append({"type": "const_string", "value": text[pos:]})
        return seq(*parts)

    @functools.cached_property
    def _tokens(self) -> re.Pattern:
        return re.compile("|".join(re.escape(s) for s in sorted(self.special, key=len, reverse=True)))


def seq(*elements: dict) -> dict:
    elements = tuple(e for e in elements if e is not None)
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": list(elements)}


def args(schema: dict | bool) -> dict:
    """JSON held to a schema (a call's arguments, or one value of them)."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": JSON_WHITESPACE}


def xml_args(schema: dict, before: str, after: str, markup: "Markup") -> dict:
    """A call's arguments as the families' XML parameters, laid out exactly as their parsers read
    them back: for each property of `schema`, in its order (the required ones always, the others
    optionally), `before` (with {name} replaced) + value + `after`. A value is the text of a string
    (one of its enum / const where it has them; else any text without `after`'s first line), else
    JSON held to the property's schema. A schema without properties takes any parameters as text."""
    stop = after.strip().split("\n")[0]
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not props:
        head, _, tail = before.partition("{name}")
        one = seq(markup.lit(head), {"type": "regex", "pattern": "[A-Za-z_][A-Za-z0-9_]*"}, markup.lit(tail),
                  free_text(stop), markup.lit(after))
        return {"type": "star", "content": one}
    required = set(schema.get("required") or ())
    parts = []
    for name, sub in props.items():
        one = seq(markup.lit(before.replace("{name}", name)), _xml_value(sub, stop), markup.lit(after))
        parts.append(one if name in required else optional(one))
    return seq(*parts) if parts else markup.lit("")


def _xml_value(schema, stop: str) -> dict:
    s = schema if isinstance(schema, dict) else {}
    choices = [s["const"]] if "const" in s else s.get("enum")
    if choices and all(isinstance(c, str) for c in choices):
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}
    if not choices and s.get("type") == "string" and not any(k in s for k in ("anyOf", "oneOf", "allOf", "$ref")):
        return free_text(stop)
    return args(schema)


def free_text(until: str) -> dict:
    """Any text that does not contain `until`."""
    return {"type": "any_text", "excludes": [until]}


def optional(fmt: dict) -> dict:
    return {"type": "optional", "content": fmt}


def blank(upto: int = 2) -> dict:
    """Up to `upto` spaces or newlines."""
    return {"type": "regex", "pattern": f"[ \\n]{{0,{upto}}}"}


def forced_calls(parser, names: list[str], parallel: bool, markup: Markup, prefix: dict | None = None) -> str:
    """The structural tag (JSON text) of `parser`'s markup holding calls of `names` (their schemas:
    parser.functions): one or more when `parallel` (and the family's format can hold several), else
    exactly one; `prefix` (the reasoning) before them."""
    one = [parser.call_format(n, parser.functions[n], markup) for n in names]
    call = one[0] if len(one) == 1 else {"type": "or", "elements": one}
    if parallel and parser.parallel_calls:
        call = seq(call, {"type": "star", "content": seq(markup.lit(parser.separator) if parser.separator else None,
                                                           call)})
    begin, end = parser.section
    body = seq(markup.lit(begin) if begin else None, call, markup.lit(end) if end else None)
    return json.dumps({"type": "structural_tag", "format": seq(prefix, body)}, ensure_ascii=False)
