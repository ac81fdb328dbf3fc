"""Request sets of `shuttle bench serve`: random prompts of a given length, or a JSONL file.

Without a tokenizer, random prompts are words drawn from a fixed list of common English words that
are one token each (with their leading space) in the usual BPE vocabularies, so a prompt of n words
is about n tokens; the exact count comes back in the server's `usage.prompt_tokens`. With --tokenizer
(a local Hugging Face tokenizer directory) prompts are built to the exact token length.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WORDS = tuple(dict.fromkeys("""
the of and to in is that for it as was with be by on not he this are or his from at which but have an they
you were her she there one all we their has been if more when will would who so no out up into do any time
about than them can only other new some could these two may first then do its like over such our man me even
most made after also did many before must through back years where much your way well down should because
each just those people how too little state good very make world still own see men work long get here between
both life being under never day same another know while last might us great old year off come since against
go came right used take three house use during without again place around however home small found thought
went say part once general high upon school every don does got united left number course war until always away
something fact though water less public put think almost hand enough far took head yet government system better
set told nothing night end why called didn eyes find going look asked later point knew city next program business
give group toward young days let room president side social given present several order national possible rather
second face per among form important often things looked early white case become large big need four within felt
along children saw best church ever least power development light thing seemed family interest want members
""".split()))


class BenchError(Exception):
    """A failure of the benchmark as a whole (unreachable server, bad dataset): one line for the user."""


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. prompt: the text (completions, and chat when `messages` is None);
    messages: chat messages; output_len: max_tokens; est_input_len: prompt tokens as estimated here
    (exact with a tokenizer), used only when the server reports no usage."""

    prompt: str
    messages: list[dict[str, Any]] | None
    output_len: int
    est_input_len: int


def uniform_lengths(n: int, length: int, range_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """n integers drawn uniformly from those in [length*(1-r), length*(1+r)] (at least 1)."""
    low = max(1, math.ceil(length * (1 - range_ratio)))
    high = max(low, math.floor(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                    tokenizer_dir: str | None = None) -> list[BenchRequest]:
    """n requests of random prompts; input and output lengths (tokens) uniform around the given ones."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lens = uniform_lengths(n, input_len, range_ratio, rng)
    out_lens = uniform_lengths(n, output_len, range_ratio, rng)
    if tokenizer_dir is None:
        prompts = [" ".join(rng.choice(WORDS, size=int(k))) for k in in_lens]
    else:
        make = _token_prompt_maker(tokenizer_dir, rng)
        prompts = [make(int(k)) for k in in_lens]
    return [BenchRequest(p, None, int(o), int(k)) for p, k, o in zip(prompts, in_lens, out_lens)]


def _token_prompt_maker(tokenizer_dir: str, rng: np.random.Generator) -> Callable[[int], str]:
    """A function n -> a text of exactly n tokens (when re-encodable) made of random vocabulary words."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        raise BenchError(f"--tokenizer {tokenizer_dir}: cannot load a tokenizer there ({e})") from None
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    words = [i for i in ids if (s := tok.decode([i])).startswith(" ") and s[1:].isalpha()]
    pool = np.array(words if len(words) >= 50 else ids)

    def make(n: int) -> str:
        ids_n = rng.choice(pool, size=n).tolist()
        text = tok.decode(ids_n)
        for _ in range(10):  # decode/encode may merge or split tokens; pad or cut until it round-trips
            again = tok.encode(text, add_special_tokens=False)
            if len(again) == n:
                break
            ids_n = again[:n] if len(again) > n else again + rng.choice(pool, size=n - len(again)).tolist()
            text = tok.decode(ids_n)
        return text

    return make


def load_jsonl(path: str | Path, num_prompts: int, default_output_len: int, chat: bool) -> list[BenchRequest]:
    """The first num_prompts requests of a JSONL file (cycled when it has fewer lines).

    Each non-blank line: {"prompt": str} or {"messages": [{"role", "content"}, ...]} (chat only), with
    optional "output_len" or "max_tokens" (else default_output_len). Errors name the file and line.
    """
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"dataset {p}: no such file")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"dataset {p}: cannot read it as UTF-8 text ({e})") from None
    found = [_jsonl_request(line, f"{p}:{i}", default_output_len, chat)
             for i, line in enumerate(lines, 1) if line.strip()]
    if not found:
        raise BenchError(f"dataset {p}: no requests in it")
    return [found[i % len(found)] for i in range(num_prompts)]


def _jsonl_request(line: str, where: str, default_output_len: int, chat: bool) -> BenchRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BenchError(f"dataset {where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise BenchError(f"dataset {where}: expected a JSON object, got {type(obj).__name__}")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise BenchError(f"dataset {where}: needs exactly one of \"prompt\" (a string) or \"messages\" (a list)")
    if prompt is not None and not isinstance(prompt, str):
        raise BenchError(f"dataset {where}: \"prompt\" must be a string")
    if messages is not None:
        if not chat:
            raise BenchError(f"dataset {where}: \"messages\" needs --backend openai-chat")
        _check_messages(messages, where)
    out = obj.get("output_len", obj.get("max_tokens", default_output_len))
    if isinstance(out, bool) or not isinstance(out, int) or out < 1:
        raise BenchError(f"dataset {where}: \"output_len\"/\"max_tokens\" must be a positive integer, got {out!r}")
    text = prompt if prompt is not None else " ".join(m["content"] for m in messages)
    return BenchRequest(prompt or "", messages, out, len(text.split()))


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise BenchError(f"dataset {where}: \"messages\" must be a non-empty list")
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BenchError(f"dataset {where}: messages[{k}] must be {{\"role\": str, \"content\": str}}")
