"""Tool-call and reasoning parsers by family (--tool-call-parser, --reasoning-parser: vLLM's names),
and the one splitting and streaming logic they share (base.py, output.py)."""
from server.parsers.base import Block, Call, ReasoningParser, ToolParser
from server.parsers.deepseek import DeepSeekR1ReasoningParser, DeepSeekV3ToolParser, DeepSeekV31ToolParser
from server.parsers.glm45 import Glm45ToolParser
from server.parsers.harmony import GptOssReasoningParser, HarmonyToolParser
from server.parsers.hermes import HermesToolParser
from server.parsers.kimi_k2 import KimiK2ReasoningParser, KimiK2ToolParser
from server.parsers.minimax_m2 import MinimaxM2ToolParser
from server.parsers.qwen3_coder import Qwen3CoderToolParser
from server.parsers.reasoning import Glm45ReasoningParser, MiniMaxM2ReasoningParser, Qwen3ReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, DeepSeekV3ToolParser, DeepSeekV31ToolParser, KimiK2ToolParser, Glm45ToolParser,
    Qwen3CoderToolParser, MinimaxM2ToolParser, HarmonyToolParser)}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (
    DeepSeekR1ReasoningParser, Qwen3ReasoningParser, Glm45ReasoningParser, KimiK2ReasoningParser,
    MiniMaxM2ReasoningParser, GptOssReasoningParser)}
REASONING_PARSERS["openai"] = GptOssReasoningParser  # the and --tool-call-parser's name for gpt-oss

__all__ = ["Block", "Call", "ReasoningParser", "ToolParser", "TOOL_PARSERS", "REASONING_PARSERS"]
