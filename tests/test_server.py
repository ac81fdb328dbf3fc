"""End to end: a real `shuttle serve` (disaggregated: an attention and an expert worker process) on
a free port, driven by the official `openai` package and by raw HTTP for the error cases.

Greedy results are compared with LLM.generate / LLM.chat (colocated, in this process) on the same
checkpoint. A second server (colocated, with an API key and a queue of one) covers 401 and 503; a
third has its expert worker killed, which must be reported, never hang.
"""
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest

from clients.live_server import LiveServer
from server import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPT = "The for statement"
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def server(ckpt):
    with LiveServer(["--model", str(ckpt), "--served-model-name", "tiny", "--max-body-bytes", "100000",
                     "--grpc-port", "0"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(ckpt)


def metric(server: LiveServer, name: str, headers: dict | None = None) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=headers).text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_greedy_completion_equals_llm_generate(client, llm):
    want = llm.generate(PROMPT, SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPT))
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12


def test_greedy_chat_equals_llm_chat(client, llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    want = llm.chat(messages, SamplingParams(max_tokens=10, **GREEDY))[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 10


def test_streams_add_up_and_end_with_usage(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])

    chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert text == whole.choices[0].message.content
    assert chat[-1].usage.completion_tokens == 6 and chat[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_and_seed(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=1234,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same samples
    assert a.usage.completion_tokens == 24
    batch = client.completions.create(model="tiny", prompt=[PROMPT, "Hello"], max_tokens=4, n=2, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy samples of one prompt agree
    streamed = list(client.completions.create(stream=True, **kw))
    for i in range(3):
        assert "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) == a.choices[i].text


def test_logprobs(client):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == got.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the best
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert content[0].token == content[0].top_logprobs[0].token


def test_stop_strings_and_vllm_extras(client, llm):
    text = llm.generate(PROMPT, SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0].text
    stop = text[3:5]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "stop" and got.choices[0].text == text[:text.index(stop)]
    ids = llm.generate(PROMPT, SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0].token_ids
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [ids[4]], "top_k": 5,
                                                "min_p": 0.0, "repetition_penalty": 1.0})
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == ids.index(ids[4]) + 1


def _error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),       # prompt + max_tokens over the context
    ({"max_tokens": "5"}, "max_tokens"),          # wrong type
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"stream": "yes"}, "stream"),
    ({"prompt": [10 ** 7]}, "prompt"),             # a token id outside the vocabulary
    ({"prompt": []}, "prompt"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_invalid_values_are_400(server, body, param):
    err = _error(httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, **body}), 400, param)
    assert err["type"] == "invalid_request_error"


def test_more_errors(server):
    url = server.url
    err = _error(httpx.post(f"{url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"
    _error(httpx.get(f"{url}/v1/nothing"), 404)
    _error(httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    _error(httpx.post(f"{url}/v1/completions", json=[1, 2]), 400)
    _error(httpx.post(f"{url}/v1/chat/completions", json={"messages": []}), 400, "messages")
    _error(httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}), 400,
           "messages.0.role")
    long = "word " * 600  # more tokens than the 512-token context
    err = _error(httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]}), 400)
    assert err["code"] == "context_length_exceeded"
    _error(httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 200_000}), 413)


