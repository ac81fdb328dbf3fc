"""The gRPC front end end to end: a real AsyncLLM (colocated, in this process) on a tiny checkpoint
behind start_grpc_server, which runs in a uvloop event loop of its own thread (as it will inside the
HTTP server). Clients: a stub that protoc generates from clients/proto/shuttle.proto when the tests
start (so what is served is what the committed .proto says), and clients.grpc_client.

Greedy results are checked against LLM.generate on the same checkpoint. Every wait is bounded:
calls carry deadlines and coroutines run under `run`'s timeout, so a bug fails a test, never hangs it.
After each test the engine must be idle (no request left running, every KV block free).
"""
import asyncio
import importlib.util
import sys
import threading
import time
from contextlib import aclosing
from pathlib import Path
from types import ModuleType, SimpleNamespace

import grpc
import pytest
import uvloop
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

import clients.proto
from clients.grpc_client import AsyncGrpcClient, GenerateResult, GrpcClient, GrpcClientError
from clients.proto import shuttle_pb2
from clients.proto.regenerate import PROTO, ROOT, regenerate, run_protoc
from server import LLM, SamplingParams
from server.async_llm import AsyncLLM
from server.grpc_server import MAX_BATCH, start_grpc_server
from tests.conftest import PROMPTS, slow_steps

GREEDY = dict(temperature=0, ignore_eos=True)
TIMEOUT = 20.0  # seconds a call or a test's coroutine may take
TEXT = "The for statement"
LONG = dict(max_tokens=400, **GREEDY)  # runs for seconds under slow_steps: always cut short


class LoopThread:
    """A uvloop event loop running in a daemon thread; `call` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-loop", daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = TIMEOUT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)
        self.loop.close()


@pytest.fixture(scope="module")
def ckpt(make_checkpoint) -> Path:
    return make_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(ckpt)


@pytest.fixture(scope="module")
def served(ckpt):
    """The gRPC server over a running AsyncLLM: .llm, .target ("127.0.0.1:PORT")."""
    engine, loop = AsyncLLM(ckpt), LoopThread()
    try:
        server, port = loop.call(start_grpc_server(engine))
        try:
            yield SimpleNamespace(llm=engine, target=f"127.0.0.1:{port}", loop=loop)
        finally:
            loop.call(server.stop(0))
    finally:
        loop.close()
        engine.shutdown()


def idle(a: AsyncLLM) -> bool:
    s = a.stats()
    return s["running"] == s["waiting"] == 0 and s["free_blocks"] == s["num_blocks"]


def wait_idle(a: AsyncLLM, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not idle(a):
        assert time.monotonic() < deadline, f"the engine is not idle {seconds} s later: {a.stats()}"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def leaves_the_engine_idle(request):
    yield
    if "served" in request.fixturenames:
        wait_idle(request.getfixturevalue("served").llm)


def run(coro):
    """asyncio.run(coro) under TIMEOUT (the clients' own loop, not the server's)."""
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def reference(llm: LLM, prompt, **params):
    """LLM.generate's completion of prompt alone."""
    return llm.generate(prompt, SamplingParams(**params))[0].outputs[0]


# -- the stub generated now from the .proto ----------------------------------------------------
def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> SimpleNamespace:
    """.pb2 and .grpc: the modules protoc generates now from the repository's shuttle.proto. Their
    descriptor has the committed modules' file name, so the pool refuses it unless it is the same."""
    out = tmp_path_factory.mktemp("fresh_stub")
    regenerate(out)
    try:
        pb2 = _load("fresh_shuttle_pb2", out / "clients/proto/shuttle_pb2.py")
    except TypeError as e:
        pytest.fail(f"the committed clients/proto modules are stale ({e}); run python -m clients.proto.regenerate")
    with pytest.MonkeyPatch.context() as mp:  # its grpc module imports `from clients.proto import shuttle_pb2`
        mp.setitem(sys.modules, "clients.proto.shuttle_pb2", pb2)
        mp.setattr(clients.proto, "shuttle_pb2", pb2, raising=False)
        pb2_grpc = _load("fresh_shuttle_pb2_grpc", out / "clients/proto/shuttle_pb2_grpc.py")
    return SimpleNamespace(pb2=pb2, grpc=pb2_grpc, dir=out)


@pytest.fixture
def stub(served, fresh):
    with grpc.insecure_channel(served.target) as channel:
        yield fresh.grpc.GenerationStub(channel)


def request(fresh, prompt, request_id: str = "", **params):
    pb2 = fresh.pb2
    kind = {"text": prompt} if isinstance(prompt, str) else {"token_ids": pb2.TokenIds(ids=prompt)}
    return pb2.GenerateRequest(request_id=request_id, sampling_params=pb2.SamplingParams(**params), **kind)


