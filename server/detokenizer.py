"""Incremental detokenization and stop strings: token ids in, streamable text out.

The engine only sees token ids; the server owns all text. Each output sequence gets one
`IncrementalDetokenizer`; the server feeds it the ids of each step and takes the text to stream.

    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["\\n\\n"])
    stop = detok.add_tokens(new_ids)          # the stop string hit, or None
    delta = detok.take_delta(finished)        # text never streamed before; never retracted later

Decoding follows vLLM's `detokenize_incrementally`: only a window of ids is decoded per step. The
window runs from `prefix` to the end; ids[prefix:read] were decoded already (their text is
`prefix_text`), so the new text is decode(ids[prefix:])[len(prefix_text):]. While that text ends
in U+FFFD (a character whose bytes have not all arrived) the offsets stay put and the window
grows; once it is complete, prefix moves to read and read to the end. The window starts with the
last few prompt ids, so the first generated id is decoded with its left context (the leading space
of a sentencepiece "▁word" survives).

Text, in characters (Python str indices): `text` equals decode(output ids, skip_special_tokens,
clean_up_tokenization_spaces=False), which is the plain `decode` of the tokenizers we ship and of
most checkpoints', for decoders that act locally (byte-level BPE, byte fallback). Two exceptions,
both as in vLLM: a tokenizer that cleans up spaces (" ." -> ".") needs lookahead that a stream cannot
have, so text is never cleaned up; and a decoder that drops the first token's leading space
(sentencepiece's Metaspace) keeps it here, because the prompt is the left context.
"""
from collections.abc import Sequence

__all__ = ["IncrementalDetokenizer", "stop_hit"]

REPLACEMENT_CHAR = "\ufffd"  # what decode makes of bytes that do not (yet) form a character
CONTEXT_TOKENS = 6  # prompt ids decoded as left context of the first generated id


def stop_hit(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest occurrence at or after character `start` of any of `stops` in `text`, as
    (index, stop string); of two starting at the same index, the shorter (it ends first). None when
    none occurs. Cost: O(len(text) - start) per stop string."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or (i, len(s)) < (best[0], len(best[1]))):
            best = (i, s)
    return best


def partial_stop_len(text: str, stops: Sequence[str], end: int) -> int:
    """Length of the longest suffix of text[:end] that is a proper prefix of some stop string: the
    characters that the next text could turn into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, end), best, -1):
            if text.endswith(s[:k], 0, end):
                best = k
                break
    return best


def settled_len(text: str) -> int:
    """len(text) without its trailing U+FFFD: characters whose bytes may still be arriving."""
    n = len(text)
    while n and text[n - 1] == REPLACEMENT_CHAR:
        n -= 1
    return n


class IncrementalDetokenizer:
    """Text and stop strings of one output sequence.

    tokenizer: a transformers tokenizer (`decode(ids, skip_special_tokens=...)` is all it uses).
    prompt_token_ids: the prompt; only its last CONTEXT_TOKENS ids are kept, as left context.
    stop: strings that end the text; only the output's text is searched, never the prompt's.
    include_stop_str_in_output: keep the stop string at the end of `text` (else cut before it).

    Attributes: token_ids (the output ids so far), stop_reason (the stop string hit, or None).
    Each add_tokens decodes O(window) ids, not the whole sequence.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 stop: Sequence[str] | str | None = (), include_stop_str_in_output: bool = False):
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stops
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None
        self._max_stop_len = max(map(len, stops), default=0)

        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: the output's first bytes would complete it and
            # the prompt's text would change. Decode the output on its own instead.
            context, context_text = [], ""
        self._context = context
        # Offsets index context + token_ids. ids[prefix:read] decode to prefix_text.
        self._prefix, self._read, self._prefix_text = 0, len(context), context_text
        self._done = ""  # text of the output ids before read: final
        self._pending = ""  # text of the ids from read on: ends in U+FFFD, or is empty
        self._sent = 0  # characters of text returned by take_delta

    @property
    def text(self) -> str:
        """The output text so far, cut at the stop string. Its trailing U+FFFD, if any, may still
        become a character as more ids arrive; all before it is final."""
        return self._done + self._pending if self._pending else self._done

    def add_tokens(self, new_token_ids: Sequence[int]) -> str | None:
        """Append generated ids; returns the stop string hit (text is then cut there), else None.
        Raises RuntimeError once a stop string has been hit."""
        if self.stop_reason is not None:
            raise RuntimeError(f"the sequence already stopped at {self.stop_reason!r}; no more tokens")
        if not new_token_ids:
            return None
        unchanged = settled_len(self.text)  # text before this index cannot change
        self.token_ids.extend(new_token_ids)
        self._decode_window()
        if not self.stop:
            return None
        return self._find_stop(max(0, unchanged - self._max_stop_len + 1))

    def take_delta(self, finished: bool) -> str:
        """Text not returned before. Unless finished (or stopped), hold back what could change or
        be cut: trailing U+FFFD and the longest suffix that could begin a stop string."""
        text = self.text
        end = len(text)
        if not finished and self.stop_reason is None:
            end = settled_len(text)
            end -= partial_stop_len(text, self.stop, end)
            end = max(end, self._sent)  # held text is never returned, so this is a no-op
        delta = text[self._sent:end]
        self._sent = end
        return delta

    def _decode_window(self) -> None:
        new_text = self._decode(self._ids(self._prefix, None))
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing yet (a skipped special token) or a character still incomplete: the window
            # grows; the prefix keeps the left context for the decoders that need it.
            self._pending = new_text[len(self._prefix_text):]
            return
        self._done += new_text[len(self._prefix_text):]
        self._pending = ""
        self._prefix, self._read = self._read, len(self._context) + len(self.token_ids)
        self._prefix_text = self._decode(self._ids(self._prefix, self._read))

    def _find_stop(self, start: int) -> str | None:
        text = self.text
        hit = stop_hit(text, self.stop, start)
        if hit is None:
            return None
        i, s = hit
        self._done = text[:i + len(s)] if self.include_stop_str_in_output else text[:i]
        self._pending = ""
        self.stop_reason = s
        return s

    def _ids(self, lo: int, hi: int | None) -> list[int]:
        """(context + token_ids)[lo:hi] without building the whole list."""
        n = len(self._context)
        hi = n + len(self.token_ids) if hi is None else hi
        return self._context[lo:hi] + self.token_ids[max(lo - n, 0):max(hi - n, 0)]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)
