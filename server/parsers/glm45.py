"""glm45: GLM-4.5 / GLM-4.6 tool calls (vLLM's `glm45`, Glm4MoeModelToolParser), one call per block:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The name runs to the end of its line (or to the first <arg_key>: GLM-4.7 writes the pairs without
newlines); then key/value pairs, whitespace between. A block ends at the first </tool_call>.
Anything else between the pairs, an empty name, or a key without its value makes the block malformed
(its text stays content). <tool_call>, <arg_key>, <think> ... are special tokens of the GLM
tokenizer (transformers 5 skips them when decoding unless told not to).

Argument values are text; each becomes a JSON value the way vLLM does it: a parameter whose schema
type is "string" keeps its text as written; any other value (or every value, without the tools'
schemas) is stripped and read as JSON, else as a Python literal (True, None, 'single quoted', ...),
else kept as the string. A literal that is not JSON data (a set, bytes, NaN, ...) stays a string.
"""
import ast
import json
from typing import Any

from server.parsers.base import Call, DelimitedToolParser
from server.parsers.forced import Markup, seq, xml_args

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_KEY, _KEY_END = "<arg_key>", "</arg_key>"
_VALUE, _VALUE_END = "<arg_value>", "</arg_value>"


class Glm45ToolParser(DelimitedToolParser):
    """functions: the request's functions, name -> its `parameters` JSON schema (optional): a
    parameter typed "string" there keeps its text unparsed."""

    name = "glm45"
    open, close = _OPEN, _CLOSE
    needs_special_tokens = True
    separator = "\n"

    def call_format(self, name: str, schema: dict, markup: Markup) -> dict:
        pair = xml_args(schema, f"{_KEY}{{name}}{_KEY_END}\n{_VALUE}", f"{_VALUE_END}\n", markup)
        return seq(markup.lit(f"{_OPEN}{name}\n"), pair, markup.lit(_CLOSE))

    def parse_body(self, body: str) -> tuple[Call, ...] | None:
        return _call(body, self.functions)


def _call(body: str, functions: dict[str, dict] | None) -> tuple[Call, ...] | None:
    cut = min(i for i in (body.find("\n"), body.find(_KEY), len(body)) if i >= 0)
    name = body[:cut].strip()
    if not name or "<" in name or ">" in name:
        return None
    properties = _properties(functions, name)
    args: dict[str, Any] = {}
    pos = cut
    while True:
        pos = _skip_space(body, pos)
        if pos == len(body):
            break
        if not body.startswith(_KEY, pos) or (key_end := body.find(_KEY_END, pos)) < 0:
            return None
        key = body[pos + len(_KEY):key_end].strip()
        pos = _skip_space(body, key_end + len(_KEY_END))
        if not body.startswith(_VALUE, pos) or (value_end := body.find(_VALUE_END, pos)) < 0:
            return None
        args[key] = _value(body[pos + len(_VALUE):value_end], properties.get(key))
        pos = value_end + len(_VALUE_END)
    return (Call(name, json.dumps(args, ensure_ascii=False)),)


def _properties(functions: dict[str, dict] | None, name: str) -> dict:
    schema = (functions or {}).get(name)
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _value(text: str, schema: Any) -> Any:
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    text = text.strip()
    for read in (_json, ast.literal_eval):
        try:
            value = read(text)
            json.dumps(value, allow_nan=False)  # JSON data only (no sets, bytes, NaN, ...)
            return value
        except Exception:  # noqa: BLE001 - any failure (also RecursionError, MemoryError) means "not this"
            pass
    return text


def _json(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constant)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
