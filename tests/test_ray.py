"""Pools on Ray (--launcher ray): a local two-node Ray cluster whose nodes carry different custom
resources; the attention pool must land on one and the expert pool on the other, talk over M2N
(tcp, at their node's address), produce the colocated engine's greedy ids; an actor killed
mid-generation is restarted in its bundle (on the same node) and every request goes on with the
same ids; a second kill, past --max-worker-restarts 1, is reported by name. One cluster for the
module: Ray's daemons are heavy on 2 cores.
"""
import contextlib
import os
import re
import time

import pytest

from attention_nodes.config import ParallelConfig
from pools.engine import PoolEngine, WorkerFailedError
from tests.test_pools import PARAMS, PROMPTS, engine_cfg, reference, run_staggered

ray = pytest.importorskip("ray", reason="--launcher ray needs Ray: pip install 'shuttle-moe[ray]' (make setup does)")


def _kill_session(message):
    """Stop the daemons a failed head start left behind (named by the session in its message), so
    the second try does not share the two cores with them."""
    import psutil  # a dependency of Ray

    session = re.search(r"session_[0-9_-]+", message)
    if session is None:
        return
    for proc in psutil.process_iter(["cmdline"]):
        if any(session.group() in part for part in proc.info["cmdline"] or ()):
            with contextlib.suppress(psutil.Error):
                proc.kill()


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    # Ray's head node gives up when its daemons are slow to start on 2 busy cores: the suite has hit
    # "The current node timed out during startup" and "Timed out waiting for file .../gcs_server_port"
    # (the GCS server's 30 s default). Wait up to 120 s for the GCS, and try once more before the
    # module fails.
    with pytest.MonkeyPatch.context() as mp:  # for this module's Ray processes only
        if "RAY_gcs_server_port_wait_time_s" not in os.environ:
            mp.setenv("RAY_gcs_server_port_wait_time_s", "120")
        for attempt in range(2):
            try:
                c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, resources={"attn_gpu": 2},
                                                                      include_dashboard=False))
                break
            except Exception as e:  # noqa: BLE001 (ray raises a bare Exception or RuntimeError for these)
                if attempt or "timed out" not in str(e).lower():
                    raise
                ray.shutdown()
                _kill_session(str(e))
        c.add_node(num_cpus=2, resources={"expert_gpu": 2})
        ray.init(address=c.address, include_dashboard=False, logging_level="WARNING")
        yield c
        ray.shutdown()
        c.shutdown()


@pytest.mark.slow
def test_pools_on_ray_nodes_by_resources(cluster, make_checkpoint):
    ckpt = make_checkpoint("mixtral")
    # Supervision drives Ray actors as it drives processes: one restart, then the clear failure.
    par = ParallelConfig(False, 1, 1, 1, "tcp", torch_threads=1, launcher="ray", ray_address=cluster.address,
                         attention_resources='{"attn_gpu": 1}', expert_resources={"expert_gpu": 1},
                         max_worker_restarts=1)
    engine = PoolEngine(engine_cfg(ckpt, par), {0})
    try:
        head, other = cluster.head_node.node_id, next(iter(cluster.worker_nodes)).node_id
        where = {p.name: p.node_id for p in engine._procs}
        assert where == {"a0": head, "e0": other}
        got = run_staggered(engine, rounds=1)
        want = reference(make_checkpoint, "mixtral")
        assert got == {k: v for k, v in want.items() if k.startswith("0-")}
        assert len(got) == len(PROMPTS) and all(len(v) == PARAMS.max_tokens for v in got.values())

        e0 = next(p for p in engine._procs if p.name == "e0")
        for i, prompt in enumerate(PROMPTS):  # the second round, with e0 killed after two steps
            engine.add_request(f"1-{i}", prompt, PARAMS)
        calls, got = 0, {}
        while engine.has_unfinished_requests():
            if calls == 2:
                ray.kill(e0.actor, no_restart=True)
            for d in engine.step(timeout=60):
                got.setdefault(d.request_id, []).extend(d.new_token_ids)
            calls += 1
        assert got == {k: v for k, v in want.items() if k.startswith("1-")}  # resumed, the same ids
        new = next(p for p in engine._procs if p.name == "e0")
        assert new is not e0 and new.node_id == other and engine.supervision.num_restarts == 1

        ray.kill(new.actor, no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"'e0'|e0 \(exit code") as err:
            engine.add_request("after-kill", PROMPTS[0], PARAMS)
            while engine.has_unfinished_requests():
                engine.step(timeout=30)
        assert "e0" in str(err.value) and "max-worker-restarts 1" in str(err.value) and time.monotonic() - t0 < 30
    finally:
        engine.shutdown()
    assert all(p.exitcode is not None for p in engine._procs)
