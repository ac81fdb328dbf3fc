"""Reasoning parsers of the <think> ... </think> families, with vLLM's names.

- qwen3 (Qwen3, Qwen3-2507 Thinking, Qwen3.5): <think> and </think> are tokens of the Qwen tokenizer,
  not special ones. Qwen3's template leaves <think> to the model (`enable_thinking=False` puts an
  empty closed block in the prompt); the Thinking-2507 and Qwen3.5 templates end the prompt with
  <think>: ReasoningParser.starts_in_reasoning sees both. As in vLLM, a <tool_call> followed (after
  whitespace) by <function= (an XML call: Qwen3.5 may call a tool without closing its thinking)
  ends the reasoning too; any other <tool_call> (Qwen3's JSON calls, the tag named in a sentence)
  is reasoning text.
- glm45 (GLM-4.5 / 4.6 / 4.7): <think>, </think> are special tokens of the GLM tokenizer. GLM-4.5
  and 4.6 write <think> themselves (the template puts <think></think> in the prompt when thinking
  is off); GLM-4.7's template opens <think> in the prompt. vLLM's glm45 parser, on a whole text,
  calls an unclosed <think> content; here (as vLLM does when streaming) it is reasoning.
- minimax_m2 (MiniMax-M2): the template ends every generation prompt with "<think>\\n" and the
  model writes only </think>. vLLM's minimax_m2 parser takes everything before </think> as reasoning
  whatever the prompt; here too, unless the prompt itself closed its last <think> (a prefilled
  answer). (vLLM's minimax_m2_append_think, which leaves it all content, is not this parser.)

In every family, a model that writes <think> again although the prompt opened it has that marker
dropped.
"""
import re

from server.parsers.base import ReasoningParser, _partial_suffix

_TOOL_CALL = "<tool_call>"
_FUNCTION_OPEN = "<function"
_FUNCTION = re.compile(r"<function[\s=]")  # what follows <tool_call> in an XML call


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def split(self, text: str, final: bool, starts_in_reasoning: bool) -> tuple[str, str]:
        lead = len(text) - len(text.lstrip())
        if starts_in_reasoning:
            body = lead + len(self.start) if text.startswith(self.start, lead) else 0
        elif text.startswith(self.start, lead):
            body = lead + len(self.start)
        else:
            return super().split(text, final, starts_in_reasoning)  # no reasoning (or not known yet)
        close = text.find(self.end, body)
        limit = len(text) if close < 0 else close
        pos = body
        while (at := text.find(_TOOL_CALL, pos, limit)) >= 0:
            after = at + len(_TOOL_CALL)
            while after < len(text) and text[after].isspace():
                after += 1
            if _FUNCTION.match(text, after):  # a tool call: the reasoning ended without </think>
                return super().split(text[:at], True, starts_in_reasoning)[0], text[at:]
            if not final and _FUNCTION_OPEN.startswith(text[after:after + len(_FUNCTION_OPEN) + 1]):
                return super().split(text[:at], False, starts_in_reasoning)[0], ""  # not known yet
            pos = at + 1
        if close < 0 and not final and (n := _partial_suffix(text, (_TOOL_CALL,))):
            return super().split(text[:len(text) - n], False, starts_in_reasoning)[0], ""
        return super().split(text, final, starts_in_reasoning)


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"
    needs_special_tokens = True


class MiniMaxM2ReasoningParser(ReasoningParser):
    name = "minimax_m2"

    def starts_in_reasoning(self, prompt: str) -> bool:
        i = prompt.rfind(self.start)
        return i < 0 or prompt.find(self.end, i) < 0
