"""Supervision: a dead or silent worker is restarted and no request is lost.

Unit level: a request resumed from prompt + delivered tokens (what the front sends after a failure)
continues exactly as the undisturbed run, greedy or seeded, with penalties, n > 1 or a grammar.
End to end: ONE real `shuttle serve` (2 attention + 2 expert workers) driven by the official
`openai` client with streams under load. Its placement replicates every expert of e1 on e0 (e0
holds all 8 experts, e1 holds 4-7), so killing e1 is a failover (no other worker restarted, no
request resumed, tokens again within seconds, e1 added back afterwards), while e0's experts 0-3
have no copy: an attention worker SIGKILLed and e0 SIGSTOPped (silent) take the restart path.
e0's restart keeps every request where it was (nothing prefilled again), a1's resumes them.
Every request succeeds with the undisturbed text (greedy; one prompt samples with a seed), tokens
flow again within 30 s of the fault, /health says 503 with Retry-After while the workers restart
(and a request sent then waits and succeeds), 200 after; a worker killed while idle is restarted
too. The fifth fault is past --max-worker-restarts 4: the clear failure of an unsupervised
deployment.
`make fault-test` runs the full-size version (200 requests at concurrency 32).
"""
import json
import os
import re
import signal
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from attention_nodes.config import CacheConfig, EngineConfig, ParallelConfig
from attention_nodes.engine import LLMEngine
from attention_nodes.sampling_params import SamplingParams
from bench.fault_load import PROMPTS, complete, fault_under_load
from clients.live_server import LiveServer
from pools.supervision import Supervision, Worker, WorkerFailedError, _Broken, _down
from server.cli import main as cli_main

NUM_REQUESTS = int(os.environ.get("SHUTTLE_FAULT_REQUESTS", "12"))
CONCURRENCY = int(os.environ.get("SHUTTLE_FAULT_CONCURRENCY", "6"))


# -- unit: resume continues exactly -----------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(make_checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(str(make_checkpoint("mixtral")), cache=CacheConfig(num_blocks=64)), {0})


def _run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
         resume: list[list[int] | None] | None = None) -> dict[int, list[int]]:
    engine.add_request(rid, prompt, params, resume)
    out: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out.setdefault(d.index, []).extend(d.new_token_ids)
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=0.5),
    SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=123, ignore_eos=True, n=2, presence_penalty=0.3),
    SamplingParams(max_tokens=12, temperature=1.0, seed=5, structured_outputs={"kind": "regex", "spec": r"[a-z]{3}-\d{2}[a-z ]+"}),
], ids=["greedy", "seeded-n2", "regex"])
def test_resume_continues_exactly(engine, params):
    """What the front sends after a failure (prompt + delivered tokens per sample, None for a
    finished sample) continues each sample token for token; the seeded generator is moved past the
    draws already taken, the grammar has accepted the delivered tokens."""
    prompt = [5, 17, 33, 100, 250, 7, 9, 11, 13, 200, 301, 45, 46, 47, 3, 4, 5, 6]  # more than one block
    full = _run(engine, "ref", prompt, params)
    assert all(len(v) >= 3 for v in full.values())
    for k in (1, min(map(len, full.values())) - 1):
        resume = [full[i][:k] for i in range(params.n)]
        got = _run(engine, f"resume-{k}", prompt, params, resume)
        assert got == {i: full[i][k:] for i in range(params.n)}, f"resumed after {k} tokens"
    if params.n > 1:  # sample 0 finished before the failure: only sample 1 goes on
        got = _run(engine, "one-left", prompt, params, [None, full[1][:4]])
        assert got == {1: full[1][4:]}
    with pytest.raises(ValueError, match="resume"):
        engine.add_request("bad", prompt, params, [[1]] * (params.n + 1))
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


# -- end to end: one live server, three faults, then one too many ----------------------------------
REPLICATED = {str(e): [0] if e < 4 else [0, 1] for e in range(8)}  # e1's experts all have a copy on e0


