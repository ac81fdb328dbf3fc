"""AsyncLLM: the engine behind an asyncio interface, for the HTTP and gRPC servers.

    llm = AsyncLLM(model_dir)
    async for out in llm.generate(prompt, SamplingParams(max_tokens=64), request_id="r1"):
        print(out.outputs[0].delta_text, end="")      # streamed as each step produces it
    await llm.abort("r2")                              # its KV blocks are free when this returns

The engine is built and runs its steps in one background thread (torch releases the GIL inside its
ops, so the event loop stays responsive; one thread for all of the engine's torch work keeps one
OpenMP pool in the process); requests and aborts reach it through a queue that it drains between steps,
and each request's outputs come back through its own asyncio queue. A consumer that stops iterating
(a client that disconnects) aborts its request. If the engine thread fails, every waiting request
gets the error and later calls raise EngineDeadError, as after shutdown(): nothing waits forever.
The engine is LLMEngine in this process or, with colocated=False, the worker pools' front
(pools/engine.py); a worker that dies is noticed within a second even while no request runs, and
restarted there (requests wait, and running ones resume, meanwhile); only a failure it cannot
recover from ends the engine thread.

max_waiting bounds the requests that wait for their first token (QueueFullError beyond it), and an
observer (server/metrics.py) is told each request's timings: both are for the servers.
"""
import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass, replace
from pathlib import Path
import time
from typing import AsyncIterator, Callable, Protocol

import torch

from attention_nodes.engine import Engine
from attention_nodes.sampling_params import SamplingParams
from server.llm import LLM
from server.outputs import RequestOutput, RequestTracker
from telemetry.trace import Tracer

log = logging.getLogger("shuttle")


class EngineDeadError(RuntimeError):
    pass


class QueueFullError(RuntimeError):
    """More than max_waiting requests are waiting for their first token; retry later."""


class Admission:
    """Room for n requests in the waiting queue, taken in one check (AsyncLLM.reserve): a response
    that has to commit to success before its requests start (an HTTP stream sends 200 first)
    reserves the room up front, so a race with other requests cannot fail it half-way. Each
    `generate(..., admission=...)` takes one unit; `release` gives back what was not taken
    (idempotent), and must run however the response ends."""

    def __init__(self, llm: "AsyncLLM", n: int):
        self._llm, self._left = llm, n

    def take(self) -> bool:
        """Move one reserved unit to a starting request; False when none is left."""
        with self._llm._lock:
            if self._left == 0:
                return False
            self._left -= 1
            return True

    def release(self) -> None:
        with self._llm._lock:
            self._llm.num_waiting -= self._left
            self._left = 0


class RequestObserver(Protocol):
    """Told about every request's progress (times from time.monotonic(), seconds)."""

    def on_output(self, arrival: float, previous: float | None, now: float, new_tokens: int) -> None:
        """A step produced new_tokens for a request (previous: the time of its last output)."""

    def on_finished(self, output: RequestOutput, arrival: float, first: float | None, now: float) -> None:
        """The request ended (finished, aborted or failed); first: the time of its first token."""


@dataclass
class _Add:
    tracker: RequestTracker
    prompt_token_ids: list[int]
    params: SamplingParams
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str
    done: asyncio.Event
    loop: asyncio.AbstractEventLoop


