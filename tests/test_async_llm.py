"""AsyncLLM on a tiny checkpoint: streaming, concurrent requests, aborts (explicit, and by a consumer
that stops iterating), bad requests, shutdown, a failed engine thread and a client's closed event
loop. Greedy results are checked against LLM.generate on the same checkpoint.

Every test runs its coroutine under a timeout (see `run`), so a request that never ends fails the
test instead of hanging it, and every AsyncLLM is shut down (its thread joined) by `serve`.
"""
import asyncio
import threading
import time

import pytest

from server import LLM, SamplingParams
from server.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from tests.conftest import PROMPTS, slow_steps

GREEDY = dict(temperature=0, ignore_eos=True)
TIMEOUT = 10.0  # seconds a test's coroutine may take
LONG = SamplingParams(max_tokens=400, **GREEDY)  # runs for seconds under slow_steps: always cut short


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(ckpt)


@pytest.fixture
def serve(ckpt):
    """serve(**engine_kwargs) -> a running AsyncLLM; all are shut down after the test."""
    started: list[AsyncLLM] = []

    def start(**engine_kwargs) -> AsyncLLM:
        started.append(AsyncLLM(ckpt, **engine_kwargs))
        return started[-1]

    try:
        yield start
    finally:
        for a in started:
            a.shutdown()
    assert not [t for t in threading.enumerate() if t.name == "shuttle-engine"], "an engine thread outlived shutdown"


