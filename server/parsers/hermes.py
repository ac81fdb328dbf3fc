"""hermes: `<tool_call>{"name": N, "arguments": {...}}</tool_call>` blocks (Hermes and Qwen2.5/Qwen3
templates). The arguments are the JSON text as written where the object is name first, then
arguments and nothing after (the templates' layout; they then stream as they arrive); otherwise they
are re-serialised."""
import json
import re

from server.parsers.base import Block, Call, DelimitedToolParser, partial_arguments
from server.parsers.forced import Markup, args, seq


class HermesToolParser(DelimitedToolParser):
    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"
    separator = "\n"

    def call_format(self, name: str, schema: dict, markup: Markup) -> dict:
        head = f'{self.open}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        return seq(markup.lit(head), args(schema), markup.lit(f"}}\n{self.close}"))

    def parse_body(self, body: str) -> tuple[Call, ...] | None:
        return _call(body)

    def pending(self, text: str, block: Block) -> list[Call]:
        head = _HEAD.match(text, block.start + len(self.open))
        if head is None:
            return []
        return [Call(json.loads(f'"{head["name"]}"'), partial_arguments(text[head.end():], (self.close,), "}"))]


# `{"name": "N", "arguments": ` at the start of a block: the name is known, the arguments follow
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _call(body: str) -> tuple[Call, ...] | None:
    try:
        obj = json.loads(body)
        name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str):
        return None
    if isinstance(args, str):
        return (Call(name, args),)
    head = _HEAD.match(body)
    if head is not None and isinstance(args, dict):
        try:
            value, end = json.JSONDecoder().raw_decode(body, head.end())
        except ValueError:
            value, end = None, 0
        if value == args and body[end:].strip() == "}":
            return (Call(name, body[head.end():end]),)  # as written
    return (Call(name, json.dumps(args, ensure_ascii=False)),)