def _drop_json_names(messages) -> None:
    for m in messages:
        for f in m.field:
            f.ClearField("json_name")
        _drop_json_names(m.nested_type)


def test_committed_modules_are_generated_from_the_proto(fresh):
    descriptors = fresh.dir / "shuttle.desc"
    assert run_protoc([f"-I{ROOT}", f"--descriptor_set_out={descriptors}", PROTO]) == 0
    generated = descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes()).file[0]
    _drop_json_names(generated.message_type)  # generated modules leave out the default JSON names
    assert descriptor_pb2.FileDescriptorProto.FromString(shuttle_pb2.DESCRIPTOR.serialized_pb) == generated, \
        "clients/proto/shuttle_pb2.py is stale: run python -m clients.proto.regenerate"
    assert [m.name for m in generated.service[0].method] == ["Generate", "GenerateStream", "BatchGenerate"]


def test_unary_generate_equals_llm_generate(stub, fresh, llm):
    for prompt in [TEXT, PROMPTS[0]]:
        reply = stub.Generate(request(fresh, prompt, "unary-1", max_tokens=10, **GREEDY), timeout=TIMEOUT)
        ref = reference(llm, prompt, max_tokens=10, **GREEDY)
        (c,) = reply.completions
        assert list(c.token_ids) == ref.token_ids and c.text == ref.text and c.finish_reason == "length"
        assert reply.request_id == "unary-1" and not c.HasField("stop_reason") and not c.logprobs
        ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert list(reply.prompt_token_ids) == ids
        u = reply.usage
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), 10, len(ids) + 10)


def test_unset_fields_take_the_sampling_params_defaults(stub, fresh):
    reply = stub.Generate(request(fresh, PROMPTS[1], ignore_eos=True), timeout=TIMEOUT)  # temperature 1.0
    assert len(reply.completions[0].token_ids) == SamplingParams().max_tokens


def test_stream_deltas_add_up_to_the_unary_result(stub, fresh):
    params = dict(max_tokens=12, **GREEDY)
    unary = stub.Generate(request(fresh, TEXT, **params), timeout=TIMEOUT).completions[0]
    messages = list(stub.GenerateStream(request(fresh, TEXT, "stream-1", **params), timeout=TIMEOUT))
    assert len(messages) > 3 and all(m.request_id == "stream-1" for m in messages)
    assert messages[0].prompt_token_ids and not any(m.prompt_token_ids for m in messages[1:])
    assert messages[-1].HasField("usage") and not any(m.HasField("usage") for m in messages[:-1])
    deltas = [c for m in messages for c in m.completions]
    assert {c.index for c in deltas} == {0}
    assert "".join(c.text for c in deltas) == unary.text
    assert [t for c in deltas for t in c.token_ids] == list(unary.token_ids)
    assert deltas[-1].finish_reason == "length" and not any(c.HasField("finish_reason") for c in deltas[:-1])
    assert messages[-1].usage.completion_tokens == 12


def test_batch_of_64_results_match_their_prompts(stub, fresh, llm, served):
    pb2, steps = fresh.pb2, served.llm.stats()["steps"]
    prompts = [[(7 * i + j) % 500 + 2 for j in range(1 + i % 13)] for i in range(64)]
    batch = pb2.BatchGenerateRequest(prompts=[pb2.Prompt(token_ids=pb2.TokenIds(ids=p)) for p in prompts],
                                     sampling_params=pb2.SamplingParams(max_tokens=6, **GREEDY), request_id="b")
    replies = list(stub.BatchGenerate(batch, timeout=TIMEOUT))
    assert sorted(r.index for r in replies) == list(range(64))
    assert served.llm.stats()["steps"] - steps < 64  # they ran together, sharing steps
    for r in replies:
        assert r.WhichOneof("result") == "response", r.error.message
        assert r.response.request_id == f"b-{r.index}"
        assert list(r.response.prompt_token_ids) == prompts[r.index]
        ref = reference(llm, prompts[r.index], max_tokens=6, **GREEDY)  # the prompt alone
        assert list(r.response.completions[0].token_ids) == ref.token_ids, r.index


def test_bad_requests_are_invalid_argument(stub, fresh, served):
    steps = served.llm.stats()["steps"]
    for req, match in [(request(fresh, TEXT, max_tokens=0), "max_tokens must be >= 1"),
                       (request(fresh, TEXT, temperature=-1), "temperature"),
                       (request(fresh, TEXT, logprobs=21), "logprobs"),
                       (request(fresh, [1, 2, 10**6]), "outside the vocabulary"),
                       (request(fresh, ""), "prompt is empty"),
                       (fresh.pb2.GenerateRequest(), "prompt is missing")]:
        for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=TIMEOUT)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in err.value.details()
    pb2 = fresh.pb2
    for batch, match in [(pb2.BatchGenerateRequest(prompts=[pb2.Prompt(text="a")],
                                                   sampling_params=pb2.SamplingParams(top_p=0)), "top_p"),
                         (pb2.BatchGenerateRequest(prompts=[pb2.Prompt(text="a")] * (MAX_BATCH + 1)), "at most")]:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.BatchGenerate(batch, timeout=TIMEOUT))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in err.value.details()
    assert served.llm.stats()["steps"] == steps  # refused before anything ran