def run(coro):
    """asyncio.run(coro) under TIMEOUT, in a thread of its own so that the test fails instead of
    hanging even when a bug makes the coroutine outlive its cancellation."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = asyncio.run(asyncio.wait_for(coro, TIMEOUT))
        except BaseException as e:  # handed to the test's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TIMEOUT + 5)
    assert not thread.is_alive(), f"still waiting {TIMEOUT + 5} s later: something never ends"
    if "error" in result:
        raise result["error"]
    return result["value"]


async def collect(a: AsyncLLM, prompt, params: SamplingParams, **kw) -> list:
    return [out async for out in a.generate(prompt, params, **kw)]


async def until(condition, seconds: float = 2.0, what: str = "condition") -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached within {seconds} s"
        await asyncio.sleep(0.005)


def idle(a: AsyncLLM) -> bool:
    s = a.stats()
    return s["running"] == s["waiting"] == 0 and s["free_blocks"] == s["num_blocks"]


def greedy_ids(llm: LLM, prompt, max_tokens: int) -> list[int]:
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))[0].outputs[0].token_ids


def test_streamed_deltas_add_up_to_the_final_output(serve, llm):
    a, prompt = serve(), "The for statement"
    outs = run(collect(a, prompt, SamplingParams(max_tokens=12, **GREEDY)))
    final = outs[-1].outputs[0]
    assert len(outs) > 3 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text
    ids: list[int] = []
    for o in outs:  # each output is a snapshot of its step, not a view that keeps growing
        ids += o.outputs[0].delta_token_ids
        assert o.outputs[0].token_ids == ids
    ref = llm.generate(prompt, SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0]
    assert final.token_ids == ref.token_ids and final.text == ref.text and final.finish_reason == "length"
    assert outs[-1].prompt == prompt and outs[-1].prompt_token_ids == llm.tokenizer.encode(prompt)


def test_several_deltas_of_a_sequence_in_one_step_all_stream(serve, llm, monkeypatch):
    """PoolEngine.step returns every delta the workers sent since the last step, so one step can
    hold several deltas of the same sequence: each output must carry all of them."""
    a, prompt = serve(), "The for statement"
    step = a.engine.step
    monkeypatch.setattr(a.engine, "step", lambda: step() + step())  # two engine steps' deltas at once
    outs = run(collect(a, prompt, SamplingParams(max_tokens=12, logprobs=2, **GREEDY)))
    final = outs[-1].outputs[0]
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.token_ids
    assert any(len(o.outputs[0].delta_token_ids) > 1 for o in outs)
    assert final.token_ids == greedy_ids(llm, prompt, 12) and len(final.logprobs) == 12


def test_concurrent_requests_equal_each_alone(serve, llm):
    a = serve()
    prompts = [PROMPTS[0], PROMPTS[1], "A class definition defines a class object", PROMPTS[3]]
    lengths = [9, 3, 14, 6]

    async def main():
        return await asyncio.gather(*(collect(a, p, SamplingParams(max_tokens=n, **GREEDY))
                                      for p, n in zip(prompts, lengths)))

    results = run(main())
    for p, n, outs in zip(prompts, lengths, results):
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == greedy_ids(llm, p, n), p
    assert a.stats()["steps"] < sum(lengths)  # they shared steps
    assert idle(a)


def test_abort_mid_stream_frees_every_block(serve, monkeypatch):
    a = serve()
    slow_steps(a, monkeypatch)

    async def main():
        stream = a.generate(PROMPTS[0], LONG, request_id="long")
        seen = [await anext(stream) for _ in range(3)]
        assert a.stats()["free_blocks"] < a.stats()["num_blocks"]
        await a.abort("long")
        assert idle(a) and not a.engine.has_unfinished_requests()
        return seen, [out async for out in stream]

    seen, rest = run(main())
    assert not seen[-1].finished and rest[-1].finished
    last = rest[-1].outputs[0]
    assert last.finish_reason == "abort" and 3 <= len(last.token_ids) < LONG.max_tokens


def test_a_consumer_that_stops_iterating_aborts_its_request(serve, monkeypatch):
    a = serve()
    slow_steps(a, monkeypatch)

    async def main():
        async for out in a.generate(PROMPTS[2], LONG):
            if len(out.outputs[0].token_ids) >= 2:
                break
        await until(lambda: idle(a), what="the abandoned request's blocks freed")

    run(main())
    assert a.stats()["generated_tokens"] < LONG.max_tokens


def test_bad_requests_raise_before_anything_runs(serve, llm, monkeypatch):
    a = serve()
    slow_steps(a, monkeypatch)

    async def main():
        for prompt, match in [([1, 2, 10**6], "outside the vocabulary"), ([5, -1], "outside the vocabulary"),
                              ([], "prompt is empty"), ("", "prompt is empty")]:
            with pytest.raises(ValueError, match=match):
                await collect(a, prompt, SamplingParams(max_tokens=4))
        assert a.stats()["steps"] == 0 and idle(a)
        # An id in use is refused without disturbing the request that holds it.
        first = asyncio.create_task(collect(a, PROMPTS[0], SamplingParams(max_tokens=30, **GREEDY), request_id="dup"))
        await until(lambda: a.stats()["generated_tokens"] > 0, what="the first request running")
        with pytest.raises(ValueError, match="already in use"):
            await collect(a, PROMPTS[1], SamplingParams(max_tokens=2), request_id="dup")
        return await first, await collect(a, PROMPTS[3], SamplingParams(max_tokens=5, **GREEDY))

    first, other = run(main())
    assert first[-1].outputs[0].finish_reason == "length"
    assert first[-1].outputs[0].token_ids == greedy_ids(llm, PROMPTS[0], 30)
    assert other[-1].outputs[0].token_ids == greedy_ids(llm, PROMPTS[3], 5)


def test_max_waiting_bounds_the_requests_without_output(serve, llm, monkeypatch):
    """One sequence runs at a time; one request may wait for its first token; a third is refused
    until the waiting one starts. An observer sees every request's timings."""
    seen = []

    class Observer:
        def on_output(self, arrival, previous, now, new_tokens):
            seen.append(("output", previous is None, new_tokens))

        def on_finished(self, output, arrival, first, now):
            seen.append(("finished", output.outputs[0].finish_reason, first is not None))

    a = serve(max_num_seqs=1, max_waiting=1, observer=Observer())
    slow_steps(a, monkeypatch)

    async def main():
        running = a.generate(PROMPTS[0], LONG, request_id="running")
        await anext(running)
        waiting = asyncio.create_task(collect(a, PROMPTS[1], SamplingParams(max_tokens=3, **GREEDY)))
        await until(lambda: a.stats()["queued"] == 1, what="the second request queued")
        with pytest.raises(QueueFullError, match="max_waiting=1"):
            await collect(a, PROMPTS[2], SamplingParams(max_tokens=3))
        await a.abort("running")  # the waiting request gets the sequence slot
        await running.aclose()
        done = await waiting
        assert a.stats()["queued"] == 0
        return done, await collect(a, PROMPTS[2], SamplingParams(max_tokens=3, **GREEDY))

    done, third = run(main())
    assert done[-1].outputs[0].token_ids == greedy_ids(llm, PROMPTS[1], 3)
    assert third[-1].outputs[0].token_ids == greedy_ids(llm, PROMPTS[2], 3)
    assert seen.count(("finished", "length", True)) == 2 and ("finished", "abort", True) in seen
    assert sum(n for kind, first, n in [x for x in seen if x[0] == "output"]) >= 6
    assert sum(1 for x in seen if x[:2] == ("output", True)) == 3  # a first output per request