@pytest.fixture(scope="module")
def server(make_checkpoint, tmp_path_factory):
    ckpt = make_checkpoint("mixtral")
    placement = tmp_path_factory.mktemp("placement") / "placement.json"
    placement.write_text(json.dumps(REPLICATED))
    with LiveServer(["--model", str(ckpt), "--attention-workers", "2", "--expert-workers", "2",
                     "--micro-batches", "2", "--max-worker-restarts", "4", "--num-kv-blocks", "256",
                     "--placement", str(placement)]) as srv:
        srv.model = str(ckpt)
        srv.client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # the undisturbed text
            srv.reference = dict(zip(PROMPTS, pool.map(lambda p: complete(srv, p), PROMPTS)))
        yield srv


def _check_recovered(srv, out: dict) -> None:
    results, watch = out["results"], out["watch"]
    failed = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert not failed, f"{len(failed)} requests failed: {list(failed.values())[:3]}\n{srv.log()[-3000:]}"
    wrong = [i for i, text in results.items() if text != srv.reference[PROMPTS[i % len(PROMPTS)]]]
    assert not wrong, f"streams {wrong} differ from the undisturbed text"
    assert out["pause_s"] is not None and out["pause_s"] < 30, out["pause_s"]
    assert (503, "engine_not_ready") in watch.codes and watch.retry_after == {"1"}, watch.codes
    assert watch.codes[-1] == 200, watch.codes[-5:]
    assert watch.late.get("text") == srv.reference[PROMPTS[0]], watch.late  # sent while restarting: waited


def _metric(srv, name: str, label: str) -> float | None:
    """The value of the /metrics series `name` whose labels include `label` (None if absent)."""
    m = re.search(rf'^{name}{{[^}}]*{label}[^}}]*}} (\S+)$', httpx.get(f"{srv.url}/metrics").text, re.M)
    return float(m.group(1)) if m else None


@pytest.mark.slow
def test_failover_with_replicas_loses_no_request(server):
    """SIGKILL e1, whose experts all have copies on e0, under load: the attention workers route
    around it from the next step (no other worker restarted, no request resumed), every stream
    has the undisturbed text, tokens flow again within seconds; the restarted e1 is added back
    (placement version + 2) and computes tokens again."""
    before, version = server.children(), _metric(server, "shuttle_expert_placement_version", "model_name")
    out = fault_under_load(server, "shuttle-expert-e1", signal.SIGKILL, NUM_REQUESTS, CONCURRENCY)
    failed = {i: r for i, r in out["results"].items() if isinstance(r, Exception)}
    assert not failed, f"{len(failed)} requests failed: {list(failed.values())[:3]}\n{server.log()[-3000:]}"
    wrong = [i for i, text in out["results"].items() if text != server.reference[PROMPTS[i % len(PROMPTS)]]]
    assert not wrong, f"streams {wrong} differ from the undisturbed text"
    # Failover aims at tokens within 2 s; a loaded 2-core host stretches it, so the bound is generous and the
    # number is printed (bench/failover.py measures it: bench/results/failover.json).
    assert out["pause_s"] is not None and out["pause_s"] < 10, out["pause_s"]
    log = server.log()
    assert "failover: expert workers e1 are out" in log and "requests resumed" not in log.split("failover:")[-1]
    deadline = time.monotonic() + 60
    while _metric(server, "shuttle_expert_placement_version", "model_name") < version + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(server, "shuttle_expert_placement_version", "model_name") == version + 2, log[-3000:]
    after = server.children()
    assert after["shuttle-expert-e1"] != before["shuttle-expert-e1"]
    assert all(after[t] == before[t] for t in before if t != "shuttle-expert-e1")  # nobody else restarted
    e1_tokens = _metric(server, "shuttle_expert_worker_tokens_total", 'worker="e1"')
    assert complete(server, PROMPTS[5]) == server.reference[PROMPTS[5]]
    deadline = time.monotonic() + 10  # expert workers publish their counts once a second
    while _metric(server, "shuttle_expert_worker_tokens_total", 'worker="e1"') in (e1_tokens, 0) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(server, "shuttle_expert_worker_tokens_total", 'worker="e1"') not in (e1_tokens, 0)  # e1 is back
    print(f"failover (e1 SIGKILL, replicas on e0): first token {out['first_after_s']:.2f} s after the fault, "
          f"longest pause in the token flow {out['pause_s']:.2f} s")


