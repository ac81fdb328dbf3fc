"""Disaggregated pools end to end: attention and expert workers as real processes over M2N.

Greedy token ids must equal the colocated engine's (float32), for every pool shape in POOLS, on
both transports and both families, with requests of different lengths joining
mid-run; a killed worker is reported.
"""
import json
import logging
import os
import signal
import socket
import time

import pytest

from torch.distributed import TCPStore

from attention_nodes import messages as wire
from attention_nodes.config import CacheConfig, EngineConfig, ParallelConfig, worker_threads
from attention_nodes.engine import LLMEngine
from attention_nodes.sampling_params import SamplingParams
from kernels import native
from m2n_comm.m2n import Placement
import pools.engine as pools_module
from pools.engine import PoolEngine, WorkerFailedError
from server.llm import LLM
from tests.test_transport import NEEDS_NIXL

PROMPTS = [[5, 17, 33, 100, 250, 7, 9, 11, 13, 200, 301, 45, 46, 47], [400, 3], [77, 78, 79, 80, 81, 82, 83],
           [12], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110], [33] * 5]
JOIN_AT = {0: [0, 1, 2], 2: [3, 4], 5: [5]}  # step call -> prompts that arrive then
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
POOLS = [(1, 1, 1), (1, 1, 2), (1, 2, 3), (2, 1, 2), (2, 2, 2), (2, 3, 4)]
_reference: dict[str, dict[str, list[int]]] = {}


def engine_cfg(ckpt, par: ParallelConfig) -> EngineConfig:
    return EngineConfig(str(ckpt), cache=CacheConfig(num_blocks=64), parallel=par)


def run_staggered(engine, rounds: int = 1) -> dict[str, list[int]]:
    """Requests join at different steps; `rounds` > 1 repeats after the pools went idle (parked)."""
    out: dict[str, list[int]] = {}
    for r in range(rounds):
        calls = 0
        # Until the last join, even if the earlier requests are done: pool workers run ahead of the
        # front's step() calls, and on a loaded host requests 0-2 may finish before call 5.
        while calls <= max(JOIN_AT) or engine.has_unfinished_requests():
            for i in JOIN_AT.get(calls, []):
                engine.add_request(f"{r}-{i}", PROMPTS[i], PARAMS)
            for d in engine.step():
                out.setdefault(d.request_id, []).extend(d.new_token_ids)
            calls += 1
    return out


def reference(make_checkpoint, family: str) -> dict[str, list[int]]:
    if family not in _reference:
        engine = LLMEngine(engine_cfg(make_checkpoint(family), ParallelConfig()), {0})
        _reference[family] = run_staggered(engine, rounds=2)
    return _reference[family]


# `make pools-test` (SHUTTLE_FULL_MATRIX=1) runs the full matrix: every pool shape x family x
# transport (24 deployments) and the three NIXL_POOLS shapes on both UCX transports (6).
FULL_MATRIX = os.environ.get("SHUTTLE_FULL_MATRIX", "0") == "1"
# CI, for the suite's time budget: every pool shape once; the shapes cycle through the four (family,
# transport) pairs, so each family runs on each transport and each transport with one and with
# several workers per pool (6 deployments; the nixl cases below add two more).
PAIRS = [("mixtral", "shm"), ("qwen2_moe", "tcp"), ("qwen2_moe", "shm"), ("mixtral", "tcp")]
CASES = ([(pools, f, t) for pools in POOLS for f, t in PAIRS] if FULL_MATRIX
         else [(pools, *PAIRS[i % len(PAIRS)]) for i, pools in enumerate(POOLS)])
NIXL_POOLS = [(1, 1, 1), (1, 2, 3), (2, 2, 2)]
NIXL_CASES = ([(tls, pools) for tls in ("tcp", "sm,self") for pools in NIXL_POOLS] if FULL_MATRIX
              else [("tcp", (1, 2, 3)), ("sm,self", (2, 2, 2))])


@pytest.mark.slow
@pytest.mark.parametrize("pools,family,transport", CASES,
                         ids=["a%d-e%d-m%d-%s-%s" % (*p, f, t) for p, f, t in CASES])