def test_disconnect_mid_stream_frees_the_request(server):
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        deadline = time.monotonic() + 10
        while metric(server, "shuttle_num_requests_running") != 1:  # the worker's stats are a moment late
            assert time.monotonic() < deadline, "the streaming request never showed as running"
            time.sleep(0.1)
        assert metric(server, "shuttle_kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 15  # the client hung up before 400 tokens
    while not (metric(server, "shuttle_num_requests_running") == 0
               and metric(server, "shuttle_kv_cache_free_blocks") == metric(server, "shuttle_kv_cache_blocks")):
        assert time.monotonic() < deadline, "the aborted request still holds KV blocks"
        time.sleep(0.1)
    aborted = [line for line in httpx.get(f"{server.url}/metrics").text.splitlines()
               if line.startswith("shuttle_request_success_total") and 'finished_reason="abort"' in line]
    assert aborted and float(aborted[0].split()[-1]) >= 1
    assert metric(server, "shuttle_generation_tokens_total") < 400 + 200  # it did not run to the end


def test_metrics_cover_the_pools(server, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("shuttle_time_to_first_token_seconds_bucket", "shuttle_time_per_output_token_seconds_bucket",
                 "shuttle_inter_token_latency_seconds_bucket", "shuttle_e2e_request_latency_seconds_count",
                 "shuttle_prompt_tokens_total", "shuttle_generation_tokens_total", "shuttle_num_requests_waiting",
                 'shuttle_http_requests_total{route="/v1/completions",status="200"}'):
        assert name in text, name
    assert metric(server, "shuttle_kv_cache_tokens") == 16 * metric(server, "shuttle_kv_cache_blocks")  # block_size
    deadline = time.monotonic() + 10  # the worker reports its steps when it parks, a moment after the last delta
    while metric(server, "shuttle_engine_steps_total") < 4:  # 4 tokens: at least 4 steps
        assert time.monotonic() < deadline, "shuttle_engine_steps_total never counted the request's steps"
        time.sleep(0.1)
    experts = [float(v) for v in re.findall(r'^shuttle_expert_tokens_total\{expert="\d+".*\} (\S+)$', text, re.M)]
    assert len(experts) == 8 and sum(experts) > 0
    pairs = re.search(r'^shuttle_expert_worker_tokens_total\{worker="e0"\} (\S+)$', text, re.M)
    assert pairs and float(pairs.group(1)) == sum(experts)  # one expert worker computes every pair
    assert metric(server, "shuttle_expert_load_imbalance") == 1.0  # one worker: balanced by definition
    assert len(re.findall(r"^shuttle_expert_hot_tokens\{", text, re.M)) == 8
    for pool, worker in (("attention", "a0"), ("expert", "e0")):
        busy = re.search(rf'^shuttle_pool_busy_fraction\{{pool="{pool}",worker="{worker}"\}} (\S+)$', text, re.M)
        assert busy and 0 <= float(busy.group(1)) <= 1


def test_grpc_beside_http(server, llm):
    from clients.grpc_client import GrpcClient

    want = llm.generate(PROMPT, SamplingParams(max_tokens=6, **GREEDY))[0].outputs[0]
    with GrpcClient(f"127.0.0.1:{server.grpc_port}") as c:
        got = c.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    assert got.completions[0].token_ids == want.token_ids and got.completions[0].text == want.text


def test_api_key_and_full_queue(ckpt):
    """A colocated server with a key and no room for waiting requests (--max-waiting 0: each request
    waits for its first token, so every one is refused; tests/test_async_llm.py checks the bound
    itself with a queue of one)."""
    with LiveServer(["--model", str(ckpt), "--colocated", "--max-waiting", "0"],
                    env={"SHUTTLE_API_KEY": "sekret"}) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes need no key
        err = _error(httpx.get(f"{srv.url}/v1/models"), 401)
        assert err["code"] == "invalid_api_key"
        _error(httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.get(f"{srv.url}/v1/models", headers=auth).status_code == 200
        _error(httpx.get(f"{srv.url}/metrics"), 401)
        assert metric(srv, "shuttle_num_requests_queued", auth) == 0
        for stream in (False, True):
            full = httpx.post(f"{srv.url}/v1/completions", headers=auth,
                              json={"prompt": PROMPT, "max_tokens": 4, "stream": stream})
            err = _error(full, 503)
            assert full.headers["retry-after"] == "1" and err["code"] == "queue_full"
        with pytest.raises(openai.APIStatusError) as e:
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekret", max_retries=0).chat.completions.create(
                model=str(ckpt), messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 503


def test_a_dead_worker_is_reported_not_hung(ckpt):
    with LiveServer(["--model", str(ckpt), "--max-worker-restarts", "0"]) as srv:  # restarts: test_supervision.py
        workers = srv.children()  # readable process titles, for ps and top
        assert sorted(workers) == ["shuttle-attention-a0", "shuttle-expert-e0"], workers
        body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(lines)
            for pid in workers.values():
                os.kill(pid, signal.SIGKILL)
            rest = list(lines)  # must end, with an error event
        events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert "error" in events[-1] and "worker" in events[-1]["error"]["message"], events[-1:]
        assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]"
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{srv.url}/health")).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert "worker" in health.json()["error"]["message"]
        _error(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}), 503)


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "grpc"])
def test_bench_serve_against_the_live_server(server, tmp_path, backend):
    """`shuttle bench serve` counts what the server counted: every request completes, and the
    generated tokens equal the server's own counter (plus the benchmark's one-token test request)."""
    from tests.test_bench_serve import bench_and_check

    generated, prompts = metric(server, "shuttle_generation_tokens_total"), metric(server, "shuttle_prompt_tokens_total")
    url = f"127.0.0.1:{server.grpc_port}" if backend == "grpc" else server.url
    result = bench_and_check(url, tmp_path, backend, 6, 4, "--num-gpus", "2")
    assert result["completed"] == 6 and result["total_output_tokens"] == 24
    assert metric(server, "shuttle_generation_tokens_total") - generated == result["total_output_tokens"] + 1
    sent = metric(server, "shuttle_prompt_tokens_total") - prompts
    assert result["total_input_tokens"] < sent <= result["total_input_tokens"] + max(result["input_lens"])
    assert result["output_throughput_per_gpu"] == pytest.approx(result["output_throughput"] / 2)


@pytest.mark.parametrize("ending", ["done", "raises", "disconnect", "cancelled twice"])
def test_sse_stream_runs_on_close_however_it_ends(ending):
    """The stream's on_close (the admission's release) runs in the event loop whatever ends it,
    also when its task is cancelled again while it cleans up."""
    import asyncio

    from server.api_server import _SSEResponse

    async def chunks():
        yield "a"
        if ending == "raises":
            raise ValueError("boom")
        if ending != "done":
            try:
                await asyncio.sleep(100)
            except asyncio.CancelledError:
                await asyncio.sleep(0.01)  # cleanup that awaits (an abort)
                raise

    async def main() -> list:
        closed, gone = [], asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(_):
            pass
        task = asyncio.create_task(_SSEResponse(chunks(), on_close=lambda: closed.append(1),
                                                media_type="text/event-stream")({"type": "http"}, receive, send))
        await asyncio.sleep(0.01)
        if ending == "disconnect":
            gone.set()
        elif ending == "cancelled twice":
            task.cancel()
            await asyncio.sleep(0)
            task.cancel()
        await asyncio.wait({task}, timeout=5)
        return closed
    assert asyncio.run(main()) == [1]
