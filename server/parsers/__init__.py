"""Tool-call and reasoning parsers by family (--tool-call-parser, --reasoning-parser: vLLM's names),
and the one splitting and streaming logic they share (base.py)."""
from server.parsers.base import Block, Call, ReasoningParser, ToolParser
from server.parsers.hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser,)}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}

__all__ = ["Block", "Call", "ReasoningParser", "ToolParser", "TOOL_PARSERS", "REASONING_PARSERS"]