@pytest.mark.slow
@pytest.mark.parametrize("victim,sig", [("shuttle-attention-a1", signal.SIGKILL), ("shuttle-expert-e0", signal.SIGSTOP)],
                         ids=["kill-a1", "stop-e0"])
def test_fault_under_load_loses_no_request(server, victim, sig):
    """a1 killed: survivors drop their requests, resumed from prompt + delivered tokens. e0 stopped
    (its experts have no copy): it is restarted and the attention workers keep their requests and
    caches, so nothing is prefilled again."""
    before, recomputed = server.children(), _metric(server, "shuttle_recomputed_tokens_total", "model_name")
    out = fault_under_load(server, victim, sig, NUM_REQUESTS, CONCURRENCY)
    _check_recovered(server, out)
    grew = _metric(server, "shuttle_recomputed_tokens_total", "model_name") - recomputed
    if victim.startswith("shuttle-expert"):
        assert grew == 0 and "the attention workers keep their requests" in server.log().split("restarting e0")[-1]
    else:
        assert grew > 0
    after = server.children()
    assert sorted(after) == sorted(before) and after[victim] != before[victim]  # a new process, same title
    assert all(after[t] == before[t] for t in before if t != victim)  # the others were not restarted
    print(f"{victim} {signal.Signals(sig).name}: first token {out['first_after_s']:.2f} s after the fault, "
          f"longest pause in the token flow {out['pause_s']:.2f} s")


@pytest.mark.slow
def test_a_throttled_expert_worker_is_named(server, capsys):
    """e1 stopped for 0.2 s of every 0.3 s (short of the front's stopped-worker check) under
    streaming load: within the straggler window /metrics scores it a straggler and the log names it;
    e0 is not (the attention pool is not judged, see below); every stream still has the undisturbed
    text."""
    pid, stop, texts = server.children()["shuttle-expert-e1"], threading.Event(), []

    def throttle() -> None:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.2)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)

    def load(i: int) -> None:
        while not stop.is_set():
            prompt = PROMPTS[(i + len(texts)) % len(PROMPTS)]
            texts.append((prompt, complete(server, prompt)))

    cycle = threading.Thread(target=throttle)
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(load, i) for i in range(4)]
        cycle.start()
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and "straggler: expert worker e1" not in server.log():
            time.sleep(0.5)
        named = time.monotonic() - deadline + 40
        e1 = _metric(server, "shuttle_worker_straggler_score", 'worker="e1"')
        e0 = _metric(server, "shuttle_worker_straggler_score", 'worker="e0"')
        rows = {w["worker"]: w for w in httpx.get(f"{server.url}/workers").json()["workers"]}
        assert cli_main(["workers", "--url", server.url]) == 0
        stop.set()
        cycle.join()
        os.kill(pid, signal.SIGCONT)
        for r in runs:
            r.result()
    assert "straggler: expert worker e1" in server.log() and "expert worker e0:" not in server.log(), server.log()[-2000:]
    assert e1 >= 3.0 and e0 < 3.0, (e0, e1)
    assert sorted(rows) == ["a0", "a1", "e0", "e1"] and rows["e1"]["score"] >= 3.0 > rows["e0"]["score"]
    table = capsys.readouterr().out.splitlines()
    # The expert pool names e1 alone. The attention pool is not judged: e1 serves one attention
    # worker's micro-batches last, so that worker reaches e0 late in turn and may score high too.
    flagged = [line.split()[:2] for line in table[2:] if line.endswith(" straggler")]
    assert [w for pool, w in flagged if pool == "expert"] == ["e1"], table
    print(f"straggler e1 named {named:.1f} s after its throttling began; scores e0 {e0:.2f}, e1 {e1:.2f}")
    assert texts and all(text == server.reference[prompt] for prompt, text in texts)


