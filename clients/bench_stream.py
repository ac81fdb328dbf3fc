"""One streamed request as `shuttle bench serve` reads it: the Server-Sent Events decoder and the
recorder that times the stream's chunks into a RequestRecord (clients/bench_serve.py's backends
feed both)."""
from __future__ import annotations

import codecs
import time

from clients.bench_datasets import BenchRequest
from clients.bench_metrics import RequestRecord


class SSEDecoder:
    """Incremental Server-Sent Events parser: bytes in as they arrive, the `data` of each complete event out.

    Follows the SSE spec: lines end in CRLF, LF or CR (a CR at the end of a read waits for a possible
    LF); `:` lines are comments (keep-alives); several `data:` lines of one event join with newlines;
    other fields (`event:`, `id:`, `retry:`) are ignored; UTF-8 sequences may be split across reads.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Consume one read; return the data of the events it completed, in order."""
        self._buf += self._utf8.decode(chunk)
        events, pos = [], 0
        while True:
            cr, lf = self._buf.find("\r", pos), self._buf.find("\n", pos)
            end = min(i for i in (cr, lf, len(self._buf)) if i >= 0)
            if end == len(self._buf) or (end == cr and cr + 1 == len(self._buf)):
                break
            skip = 2 if self._buf.startswith("\r\n", end) else 1
            self._line(self._buf[pos:end], events)
            pos = end + skip
        self._buf = self._buf[pos:]
        return events

    def close(self) -> list[str]:
        """End of stream: finish a last unterminated line and event."""
        events: list[str] = []
        tail = self._buf + self._utf8.decode(b"", final=True)
        self._buf = ""
        for line in tail.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
            self._line(line, events)
        self._line("", events)
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


class StreamRecorder:
    """Fills one RequestRecord as its stream arrives; created when the request is sent (its start
    time). Times are perf_counter seconds."""

    def __init__(self, req: BenchRequest) -> None:
        self.rec = RequestRecord(prompt_tokens=req.est_input_len, start_time=time.perf_counter())
        self._last = self.rec.start_time
        self._chunks = 0
        self._tokens = 0
        self._textless: list[float] = []  # arrivals of chunks whose choice carried no text

    def content(self, text: str, now: float, tokens: int = 1) -> None:
        """A chunk carrying generated text (and `tokens` tokens) arrived at `now`."""
        if self._chunks == 0:
            self.rec.ttft = now - self.rec.start_time
        else:
            self.rec.itl.append(now - self._last)
        self._last, self._chunks, self._tokens = now, self._chunks + 1, self._tokens + tokens
        self.rec.generated_text += text

    def textless(self, now: float) -> None:
        """A chunk with a choice but no text arrived at `now` (a chat role chunk, a finish-only chunk,
        or tokens that decode to nothing, such as special tokens)."""
        self._textless.append(now)

    def usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """The server's token counts (the last report wins)."""
        self.rec.prompt_tokens = int(prompt_tokens or 0)
        self.rec.output_tokens = int(completion_tokens or 0)
        self.rec.usage_reported = True

    def finish(self, error: str = "") -> RequestRecord:
        """The stream ended now, with `error` if it failed. TTFT and ITL come from the chunks that
        carried text; a stream whose choices carried none (every token decoded to nothing) still
        succeeds, timed from its first chunk, as vllm bench serve counts it; one without any choice
        fails."""
        rec = self.rec
        rec.latency = time.perf_counter() - rec.start_time
        if not self._chunks and self._textless and not error:
            rec.ttft = self._textless[0] - rec.start_time
            rec.itl = [b - a for a, b in zip(self._textless, self._textless[1:])]
            self._tokens = len(self._textless)
        rec.error = error or ("" if self._chunks or self._textless else "the response carried no generated text")
        rec.success = not rec.error
        if not rec.usage_reported:
            rec.output_tokens = self._tokens
        return rec
