"""Tool calling: the hermes parser on fixed text (whole and streamed at every split), the tool_choice
rules of a request, and the built-in chat template rendering tools and earlier calls. The end-to-end
runs against a live server are in tests/test_structured_outputs.py (they share its server)."""
import json

import pytest

from server.openai_protocol import ChatCompletionRequest, OpenAIError
from server.parsers import TOOL_PARSERS
from server.parsers.output import ChatOutput
from server.tool_calls import ToolMode
from tests.parser_cases import check

TEXT = ('Let me look that up. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def test_hermes_whole_and_streamed_carry_the_same_content():
    """Whole and streamed in pieces of any size, the content before the calls is the same (the
    streamed one used to keep the newline the whole one stripped) and the calls are the same."""
    want = (None, "Let me look that up.", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})])
    check(TEXT, want, tools=TOOL_PARSERS["hermes"]())
    check("a <toolbox> b", (None, "a <toolbox> b", []), tools=TOOL_PARSERS["hermes"]())
    message = ChatOutput(None, TOOL_PARSERS["hermes"]()).message(TEXT)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **kw})


def test_tool_choice_rules():
    assert _request(tool_choice="none").tool_mode("hermes") is None
    assert _request().tool_mode("hermes").mode == "auto"
    named = _request(tool_choice={"type": "function", "function": {"name": "add"}}).tool_mode(None)
    assert named.mode == "named" and json.loads(named.constraint().spec)["properties"]["a"] == {"type": "integer"}
    required = _request(tool_choice="required").tool_mode(None)
    assert json.loads(required.constraint().spec)["minItems"] == 1
    for kw, match in [({}, "--tool-call-parser"), ({"tool_choice": {"type": "function", "function": {"name": "x"}}},
                                                   "not among the tools")]:
        with pytest.raises(OpenAIError, match=match):
            _request(**kw).tool_mode(None)
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    with pytest.raises(OpenAIError, match=r"tools\[0\]"):
        _request(tools=bad, tool_choice="required").tool_mode(None)


def test_builtin_template_renders_tools_and_calls():
    from transformers import AutoTokenizer

    from models.builtin import BUILTIN_DIR

    tok = AutoTokenizer.from_pretrained(str(BUILTIN_DIR))
    msgs = [m.as_template_input() for m in _request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]).messages]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in text and '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}' in text
    assert "<|tool|>\nsunny<|end|>" in text
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert plain == "<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_an_assistant_turns_reasoning_reaches_the_template():
    """reasoning_content (or vLLM's alias reasoning) sent back in an assistant turn is what the
    families' templates read: reasoning_content (Qwen3, GLM, DeepSeek) and thinking (gpt-oss)."""
    for key in ("reasoning_content", "reasoning"):
        req = ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", key: "weighed it"}]})
        turn = req.messages[1].as_template_input()
        assert turn["reasoning_content"] == turn["thinking"] == "weighed it"
        assert "thinking" not in req.messages[0].as_template_input()
