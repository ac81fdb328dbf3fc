"""tool_choice required / named with a --tool-call-parser: the grammar holds the model to the
family's markup, and whatever it lets through, the family's parser reads as the calls it forced.

Random walks: from each family's grammar, tokens drawn at random among those the grammar allows
(with the tests' trained tokenizer), until the grammar may end; the text must parse into calls of
the forced functions whose arguments validate against their schemas."""
import json
import random

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from attention_nodes.structured import GrammarCache, StructuredOutputs
from server.parsers import REASONING_PARSERS, TOOL_PARSERS
from server.parsers.forced import Markup
from server.parsers.output import ChatOutput
from server.tool_calls import ToolMode

# Bounded arguments (enums, small integers), so that a random walk ends.
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {
    "type": "integer", "minimum": 0, "maximum": 9}}, "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a"], "additionalProperties": False}
FUNCTIONS = {"get_weather": WEATHER, "add": ADD}

# One call of get_weather as each family writes it (what the grammar must accept).
WRITTEN = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                    '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
               '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>',
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
             "<arg_value>3</arg_value>\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                   "</parameter>\n</function>\n</tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                  '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
    "openai": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}',
}
THINKING = {"deepseek_v3": ("deepseek_r1", "<think>Look.</think>\n\n"), "kimi_k2": ("kimi_k2", "<think>Look.</think>"),
            "glm45": ("glm45", "<think>Look.</think>\n"), "hermes": ("qwen3", "<think>\nLook.\n</think>\n\n"),
            "openai": ("openai", "<|channel|>analysis<|message|>Look.<|end|><|start|>assistant")}


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def grammars(tok):
    g = GrammarCache(tok, len(tok), {tok.eos_token_id})
    g.eos = tok.eos_token_id
    return g


def _calls(parser: str, text: str, reasoning: str | None = None) -> list[tuple[str, dict]]:
    out = ChatOutput(REASONING_PARSERS[reasoning]() if reasoning else None, TOOL_PARSERS[parser](FUNCTIONS))
    _, content, calls = out.parse(text)
    assert content == "", (parser, text)
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _walk(grammars: GrammarCache, tok, spec: StructuredOutputs, rng: random.Random, limit: int = 2000) -> str:
    """Tokens drawn at random among those the grammar allows; ends (when allowed) with chance 1/2."""
    m = grammars.matcher(spec)
    mask = torch.zeros((1, (len(tok) + 31) // 32), dtype=torch.int32)
    ids = []
    for _ in range(limit):
        m.fill_next_token_bitmask(mask)
        words = mask[0].tolist()
        allowed = [i for i in range(len(tok)) if (words[i // 32] >> (i % 32)) & 1]
        eos = tok.eos_token_id in allowed
        if eos and (len(allowed) == 1 or rng.random() < 0.5):
            return tok.decode(ids)
        pick = rng.choice([i for i in allowed if i != tok.eos_token_id])
        assert m.accept_token(pick)
        ids.append(pick)
    raise AssertionError(f"no end after {limit} tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_the_family_text_is_what_the_grammar_allows(grammars, parser):
    tools = ToolMode("named", FUNCTIONS, "get_weather", parser=TOOL_PARSERS[parser])
    m = grammars.matcher(tools.constraint())
    assert m.accept_string(WRITTEN[parser]) and m.accept_token(grammars.eos), parser
    assert _calls(parser, WRITTEN[parser]) == [("get_weather", {"city": "Paris", "days": 3})]
    other = ToolMode("named", FUNCTIONS, "add", parser=TOOL_PARSERS[parser])
    assert not grammars.matcher(other.constraint()).accept_string(WRITTEN[parser])  # named: only that function
    if parser in THINKING:
        reasoning, head = THINKING[parser]
        splitter = REASONING_PARSERS[reasoning]()
        spec = tools.constraint(Markup(), splitter.forced_prefix(False, Markup()))
        for text in (WRITTEN[parser], head + WRITTEN[parser]):
            m = grammars.matcher(spec)
            assert m.accept_string(text) and m.accept_token(grammars.eos), (parser, text)
        assert _calls(parser, head + WRITTEN[parser], reasoning) == [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("mode", ["required", "named", "one"])
def test_random_walks_through_the_grammar_parse(grammars, tok, parser, mode):
    tools = ToolMode("named" if mode == "named" else "required", FUNCTIONS, "add" if mode == "named" else None,
                     parallel=mode == "required", parser=TOOL_PARSERS[parser])
    spec = tools.constraint()
    rng = random.Random(f"{parser}-{mode}")
    for _ in range(6):
        text = _walk(grammars, tok, spec, rng)
        calls = _calls(parser, text)
        assert calls, (parser, text)
        if mode != "required" or not TOOL_PARSERS[parser].parallel_calls:
            assert len(calls) == 1, (parser, text)
        for name, arguments in calls:
            assert mode != "named" or name == "add"
            jsonschema.validate(arguments, FUNCTIONS[name])


def test_special_tokens_are_matched_as_tokens(tok):
    """Markup that is a special token of the tokenizer becomes that token in the grammar."""
    markup = Markup({"<|call|>": 7, "<|c|>": 9})
    assert markup.lit("a<|c|>b<|call|>") == {"type": "sequence", "elements": [
        {"type": "const_string", "value": "a"}, {"type": "token", "token": 9},
        {"type": "const_string", "value": "b"}, {"type": "token", "token": 7}]}
    assert markup.lit("plain") == {"type": "const_string", "value": "plain"}
    assert Markup.of(None).special == {}
    assert all(isinstance(i, int) for i in Markup.of(tok).special.values())