def test_a_bad_prompt_fails_only_its_index_of_a_batch(served, llm):
    prompts = [TEXT, [3, 10**6], PROMPTS[2], "", PROMPTS[0]]
    with GrpcClient(served.target, timeout=TIMEOUT) as client:
        items = list(client.batch_generate(prompts, max_tokens=8, **GREEDY))
    assert sorted(i for i, _ in items) == list(range(5))
    assert {i for i, _ in items[:2]} == {1, 3}  # the errors come first: they need no engine step
    results = dict(items)
    for i, match in [(1, "outside the vocabulary"), (3, "prompt is empty")]:
        assert isinstance(results[i], GrpcClientError) and results[i].code() == grpc.StatusCode.INVALID_ARGUMENT
        assert match in str(results[i]) and "INVALID_ARGUMENT" in str(results[i])
    for i in (0, 2, 4):
        assert isinstance(results[i], GenerateResult)
        assert results[i].completions[0].token_ids == reference(llm, prompts[i], max_tokens=8, **GREEDY).token_ids


def test_client_results_equal_llm_generate(served, llm):
    ref = reference(llm, TEXT, max_tokens=9, **GREEDY)
    with GrpcClient(served.target, timeout=TIMEOUT) as client:
        result = client.generate(TEXT, max_tokens=9, **GREEDY)
        chunks = list(client.generate_stream(TEXT, max_tokens=9, **GREEDY))
    (c,) = result.completions
    assert (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) == \
           (0, ref.text, ref.token_ids, "length", None, None)
    assert result.usage.completion_tokens == 9 and result.usage.total_tokens == 9 + len(result.prompt_token_ids)
    assert "".join(ch.text for ch in chunks) == ref.text and sum((ch.token_ids for ch in chunks), []) == ref.token_ids
    assert chunks[-1].usage == result.usage and chunks[-1].finish_reason == "length"
    assert all(ch.usage is None and ch.finish_reason is None for ch in chunks[:-1])


def test_async_client_stream_and_batch(served, llm):
    prompts = [PROMPTS[0], PROMPTS[1], TEXT]

    async def main():
        async with AsyncGrpcClient(served.target, timeout=TIMEOUT) as client:
            chunks = [ch async for ch in client.generate_stream(TEXT, max_tokens=7, ignore_eos=True, temperature=0)]
            items = [item async for item in client.batch_generate(prompts, max_tokens=5, **GREEDY)]
            return chunks, items, await client.generate(PROMPTS[3], max_tokens=4, **GREEDY)

    chunks, items, single = run(main())
    assert sum((ch.token_ids for ch in chunks), []) == reference(llm, TEXT, max_tokens=7, **GREEDY).token_ids
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    for i, result in items:
        assert result.completions[0].token_ids == reference(llm, prompts[i], max_tokens=5, **GREEDY).token_ids
    assert single.completions[0].token_ids == reference(llm, PROMPTS[3], max_tokens=4, **GREEDY).token_ids


def test_logprobs_stop_ids_and_several_completions(served, llm):
    ref = llm.generate(TEXT, SamplingParams(max_tokens=6, logprobs=3, **GREEDY))[0].outputs[0]
    with GrpcClient(served.target, timeout=TIMEOUT) as client:
        c = client.generate(TEXT, max_tokens=6, logprobs=3, **GREEDY).completions[0]
        stopped = client.generate(TEXT, max_tokens=6, temperature=0, stop_token_ids=[ref.token_ids[2]]).completions[0]
        chunks = list(client.generate_stream(TEXT, max_tokens=5, n=2, seed=3, ignore_eos=True))
        sampled = client.generate(TEXT, max_tokens=5, n=2, seed=3, ignore_eos=True)
    assert [lp.token_id for lp in c.logprobs] == ref.token_ids
    for lp, entry, token in zip(c.logprobs, ref.logprobs, ref.token_ids):
        assert lp.logprob == pytest.approx(entry[token].logprob) and lp.rank == 1
        assert [t.token_id for t in lp.top] == list(entry)[:3] and lp.top[0].token_id == token
        assert lp.decoded_token == llm.tokenizer.decode([token])
    end = ref.token_ids.index(ref.token_ids[2]) + 1  # the stop id's first occurrence ends the text
    assert (stopped.finish_reason, stopped.stop_reason, stopped.token_ids) == ("stop", str(ref.token_ids[2]),
                                                                             ref.token_ids[:end])
    for i, want in enumerate(sampled.completions):  # each index's deltas add up to its completion
        assert sum((ch.token_ids for ch in chunks if ch.index == i), []) == want.token_ids
        assert "".join(ch.text for ch in chunks if ch.index == i) == want.text


