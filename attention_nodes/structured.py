"""Structured outputs: a grammar (JSON schema, any JSON object, regex, a choice of strings, or EBNF)
that every generated token must keep the text inside, enforced with xgrammar (the grammar engine
of vLLM and SGLang).

    spec = StructuredOutputs("json", json.dumps(schema))   # in SamplingParams.structured_outputs
    spec.check()                                           # ValueError naming what is wrong (the server: 400)
    grammars = GrammarCache(tokenizer, vocab_size, eos_ids)  # once per process that samples
    matcher = grammars.matcher(spec)                       # one per sequence; compiled once per distinct spec
    apply_grammar_masks(logits_BV, [matcher or None per row])  # the whole batch: one bitmask, one masked fill
    matcher.accept_token(token)                            # after sampling

JSON is generated compact (no free whitespace): a small model allowed any whitespace can pad for ever.
"""
import functools
import json
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kernels.sampling import apply_token_bitmask_

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
COMPILED_CACHE_SIZE = 256  # compiled grammars kept per process (least recently used dropped)
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match. kind: one of KINDS. spec: the JSON schema as a JSON string
    (json), a regular expression (regex), a JSON list of strings (choice), an EBNF grammar in the
    GBNF format of llama.cpp (grammar), xgrammar's structural tag as JSON text (structural_tag: the
    families' tool-call markup, server/parsers/forced.py); ignored for json_object."""

    kind: str
    spec: str = ""

    def check(self) -> None:
        """ValueError saying what is wrong with the spec (cached per distinct spec)."""
        _check(self.kind, self.spec)


@functools.lru_cache(maxsize=1024)
def _check(kind: str, spec: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"structured_outputs kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(spec, str):
        raise ValueError(f"structured_outputs {kind} must be given as a string, got {type(spec).__name__}")
    if kind == "json":
        _check_json_schema(spec)
    elif kind == "choice":
        choices = _choices(spec)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("structured_outputs choice must be a non-empty list of strings")
    _grammar(kind, spec)  # the grammar compiles (without a tokenizer: cheap)


def _check_json_schema(spec: str) -> None:
    try:
        schema = json.loads(spec)
    except ValueError as e:
        raise ValueError(f"structured_outputs json: the schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs json: a schema is a JSON object, got {type(schema).__name__}")
    try:
        import jsonschema
    except ImportError:  # xgrammar's own conversion below still checks what it uses
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(f"structured_outputs json: invalid JSON schema at {where}: {e.message}") from None


def _choices(spec: str) -> list:
    try:
        choices = json.loads(spec)
    except ValueError:
        return []
    return choices if isinstance(choices, list) else []


def _grammar(kind: str, spec: str):
    """The xgrammar Grammar of a spec; ValueError with xgrammar's reason if it does not convert."""
    import xgrammar as xgr

    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in _choices(spec)))
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec)
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        reason = _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        raise ValueError(f"structured_outputs {kind}: {reason}") from None


class GrammarCache:
    """Compiles grammars for one tokenizer (each distinct spec once) and masks logits with them.

    tokenizer: the checkpoint's Hugging Face tokenizer. vocab_size: columns of the model's logits.
    eos_token_ids: the ids that end a sequence (where a finished grammar allows only these)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[StructuredOutputs, object] = OrderedDict()  # least recently used first

    def matcher(self, spec: StructuredOutputs):
        """A fresh xgrammar GrammarMatcher for one sequence (the grammar is compiled on first use
        of a spec). ValueError naming what is wrong with the spec."""
        compiled = self._compiled.pop(spec, None)
        if compiled is None:
            spec.check()
            compiled = self.compiler.compile_grammar(_grammar(spec.kind, spec.spec))
            if len(self._compiled) >= COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled[spec] = compiled
        return self._xgr.GrammarMatcher(compiled)


def apply_grammar_masks(logits_BV: torch.Tensor, matchers: list, vocab_size: int) -> torch.Tensor:
    """-inf (in place) on every token the row's matcher forbids next; rows whose matcher is None
    are left alone. logits_BV: float32 (B, >= vocab_size)."""
    import xgrammar as xgr

    rows = [b for b, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits_BV
    bitmask_BW = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for b in rows:  # xgrammar walks each matcher's state (C++); the mask is then applied to all rows at once
        matchers[b].fill_next_token_bitmask(bitmask_BW, b)
    apply_token_bitmask_(logits_BV[:, :vocab_size], bitmask_BW, rows)
    return logits_BV