@pytest.mark.slow
def test_expert_worker_killed_in_bf16_recomputes_nothing(make_checkpoint):
    """bf16 (the default where the CPU has native bf16, and on GPUs), 1 + 1 workers, e0 SIGKILLed
    under streaming load: it is restarted while the attention worker keeps its requests and KV
    cache, so every stream has exactly the undisturbed greedy text (resuming from the prompt would
    sum in another order and may flip a near-tie) and no token is prefilled again."""
    ckpt = make_checkpoint("mixtral")
    with LiveServer(["--model", str(ckpt), "--dtype", "bfloat16", "--attention-workers", "1", "--expert-workers",
                     "1", "--micro-batches", "2", "--num-kv-blocks", "256"]) as srv:
        srv.model = str(ckpt)
        srv.client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            srv.reference = dict(zip(PROMPTS, pool.map(lambda p: complete(srv, p), PROMPTS)))
        out = fault_under_load(srv, "shuttle-expert-e0", signal.SIGKILL, 8, 4)
        _check_recovered(srv, out)
        assert _metric(srv, "shuttle_recomputed_tokens_total", "model_name") == 0
        assert _metric(srv, "shuttle_worker_restarts_total", "model_name") == 1
        assert "the attention workers keep their requests" in srv.log()


@pytest.mark.slow
def test_idle_fault_is_restarted(server):
    """A worker killed while nothing runs is restarted too: /health goes 503 at once (the process is
    gone), 200 once the new one joined, and the next request gets the undisturbed text."""
    os.kill(server.children()["shuttle-expert-e0"], signal.SIGKILL)  # no copies of its experts 0-3: a restart
    codes, deadline = [], time.monotonic() + 90
    while (not codes or codes[-1] != 200 or 503 not in codes) and time.monotonic() < deadline:
        codes.append(httpx.get(f"{server.url}/health", timeout=5).status_code)
        time.sleep(0.05)
    assert 503 in codes[:10] and codes[-1] == 200, codes  # 503 within about half a second
    assert complete(server, PROMPTS[2]) == server.reference[PROMPTS[2]]


@pytest.mark.slow
def test_past_max_restarts_fails_clearly(server):
    """The fifth fault (restart budget 4 spent above): streams end with an error event naming the
    worker, /health turns 503 engine_dead, new requests are refused: no hang."""
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'shuttle_worker_restarts_total{{model_name="{server.model}"}} 4.0' in metrics
    victim = server.children()["shuttle-expert-e0"]
    start = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for i, _ in enumerate(server.client.completions.create(
                model=server.model, prompt=PROMPTS[1], max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True})):
            if i == 1:
                os.kill(victim, signal.SIGKILL)
    assert time.monotonic() - start < 30
    assert "e0" in str(err.value) and "max-worker-restarts" in str(err.value), err.value
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    with pytest.raises(openai.APIStatusError) as refused:
        server.client.completions.create(model=server.model, prompt="x", max_tokens=2)
    assert refused.value.status_code == 503


# -- unit: the restart budget ------------------------------------------------------------------------
class _NoStore:
    def check(self, keys) -> bool:
        return False


def _front(remote: bool = False, max_restarts: int = 2, window_s: float = 600.0) -> Supervision:
    """The supervision of pools with only what the restart budget reads (no processes)."""
    cfg = EngineConfig("unused", parallel=ParallelConfig(False, 1, 1, max_worker_restarts=max_restarts,
                                                         restart_window_s=window_s))
    return Supervision(types.SimpleNamespace(cfg=cfg, _procs=[], _store=_NoStore(), session="s",
                                             transport=types.SimpleNamespace(dead_after_s=3.0)), remote)


