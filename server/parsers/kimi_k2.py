"""Kimi K2's markup (vLLM's kimi_k2 tool and reasoning parsers).

Tool calls: one section of calls, each named by its id `functions.NAME:IDX` (the function's name
is what follows the last dot before the colon; IDX counts the calls of the conversation):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{ARGS}<|tool_call_end|>
    <|tool_call_begin|>...<|tool_call_end|><|tool_calls_section_end|>

The model sometimes writes the section markers in the singular (`<|tool_call_section_begin|>`);
vLLM accepts both, as here. Whitespace around the id and the arguments is allowed. Kimi's
tokenizer drops these markers and `</think>` (id 163607) when decoding with skip_special_tokens
(vLLM's kimi_k2 parser sets skip_special_tokens false whenever tools are given; NVIDIA Dynamo keeps
special tokens for its Kimi parsers since `</think>` was found stripped), so both parsers need
special tokens kept; the turn then ends with `<|im_end|>`, which after the calls never reaches the
content.

Reasoning (Kimi K2 Thinking): `<think>`...`</think>` at the start of the output (the template's
generation prompt does not open it; where a prompt does, a `<think>` the model writes again is
dropped); a tool-call section also ends the reasoning, as the model may start its calls without
closing it (vLLM's kimi_k2 reasoning parser does the same).
"""
import dataclasses
import re

from server.parsers.base import Call, ReasoningParser, partial_arguments
from server.parsers.deepseek import SectionToolParser, make_call
from server.parsers.forced import Markup, args, seq

SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN, CALL_END, ARGUMENT_BEGIN = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
IM_END = "<|im_end|>"

_ID = re.compile(r"(?P<function>[^\s<:]+):(?P<index>\d+)")


class KimiK2ToolParser(SectionToolParser):
    name = "kimi_k2"
    begins, ends = SECTION_BEGINS, SECTION_ENDS
    call_begin, call_end = CALL_BEGIN, CALL_END
    end_of_text = (IM_END,)
    needs_special_tokens = True
    section = (SECTION_BEGINS[0], SECTION_ENDS[0])

    def call_format(self, name: str, schema: dict, markup: Markup) -> dict:
        return seq(markup.lit(f"{CALL_BEGIN}functions.{name}:"), {"type": "regex", "pattern": "[0-9]{1,3}"},
                   markup.lit(ARGUMENT_BEGIN), args(schema), markup.lit(CALL_END))

    def parse_call(self, inner: str) -> Call | None:
        head, sep, args = inner.partition(ARGUMENT_BEGIN)
        m = _ID.fullmatch(head.strip())
        if not sep or m is None:
            return None
        call = make_call(m["function"].split(".")[-1], args)
        return None if call is None else dataclasses.replace(call, id=head.strip())

    def partial_call(self, inner: str) -> Call | None:
        head, sep, args = inner.partition(ARGUMENT_BEGIN)
        m = _ID.fullmatch(head.strip())
        if not sep or m is None:
            return None
        return Call(m["function"].split(".")[-1], partial_arguments(args, (CALL_END,)), id=head.strip())


class KimiK2ReasoningParser(ReasoningParser):
    name = "kimi_k2"
    needs_special_tokens = True
    also_ends = SECTION_BEGINS  # a tool-call section ends the reasoning (it stays in the answer)