class AsyncLLM:
    """Same arguments as LLM. `generate` yields RequestOutputs (cumulative text plus the step's delta)."""

    def __init__(self, model: str | Path | None = None, dtype: str | torch.dtype | None = "auto",
                 device: str | None = None, kernels: str | None = None, *, max_waiting: int | None = None,
                 observer: RequestObserver | None = None, **engine_kwargs):
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting, self.observer = max_waiting, observer
        self.num_waiting = 0  # requests that have no output yet (asyncio side, under _lock)
        self._busy_ns, self._start_ns = 0, time.monotonic_ns()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, tuple[RequestTracker, asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._stopping = False
        self._closed = False  # set (under _lock) as the engine thread exits: no message is taken after
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # The engine is built in its own thread, which then runs the steps: every torch op of this
        # engine (loading and packing included) runs on one thread, so the process has one OpenMP
        # thread pool. Built here and stepped there, libgomp would keep two pools, count more threads
        # than cores and stop spinning between parallel regions: each op then paid a wake-up, and a
        # colocated `shuttle serve` ran its decode steps ~2x slower than LLM.generate (2.2 against
        # 1.0 ms a step at batch 1 on a 25M-parameter model, 2-core AVX-512 EPYC).
        built, failed = threading.Event(), []
        self._thread = threading.Thread(target=self._build_and_loop,
                                        args=((model, dtype, device, kernels), engine_kwargs, built, failed),
                                        name="shuttle-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failed:
            self._thread.join()
            raise failed[0]
        self.tokenizer, self.model_config, self.model_dir = self._llm.tokenizer, self._llm.cfg, self._llm.model_dir
        self.engine_cfg = self._llm.engine_cfg
        self.render_chat = self._llm.render_chat

    def _build_and_loop(self, args: tuple, engine_kwargs: dict, built: threading.Event, failed: list) -> None:
        try:
            self._llm = LLM(*args, **engine_kwargs)  # tokenizer, validation, engine
            self.engine: Engine = self._llm.engine
        except BaseException as e:  # raised by __init__ in the caller's thread
            failed.append(e)
            return
        finally:
            built.set()
        self._loop()

    # -- the asyncio side ---------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       admission: Admission | None = None, *, validated: bool = False
                       ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its output after every step that changed it, the last one with
        finished=True. Raises ValueError for a bad request (before anything runs), QueueFullError
        when max_waiting requests already wait for their first token (unless it takes its place
        from `admission`, reserved earlier). validated: the caller passed token ids it checked with
        check_prompt and check_params itself (the HTTP front does, to name the request's field in its errors)."""
        self.check_alive()
        request_id = request_id or f"req-{next(self._ids)}"
        ids = list(prompt) if validated else self._llm._encode(prompt, params)
        tracker = RequestTracker(request_id, prompt if isinstance(prompt, str) else None, ids, params, self.tokenizer)
        out: asyncio.Queue = asyncio.Queue()
        if admission is None or not admission.take():
            self._admit()
        arrival, first, last, waiting = time.monotonic(), None, None, True
        if not self._send(_Add(tracker, ids, params, out, asyncio.get_running_loop())):
            self._admitted()
            raise self._dead_error()
        finished = False
        try:
            while not finished:
                item = await out.get()
                if waiting:
                    waiting = self._admitted()
                if isinstance(item, BaseException):
                    finished = True  # the request was refused or the engine is gone: nothing to abort
                    raise item
                now, finished = time.monotonic(), item.finished
                new = sum(len(o.delta_token_ids) for o in item.outputs)
                if new and self.observer:
                    self.observer.on_output(arrival, last, now, new)
                first, last = first or (now if new else None), now if new else last
                yield item
        finally:
            if waiting:
                self._admitted()
            if not finished:
                await self.abort(request_id)
            if self.observer:
                self.observer.on_finished(tracker.output, arrival, first, time.monotonic())

    def check_capacity(self, n: int = 1) -> None:
        """Raise QueueFullError unless n more requests may wait now (EngineDeadError if dead)."""
        self.check_alive()
        if self.max_waiting is not None and self.num_waiting + n > self.max_waiting:
            raise QueueFullError(f"{self.num_waiting} requests are waiting for their first token "
                                 f"(max_waiting={self.max_waiting}); retry later")

    def reserve(self, n: int = 1) -> Admission:
        """Check that n more requests may wait and hold their places (QueueFullError if not,
        EngineDeadError if dead); see Admission."""
        with self._lock:
            self.check_capacity(n)
            self.num_waiting += n
        return Admission(self, n)

    def _admit(self) -> None:
        with self._lock:
            self.check_capacity()
            self.num_waiting += 1

    def _admitted(self) -> bool:
        """The request left the waiting queue (it has output, or ended); returns False."""
        with self._lock:
            self.num_waiting -= 1
        return False

    async def abort(self, request_id: str) -> None:
        """Stop a request; when this returns its sequences are retired and their blocks are free."""
        done = asyncio.Event()
        if self._send(_Abort(request_id, done, asyncio.get_running_loop())):
            await done.wait()  # else the engine thread is gone and holds no blocks for anyone

    def stats(self) -> dict:
        """The engine's counters (LLMEngine.stats keys, expert_tokens), `queued` (requests still
        waiting for their first token: what max_waiting bounds) and `busy`: per worker, its busy
        and up time in ns (colocated: the engine thread's time inside steps)."""
        s = self.engine.stats()
        s["queued"] = self.num_waiting
        if "busy" not in s:
            s["busy"] = [{"pool": "colocated", "worker": "engine", "busy_ns": self._busy_ns,
                          "uptime_ns": time.monotonic_ns() - self._start_ns}]
        return s

    def shutdown(self) -> None:
        """Stop the engine thread (failing what still waits), then the worker pools if any."""
        self._stopping = True
        self._wake.set()
        self.engine.wake()
        self._thread.join(timeout=30)
        self._llm.shutdown()

    def _send(self, msg: object) -> bool:
        """Queue msg for the engine thread; False when that thread has exited and will never read it."""
        with self._lock:
            if self._closed:
                return False
            self._inbox.put(msg)
        self._wake.set()
        self.engine.wake()
        return True

    def _dead_error(self) -> EngineDeadError:
        if self._error is not None:
            return EngineDeadError(f"the engine stopped: {self._error!r}")
        return EngineDeadError("the engine is shut down")

    @property
    def ready(self) -> bool:
        """A generation step can run now: the engine is alive and, with worker pools, every worker
        is up and connected (False while failed workers are restarted; requests wait meanwhile)."""
        return self._error is None and not self._stopping and self.engine.ready

    def check_alive(self) -> None:
        """Raise EngineDeadError if the engine failed (a dead worker included) or was shut down."""
        if self._error is not None or self._stopping:
            raise self._dead_error()

    # -- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        tracer = self._llm.tracer  # with trace_dir: this loop's admissions, steps and deliveries
        try:
            while not self._stopping:
                t0 = Tracer.now()
                admitted = self._drain_inbox()
                if admitted and tracer.enabled:
                    tracer.span("admit", "front", t0, args={"messages": admitted})
                if not self.engine.has_unfinished_requests():
                    self.engine.check_health()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                changed, start = {}, time.monotonic_ns()
                deltas = self._llm.step()
                self._busy_ns += time.monotonic_ns() - start
                t0 = Tracer.now()
                for delta in deltas:
                    tracker, q, loop = self._requests[delta.request_id]
                    stop = tracker.apply(delta)
                    if stop is not None:
                        self.engine.stop_sequence(delta.request_id, delta.index, stop)
                    changed[delta.request_id] = (tracker, q, loop)
                for rid, (tracker, q, loop) in changed.items():
                    self._emit(rid, tracker, q, loop)
                if tracer.enabled:
                    tracer.span("deliver", "front", t0, args={"deltas": len(deltas)})
        except BaseException as e:
            log.exception("engine thread failed")
            self._error = e
        finally:  # failed or shut down: report to every waiter; never leave one hanging
            self._close()

    def _pending(self):
        """The queued messages, oldest first, until the inbox is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> int:
        """Carry out the queued adds and aborts; returns how many."""
        n = 0
        for msg in self._pending():
            n += 1
            if isinstance(msg, _Add):
                rid = msg.tracker.output.request_id
                try:
                    self.engine.add_request(rid, msg.prompt_token_ids, msg.params)
                except ValueError as e:
                    _post(msg.loop, msg.out.put_nowait, e)
                    continue
                self._requests[rid] = (msg.tracker, msg.out, msg.loop)
            else:
                for delta in self.engine.abort_request(msg.request_id):
                    entry = self._requests.get(msg.request_id)
                    if entry:
                        entry[0].apply(delta)
                entry = self._requests.get(msg.request_id)
                if entry:
                    self._emit(msg.request_id, *entry)
                _post(msg.loop, msg.done.set)
        return n

    def _emit(self, rid: str, tracker: RequestTracker, q: asyncio.Queue, loop: asyncio.AbstractEventLoop) -> None:
        snapshot = _snapshot(tracker.output)
        tracker.clear_deltas()
        delivered = _post(loop, q.put_nowait, snapshot)
        if snapshot.finished or not delivered:
            self._requests.pop(rid, None)
        if not delivered:  # its consumer's event loop is closed: nobody will read it
            self.engine.abort_request(rid)

    def _close(self) -> None:
        """Take no more messages, then fail the running requests and answer the queued messages."""
        with self._lock:
            self._closed = True
        for _, q, loop in self._requests.values():
            _post(loop, q.put_nowait, self._dead_error())
        self._requests.clear()
        for msg in self._pending():
            if isinstance(msg, _Add):
                _post(msg.loop, msg.out.put_nowait, self._dead_error())
            else:
                _post(msg.loop, msg.done.set)


def _post(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> bool:
    """Run callback(*args) in loop's thread; False when that loop is closed (its consumer is gone).
    A client's closed loop must not kill the engine thread that serves everyone else."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the consumer may keep while the engine thread goes on updating the original (whose
    token_ids and logprobs lists grow in place)."""
    outputs = [replace(o, token_ids=list(o.token_ids), logprobs=None if o.logprobs is None else list(o.logprobs))
               for o in out.outputs]
    return RequestOutput(out.prompt, out.prompt_token_ids, outputs, out.finished, out.request_id,
                         out.num_cached_tokens, None if out.prompt_logprobs is None else list(out.prompt_logprobs))
