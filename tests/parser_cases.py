"""The check every tool-call and reasoning parser passes (tests/test_parsers*.py): a text parsed
whole gives the expected message, and streamed, split at every character boundary (and token by
token where the test gives tokens), the deltas add up to the same message: a call's first delta
carries its id and name, later ones add to its arguments (calls abandoned mid-stream aside)."""
import json

from server.parsers.base import ReasoningParser, ToolParser
from server.parsers.output import ChatOutput


def whole(text: str, tools: ToolParser | None = None, reasoning: ReasoningParser | None = None,
          starts_in_reasoning: bool = False) -> tuple[str | None, str, list[tuple[str, object]]]:
    """(reasoning, content, [(name, arguments as a JSON value)]) of the whole text."""
    r, content, calls = ChatOutput(reasoning, tools, starts_in_reasoning).parse(text)
    return r, content, [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(pieces: list[str], tools: ToolParser | None = None, reasoning: ReasoningParser | None = None,
             starts_in_reasoning: bool = False) -> tuple[str | None, str, list[tuple[str, object]]]:
    """The same, from the stream deltas of the text arriving in `pieces`."""
    out = ChatOutput(reasoning, tools, starts_in_reasoning)
    text, r, content, calls = "", "", "", []
    for i, piece in enumerate(pieces):
        text += piece
        for d in out.feed(text, final=i == len(pieces) - 1):
            r += d.get("reasoning_content", "")
            assert d.get("reasoning", d.get("reasoning_content")) == d.get("reasoning_content")
            content += d.get("content", "")
            for call in d.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(calls) and call["id"] and call["function"]["name"]
                    calls.append([call["function"]["name"], ""])
                else:
                    assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]][1] += call["function"]["arguments"]
    return (r if reasoning is not None else None), content, [(name, _value(args)) for name, args in calls]


def _value(args: str) -> object:
    try:
        return json.loads(args)
    except ValueError:
        return args  # a call abandoned mid-stream (see agrees)


def agrees(stream: tuple, expected: tuple, tools: ToolParser | None) -> bool:
    """The stream gives the whole answer's message; or, where a block did not close as valid markup
    (the whole answer has its markup in the content: malformed, or cut short), the same reasoning and
    content, and the whole answer's calls among the streamed ones (a call streams while its block is
    open, JSON-argument formats)."""
    if stream == expected:
        return True
    if tools is None or not any(m in expected[1] for m in tools.markers) or stream[:2] != expected[:2]:
        return False
    rest = iter(stream[2])
    return all(call in rest for call in expected[2])


def check(text: str, expected: tuple, tools: ToolParser | None = None, reasoning: ReasoningParser | None = None,
          starts_in_reasoning: bool = False) -> None:
    """`expected`: (reasoning or None, content, [(name, arguments)]). Whole, streamed in one piece,
    split once at every character boundary, and one character at a time."""
    kw = dict(tools=tools, reasoning=reasoning, starts_in_reasoning=starts_in_reasoning)
    assert whole(text, **kw) == expected, text
    assert streamed([text], **kw) == expected, text
    for i in range(1, len(text)):
        assert agrees(streamed([text[:i], text[i:]], **kw), expected, tools), (text[:i], text[i:])
    assert agrees(streamed(list(text), **kw), expected, tools), text