def test_a_cancelled_stream_frees_its_blocks(served, monkeypatch):
    a = served.llm
    slow_steps(a, monkeypatch)
    before = a.stats()["generated_tokens"]

    async def main():
        async with AsyncGrpcClient(served.target, timeout=TIMEOUT) as client:
            async with aclosing(client.generate_stream(PROMPTS[0], **LONG)) as stream:
                async for chunk in stream:
                    if chunk.token_ids and a.stats()["generated_tokens"] - before >= 3:
                        running = not idle(a)  # the request holds blocks when the client leaves
                        break
            assert running
            deadline = time.monotonic() + 5
            while not idle(a):
                assert time.monotonic() < deadline, f"the cancelled request's blocks are not freed: {a.stats()}"
                await asyncio.sleep(0.01)

    run(main())
    assert a.stats()["generated_tokens"] - before < LONG["max_tokens"]


def test_a_deadline_or_a_left_stream_aborts_the_request(served, monkeypatch):
    a = served.llm
    slow_steps(a, monkeypatch)
    before = a.stats()["generated_tokens"]
    with GrpcClient(served.target, timeout=0.3) as client:
        with pytest.raises(GrpcClientError, match="DEADLINE_EXCEEDED") as err:
            client.generate(PROMPTS[2], **LONG)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_idle(a)
    with GrpcClient(served.target, timeout=TIMEOUT) as client:
        for _ in client.generate_stream(PROMPTS[1], **LONG):
            break  # the generator is closed here: the call is cancelled
        wait_idle(a)
    assert a.stats()["generated_tokens"] - before < LONG["max_tokens"]


def test_client_argument_errors(served):
    client = GrpcClient(served.target)
    try:
        with pytest.raises(TypeError, match="max_new_tokens"):
            client.generate(TEXT, max_new_tokens=3)
        with pytest.raises(TypeError, match="max_new_tokens"):
            client.generate_stream(TEXT, max_new_tokens=3)  # checked before the first chunk is asked for
        with pytest.raises(TypeError, match="temperature"):
            client.generate(TEXT, temperature="hot")
        with pytest.raises(TypeError, match="prompt must be"):
            client.generate(3.5)
    finally:
        client.close()
    with pytest.raises(ValueError, match="timeout"):
        GrpcClient(served.target, timeout=0)


def test_a_stopped_engine_is_unavailable(ckpt):
    engine, loop = AsyncLLM(ckpt), LoopThread()
    try:
        server, port = loop.call(start_grpc_server(engine))
        engine.shutdown()
        with GrpcClient(f"127.0.0.1:{port}", timeout=TIMEOUT) as client:
            with pytest.raises(GrpcClientError, match="UNAVAILABLE: the engine is shut down"):
                client.generate(TEXT)
            with pytest.raises(GrpcClientError, match="UNAVAILABLE"):
                list(client.batch_generate([TEXT, TEXT]))
        loop.call(server.stop(0))
    finally:
        loop.close()
        engine.shutdown()


def test_reflection_lists_the_service(served):
    with grpc.insecure_channel(served.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "shuttle.v1.Generation" in db.get_services()
        service = descriptor_pool.DescriptorPool(db).FindServiceByName("shuttle.v1.Generation")
        assert [m.name for m in service.methods] == ["Generate", "GenerateStream", "BatchGenerate"]
        assert service.methods_by_name["BatchGenerate"].output_type.full_name == "shuttle.v1.BatchGenerateResponse"


def test_bad_ports_are_refused(served):
    with pytest.raises(ValueError, match="port"):
        served.loop.call(start_grpc_server(served.llm, port=70000))
    port = int(served.target.rsplit(":", 1)[1])
    with pytest.raises(OSError, match="cannot listen"):
        served.loop.call(start_grpc_server(served.llm, port=port))  # in use


def test_a_full_waiting_queue_is_resource_exhausted(served, monkeypatch):
    monkeypatch.setattr(served.llm, "max_waiting", 0)
    with GrpcClient(served.target, timeout=TIMEOUT) as client:
        with pytest.raises(GrpcClientError, match="RESOURCE_EXHAUSTED: .*max_waiting=0"):
            client.generate(TEXT)
        with pytest.raises(GrpcClientError, match="RESOURCE_EXHAUSTED"):
            list(client.batch_generate([TEXT, TEXT]))