def test_greedy_equals_colocated(make_checkpoint, family, pools, transport):
    n_a, n_e, m = pools
    default_threads = pools == (1, 1, 1)  # shuttle serve's default: worker_threads, every core each at m = 1
    par = ParallelConfig(False, n_a, n_e, m, transport, torch_threads=None if default_threads else 1)
    engine = PoolEngine(engine_cfg(make_checkpoint(family), par), {0})
    try:
        if default_threads:  # a burst of wake() calls (AsyncLLM: one per message) queues one wake-up
            engine.wake(), engine.wake()
            assert [e for _, e in list(engine._events.queue)].count(pools_module._WAKE) == 1
        got = run_staggered(engine, rounds=2)
        if default_threads:
            engine.wake()  # the first one was taken by a step: the next is queued again
            assert [e for _, e in list(engine._events.queue)].count(pools_module._WAKE) == 1
            cores = len(os.sched_getaffinity(0))
            assert (engine._spawn_cfg.parallel.torch_threads, engine._expert_threads) == (cores, cores)
            # OpenMP reads its wait policy when the fork server imports torch: the workers' start environment
            environ = open(f"/proc/{engine._procs[0].pid}/environ", "rb").read().split(b"\0")
            assert b"OMP_WAIT_POLICY=PASSIVE" in environ
    finally:
        engine.shutdown()
    want = reference(make_checkpoint, family)
    assert got == want
    assert len(got) == 2 * len(PROMPTS) and all(len(v) == PARAMS.max_tokens for v in got.values())


@pytest.mark.slow
@NEEDS_NIXL
@pytest.mark.parametrize("ucx_tls,pools", NIXL_CASES,
                         ids=["%s-a%d-e%d-m%d" % ("tcp" if t == "tcp" else "shm", *p) for t, p in NIXL_CASES])
def test_greedy_equals_colocated_on_nixl(make_checkpoint, monkeypatch, ucx_tls, pools):
    """The nixl transport, with UCX over tcp and over shared memory (the workers get UCX_TLS). CI: one
    deployment with several expert workers and one with several attention workers, for the suite's
    time budget (the transports' own tests cover nixl's protocol, M=N=1 included, on both);
    `make pools-test`: (1,1,1), (1,2,3) and (2,2,2) on both."""
    monkeypatch.setenv("UCX_TLS", ucx_tls)
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    test_greedy_equals_colocated(make_checkpoint, "mixtral", pools, "nixl")


@pytest.mark.slow
def test_replicated_hot_expert_and_llm_api(make_checkpoint, tmp_path):
    """A placement file puts expert 0 on both expert workers (its tokens are split between the
    copies); LLM.generate over the pools equals LLM.generate colocated. With trace_dir every worker
    writes its Chrome trace when it stops, the attention worker's steps saying what they ran."""
    ckpt = make_checkpoint("mixtral")
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"0": [0, 1], "5": [1, 0]}))
    assert Placement.from_file(placement, 8, 2).copies[0] == (0, 1)
    prompts = [p for p in PROMPTS]
    colocated = LLM(ckpt, num_kv_blocks=64, trace_dir=tmp_path / "colocated")
    want = [o.outputs[0].token_ids for o in colocated.generate(prompts, PARAMS)]
    colocated.shutdown()
    llm = LLM(ckpt, num_kv_blocks=64, colocated=False, expert_workers=2, micro_batches=2, placement=str(placement),
              torch_threads=1, trace_dir=tmp_path / "trace")
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    finally:
        llm.shutdown()
    assert got == want
    assert sorted(f.name for f in (tmp_path / "trace").iterdir()) == \
        ["a0.trace.json", "e0.trace.json", "e1.trace.json", "front.trace.json"]
    for trace in (tmp_path / "trace" / "a0.trace.json", tmp_path / "colocated" / "engine.trace.json"):
        steps = [e["args"] for e in json.loads(trace.read_text()) if e["name"] == "step"]
        # one new token: every token after the first, and a one-token prompt's prefill
        assert sum(s["decode"] for s in steps) == sum(len(g) - 1 for g in got) + sum(len(p) == 1 for p in prompts)
        assert sum(s["prompt_tokens"] for s in steps) == sum(len(p) for p in prompts if len(p) > 1)
        assert max(s["seqs"] for s in steps) <= len(prompts)
    front = [e["args"]["deltas"] for e in json.loads((tmp_path / "trace" / "front.trace.json").read_text())]
    assert sum(front) == sum(len(g) for g in got)  # every token came through the front's steps


