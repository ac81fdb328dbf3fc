"""A small interval recorder for Chrome's trace viewer (chrome://tracing, ui.perfetto.dev).

Workers record what they spend time on (attention compute, expert compute, sending, waiting) as
complete events on the system-wide monotonic clock, so traces of several processes line up.
Disabled tracers record no event, but every tracer keeps the total time per category (`totals`,
nanoseconds), which workers report as their busy time (the server's /metrics busy fractions).
"""
import json
import time
from pathlib import Path


class Tracer:
    def __init__(self, process: str, enabled: bool = False):
        self.process, self.enabled = process, enabled
        self.events: list[tuple[str, str, int, int, dict | None]] = []  # name, category, start ns, end ns, args
        self.totals: dict[str, int] = {}  # category -> nanoseconds spent in it, recorded even when disabled

    @staticmethod
    def now() -> int:
        return time.monotonic_ns()

    def span(self, name: str, cat: str, start_ns: int, end_ns: int | None = None, args: dict | None = None) -> None:
        end_ns = end_ns if end_ns is not None else time.monotonic_ns()
        self.totals[cat] = self.totals.get(cat, 0) + end_ns - start_ns
        if self.enabled:
            self.events.append((name, cat, start_ns, end_ns, args))

    def chrome_events(self) -> list[dict]:
        return [{"name": n, "cat": c, "ph": "X", "ts": s / 1e3, "dur": (e - s) / 1e3, "pid": self.process, "tid": c,
                 **({"args": a} if a else {})} for n, c, s, e, a in self.events]

    def dump(self, directory: str | Path) -> Path:
        """Write this process's events to DIRECTORY/PROCESS.trace.json (a list of Chrome events),
        making the directory if it is not there."""
        path = Path(directory) / f"{self.process}.trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_events()))
        return path


def busy_fraction(events: list[dict], cats: set[str], start_us: float, end_us: float) -> float:
    """Share of [start, end] covered by events of the given categories (events must not overlap)."""
    covered = sum(max(0.0, min(e["ts"] + e["dur"], end_us) - max(e["ts"], start_us))
                  for e in events if e["cat"] in cats)
    return covered / max(end_us - start_us, 1e-9)

