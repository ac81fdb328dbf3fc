"""A request is validated once, where it enters: LLM and AsyncLLM for Python callers, the HTTP
front for HTTP (it checks itself to name the request's field in its errors); engines and workers
trust their front."""
import asyncio
import collections
import types

import httpx
import pytest

import attention_nodes.engine as engine_module
from attention_nodes.sampling_params import SamplingParams
from pools.engine import PoolEngine
from server import LLM
from server.api_server import ServerConfig, build_app
from server.async_llm import AsyncLLM
from server.metrics import ServerMetrics
import server.openai_serving as serving_module


@pytest.fixture
def calls(monkeypatch) -> collections.Counter:
    """Counts check_prompt and check_params wherever a front calls them from."""
    counter: collections.Counter = collections.Counter()
    for name in ("check_prompt", "check_params"):
        real = getattr(engine_module, name)

        def counted(*args, _real=real, _name=name):
            counter[_name] += 1
            return _real(*args)

        for module in (engine_module, serving_module):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted)
    return counter


def test_llm_checks_each_request_once(make_checkpoint, calls):
    llm = LLM(make_checkpoint("mixtral"))
    llm.generate(["The for statement", [5, 6, 7]], SamplingParams(max_tokens=3))
    assert calls == {"check_prompt": 2, "check_params": 2}
    calls.clear()
    llm.engine.add_request("direct", [5, 6], SamplingParams(max_tokens=2))  # the engine trusts its caller
    assert calls == {}


def test_http_and_async_fronts_check_each_request_once(make_checkpoint, calls):
    llm = AsyncLLM(make_checkpoint("mixtral"))
    try:
        async def main():
            async for _ in llm.generate([5, 6, 7], SamplingParams(max_tokens=2)):
                pass
            assert calls == {"check_prompt": 1, "check_params": 1}
            calls.clear()
            app = build_app(llm, ServerConfig(), ServerMetrics("tiny"))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shuttle") as http:
                r = await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert calls == {"check_prompt": 1, "check_params": 1}
                r = await http.post("/v1/completions", json={"prompt": [5, 10**6], "max_tokens": 2})
                assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text

        asyncio.run(main())
    finally:
        llm.shutdown()


def test_pool_front_forwards_without_checking(calls):
    """PoolEngine.add_request hands the validated request to a worker as it is (and the worker's
    LLMEngine.add_request checks nothing either: test_llm_checks_each_request_once)."""
    sent = []
    eng = PoolEngine.__new__(PoolEngine)
    eng._requests, eng._kv_blocks, eng._load = {}, {}, [0, 0]
    eng._send = lambda rank, msg: sent.append((rank, msg))
    eng.cfg = types.SimpleNamespace(cache=types.SimpleNamespace(block_size=16))
    eng.add_request("r", [5, 6], SamplingParams(max_tokens=2))
    assert calls == {} and [m.prompt_token_ids for _, m in sent] == [[5, 6]]
