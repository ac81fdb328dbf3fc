"""qwen3_coder: Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder`, Qwen3CoderToolParser):

    <tool_call>
    <function=write_file>
    <parameter=path>
    /tmp/a.py
    </parameter>
    <parameter=content>
    print("hi")
    </parameter>
    </function>
    </tool_call>

A block is read structurally, so that a value may hold any text (code that itself contains
</tool_call>, <tool_call> or </parameter>): a value ends at the first </parameter> followed, after
whitespace, by the next <parameter= or by </function> (or by </tool_call>: a </function> left out is
forgiven, as vLLM does); the block ends at the </tool_call> after its </function>. One newline after
<parameter=NAME> and one before </parameter> belong to the markup. Several <function=...> in one
<tool_call> are several calls (the template writes one per <tool_call>). Anything else (text outside
values, a name with spaces or quotes) makes the block malformed: it then ends at the next
</tool_call> and its text is content; a value never closed leaves the block open (content when the
text ends). <tool_call> and </tool_call> are tokens of the Qwen tokenizer but not special ones;
<function= and <parameter= are plain text.

Argument values are text. With the tools' schemas (`functions`) each is converted by its parameter's
type the way vLLM does (integer, number, boolean, object/array as JSON or a Python literal, "null"
for a nullable one; a string type, or a parameter the schema does not name, keeps the text). Without
schemas (vLLM always has them: it only parses calls of a request with tools) a value that reads as
JSON is that JSON value, any other stays a string: '3' -> 3, '{"a": 1}' -> {"a": 1}, 'Paris' ->
"Paris" (so a string parameter whose text happens to be JSON, e.g. '123', becomes a number).
"""
import ast
import json
import re
from typing import Any

from server.parsers.base import Call, DelimitedToolParser
from server.parsers.forced import Markup, seq, xml_args

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"
_AFTER_VALUE = (_FUNCTION_END, _PARAMETER, _CLOSE)  # what may follow a value's </parameter>
_BAD_NAME = re.compile(r"[\s{}<>\"']")
_OPEN_BLOCK = object()  # the scan needs more text