def test_restart_budget_and_remote_workers(monkeypatch):
    """--max-worker-restarts counts within --restart-window-s; 0 and --role workers fail at once."""
    eng = _front(max_restarts=2, window_s=100.0)
    now = [1000.0]
    monkeypatch.setattr("pools.supervision.time.monotonic", lambda: now[0])
    eng._count_restart(_Broken("worker e0 exited with code -9"), {Worker.named("e0")})
    now[0] += 50
    eng._count_restart(_Broken("worker e0 exited with code -9"), {Worker.named("e0")})
    with pytest.raises(WorkerFailedError, match=r"e0 exited.*giving up: 2 restarts within the last 100 s.*"
                                                r"--max-worker-restarts 2"):
        eng._count_restart(_Broken("worker e0 exited with code -9"), {Worker.named("e0")})
    now[0] += 60  # the first restart left the window
    eng._count_restart(_Broken("worker a0 exited with code 1"), {Worker.named("a0")})
    assert eng.num_restarts == 3
    with pytest.raises(WorkerFailedError, match="not restarted by the server"):
        _front(remote=True)._count_restart(_Broken("attention worker a0: M2N peer 'e1' is dead"), {Worker.named("e1")})
    with pytest.raises(WorkerFailedError, match="^worker e0 exited"):
        _front(max_restarts=0)._count_restart(_Broken("worker e0 exited with code -9"), {Worker.named("e0")})



def _exit_with(code: int) -> None:
    os._exit(code)


def _state(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0]


class _LateReport:
    """A worker started through a fork server: its exit code arrives from the server a moment after
    the process exited, until then it is a zombie that /proc shows as down (here: until join)."""

    def __init__(self, code: int):
        import multiprocessing as mp

        self._proc = mp.get_context("fork").Process(target=_exit_with, args=(code,), name="e0")
        self._proc.start()
        self.pid, self.name, self._joined = self._proc.pid, "e0", False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _state(self.pid) != b"Z":
            time.sleep(0.01)

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode if self._joined else None

    def join(self, timeout: float | None = None) -> None:
        self._joined = True
        self._proc.join(timeout)


@pytest.mark.parametrize("code,match", [(3, "re-import your script"), (1, "worker e0 exited with code 1")])
def test_an_exited_worker_is_not_reported_as_stopped(code, match):
    """A worker that exited but whose exit code has not arrived yet (a zombie: /proc says it is
    down) is reported with its exit code, the missing main guard's hint included, not as 'stopped'."""
    eng = _front()
    eng.pools._procs = [_LateReport(code)]
    with pytest.raises((WorkerFailedError, _Broken), match=match):
        eng.check_procs()


def test_a_worker_is_failed_only_when_stopped_throughout_dead_after_s():
    """A stop/continue cycle is a straggler, not a failure: supervision fails a stopped worker only
    when it was seen stopped without running in between for dead_after_s (then promptly)."""
    import subprocess
    import sys

    eng = _front()
    eng.pools.transport.dead_after_s = 0.6
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    eng.pools._procs = [types.SimpleNamespace(pid=child.pid, name="e0", exitcode=None, join=lambda t: None)]
    try:
        time.sleep(0.2)
        for _ in range(4):  # stopped 0.3 s of every 0.35 s for 1.4 s: never failed
            os.kill(child.pid, signal.SIGSTOP)
            for _ in range(3):
                time.sleep(0.1)
                eng.check_procs()
            os.kill(child.pid, signal.SIGCONT)
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGSTOP)
        # A stop takes effect when the child is next scheduled, and its last context switch is
        # counted as it stops: on a loaded host the first look could come before either.
        deadline = time.monotonic() + 5
        while not _down(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        eng.check_procs()
        time.sleep(0.65)
        with pytest.raises(_Broken, match="worker e0 is stopped .* for 0.6 s or more"):
            eng.check_procs()
    finally:
        child.kill()
        child.wait()
