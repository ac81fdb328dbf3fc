"""minimax_m2: MiniMax-M2's tool calls (vLLM's `minimax_m2`, MinimaxM2ToolParser); one wrapper holds
one or more calls:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    <invoke name="get_time">
    <parameter name="tz">Europe/Paris</parameter>
    </invoke>
    </minimax:tool_call>

A block ends at the first </minimax:tool_call>; in it, whitespace and <invoke name="...">...</invoke>
(the name in double, single or no quotes), in each whitespace and <parameter name="...">VALUE
</parameter>, a value ending at the first </parameter>. Anything else, or no invoke at all, makes the
block malformed (its text is content). Each value is stripped of surrounding whitespace (as vLLM
does). The markers are tokens of the MiniMax-M2 tokenizer but not special ones.

Argument values are text. With the tools' schemas (`functions`) each is converted as vLLM does:
"null" / "none" / "nil" is null; else by the types its schema allows (type, type lists, enum values,
anyOf / oneOf / allOf), trying integer, number, boolean, object, array, string in that order; a
parameter the schema does not name is a string. Without schemas (vLLM always has them: it only
parses calls of a request with tools) a value that reads as JSON is that JSON value, any other stays
a string: '3' -> 3, '[1, 2]' -> [1, 2], 'Paris' -> "Paris".
"""
import json
from typing import Any

from server.parsers.base import Call, DelimitedToolParser
from server.parsers.forced import Markup, seq, xml_args

_OPEN, _CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE, _INVOKE_END = "<invoke name=", "</invoke>"
_PARAMETER, _PARAMETER_END = "<parameter name=", "</parameter>"
_ORDER = ("integer", "int", "number", "float", "boolean", "bool", "object", "array", "string", "str", "text")


class MinimaxM2ToolParser(DelimitedToolParser):
    """functions: the request's functions, name -> its `parameters` JSON schema (optional): values
    are then converted by their parameter's types, as vLLM does."""

    name = "minimax_m2"
    open, close = _OPEN, _CLOSE
    section, separator = (f"{_OPEN}\n", _CLOSE), "\n"

    def call_format(self, name: str, schema: dict, markup: Markup) -> dict:
        params = xml_args(schema, f'{_PARAMETER}"{{name}}">', f"{_PARAMETER_END}\n", markup)
        return seq(markup.lit(f'{_INVOKE}"{name}">\n'), params, markup.lit(_INVOKE_END + "\n"))

    def parse_body(self, body: str) -> tuple[Call, ...] | None:
        return _calls(body, self.functions)


def _calls(body: str, functions: dict[str, dict] | None) -> tuple[Call, ...] | None:
    calls, pos = [], 0
    while (pos := _skip_space(body, pos)) < len(body):
        if not body.startswith(_INVOKE, pos) or (name_end := body.find(">", pos)) < 0:
            return None
        name = _unquote(body[pos + len(_INVOKE):name_end])
        end = body.find(_INVOKE_END, name_end)
        if not name or "<" in name or "\n" in name or end < 0:
            return None
        args = _arguments(body[name_end + 1:end], _properties(functions, name), functions is not None)
        if args is None:
            return None
        calls.append(Call(name, json.dumps(args, ensure_ascii=False)))
        pos = end + len(_INVOKE_END)
    return tuple(calls) or None


def _arguments(body: str, properties: dict, typed: bool) -> dict | None:
    args, pos = {}, 0
    while (pos := _skip_space(body, pos)) < len(body):
        if not body.startswith(_PARAMETER, pos) or (name_end := body.find(">", pos)) < 0:
            return None
        key = _unquote(body[pos + len(_PARAMETER):name_end])
        end = body.find(_PARAMETER_END, name_end)
        if not key or "<" in key or "\n" in key or end < 0:
            return None
        value = body[name_end + 1:end].strip()
        args[key] = _convert(value, properties.get(key)) if typed else _json_or_text(value)
        pos = end + len(_PARAMETER_END)
    return args


def _unquote(name: str) -> str:
    name = name.strip()
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        name = name[1:-1]
    return name


def _properties(functions: dict[str, dict] | None, name: str) -> dict:
    schema = (functions or {}).get(name)
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _convert(value: str, schema: Any) -> Any:
    if value.lower() in ("null", "none", "nil"):
        return None
    kinds = {k.lower() for k in _types(schema)}
    for kind in _ORDER:
        if kind not in kinds:
            continue
        if kind in ("string", "str", "text"):
            return value
        if kind in ("integer", "int"):
            try:
                return int(value)
            except ValueError:
                continue
        elif kind in ("number", "float"):
            try:
                number = float(value)
            except ValueError:
                continue
            if number != number or number in (float("inf"), float("-inf")):
                continue
            return int(number) if number.is_integer() else number
        elif kind in ("boolean", "bool"):
            if value.lower() in ("true", "1", "yes", "on"):
                return True
            if value.lower() in ("false", "0", "no", "off"):
                return False
        else:  # object, array
            parsed = _json_or_text(value)
            if parsed is not value:
                return parsed
    return _json_or_text(value)


def _types(schema: Any) -> list[str]:
    """The types a parameter's schema allows (string when it names none), as vLLM reads them."""
    if not isinstance(schema, dict):
        return ["string"]
    kinds: list[str] = []
    kind = schema.get("type")
    if isinstance(kind, str):
        kinds.append(kind)
    elif isinstance(kind, list):
        kinds += [k for k in kind if isinstance(k, str)]
    if isinstance(schema.get("enum"), list):
        kinds += [_type_of(value) for value in schema["enum"]]
    for choice in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(choice), list):
            for option in schema[choice]:
                kinds += _types(option)
    return kinds or ["string"]


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _json_or_text(value: str) -> Any:
    """The JSON value the text reads as (JSON data only: no NaN), else the text itself."""
    try:
        parsed = json.loads(value, parse_constant=_no_constant)
        json.dumps(parsed, allow_nan=False)
        return parsed
    except (ValueError, RecursionError):
        return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