@pytest.mark.skipif(not native.avx512_bf16(), reason="needs AVX-512 BF16 and the native kernels")
def test_bf16_native_layers_in_pools_equal_colocated(make_checkpoint):
    """bf16 on AVX-512 BF16: the attention worker runs each layer's attention side natively
    (models/native_decode.py, "layers"), its prompts as one-token rows too (ModelRunner.prompts_as_rows),
    at m = 2; greedy ids equal the colocated engine's, whose steps run whole in the native call."""
    ckpt = make_checkpoint("mixtral", dtype="bfloat16")
    colocated = LLM(ckpt, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in colocated.generate(PROMPTS, PARAMS)]
    colocated.shutdown()
    llm = LLM(ckpt, num_kv_blocks=64, colocated=False, micro_batches=2, torch_threads=1)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.shutdown()
    assert got == want


def test_request_bigger_than_the_cache_is_refused_as_colocated(make_checkpoint):
    """A prompt plus max_tokens that needs more KV blocks than a worker has raises the colocated
    engine's ValueError at add time (it used to reach the worker, which could only abort it: an empty
    output with finish_reason "abort"); requests that fit still run."""
    ckpt = make_checkpoint("mixtral")
    big = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    colocated = LLM(ckpt, num_kv_blocks=4)
    with pytest.raises(ValueError) as want:
        colocated.generate([PROMPTS[0]], big)
    llm = LLM(ckpt, num_kv_blocks=4, colocated=False, torch_threads=1)
    try:
        with pytest.raises(ValueError) as got:
            llm.generate([PROMPTS[0]], big)
        assert str(got.value) == str(want.value) and "need 8 KV blocks, but the cache has 4" in str(got.value)
        bad_bias = SamplingParams(n=2, max_tokens=4, temperature=0.0, logit_bias={100000: 1.0})
        with pytest.raises(ValueError, match="outside the vocabulary"):  # refused at the front (it hung at n=2)
            llm.generate([PROMPTS[0]], bad_bias)
        assert [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]], PARAMS)] == \
            [o.outputs[0].token_ids for o in colocated.generate([PROMPTS[0]], PARAMS)]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tcp_slots_aligned_for_odd_capacity(make_checkpoint):
    """top_k 3 and an odd token budget make tcp's slot capacity odd; with two slots (m = 2) the
    second held the int64 ids at an unaligned offset and the expert worker failed viewing them."""
    ckpt = make_checkpoint("mixtral", num_experts_per_tok=3)
    want = [o.outputs[0].token_ids for o in LLM(ckpt, num_kv_blocks=64).generate(PROMPTS, PARAMS)]
    llm = LLM(ckpt, num_kv_blocks=64, max_num_batched_tokens=2047, colocated=False, micro_batches=2,
              transport="tcp", torch_threads=1)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == want
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["e1", "a1"])
def test_killed_worker_is_reported(make_checkpoint, victim):
    """SIGKILL one worker mid-run: the front raises WorkerFailedError naming it within 5 s."""
    par = ParallelConfig(False, 2, 2, 2, "shm", torch_threads=1, max_worker_restarts=0)  # supervision: test_supervision.py
    engine = PoolEngine(engine_cfg(make_checkpoint("mixtral"), par), {0})
    try:
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        for i in range(4):
            engine.add_request(str(i), PROMPTS[i], long)
        for _ in range(3):
            engine.step()
        proc = next(p for p in engine._procs if p.name == victim)
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError) as err:
            while time.monotonic() - start < 30:
                engine.step(timeout=1.0)
        elapsed = time.monotonic() - start
    finally:
        engine.shutdown()
    assert elapsed < 5.0, f"reported after {elapsed:.1f} s"
    assert victim in str(err.value)


