"""Streams under load while a worker is killed or stopped: what tests/test_supervision.py checks
and bench/failover.py measures. `srv` is a clients.live_server.LiveServer with `client` (an openai
client), `model` and `reference` (each prompt's undisturbed text) set by the caller.
"""
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

PROMPTS = ["The for statement", "A list is", "def main():", "import os", "While the loop", "Errors are",
           "class Foo:", "The value of"]
SEEDED = {"The value of": {"temperature": 0.9, "top_p": 0.95, "seed": 7}}  # the others are greedy
MAX_TOKENS = int(os.environ.get("SHUTTLE_FAULT_MAX_TOKENS", "32"))


def complete(srv, prompt: str, stamps: list[float] | None = None) -> str:
    """One streamed completion (greedy, or seeded for SEEDED prompts) through the openai client;
    `stamps` gets each chunk's time."""
    text = []
    sampling = SEEDED.get(prompt, {"temperature": 0})
    for chunk in srv.client.completions.create(model=srv.model, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                               extra_body={"ignore_eos": True}, **sampling):
        if chunk.choices and chunk.choices[0].text:
            text.append(chunk.choices[0].text)
            if stamps is not None:
                stamps.append(time.monotonic())
    return "".join(text)


class HealthWatch(threading.Thread):
    """Polls /health every 50 ms; on the first 503 it sends one more request (which must wait, not fail)."""

    def __init__(self, srv):
        super().__init__(daemon=True)
        self.srv, self.codes, self.retry_after, self.stop = srv, [], set(), threading.Event()
        self.late: dict = {}

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                r = httpx.get(f"{self.srv.url}/health", timeout=5)
            except httpx.HTTPError:
                continue
            self.codes.append(r.status_code)
            if r.status_code == 503:
                self.retry_after.add(r.headers.get("retry-after"))
                self.codes[-1] = (503, r.json()["error"]["code"])
                if not self.late:
                    self.late["thread"] = threading.Thread(target=self._late, daemon=True)
                    self.late["thread"].start()
            time.sleep(0.05)

    def _late(self) -> None:
        try:
            self.late["text"] = complete(self.srv, PROMPTS[0])
        except Exception as e:  # noqa: BLE001 - the assertion names it
            self.late["error"] = repr(e)


def fault_under_load(srv, victim: str, sig: int, requests: int, concurrency: int) -> dict:
    """Send `requests` streams at `concurrency`; once several streams are under way, signal the
    victim worker (its process title). Returns the texts or errors by request index, when tokens
    came again and the longest pause after the fault, and the health watch."""
    stamps: list[float] = []
    started = threading.Event()
    results: dict[int, str | Exception] = {}

    def one(i: int) -> None:
        try:
            results[i] = complete(srv, PROMPTS[i % len(PROMPTS)], stamps)
        except Exception as e:  # noqa: BLE001
            results[i] = e

    watch = HealthWatch(srv)
    # the victim found before the load: its pgreps took long enough for a fast host's streams to end
    # between the trigger and the signal
    pid = srv.children()[victim]
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one, i) for i in range(requests)]
        deadline = time.monotonic() + 60
        while len(stamps) < 3 * concurrency and time.monotonic() < deadline:
            time.sleep(0.01)
        killed_at = time.monotonic()
        os.kill(pid, sig)
        watch.start()
        for f in futures:
            f.result()
    if watch.late.get("thread"):
        watch.late["thread"].join(120)
    # the streams may all end (the restarted worker serving them) a moment before the front reports
    # itself ready again: the watch runs until it does, for at most 30 s
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and watch.is_alive() and (not watch.codes or watch.codes[-1] != 200):
        time.sleep(0.05)
    watch.stop.set()
    watch.join(5)
    after = sorted(t for t in stamps if t > killed_at)
    # Tokens already in flight may still arrive just after the fault: the outage is the longest
    # pause in the token flow from the fault on (detection, restart, recompute).
    pause = max((b - a for a, b in zip([killed_at] + after, after)), default=None)
    return {"results": results, "first_after_s": after[0] - killed_at if after else None, "pause_s": pause,
            "watch": watch}