class Qwen3CoderToolParser(DelimitedToolParser):
    """functions: the request's functions, name -> its `parameters` JSON schema (optional): values
    are then converted by their parameter's type, as vLLM does."""

    name = "qwen3_coder"
    open, close = _OPEN, _CLOSE
    separator = "\n"

    def call_format(self, name: str, schema: dict, markup: Markup) -> dict:
        params = xml_args(schema, f"{_PARAMETER}{{name}}>\n", f"\n{_PARAMETER_END}\n", markup)
        return seq(markup.lit(f"{_OPEN}\n{_FUNCTION}{name}>\n"), params, markup.lit(f"{_FUNCTION_END}\n{_CLOSE}"))

    def scan(self, text: str, start: int) -> tuple[int | None, tuple[Call, ...] | None]:
        """(end, calls) of the block at `start`; end None while it is open. Malformed: calls None
        and the block ends at the next </tool_call>."""
        calls, pos = [], start + len(_OPEN)
        while True:
            pos = _skip_space(text, pos)
            if calls:
                if text.startswith(_CLOSE, pos):
                    return pos + len(_CLOSE), tuple(calls)
                if _pending(text, pos, (_CLOSE, _FUNCTION)):
                    return None, None
            if not text.startswith(_FUNCTION, pos):
                return (None, None) if _pending(text, pos, (_FUNCTION,)) else _malformed(text, pos)
            got = self._function(text, pos + len(_FUNCTION))
            if got is _OPEN_BLOCK:
                return None, None
            if got is None:
                return _malformed(text, pos)
            call, pos = got
            calls.append(call)

    def _function(self, text: str, pos: int):
        """The call whose name starts at `pos` and the position after its </function>; None when
        malformed, _OPEN_BLOCK when the text ends first."""
        name_end = text.find(">", pos)
        if name_end < 0:
            return None if _BAD_NAME.search(text, pos) else _OPEN_BLOCK
        name = text[pos:name_end]
        if not name or _BAD_NAME.search(name):
            return None
        properties = _properties(self.functions, name)
        args: dict[str, Any] = {}
        pos = name_end + 1
        while True:
            pos = _skip_space(text, pos)
            if text.startswith(_FUNCTION_END, pos):
                return Call(name, json.dumps(args, ensure_ascii=False)), pos + len(_FUNCTION_END)
            if text.startswith(_CLOSE, pos):  # </function> left out: </tool_call> ends the call
                return Call(name, json.dumps(args, ensure_ascii=False)), pos
            if not text.startswith(_PARAMETER, pos):
                return _OPEN_BLOCK if _pending(text, pos, _AFTER_VALUE) else None
            key_end = text.find(">", pos + len(_PARAMETER))
            if key_end < 0:
                return None if text.find("\n", pos) >= 0 else _OPEN_BLOCK
            key = text[pos + len(_PARAMETER):key_end]
            if not key or "\n" in key or "<" in key:
                return None
            value_end = _value_end(text, key_end + 1, properties if self.functions is not None else None)
            if value_end is None:
                return _OPEN_BLOCK
            value = text[key_end + 1:value_end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _convert(value, key, properties, self.functions is not None)
            pos = value_end + len(_PARAMETER_END)


def _value_end(text: str, pos: int, properties: dict | None) -> int | None:
    """Where the value starting at `pos` ends: the first </parameter> followed (after whitespace) by
    </function>, by <parameter=NAME> (NAME one of the schema's, when the function has one) or, the
    model having left </function> out, by </tool_call>; None while the text ends before that is
    known."""
    while (close := text.find(_PARAMETER_END, pos)) >= 0:
        after = _skip_space(text, close + len(_PARAMETER_END))
        if text.startswith(_FUNCTION_END, after) or text.startswith(_CLOSE, after):
            return close
        if text.startswith(_PARAMETER, after):
            if not properties:
                return close
            name_end = text.find(">", after + len(_PARAMETER))
            if name_end < 0:
                if text.find("\n", after) < 0:
                    return None  # the name is still arriving
            elif text[after + len(_PARAMETER):name_end] in properties:
                return close
        elif _pending(text, after, _AFTER_VALUE):
            return None
        pos = close + len(_PARAMETER_END)
    return None


def _pending(text: str, pos: int, markups: tuple[str, ...]) -> bool:
    """Whether the text ends at `pos` or within a proper start of one of `markups` there."""
    return any(len(text) - pos <= len(m) and m.startswith(text[pos:]) for m in markups)


def _malformed(text: str, pos: int) -> tuple[int | None, None]:
    close = text.find(_CLOSE, pos)
    return (None if close < 0 else close + len(_CLOSE)), None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _properties(functions: dict[str, dict] | None, name: str) -> dict:
    schema = (functions or {}).get(name)
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _convert(value: str, key: str, properties: dict, typed: bool) -> Any:
    if not typed:
        return _json_or_text(value)
    if key not in properties:
        return value
    kind, nullable = _type(properties[key])
    if nullable and value.lower() in ("null", "none"):
        return None
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if value.lower() in ("null", "none"):
        return None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if number != number or number in (float("inf"), float("-inf")):
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    container = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    if container:
        try:
            parsed = json.loads(value, parse_constant=_no_constant)
            if isinstance(parsed, str):  # a JSON-encoded Python repr
                parsed = _literal(parsed, parsed)
            return _data(parsed, value)
        except (ValueError, RecursionError):
            pass
    parsed = _literal(value, value)
    if container and isinstance(parsed, str):
        parsed = _literal(parsed, parsed)
    return _data(parsed, value)


def _type(schema: Any) -> tuple[str, bool]:
    """(the parameter's type, lower case; whether null is allowed), as vLLM reads them: `type` (the
    first non-null of a list), or the first non-null type of `anyOf`; else string."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        kinds = [str(k).strip().lower() for k in kinds]
        others = [k for k in kinds if k != "null"]
        return (others[0] if others else "null"), "null" in kinds
    if isinstance(schema.get("anyOf"), list):
        kinds = [str(o["type"]).strip().lower() for o in schema["anyOf"] if isinstance(o, dict) and "type" in o]
        others = [k for k in kinds if k != "null"]
        return (others[0] if others else "string"), "null" in kinds
    return "string", False


def _literal(text: str, otherwise: Any) -> Any:
    try:
        return ast.literal_eval(text)
    except Exception:  # noqa: BLE001 - also RecursionError, MemoryError: not a literal
        return otherwise


def _data(value: Any, otherwise: str) -> Any:
    """`value` when it is JSON data (no sets, bytes, NaN, ...), else the text."""
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError, RecursionError):
        return otherwise


def _json_or_text(value: str) -> Any:
    try:
        return _data(json.loads(value, parse_constant=_no_constant), value)
    except (ValueError, RecursionError):
        return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