def test_worker_threads_follow_the_pipeline():
    """At m = 1 the pools take turns, so each pool's workers split every core; with m >= 2 both
    pools compute at once and split the cores between all workers; --torch-threads wins."""
    def par(a: int, e: int, m: int, threads: int | None = None) -> ParallelConfig:
        return ParallelConfig(False, a, e, m, torch_threads=threads)
    assert worker_threads(par(1, 1, 1), 2) == (2, 2)
    assert worker_threads(par(2, 1, 1), 4) == (2, 4)
    assert worker_threads(par(3, 2, 1), 2) == (1, 1)
    assert worker_threads(par(1, 1, 2), 2) == (1, 1)
    assert worker_threads(par(2, 2, 3), 16) == (4, 4)
    assert worker_threads(par(2, 1, 2), 2) == (1, 1)
    assert worker_threads(par(1, 1, 1, threads=3), 2) == (3, 3)


def test_placement_checks():
    assert Placement.balanced(8, 3).copies == ((0,), (0,), (0,), (1,), (1,), (1,), (2,), (2,))
    assert Placement.balanced(4, 2, {1: 2}).experts_on(1) == [1, 2, 3]
    with pytest.raises(ValueError, match="without experts"):
        Placement(2, 2, ((0,), (0,)))
    with pytest.raises(ValueError, match="expert workers for 2 experts"):
        Placement.balanced(2, 3)
    with pytest.raises(ValueError, match="micro_batches"):
        ParallelConfig(micro_batches=5)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (pinned host staging)")
def test_host_staging_round_trip_on_cuda():
    import torch

    from m2n_comm.m2n import HostStaging

    staging = HostStaging()
    x = torch.randn(5, 7, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 9, (5, 2), device="cuda", dtype=torch.int32)
    host = staging.to_host([x, ids])
    assert all(t.device.type == "cpu" and t.is_pinned() for t in host)
    back = HostStaging().to_device(host, torch.device("cuda"))
    assert torch.equal(back[0], x) and torch.equal(back[1], ids)


@pytest.mark.slow
def test_roles_meet_at_a_rendezvous(make_checkpoint, caplog):
    """The multi-host path on one host: the front waits at HOST:PORT, `shuttle serve --role` workers
    join it over tcp (with the deployment token from their SHUTTLE_DEPLOYMENT_TOKEN: the store never
    holds it), and the output equals the colocated engine's. Two strangers who reach the control
    listener first (a HELLO signed with the wrong token; a control message before any HELLO) are
    dropped and logged; the store's deployment record holds no token, is refused with a wrong
    token, and a worker started without one stops before it takes a rank, saying what to set."""
    import subprocess
    import sys

    from m2n_comm._hello import hello_body
    from pools.roles import read_deployment, run_role
    from tests.test_handshake import dial_raw

    ckpt = make_checkpoint("qwen2_moe")
    want = [o.outputs[0].token_ids for o in LLM(ckpt, num_kv_blocks=64).generate(PROMPTS[:3], PARAMS)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers, strangers, published = [], [], {}
    token = {"SHUTTLE_DEPLOYMENT_TOKEN": "t0k-" + os.urandom(8).hex()}

    def start_workers():
        time.sleep(1.0)  # the front's store must be listening first
        store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        published["raw"] = store.get("shuttle/deployment")
        published.update(read_deployment(store, token["SHUTTLE_DEPLOYMENT_TOKEN"], "here"))
        try:
            read_deployment(store, "guess", "here")
        except ValueError as e:
            published["wrong token"] = str(e)
        # Strangers reach the control listener before the real attention worker: refused.
        control = tuple(published["control"])
        strangers.append(dial_raw(control, "guess", hello_body("a0"), sign_anyway=True))
        strangers.append(socket.create_connection(control))
        strangers[-1].sendall(wire.encode(wire.Ready(0, 64)))
        try:  # a worker without the token stops before it takes a rank
            run_role("expert", f"127.0.0.1:{port}")
        except ValueError as e:
            published["tokenless worker"] = str(e)
        for role in ("expert", "expert", "attention"):
            workers.append(subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--role", role,
                                             "--rendezvous", f"127.0.0.1:{port}", "--torch-threads", "1"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                            env={**os.environ, **token}))

    import threading
    t = threading.Thread(target=start_workers)
    t.start()
    caplog.set_level("WARNING", logger="shuttle")
    llm = LLM(ckpt, num_kv_blocks=64, colocated=False, expert_workers=2, micro_batches=2, transport="tcp",
              rendezvous=f"127.0.0.1:{port}", deployment_token=token["SHUTTLE_DEPLOYMENT_TOKEN"])
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], PARAMS)]
    finally:
        llm.shutdown()
        t.join()
    codes = [w.wait(timeout=30) for w in workers]
    for c in strangers:
        c.settimeout(10)
        assert c.recv(1) == b""  # closed by the front
        c.close()
    refused = [r.getMessage() for r in caplog.records if "control listener refused" in r.getMessage()]
    assert any("wrong deployment token (claimed to be 'a0')" in r for r in refused), refused
    assert any("not a Shuttle HELLO" in r for r in refused), refused
    assert got == want
    assert "token" not in published["transport"] and token["SHUTTLE_DEPLOYMENT_TOKEN"].encode() not in published["raw"]
    assert "not signed with this worker's SHUTTLE_DEPLOYMENT_TOKEN" in published["wrong token"]
    assert "set SHUTTLE_DEPLOYMENT_TOKEN on this worker" in published["tokenless worker"]
    assert codes == [0, 0, 0], [w.stderr.read().decode()[-2000:] for w in workers]


