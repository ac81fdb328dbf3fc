"""hermes: `<tool_call>{"name": N, "arguments": {...}}</tool_call>` blocks (Hermes and Qwen2.5/Qwen3
templates)."""
import json

from server.parsers.base import Call, DelimitedToolParser
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


def _call(body: str) -> tuple[Call, ...] | None:
    try:
        obj = json.loads(body)
        name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str):
        return None
    return (Call(name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)),)
