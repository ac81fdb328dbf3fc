"""hermes: `<tool_call>{"name": N, "arguments": {...}}</tool_call>` blocks (Hermes and Qwen2.5/Qwen3
templates)."""
import json
import re

from server.parsers.base import Block, Call, ToolParser

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_OPEN = "<tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (_OPEN,)

    def blocks(self, text: str) -> list[Block]:
        out, pos = [], 0
        for m in _BLOCK.finditer(text):
            out.append(Block(m.start(), m.end(), _call(m.group(1))))
            pos = m.end()
        start = text.find(_OPEN, pos)
        if start >= 0:
            out.append(Block(start, None))
        return out


def _call(body: str) -> tuple[Call, ...] | None:
    try:
        obj = json.loads(body)
        name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str):
        return None
    return (Call(name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)),)