def test_pool_engine_refuses_an_empty_token():
    """deployment_token (SHUTTLE_DEPLOYMENT_TOKEN), when given, must be a non-empty string; the HELLO
    and the signed store records are tested in tests/test_handshake.py."""
    with pytest.raises(ValueError, match="must be a non-empty string"):
        PoolEngine(engine_cfg("no-such-model", ParallelConfig(False)), {0}, deployment_token=" ")


def test_role_worker_waits_for_its_front_with_a_logged_back_off(caplog):
    """A --role worker started before its front says what it waits for, backs off, and gives up
    with a clear error; once the front has published the deployment it goes on."""
    import threading

    from clients.live_server import free_port
    from pools.roles import wait_for_front

    addr = f"127.0.0.1:{free_port()}"
    with caplog.at_level(logging.INFO, logger="shuttle"), pytest.raises(TimeoutError, match="no deployment at"):
        wait_for_front(addr, wait_s=4, first_retry_s=0.2)
    assert "waiting for the front's rendezvous store at " + addr in caplog.text
    caplog.clear()
    front = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    threading.Timer(0.5, front.set, ("shuttle/deployment", "{}")).start()
    with caplog.at_level(logging.INFO, logger="shuttle"):
        store = wait_for_front(f"127.0.0.1:{front.port}", wait_s=30, first_retry_s=0.2)
    assert store.get("shuttle/deployment") == b"{}"
    assert "waiting for its front to publish the deployment" in caplog.text


@pytest.mark.slow
def test_fp8_dispatch_serves_close_to_colocated(make_checkpoint):
    """--m2n-dtype fp8 (1 attention + 2 expert workers): tokens cross to the experts as float8 with
    per-token scales, a lossy step, so sampled or greedy text may part from the colocated one where
    two logits nearly tie. Scored on the same tokens (the prompts' log-probabilities), it stays
    within e4m3's rounding of the colocated engine, and each prompt's first new token is the same."""
    ckpt = make_checkpoint("mixtral")
    prompts = [list(range(3, 200, 7)), PROMPTS[0] * 3, PROMPTS[4]]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def scored(llm) -> tuple[list[float], list[int]]:
        try:
            outs = llm.generate(prompts, params)
        finally:
            llm.shutdown()
        return ([next(iter(lp.values())).logprob for o in outs for lp in o.prompt_logprobs[1:]],
                [o.outputs[0].token_ids[0] for o in outs])

    want, want_first = scored(LLM(ckpt, num_kv_blocks=64))
    got, got_first = scored(LLM(ckpt, num_kv_blocks=64, colocated=False, expert_workers=2, torch_threads=1,
                                m2n_dtype="fp8"))
    diff = [abs(a - b) for a, b in zip(got, want)]
    print(f"fp8 dispatch: prompt log-probabilities differ by {sum(diff) / len(diff):.4f} on average, "
          f"{max(diff):.4f} at most, over {len(diff)} tokens")
    assert len(got) == len(want) > 80 and sum(diff) / len(diff) < 0.05 and max(diff) < 0.5
    assert got_first == want_first
    with pytest.raises(ValueError, match="m2n_dtype"):
        ParallelConfig(True, m2n_dtype="fp8")