def test_reserved_places_are_kept_against_later_requests(serve, llm):
    """A response that reserved its places (an HTTP stream, which answers 200 before its requests
    start) is never refused by requests that arrived in between; release gives back the rest."""
    a = serve(max_waiting=2)

    async def main():
        admission = a.reserve(2)
        with pytest.raises(QueueFullError, match="max_waiting=2"):
            a.check_capacity()  # a later request is refused: the queue is held for the reservation
        with pytest.raises(QueueFullError):
            a.reserve(1)
        out = await collect(a, PROMPTS[0], SamplingParams(max_tokens=3, **GREEDY), admission=admission)
        assert a.num_waiting == 1  # the started request's place was taken; the other is still held
        admission.release()
        admission.release()  # idempotent
        assert a.num_waiting == 0
        return out, await collect(a, PROMPTS[1], SamplingParams(max_tokens=3, **GREEDY), admission=admission)

    out, after = run(main())  # an exhausted admission admits like no admission
    assert out[-1].outputs[0].token_ids == greedy_ids(llm, PROMPTS[0], 3)
    assert after[-1].outputs[0].token_ids == greedy_ids(llm, PROMPTS[1], 3)
    assert a.num_waiting == 0


def test_shutdown_fails_waiting_requests_and_refuses_new_ones(serve, monkeypatch):
    a = serve()
    slow_steps(a, monkeypatch)

    async def main():
        waiting = asyncio.create_task(collect(a, PROMPTS[0], LONG))
        await until(lambda: a.stats()["generated_tokens"] > 0, what="the request running")
        await asyncio.to_thread(a.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(waiting, 2)
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(a, PROMPTS[1], SamplingParams(max_tokens=2))
        await asyncio.wait_for(a.abort("anything"), 2)  # returns at once: nothing runs

    run(main())


def test_a_request_that_races_shutdown_is_refused(serve, monkeypatch):
    """The engine thread exits between generate's liveness check and its message to that thread."""
    a = serve()
    encode = a._llm._encode

    def encode_then_shut_down(prompt, params):
        ids = encode(prompt, params)
        a.shutdown()
        return ids

    monkeypatch.setattr(a._llm, "_encode", encode_then_shut_down)
    with pytest.raises(EngineDeadError, match="shut down"):
        run(collect(a, PROMPTS[1], SamplingParams(max_tokens=2)))


def test_a_failed_engine_thread_fails_every_waiter(serve, monkeypatch):
    a = serve()
    step, calls = a.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("boom")
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(a.engine, "step", failing_step)

    async def main():
        waiting = [asyncio.create_task(collect(a, p, LONG)) for p in PROMPTS[:3]]
        for task in waiting:
            with pytest.raises(EngineDeadError, match="boom"):
                await asyncio.wait_for(task, 2)
        with pytest.raises(EngineDeadError, match="boom"):
            await collect(a, PROMPTS[3], SamplingParams(max_tokens=2))
        await asyncio.wait_for(a.abort("anything"), 2)

    run(main())


def test_a_closed_client_loop_does_not_stop_the_engine(serve, llm, monkeypatch):
    a = serve()
    slow_steps(a, monkeypatch)
    abandoned = a.generate(PROMPTS[0], LONG)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(anext(abandoned), TIMEOUT))
    finally:
        loop.close()  # without closing the stream: its request runs on, and nobody can read it

    async def main():
        outs = await collect(a, PROMPTS[1], SamplingParams(max_tokens=5, **GREEDY))
        await until(lambda: idle(a), what="the orphaned request's blocks freed")
        return outs

    assert run(main())[-1].outputs[0].token_ids == greedy_ids(llm, PROMPTS[1], 5)
    assert a.stats()["generated_tokens"] < LONG.max_tokens
