"""The simulator on a tiny deterministic profile: hand-computed step times for one micro-batch,
m overlapping micro-batches, lock-step across attention workers, and a whole workload."""
import heapq
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from attention_nodes.sampling_params import SamplingParams
from attention_nodes.scheduler import ScheduledBatch
from attention_nodes.sequence import Sequence
from planner.perf import ProfilePerf
from planner.simulate import Deployment, SimModel, Simulator, Workload

MS = 1e-3


def fit(terms, coef):
    return {"terms": list(terms), "coef": list(coef), "median_abs_residual": 0.0, "max_abs_residual": 0.0,
            "samples": 9}


def profile(a=1.0, a_tok=0.0, e=2.0, e_pair=0.0, h=0.0, s=0.0, c=0.0, layers=4, experts=8, top_k=2):
    """Times in milliseconds: attention a + a_tok*tokens per layer and micro-batch, experts e +
    e_pair*pairs, head h, step s, one transfer c (any size)."""
    fits = {"attention": fit(("tokens", "const", "kv_reads"), (a_tok * MS, a * MS, 0.0)),
            "head": fit(("rows", "tokens", "const"), (0.0, 0.0, h * MS)),
            "step": fit(("seqs", "const"), (0.0, s * MS)),
            "experts": fit(("pairs", "const", "active"), (e_pair * MS, e * MS, 0.0))}
    return {"version": 1, "kind": "measured", "fits": {"1": fits},
            "transfer": {"shm": fit(("bytes", "const"), (0.0, c * MS))},
            "model": {"name": "toy", "config_hash": "x", "dtype": "float32", "num_layers": layers,
                      "num_moe_layers": layers, "num_experts": experts, "top_k": top_k, "hidden_size": 16},
            "host": {"cpu": "toy", "cores": 2}}


def batch(tokens_per_seq: list[int]) -> ScheduledBatch:
    """Decode-like sequences (one new token each unless told) with no context."""
    seqs = [Sequence(str(i), 0, [1] * n, n, SamplingParams(), 4, i) for i, n in enumerate(tokens_per_seq)]
    return ScheduledBatch(seqs, list(tokens_per_seq), [True] * len(seqs))


def sim(p: dict, **dep) -> Simulator:
    return Simulator(ProfilePerf(p), SimModel.from_profile(p), Deployment(**dep))


def test_one_micro_batch_is_the_sum_of_its_parts():
    p = profile(a=1.0, e=2.0, h=0.5, s=0.25, c=0.1, layers=4)
    t = sim(p).step_time(0.0, [batch([1, 1])])
    assert t == pytest.approx((0.25 + 4 * (1.0 + 0.1 + 2.0 + 0.1) + 0.5) * MS)
    colocated = sim(p, colocated=True).step_time(0.0, [batch([1, 1])])
    assert colocated == pytest.approx((0.25 + 4 * (1.0 + 2.0) + 0.5) * MS)


@pytest.mark.parametrize("m,a,e,c", [(2, 1.0, 1.0, 0.0), (3, 1.0, 2.0, 0.25), (4, 2.0, 1.5, 0.5)])
def test_m_micro_batches_overlap_as_megascale_infer_says(m, a, e, c):
    """With m >= 2(1 + T_c / max(T_a, T_e)) both pools stay busy and one step takes
    (T_a + T_e + 2 T_c) + max(T_a, T_e)(mL - 1)."""
    L = 4
    t = sim(profile(a=a, e=e, c=c, layers=L), micro_batches=m).step_time(0.0, [batch([1] * m)])
    assert t == pytest.approx((a + e + 2 * c + max(a, e) * (m * L - 1)) * MS)


def test_too_few_micro_batches_leave_bubbles():
    # m=2 with T_c = T_a = T_e: m < 2(1 + 1) = 4, so each layer waits for the round trip.
    t = sim(profile(a=1.0, e=1.0, c=1.0, layers=3), micro_batches=2).step_time(0.0, [batch([1, 1])])
    per_layer_round = 1.0 + 1.0 + 1.0 + 1.0  # attention, transfer, experts, transfer of mb 0
    assert t == pytest.approx((3 * per_layer_round + 1.0) * MS)  # mb 1's last answer lands a T_a later


def test_lock_step_across_attention_workers_waits_for_the_slowest_and_gathers():
    # worker 0: 1 token, worker 1: 3 tokens; attention 1 + 1 per token; experts 1 + 0.5 per pair (K=2).
    p = profile(a=1.0, a_tok=1.0, e=1.0, e_pair=0.5, c=0.0, layers=2, top_k=2)
    t = sim(p, attention_workers=2).step_time(0.0, [batch([1]), batch([1, 1, 1])])
    slow_attention, gathered_experts = 1.0 + 3.0, 1.0 + 0.5 * (1 + 3) * 2
    assert t == pytest.approx(2 * (slow_attention + gathered_experts) * MS)
    # An idle worker still takes its turn but costs nothing, so 1 busy worker + 1 idle = 1 alone.
    alone = sim(p).step_time(0.0, [batch([1, 1, 1])])
    assert sim(p, attention_workers=2).step_time(0.0, [batch([1, 1, 1]), batch([])]) == pytest.approx(alone)


def test_cores_bound_oversubscribed_steps():
    p = profile(a=1.0, e=1.0, layers=2)
    free = sim(p, attention_workers=2, micro_batches=1).step_time(0.0, [batch([1]), batch([1])])
    shared = sim(p, attention_workers=2, cores=1, torch_threads=1).step_time(0.0, [batch([1]), batch([1])])
    assert free == pytest.approx(2 * (1.0 + 1.0) * MS)
    assert shared == pytest.approx(2 * (2 * 1.0 + 1.0) * MS)  # 6 ms of CPU work on one core


def test_front_work_delays_workers_by_the_share_of_cores_they_hold():
    # 2 layers of attention 1 ms + experts 1 ms; the front and load generator: 0.75 + 0.25 ms of CPU
    # per output token, 2 tokens a step -> 2 ms of front work.
    p = profile(a=1.0, e=1.0, layers=2)
    p["front"] = {"front_s_per_token": 0.75 * MS, "client_s_per_token": 0.25 * MS}
    p["fits"]["2"] = p["fits"]["1"]  # the same times at 2 threads
    two = [batch([1, 1])]
    assert sim(p).step_time(0.0, two) == pytest.approx(4 * MS)  # no shared host: the front costs nothing
    # 1 + 1 with a thread each on 2 cores: the front's work lands on one of the two cores, the
    # critical worker's half the time: half of its 2 ms on the step.
    assert sim(p, cores=2, torch_threads=1).step_time(0.0, two) == pytest.approx((4 + 2 * 0.5) * MS)
    # ... on 4 cores a quarter of it.
    assert sim(p, cores=4, torch_threads=1).step_time(0.0, two) == pytest.approx((4 + 2 * 0.25) * MS)
    # Front work longer than the step (8 tokens: 8 ms on a 4 ms step) shares the critical worker's
    # core for the whole step at most: a quarter of 4 ms, not of 8; the rest runs past the step's
    # end (and no step beats all the CPU work over the cores: (4 + 8) / 4 = 3 ms here).
    assert sim(p, cores=4, torch_threads=1).step_time(0.0, [batch([1] * 8)]) == pytest.approx((4 + 4 * 0.25) * MS)
    # ... but where the step's workers hold every core (m = 1 here; colocated, oversubscribed) all
    # of it: 4 + 8 ms.
    assert sim(p, cores=2).step_time(0.0, [batch([1] * 8)]) == pytest.approx((4 + 8) * MS)
    # shuttle serve's default at m = 1 (worker_threads): the pools take turns with both cores each,
    # so the computing one always has the core the front takes: all of it.
    assert sim(p, cores=2).dep.pool_threads == (2, 2) and not sim(p, cores=2).dep.oversubscribed
    assert sim(p, cores=2).step_time(0.0, two) == pytest.approx((4 + 2) * MS)
    # No step beats all the CPU work over the cores: 1 + 1 at a thread each on one core.
    assert sim(p, cores=1, torch_threads=1).step_time(0.0, two) == pytest.approx((4 + 2) * MS)
    # More threads computing at once than cores (2 + 1 at m = 2 on 2 cores): every core is shared
    # by workers the step waits on, so all of the front's work lands on it.
    over = sim(p, cores=2, torch_threads=1, attention_workers=2, micro_batches=2)
    assert over.dep.oversubscribed and over._held == 1.0
    assert sim(p, cores=3, torch_threads=1, attention_workers=2, micro_batches=2)._held == pytest.approx(1 / 3)
    assert sim(p, cores=2, micro_batches=2).dep.pool_threads == (1, 1)
    # Colocated, on both cores or on one of 2: the engine shares the front's interpreter lock, so
    # the front's work runs in turn with the engine's either way.
    assert sim(p, colocated=True, torch_threads=2, cores=2).step_time(0.0, two) == pytest.approx((4 + 2) * MS)
    assert sim(p, colocated=True, torch_threads=1, cores=2).step_time(0.0, two) == pytest.approx((4 + 2) * MS)


def test_a_served_front_scale_applies_to_its_kind_only():
    """A profile's factor solved on a served run (planner.calibrate.front_scales) scales the front's CPU
    beside a colocated step (the nearest thread count's) or an m = 1 step that takes every core;
    other deployments keep the front as measured."""
    p = profile(a=1.0, e=1.0, layers=2)
    p["front"] = {"front_s_per_token": 0.75 * MS, "client_s_per_token": 0.25 * MS}
    p["fits"]["2"] = p["fits"]["1"]
    p["front_scales"] = [{"kind": "colocated", "threads": 1, "scale": 0.0},
                         {"kind": "colocated", "threads": 2, "scale": 0.5}, {"kind": "m1", "threads": 2, "scale": 0.25}]
    two = [batch([1, 1])]  # 2 ms of front work on a 4 ms step, all of it on the step
    assert sim(p, colocated=True, torch_threads=2, cores=2).step_time(0.0, two) == pytest.approx((4 + 1) * MS)
    assert sim(p, colocated=True, torch_threads=1, cores=2).step_time(0.0, two) == pytest.approx(4 * MS)
    assert sim(p, colocated=True, torch_threads=4, cores=2).perf.front_s_per_token == pytest.approx(0.5 * MS)
    assert sim(p, cores=2).perf.front_s_per_token == pytest.approx(0.25 * MS)  # m = 1, 2 threads each
    for dep in ({"cores": 2, "torch_threads": 1}, {"cores": 2, "micro_batches": 2}, {"colocated": True}):
        assert sim(p, **dep).perf.front_s_per_token == pytest.approx(1.0 * MS)  # no scale: the front as measured


def test_a_front_scale_served_at_two_batch_sizes_is_interpolated_between_them():
    """The colocated engine served at batch 64 and 256 (planner.front.measure_scale_runs): the factor
    is linear in 1 / max_num_seqs between the two runs' and held at the nearer one outside them; a
    thread count served at one batch size (or an entry from before concurrency was recorded) keeps
    its one factor at every batch."""
    p = profile(a=1.0, e=1.0, layers=2)
    p["front"] = {"front_s_per_token": 1.0 * MS}
    p["fits"]["2"] = p["fits"]["1"]
    p["front_scales"] = [{"kind": "colocated", "threads": 2, "concurrency": 64, "scale": 0.5},
                         {"kind": "colocated", "threads": 2, "concurrency": 256, "scale": 1.0},
                         {"kind": "colocated", "threads": 1, "scale": 0.25}]
    for seqs, scale in ((16, 0.5), (64, 0.5), (128, 1.0 - 0.5 / 3), (256, 1.0), (1024, 1.0)):
        got = sim(p, colocated=True, torch_threads=2, cores=2, max_num_seqs=seqs).perf.front_s_per_token
        assert got == pytest.approx(scale * MS), seqs
    for seqs in (16, 256):
        got = sim(p, colocated=True, torch_threads=1, cores=2, max_num_seqs=seqs).perf.front_s_per_token
        assert got == pytest.approx(0.25 * MS)


def test_front_scales_give_the_served_runs_their_wall_time():
    from planner.calibrate import front_scales

    p = profile(a=1.0, e=1.0, layers=2)
    p["fits"]["2"] = p["fits"]["1"]
    p["front"] = {"front_s_per_token": 1.0 * MS, "front_s_per_step": 0.5 * MS}
    work = {"requests": 8, "prompt_len": 3, "output_len": 3, "concurrency": 4, "micro_batches": 1}
    dep = Deployment(True, 1, 1, 1, 2, 2, "shm", max_num_seqs=4)

    def duration(scale: float) -> float:
        q = {**p, "front_scales": [{"kind": "colocated", "threads": 2, "scale": scale}]}
        return Simulator(ProfilePerf(q), SimModel.from_profile(q), dep).run(Workload(8, 3, 3, 4))["duration"]
    p["front"]["scale_runs"] = [{"kind": "colocated", "threads": 2, **work, "load_s": duration(0.6)},
                                {"kind": "colocated", "threads": 1, **work, "load_s": 1e-6},  # faster than any
                                {"kind": "m1", "threads": None, **work, "load_s": 1e3}]  # slower than twice the front
    scales = front_scales(p)
    assert scales[0]["scale"] == pytest.approx(0.6, abs=2e-3)
    assert [(s["kind"], s["threads"], s["scale"]) for s in scales[1:]] == [("colocated", 1, 0.0), ("m1", 2, 2.0)]
    assert all(s["concurrency"] == 4 for s in scales)


def test_front_work_per_delta_message():
    """Per step the front also pays for each delta message (one per attention worker that sampled,
    whatever it carries): profile front_s_per_step + client_s_per_step."""
    p = profile(a=1.0, e=1.0, layers=2)
    p["front"] = {"front_s_per_token": 0.5 * MS, "front_s_per_step": 0.75 * MS, "client_s_per_step": 0.25 * MS}
    p["fits"]["2"] = p["fits"]["1"]  # the same times at 2 threads
    # 1 + 1 taking turns on 2 cores (m = 1, 2 threads each: the front's work all on the step): 4 ms
    # of work, 2 tokens (1 ms), one message (1 ms).
    assert sim(p, cores=2).step_time(0.0, [batch([1, 1])]) == pytest.approx((4 + 1 + 1) * MS)
    # 2 + 1, 3 single-thread workers on 3 cores: two messages (2 ms) and 2 tokens (1 ms), a third of
    # it on the step.
    two = sim(p, cores=3, torch_threads=1, attention_workers=2).step_time(0.0, [batch([1]), batch([1])])
    assert two == pytest.approx((4 + (1 + 2) / 3) * MS)
    # A worker that sampled nothing (a prefill chunk) sends no deltas: one message and 1 token.
    chunk = ScheduledBatch(batch([4]).seqs, [4], [False])
    assert sim(p, cores=3, torch_threads=1, attention_workers=2).step_time(0.0, [batch([1]), chunk]) == \
        pytest.approx((4 + (0.5 + 1) / 3) * MS)
    assert ProfilePerf({**p, "front": {"front_s_per_token": 1.0}}).front(3, 2) == 3.0  # older profiles: per token only


def test_pools_take_the_passive_fits_and_colocated_the_spinning_ones():
    # At 2 threads the pools' workers wait passively between OpenMP regions: their fits.
    p = profile(a=1.0, e=1.0, layers=2)
    p["fits"]["2"] = p["fits"]["1"]
    p["fits_passive"] = {"2": profile(a=3.0, e=2.0, layers=2)["fits"]["1"]}
    one = [batch([1])]
    assert sim(p, colocated=True, torch_threads=2).step_time(0.0, one) == pytest.approx(4 * MS)
    assert sim(p, torch_threads=2).step_time(0.0, one) == pytest.approx(2 * (3 + 2) * MS)
    assert sim(p, torch_threads=1).step_time(0.0, one) == pytest.approx(4 * MS)  # one thread: no pool to wake


def test_waits_longer_than_the_polling_pay_a_wake_up():
    # 1 + 1, m=1, 2 layers of attention 1 ms and experts 1 ms, no transfer time: every wait (the
    # expert for its input, attention for the answer, twice a layer) lasts 1 ms.
    p = profile(a=1.0, e=1.0, layers=2)
    p["transfer"]["shm"].update(wake_s=0.5 * MS, spin_s=0.1 * MS)
    assert sim(p).step_time(0.0, [batch([1])]) == pytest.approx((4 + 4 * 0.5) * MS)
    p["transfer"]["shm"]["spin_s"] = 10 * MS  # every wait ends while still polling
    assert sim(p).step_time(0.0, [batch([1])]) == pytest.approx(4 * MS)


def test_sending_keeps_the_sender_busy():
    # 1 + 1, m=2, 1 layer: attention 1 ms, experts 1 ms, transfers 1 ms of which the sender's copy
    # is 0.5 ms. mb0: attention 0-1, sent (copy to 1.5), experts 2-3, copy back to 3.5, answer at 4;
    # mb1: attention 1.5-2.5, experts 3.5-4.5 (after mb0's copy back), answer 5.5; heads at 5.5.
    p = profile(a=1.0, e=1.0, c=1.0, layers=1)
    p["transfer"]["shm"]["send"] = fit(("bytes", "const"), (0.0, 0.5 * MS))
    assert sim(p, micro_batches=2).step_time(0.0, [batch([1, 1])]) == pytest.approx(5.5 * MS)
    del p["transfer"]["shm"]["send"]
    assert sim(p, micro_batches=2).step_time(0.0, [batch([1, 1])]) == pytest.approx(5.0 * MS)


def test_workload_metrics_use_bench_serve_names():
    # Every step costs the same 4 layers x (1 + 2) ms colocated: 4 requests prefill in one step,
    # then decode 3 more tokens each.
    p = profile(a=1.0, e=2.0, layers=4)
    r = sim(p, colocated=True).run(Workload(num_prompts=4, input_len=8, output_len=4))
    step = 12 * MS
    assert r["completed"] == 4 and r["total_output_tokens"] == 16 and r["steps"] == 4
    assert r["duration"] == pytest.approx(4 * step)
    assert r["output_throughput"] == pytest.approx(16 / (4 * step))
    assert r["mean_ttft_ms"] == pytest.approx(12.0) and r["mean_tpot_ms"] == pytest.approx(12.0)
    assert r["median_itl_ms"] == pytest.approx(12.0) and r["mean_e2el_ms"] == pytest.approx(48.0)
    # At most 2 in flight: two waves of 4 steps.
    r2 = sim(p, colocated=True).run(Workload(num_prompts=4, input_len=8, output_len=4, max_concurrency=2))
    assert r2["duration"] == pytest.approx(8 * step) and r2["mean_ttft_ms"] == pytest.approx(12.0)  # from its send


def test_simulate_command_json_trace_and_errors(tmp_path, capsys):
    from server.cli import main

    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(profile()))
    out, trace = tmp_path / "r.json", tmp_path / "t.json"
    assert main(["simulate", "--profile", str(prof), "--attention-workers", "1", "--expert-workers", "1",
                 "--micro-batches", "2", "--num-prompts", "8", "--input-len", "8", "--output-len", "4",
                 "--json", str(out), "--trace", str(trace)]) == 0
    r = json.loads(out.read_text())
    for key in ("output_throughput", "mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms",
                "attention_busy", "expert_busy"):
        assert key in r
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["cat"] for e in events} == {"attention", "expert"} and {e["pid"] for e in events} == {"a0", "e0"}
    capsys.readouterr()
    assert main(["simulate", "--profile", str(tmp_path / "none.json")]) == 2
    assert "file not found" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(prof), "--transport", "tcp"]) == 2
    assert "tcp" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(prof), "--micro-batches", "5"]) == 2
    assert "micro_batches" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(prof), "--quantization", "int8"]) == 2
    assert ("was measured with quantization none, not int8; profile again with shuttle profile --quantization int8"
            in capsys.readouterr().err)


def test_simulate_takes_the_profiles_quantization(tmp_path, capsys):
    """A profile measured with --quantization int8 simulates int8 experts (its fits are theirs); asked
    for unquantised experts it is refused."""
    from server.cli import main

    p = profile()
    p["model"]["quantization"] = "int8"
    prof, out = tmp_path / "p.json", tmp_path / "r.json"
    prof.write_text(json.dumps(p))
    for flags in ([], ["-q", "int8"], ["-q", "experts_int8"]):
        assert main(["simulate", "--profile", str(prof), "--colocated", "--num-prompts", "4", "--input-len", "8",
                     "--output-len", "2", "--json", str(out), *flags]) == 0
        assert json.loads(out.read_text())["deployment"]["quantization"] == "int8"
        assert "colocated, 2 thread(s), int8 experts on toy" in capsys.readouterr().out
    assert main(["simulate", "--profile", str(prof), "--quantization", "none"]) == 2
    assert "was measured with quantization int8, not none" in capsys.readouterr().err


def test_the_front_admits_on_its_fair_share_of_a_busy_host():
    """On a shared host a request's front work runs on the front's fair share of the cores: the cores
    over the threads computing at once plus the front's and the load generator's."""
    p = profile(a=0.1, e=0.1, layers=1)
    p["front"] = {"front_s_per_request": 8 * MS, "client_s_per_request": 2 * MS}
    assert sim(p, colocated=True, torch_threads=2, cores=2)._front_share == pytest.approx(2 / 4)
    assert sim(p, colocated=True, torch_threads=1, cores=2)._front_share == pytest.approx(2 / 3)
    assert sim(p, cores=2, torch_threads=1, micro_batches=2)._front_share == pytest.approx(2 / 4)  # both pools at once
    assert sim(p, cores=2)._front_share == pytest.approx(2 / 4)  # m = 1: the pools take turns, 2 threads each
    assert sim(p, cores=3, torch_threads=1, attention_workers=2, micro_batches=2)._front_share == pytest.approx(3 / 5)
    assert sim(p, cores=8, torch_threads=1)._front_share == 1.0 and sim(p, colocated=True)._front_share == 1.0
    # Three requests at t=0, the engine idle: the i-th reaches it (i+1) x 10 ms / (2/3) after they were sent.
    r = Simulator(ProfilePerf(p), SimModel.from_profile(p), Deployment(True, torch_threads=1, cores=2))
    seen = []
    step_time = r.step_time
    r.step_time = lambda t0, batches, step=0: (seen.append((t0, len(batches[0].seqs))), step_time(t0, batches, step))[1]
    r.run(Workload(num_prompts=3, input_len=1, output_len=1))
    assert seen[0] == (pytest.approx(15 * MS), 1)


def test_tokens_reach_the_client_the_fronts_delivery_time_after_the_step():
    """On a shared host a step's tokens reach the client, and a finished request's concurrency slot
    frees, the front's CPU for the step's deltas (per message and per token) after the step ends, at
    the front's share of the cores; the next request is sent only then. A latency, not a queue: a
    delivery longer than a step does not make the later tokens later still (served runs' TPOT at the
    front equals the client's)."""
    p = profile(a=0.1, e=0.1, layers=1)
    wl = Workload(num_prompts=2, input_len=1, output_len=1, max_concurrency=1)
    alone = sim(p, colocated=True, torch_threads=1, cores=2).run(wl)
    p["front"] = {"front_s_per_step": 4 * MS, "client_s_per_step": 1 * MS}
    r = sim(p, colocated=True, torch_threads=1, cores=2).run(wl)
    # each step takes the front's 5 ms on top (a colocated engine shares its interpreter lock), and
    # its one token reaches the client 5 ms / (2 cores / (1 engine thread + 2)) = 7.5 ms after it ends
    assert r["mean_ttft_ms"] == pytest.approx(alone["mean_ttft_ms"] + 5 + 7.5)
    assert r["duration"] == pytest.approx(alone["duration"] + 2 * (5 + 7.5) * MS)
    # 7.5 ms of delivery after steps of ~5 ms: every token the same 7.5 ms late, TPOT the step's
    long = Workload(num_prompts=1, input_len=1, output_len=6)
    step = sim(p, colocated=True, torch_threads=1, cores=2).run(long)
    assert step["mean_tpot_ms"] == pytest.approx(sim(p, colocated=True, torch_threads=1).run(long)["mean_tpot_ms"] + 5)
    # Without a shared host (cores unset) the front costs nothing and delays nothing.
    assert sim(p, colocated=True, torch_threads=1).run(wl)["mean_ttft_ms"] == pytest.approx(alone["mean_ttft_ms"])


def test_deltas_queue_on_the_cores_the_workers_leave():
    """A step's tokens reach the client after its deltas' CPU at the front's fair share (a latency),
    or later, once the front is through with the earlier steps' deltas on the cores the workers left
    free (a queue that a front slower than the steps falls behind on)."""
    p = profile(a=0.1, e=0.1, layers=1)
    s = sim(p, colocated=True, torch_threads=1, cores=2)  # fair share 2 / (1 + 2)
    s._deltas_cpu, s._spare = 6 * MS, 1.0
    assert s._delivered(100 * MS) == pytest.approx(109 * MS)  # latency 6 / (2/3); the queue's 106 is earlier
    s._spare = 0.5  # the workers left half a core: 12 ms a step's deltas
    assert s._delivered(110 * MS) == pytest.approx(122 * MS)
    assert s._delivered(115 * MS) == pytest.approx(134 * MS)  # behind the last step's deltas
    assert s._delivered(200 * MS) == pytest.approx(212 * MS)  # caught up


def test_requests_in_the_front_wait_for_a_steps_deltas():
    """Requests sent by a step's end and not through the front by then wait for that step's deltas
    (at the cores the workers left); the front takes them one after another, so one sent later
    starts after them or at its send; those the front was through with do not move."""
    s = sim(profile(a=0.1, e=0.1, layers=1), colocated=True, torch_threads=1, cores=2)
    s._deltas_cpu, s._spare = 4 * MS, 0.5  # 8 ms of deltas
    send = np.array([0.0, 15.0, 18.0, 25.0, 90.0]) * MS
    # taken 10 ms each: r0 through at 10, r1 on it from 15 (5 ms done at the step's end at 20), r2
    # queued behind it, r3 sent after the step, r4 long after
    inbox = [(10 * MS, 0), (25 * MS, 1), (35 * MS, 2), (45 * MS, 3), (100 * MS, 4)]
    heapq.heapify(inbox)
    assert s._hold_in_front(20 * MS, 100 * MS, inbox, send, 10 * MS) == pytest.approx(100 * MS)
    assert dict((r, a / MS) for a, r in inbox) == {0: pytest.approx(10), 1: pytest.approx(33), 2: pytest.approx(43),
                                                    3: pytest.approx(53), 4: pytest.approx(100)}
    assert s._hold_in_front(120 * MS, 100 * MS, inbox, send, 10 * MS) == pytest.approx(100 * MS)  # all through


def test_an_open_loop_is_not_held_by_steps_before_its_arrivals():
    """Requests arriving later (a request rate) wait for no step that ended before they were sent:
    at a rate the host keeps up with, the front's costs add about one request's handling and one
    step's delivery to the first token, whatever the number of steps before."""
    p = profile(a=0.1, e=0.1, layers=1)
    p["front"] = {"front_s_per_request": 1 * MS, "front_s_per_step": 1 * MS}
    wl = Workload(num_prompts=40, input_len=4, output_len=4, request_rate=20.0)
    alone = sim(profile(a=0.1, e=0.1, layers=1), colocated=True, torch_threads=1, cores=2).run(wl)
    r = sim(p, colocated=True, torch_threads=1, cores=2).run(wl)
    assert alone["mean_ttft_ms"] < r["mean_ttft_ms"] < alone["mean_ttft_ms"] + 10


def test_a_simulator_runs_a_workload_again_to_the_same_result():
    p = profile(a=0.1, e=0.1, layers=1)
    p["front"] = {"front_s_per_request": 1 * MS, "front_s_per_step": 1 * MS, "front_s_per_token": 0.1 * MS}
    s = Simulator(ProfilePerf(p), SimModel.from_profile(p), Deployment(False, 1, 1, 2, 1, 2, "shm", max_num_seqs=8))
    wl = Workload(num_prompts=24, input_len=5, output_len=6, max_concurrency=8)
    first, again = s.run(wl), s.run(wl)
    assert again == first


def test_the_front_admits_requests_one_at_a_time():
    """A per-request front cost (profile front_s_per_request + client_s_per_request) admits
    requests that all arrive at t=0 one after another: the i-th reaches the engine at (i+1) x that
    cost, so each first token comes that much later than alone (steps far shorter than the cost)."""
    p = profile(a=0.1, e=0.1, layers=1)
    alone = sim(p, colocated=True).run(Workload(num_prompts=1, input_len=1, output_len=2))["mean_ttft_ms"]
    p["front"] = {"front_s_per_token": 0.0, "front_s_per_request": 8 * MS, "client_s_per_request": 2 * MS}
    r = sim(p, colocated=True).run(Workload(num_prompts=3, input_len=1, output_len=2))
    assert r["mean_ttft_ms"] == pytest.approx(alone + (10 + 20 + 30) / 3)
    assert ProfilePerf(p).front_request() == pytest.approx(10 * MS)
    del p["front"]  # older profiles: no per-request cost
    assert ProfilePerf(p).front_request() == 0.0


def test_served_factor_slows_the_workers_on_a_shared_host_only():
    from planner.calibrate import served_factor

    p = profile(a=1.0, e=1.0, layers=2)
    one = [batch([1])]
    # The calibration: a served run that took twice what the fits say gives 2 (never below 1).
    p["front"] = {"run": {"requests": 4, "prompt_len": 3, "output_len": 2, "concurrency": 2, "micro_batches": 2}}
    dep = Deployment(False, 1, 1, 2, 1, 2, "shm", max_num_seqs=2)
    simulated = Simulator(ProfilePerf(p), SimModel.from_profile(p), dep).run(Workload(4, 3, 2, 2))["duration"]
    p["front"]["run"]["load_s"] = 2 * simulated
    assert served_factor(p) == pytest.approx(2.0)
    p["front"]["run"]["load_s"] = 0.5 * simulated
    assert served_factor(p) == 1.0
    # Applied to every worker's compute on a shared host where the pools compute at once (m >= 2);
    # not where each process has its device, nor to pools at m = 1 or a colocated engine (whose
    # attention and experts compute in turn, never beside each other).
    p["served_factor"] = 1.5
    assert sim(p).step_time(0.0, one) == pytest.approx(4 * MS)
    assert sim(p, cores=2, torch_threads=1).step_time(0.0, one) == pytest.approx(4 * MS)
    assert sim(p, colocated=True, cores=2, torch_threads=1).step_time(0.0, one) == pytest.approx(4 * MS)
    two = [batch([1, 1])]
    bare = sim({**p, "served_factor": 1.0}, cores=2, torch_threads=1, micro_batches=2).step_time(0.0, two)
    assert sim(p, cores=2, torch_threads=1, micro_batches=2).step_time(0.0, two) == pytest.approx(1.5 * bare)


def test_served_factor_is_solved_so_the_simulator_gives_the_served_run():
    """Only the workers' compute scales with the factor, not the front's CPU or the transfers: the
    factor is the one with which the simulated run lasts what the served one did (the plain ratio of
    served to unscaled simulated time under-corrects by the front's share)."""
    from planner.calibrate import served_factor

    p = profile(a=1.0, e=1.0, c=0.5, layers=2)
    p["front"] = {"front_s_per_token": 1.0 * MS, "front_s_per_step": 0.5 * MS,
                  "run": {"requests": 6, "prompt_len": 3, "output_len": 3, "concurrency": 2, "micro_batches": 2}}
    dep = Deployment(False, 1, 1, 2, 1, 2, "shm", max_num_seqs=2)
    wl = Workload(6, 3, 3, 2)

    def duration(factor: float) -> float:
        return Simulator(ProfilePerf({**p, "served_factor": factor}), SimModel.from_profile(p), dep).run(wl)["duration"]
    p["front"]["run"]["load_s"] = 1.6 * duration(1.0)
    f = served_factor(p)
    assert f > 1.6  # the ratio alone
    assert duration(f) == pytest.approx(p["front"]["run"]["load_s"], rel=2e-3)


def test_prefilling_sequences_pay_the_prefill_terms_and_decodes_do_not():
    """The attention fit has its own terms for the tokens of prefilling sequences (more than one new
    token) and the context they read; a decode step never pays them, and a profile made before
    them (three terms) prices both alike."""
    p = profile(a=1.0, e=2.0, layers=4)
    p["fits"]["1"]["attention"] = fit(("tokens", "const", "kv_reads", "prefill_tokens", "kv_prefill"),
                                      (0.0, 1.0 * MS, 0.0, 0.5 * MS, 0.1 * MS))
    decode = sim(p, colocated=True).step_time(0.0, [batch([1, 1])])
    assert decode == pytest.approx(4 * (1.0 + 2.0) * MS)
    # one sequence prefills 5 tokens from no context: 5 prefill tokens reading 1 + 2 + ... + 5 = 15
    mixed = sim(p, colocated=True).step_time(0.0, [batch([1, 5])])
    assert mixed == pytest.approx(4 * (1.0 + 0.5 * 5 + 0.1 * 15 + 2.0) * MS)
    old = profile(a=1.0, e=2.0, layers=4)
    assert sim(old, colocated=True).step_time(0.0, [batch([1, 5])]) == pytest.approx(decode)


def test_served_factors_slow_small_batches_where_both_pools_compute_at_once():
    """A profile's served runs at two batch sizes (planner.calibrate.served_factors): for pools at
    m >= 2 on a shared host each call's compute scales by the factor at its tokens, interpolated in
    1 / tokens between the two points and held at the nearer one outside them; the points are solved
    together from the runs (the small run's prefill calls take the large run's point); the step's
    own work takes the factor at the batch per micro-batch; one factor elsewhere."""
    from planner.calibrate import served_factors
    from planner.factors import call_slowdown, served_slowdown

    p = profile(a=1.0, a_tok=0.2, e=1.0, e_pair=0.1, layers=2)
    p["fits"]["2"] = p["fits"]["1"]
    runs = {"run": {"requests": 8, "prompt_len": 9, "output_len": 4, "concurrency": 8, "micro_batches": 2},
            "run_small": {"requests": 8, "prompt_len": 9, "output_len": 4, "concurrency": 2, "micro_batches": 2}}
    truth = [[1.0, 3.0], [4.0, 1.5]]  # 1 and 4 sequences a micro-batch
    for r in runs.values():  # served runs as long as the per-call model with these points says
        dep = Deployment(False, 1, 1, 2, 1, 2, "shm", max_num_seqs=r["concurrency"])
        r["load_s"] = Simulator(ProfilePerf({**p, "served_factors": truth}), SimModel.from_profile(p), dep).run(
            Workload(r["requests"], r["prompt_len"], r["output_len"], r["concurrency"]))["duration"]
    p["front"] = runs
    got = served_factors(p)
    assert [t for t, _ in got] == [1.0, 4.0]
    assert [f for _, f in got] == pytest.approx([3.0, 1.5], abs=0.02)
    # a call's factor: the points at their tokens, between them linear in 1 / tokens, the nearer outside
    f = call_slowdown(ProfilePerf({**p, "served_factors": truth}), Deployment(False, 1, 1, 2, 1, 2, "shm"))
    assert f(np.array([1.0, 2.0, 4.0, 512.0, 0.0])) == pytest.approx([3.0, 2.0, 1.5, 1.5, 3.0])
    assert call_slowdown(ProfilePerf({**p, "served_factors": truth}), Deployment(True, 1, 1, 1, 1, 2, "shm")) is None
    assert call_slowdown(ProfilePerf({**p, "served_factors": truth}), Deployment(False, 1, 1, 1, 1, 2, "shm")) is None
    p.update(served_factor=1.5, served_factors=[[8.0, 2.0], [32.0, 1.0]])
    perf = ProfilePerf(p)

    def pools(batch: int, m: int = 2, **kw) -> Deployment:
        return Deployment(False, 1, 1, m, 1, kw.get("cores", 2), "shm", max_num_seqs=batch)
    assert [served_slowdown(perf, pools(b)) for b in (8, 16, 32, 64, 256)] == pytest.approx([2.0, 2.0, 4 / 3, 1.0, 1.0])
    # Every compute time of the deployment scales: a step of 8 sequences per micro-batch takes twice
    # the unscaled one (no front, no transfer time here).
    bare = sim({**p, "served_factor": 1.0, "served_factors": []}, cores=2, torch_threads=1, micro_batches=2,
               max_num_seqs=16)
    scaled = sim(p, cores=2, torch_threads=1, micro_batches=2, max_num_seqs=16)
    step = [batch([1] * 16)]
    assert scaled.step_time(0.0, step) == pytest.approx(2 * bare.step_time(0.0, step))
    # ... by its calls' tokens, not the batch's: two 32-token prefills, one a micro-batch, take 32's factor
    prefill = [batch([32, 32])]
    assert scaled.step_time(0.0, prefill) == pytest.approx(bare.step_time(0.0, prefill))
    # A workload's concurrency below max_num_seqs, or split over attention workers, sets the batch.
    many = Deployment(False, 1, 1, 2, 1, 2, "shm", max_num_seqs=128)
    sim_many = Simulator(perf, SimModel.from_profile(p), many)
    sim_many.run(Workload(num_prompts=16, input_len=1, output_len=2, max_concurrency=16))
    assert sim_many.slow == pytest.approx(2.0)
    two = Deployment(False, 2, 1, 2, 1, 4, "shm", max_num_seqs=64)
    sim_two = Simulator(perf, SimModel.from_profile(p), two)
    sim_two.run(Workload(num_prompts=64, input_len=1, output_len=2, max_concurrency=64))  # 32 each: 16 a call
    assert sim_two.slow == pytest.approx(4 / 3)
    # colocated and pools at m = 1 (one computing at a time), and a host of its own: none
    assert served_slowdown(perf, Deployment(True, cores=2, max_num_seqs=16)) == 1.0
    assert served_slowdown(perf, pools(16, m=1)) == 1.0
    assert served_slowdown(perf, Deployment(False, 1, 1, 2, 1, None, "shm", max_num_seqs=16)) == 1.0


def test_colocated_decode_steps_take_the_native_decode_saving():
    """A colocated decode-only step is shorter by what the profile measured the native decode step
    to save at its tokens; a step with a prefilling sequence is not, nor are the pools' steps."""
    p = profile(a=1.0, e=2.0, h=0.5, s=0.25, c=0.1, layers=4)
    plain, pools = sim(p, colocated=True), sim(p)
    p["fits"]["1"]["native_decode"] = fit(("tokens", "const"), (0.01 * MS, 0.5 * MS))
    saved = sim(p, colocated=True)
    decode, mixed = [batch([1, 1])], [batch([3, 1])]
    assert plain.step_time(0.0, decode) - saved.step_time(0.0, decode) == pytest.approx((0.5 + 2 * 0.01) * MS)
    assert saved.step_time(0.0, mixed) == pytest.approx(plain.step_time(0.0, mixed))
    assert sim(p).step_time(0.0, decode) == pytest.approx(pools.step_time(0.0, decode))


def test_colocated_steps_take_the_whole_step_fit():
    """Where the profile measured whole colocated steps (its "colocated" fit), a colocated step
    takes that fit at its tokens, context reads, prompt tokens and expected active experts, plus the
    step overhead, in place of its parts and the native decode saving; the pools' steps keep theirs."""
    p = profile(a=1.0, e=2.0, h=0.5, s=0.25, c=0.1, layers=4)
    pools = sim(p).step_time(0.0, [batch([1, 1])])
    p["fits"]["1"]["native_decode"] = fit(("tokens", "const"), (0.01 * MS, 0.5 * MS))
    p["fits"]["1"]["colocated"] = fit(("tokens", "const", "kv_reads", "prefill_tokens", "kv_prefill", "active"),
                                      (0.1 * MS, 3.0 * MS, 0.0, 0.05 * MS, 0.0, 0.2 * MS))
    decode, mixed = [batch([1, 1])], [batch([3, 1])]
    # 2 tokens reach 1 - (6/8)^2 of 8 experts (top-2) on average: 3.5 active
    assert sim(p, colocated=True).step_time(0.0, decode) == pytest.approx((0.25 + 0.2 + 3.0 + 0.2 * 3.5) * MS)
    active = 8 * (1 - (6 / 8) ** 4)
    assert sim(p, colocated=True).step_time(0.0, mixed) == pytest.approx(
        (0.25 + 0.4 + 3.0 + 0.05 * 3 + 0.2 * active) * MS)
    assert sim(p).step_time(0.0, decode) == pytest.approx(pools)


def _bench_planner():
    """bench/planner.py as a module (bench/ is a directory of scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_planner", Path(__file__).resolve().parents[1] / "bench" / "planner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_planner_results_replay_to_their_predictions(capsys):
    """bench/results/planner.json holds predictions of the simulator as it is: replayed from the
    profiles the file keeps, every row's predicted throughput, TPOT and TTFT (first profile) and
    throughput and TPOT (fresh profiles; with --rounds, each round's) come out as stored. A change
    to the simulator or to the profile's calibration fails here until the file is made again
    (`make bench-planner`: `python bench/planner.py --quick --rounds 12`, ~61 minutes). A sample,
    as the whole replay took 70 s of the suite: every other row (both models, colocated and pools,
    m = 1 to 3, the picks) and the first profile and one of the rounds'."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bench_planner = _bench_planner()
    stored = json.loads((root / "bench" / "results" / "planner.json").read_text())["rows"]
    picked = set(range(0, len(stored), 2))
    rows = bench_planner.replay(root / "bench" / "results" / "planner.json", picked, only_rounds=1)
    capsys.readouterr()
    stored = [r for i, r in enumerate(stored) if i in picked]
    assert len(rows) == len(stored) >= 7
    for new, old in zip(rows, stored):
        name = f"{new['model']} {new['deployment']}"
        assert new["pred_tok_s"] == pytest.approx(old["pred_tok_s"], rel=1e-6), name
        assert new["pred_tpot_ms"] == pytest.approx(old["pred_tpot_ms"], rel=1e-6), name
        assert new["pred_ttft_ms"] == pytest.approx(old["pred_ttft_ms"], rel=1e-6), name
        if "fresh_profile" in old:
            assert new["tok_s_err_fresh"] == pytest.approx(old["tok_s_err_fresh"], rel=1e-6, abs=1e-9), name
            assert new["tpot_err_fresh"] == pytest.approx(old["tpot_err_fresh"], rel=1e-6, abs=1e-9), name
        if "tok_s_err_rounds" in old:
            assert new["pred_round_tok_s"] == pytest.approx(old["pred_round_tok_s"][:2], rel=1e-6), name


def test_committed_speculative_planner_results_replay_to_their_predictions(capsys):
    """bench/results/planner_mtp_zen5_quick.json (`bench/planner.py --speculative --quick`): its plain and
    MTP rows, replayed from the stored profile with the speculation model as it is, come out as stored,
    and the speculative rows were predicted at the profile's acceptance."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "results" / "planner_mtp_zen5_quick.json"
    stored = json.loads(path.read_text())["rows"]
    rows = _bench_planner().replay(path)
    capsys.readouterr()
    assert len(rows) == len(stored) and sum("mtp" in r["deployment"] for r in rows) >= 2
    for new, old in zip(rows, stored):
        assert new["pred_tok_s"] == pytest.approx(old["pred_tok_s"], rel=1e-6), new["deployment"]
        assert new["pred_tpot_ms"] == pytest.approx(old["pred_tpot_ms"], rel=1e-6), new["deployment"]
        if "mtp" in old["deployment"]:
            assert len(old["pred_acceptance"]) == len(old["meas_acceptance"]) == len(old["profile_acceptance"]) == 2


def test_the_plans_pick_is_paired_against_the_best_row_in_alternating_runs(monkeypatch):
    """bench/planner.py judges the pick in alternating runs, A B, B A, ..., each on a server of its own
    started for it (only one deployment on the host at a time): the median of the rounds' ratios,
    which a drift over the rounds does not move; a run with failed or missing requests raises."""
    import contextlib
    from pathlib import Path
    from types import SimpleNamespace

    bp = _bench_planner()
    live, log = [], []

    @contextlib.contextmanager
    def server(ckpt, flags, batch, args):
        assert not live, "two servers on the host at once"
        live.append(flags[0])
        try:
            yield SimpleNamespace(url=f"http://{flags[0]}")
        finally:
            live.pop()

    drift = iter(range(100))

    def run_bench(argv):
        who = argv[argv.index("--base-url") + 1].removeprefix("http://")
        log.append(who)
        n = int(argv[argv.index("--num-prompts") + 1])
        speed = {"A": 110.0, "B": 100.0}[who] * (1 + 0.05 * next(drift))  # the host speeds up run by run
        return {"output_throughput": speed, "completed": n, "failed": 0}
    monkeypatch.setattr(bp, "_server", server)
    monkeypatch.setattr(bp, "run_bench", run_bench)
    args = SimpleNamespace(repeats=4, rounds=1, min_prompts=16, input_len=8, output_len=4)
    out = bp.paired(Path("ckpt"), (["A"], 64), (["B"], 256), args)
    assert log == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert len(out["a_tok_s"]) == len(out["b_tok_s"]) == 4
    assert out["ratio"] == pytest.approx(1.1, rel=0.03)  # 1.1 apart whatever the drift, within a round's step
    assert bp.paired_ratio([100, 200, 300], [100, 190, 310]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bp.paired_ratio([1, 2], [1])

    def failing(argv):
        return {"output_throughput": 1.0, "completed": 3, "failed": 1}
    monkeypatch.setattr(bp, "run_bench", failing)
    with pytest.raises(RuntimeError, match="3 of 256 requests completed, 1 failed"):
        bp.paired(Path("ckpt"), (["A"], 64), (["B"], 64), args)


def test_rounds_measure_every_deployment_in_alternating_order_each_after_a_profile(monkeypatch):
    """bench/planner.py --rounds R: every round profiles each shape again (the first takes the first
    profile), then measures each deployment once, forward in even rounds and backward in odd ones;
    a row's measurement is the median over the rounds and its *_rounds error the median of the
    rounds' predictions against it, so a drift of the host over the run moves both sides alike."""
    from types import SimpleNamespace

    bp = _bench_planner()
    log, speed = [], iter(range(100))
    states = {"s": {"ckpt": "ckpt", "profile": {"speed": 1.0}, "plan": {}, "round_profiles": [],
                    "deployments": {"A": (["A"], 64), "B": (["B"], 64), "C": (["C"], 64)}}}

    def measure(ckpt, flags, batch, args, seed=0):
        drift = 1 + 0.1 * next(speed)  # the host speeds up run by run
        log.append(("run", flags[0], seed))
        tok = {"A": 100.0, "B": 200.0, "C": 300.0}[flags[0]] * drift
        return {"output_throughput": tok, "mean_tpot_ms": 1000 / tok, "mean_ttft_ms": 1.0, "completed": 4,
                "total_input_tokens": 32, "repeat_tok_s": [tok], "repeat_tpot_ms": [1000 / tok],
                "repeat_failed": [0], "load_average": 1.0, "cpu_s_per_token": {"front": 1e-4}}

    def profile_again(st, args):
        log.append(("profile",))
        return {"speed": 1 + 0.1 * (len([e for e in log if e[0] == "run"]))}  # profiled as fast as the host is

    def predict(profile, dep, wl, output_len, flags=()):
        tok = {"A": 100.0, "B": 200.0, "C": 300.0}[dep] * profile["speed"]
        return {"output_throughput": tok, "mean_tpot_ms": 1000 / tok, "mean_ttft_ms": 1.0, "attention_busy": 0.5,
                "expert_busy": None}
    monkeypatch.setattr(bp, "measure", measure)
    monkeypatch.setattr(bp, "profile_again", profile_again)
    monkeypatch.setattr(bp, "predict", predict)

    class Dep(str):
        oversubscribed = False
    monkeypatch.setattr(bp, "deployment_of", lambda st, d: Dep(d))
    args = SimpleNamespace(rounds=3, repeats=1, output_len=4, fresh_profile=False)
    rows = bp.measure_shapes(states, args)
    assert [e[1] if e[0] == "run" else "P" for e in log] == ["A", "B", "C", "P", "C", "B", "A", "P", "A", "B", "C"]
    assert [e[2] for e in log if e[0] == "run"][::3] == [0, 1, 2]  # each round draws other prompts
    assert len(states["s"]["round_profiles"]) == 3 and states["s"]["round_profiles"][0] is states["s"]["profile"]
    by = {r["deployment"]: r for r in rows}
    assert by["B"]["meas_round_tok_s"] == pytest.approx([220.0, 280.0, 340.0])
    assert by["B"]["meas_tok_s"] == pytest.approx(280.0)
    assert by["B"]["tok_s_err"] == pytest.approx(200 / 280 - 1)  # the first profile: the host's drift in the error
    assert by["B"]["pred_round_tok_s"] == pytest.approx([200.0, 260.0, 320.0])
    assert by["B"]["tok_s_err_rounds"] == pytest.approx(260 / 280 - 1)  # the rounds' profiles drift with the runs
    assert by["B"]["pred_rounds_tpot_ms"] == pytest.approx(1000 / by["B"]["pred_rounds_tok_s"])
    # the noise of both medians over the rounds, and what it allows a model without bias
    from bench.common import median_noise, within_by_noise
    noise = np.hypot(median_noise([220.0, 280.0, 340.0]), median_noise([200.0, 260.0, 320.0]))
    assert by["B"]["noise_sd_rounds"] == pytest.approx(noise) and noise > 0
    assert by["B"]["p_within_10pct_rounds"] == pytest.approx(within_by_noise(noise, 0.10))
    summary = bp.summarize(rows, {})
    assert summary["expected_within_10pct_by_noise"] == pytest.approx(sum(r["p_within_10pct_rounds"] for r in rows))
    assert summary["p_all_within_10pct_by_noise"] == pytest.approx(np.prod([r["p_within_10pct_rounds"] for r in rows]))


def test_the_noise_of_a_median_and_what_it_allows_a_model_without_bias():
    """bench.common.median_noise: the bootstrap standard deviation of log(median); within_by_noise:
    the chance that a log-normal error of that deviation stays inside the band (asymmetric in log)."""
    from statistics import NormalDist

    from bench.common import median_noise, within_by_noise
    assert median_noise([5.0] * 6) == pytest.approx(0.0, abs=1e-12) and median_noise([5.0]) == 0.0
    # two values 1 and e^0.2: the median of two draws is 0, 0.1 or 0.2 in log with 1/4, 1/2, 1/4
    assert median_noise([1.0, float(np.exp(0.2))]) == pytest.approx(np.sqrt(0.005), rel=0.03)
    sd = 0.05
    want = NormalDist(0, sd).cdf(np.log(1.1)) - NormalDist(0, sd).cdf(np.log(0.9))
    assert within_by_noise(sd, 0.10) == pytest.approx(want)
    assert within_by_noise(0.0, 0.10) == 1.0 and within_by_noise(1.0, 0.10) < 0.1


@pytest.mark.parametrize("argv", [["--rounds", "2", "--fresh-profile"], ["--rounds", "2", "--fresh-front"],
                                  ["--rounds", "0"]])
def test_rounds_refuse_fresh_profiles_and_nonpositive_counts(monkeypatch, capsys, argv):
    """--rounds profiles everything every round: --fresh-profile / --fresh-front (a profile after each
    row's one measurement) with it, or a count under 1, is a usage error (exit code 2) before
    anything is built or measured."""
    bp = _bench_planner()
    monkeypatch.setattr(bp, "setup_shape", lambda *a: pytest.fail("measured despite the usage error"))
    monkeypatch.setattr(sys, "argv", ["planner.py", "--quick", *argv])
    with pytest.raises(SystemExit) as e:
        bp.main()
    assert e.value.code == 2
    assert "--rounds" in capsys.readouterr().err


def spec_profile(pass_ms=1.0, row_ms=0.0) -> dict:
    p = profile(a=1.0, e=2.0, layers=4)  # every colocated step: 4 x (1 + 2) = 12 ms
    p["fits"]["1"]["mtp"] = fit(("rows", "passes", "prefill_tokens"), (row_ms * MS, pass_ms * MS, 0.0))
    p["mtp_acceptance"] = [0.5, 0.25]
    return p


def test_speculation_emits_accepted_drafts_and_pays_the_mtp_passes():
    """One request, k = 2, every draft accepted: the prompt's step emits 1 token, then each verify step
    3 (7 tokens in 3 steps, against 7 plain ones); after the first two steps the MTP layer runs a pass
    over the kept rows and a chained one (2 passes x 1 ms); after the last, the sequence is done: none."""
    from planner.simulate import Speculation

    p, wl = spec_profile(), Workload(num_prompts=1, input_len=8, output_len=7)
    plain = sim(p, colocated=True).run(wl)
    s = Simulator(ProfilePerf(p), SimModel.from_profile(p), Deployment(colocated=True),
                  spec=Speculation(2, (1.0, 1.0), disable_by_batch_size=8))
    r = s.run(wl)
    assert plain["steps"] == 7 and plain["duration"] == pytest.approx(84 * MS)
    assert r["steps"] == 3 and r["total_output_tokens"] == 7
    assert r["spec_decode_per_position_acceptance_rates"] == [1.0, 1.0]  # (vLLM's: accepted / draft sets)
    assert r["duration"] == pytest.approx((3 * 12 + 2 * 2) * MS)
    # none accepted: every step emits one token and still pays for drafting
    r0 = Simulator(ProfilePerf(p), SimModel.from_profile(p), Deployment(colocated=True),
                   spec=Speculation(2, (0.0, 0.0), disable_by_batch_size=8)).run(wl)
    assert r0["steps"] == 7 and r0["duration"] > plain["duration"]


def test_speculation_draws_acceptance_per_position_and_switches_off_above_its_batch_size():
    from planner.simulate import Speculation

    p = spec_profile(pass_ms=0.0)
    wl = Workload(num_prompts=1, input_len=8, output_len=241)
    spec = Speculation(2, (0.9, 0.5), disable_by_batch_size=8)
    r = Simulator(ProfilePerf(p), SimModel.from_profile(p), Deployment(colocated=True), spec=spec).run(wl)
    # 240 tokens after the prompt's at 2.4 a verify step (whole rejections, which back off, are rare)
    assert spec.mean_accept_len() == pytest.approx(2.4)
    assert 240 / 2.4 * 0.9 < r["steps"] - 1 < 240 / 2.4 * 1.1
    # 16 running > disable_by_batch_size 8: no drafts, the plain run's steps
    wl16 = Workload(num_prompts=16, input_len=8, output_len=20)
    on = Simulator(ProfilePerf(p), SimModel.from_profile(p), Deployment(colocated=True),
                   spec=Speculation(2, (1.0, 1.0), disable_by_batch_size=8)).run(wl16)
    assert on["steps"] == sim(p, colocated=True).run(wl16)["steps"] == 20
    with pytest.raises(ValueError, match="non-increasing"):
        Speculation(2, (0.3, 0.6), 8)
    with pytest.raises(ValueError, match="each of the 3 draft positions"):
        Speculation(3, (0.3, 0.2), 8)


def test_verification_rows_are_decode_rows_and_every_one_is_sampled():
    from planner.simulate import Speculation

    p = spec_profile()
    s = Simulator(ProfilePerf(p), SimModel.from_profile(p), Deployment(colocated=True),
                  spec=Speculation(2, (1.0, 0.5), disable_by_batch_size=8))
    seq = Sequence("0", 0, [1] * 9, 8, SamplingParams(), 16, 0)
    seq.num_computed_tokens = 8
    seq.token_ids += [1, 1]
    seq.num_draft_tokens = 2
    s._accept[id(seq)] = 1
    tok, kv, rows, out, seqs, ptok, pkv, prompt, verify = s._shape([ScheduledBatch([seq], [3], [True])])
    assert tok[0, 0] == 3 and rows[0, 0] == 3 and out[0, 0] == 2 and ptok[0, 0] == 0 and pkv[0, 0] == 0
    assert prompt[0] == 0 and verify[0] == 3


def test_speculating_deployments_take_the_speculative_front_scale():
    """front_scale: a deployment that speculates at every step (at most disable_by_batch_size sequences)
    takes its plain factor times its kind's speculating run's over the plain factor at that run's batch
    (alone: the speculating run's); a bigger batch, a plain deployment, or a profile without such runs
    takes the plain one."""
    from planner.factors import front_scale
    from planner.simulate import Speculation

    spec = Speculation(2, (0.5, 0.25), disable_by_batch_size=4)
    runs = [{"kind": "colocated", "threads": 2, "concurrency": 1, "scale": 0.4},
            {"kind": "colocated", "threads": 2, "concurrency": 64, "scale": 0.8},
            {"kind": "colocated", "threads": 2, "concurrency": 2, "scale": 1.5, "speculative": '{"method": "mtp"}'}]
    perf = SimpleNamespace(front_scales=runs)
    dep = Deployment(colocated=True, torch_threads=2, cores=2, max_num_seqs=4)
    at = {b: front_scale(perf, Deployment(colocated=True, torch_threads=2, cores=2, max_num_seqs=b)) for b in (2, 4)}
    assert front_scale(perf, dep, spec) == pytest.approx(at[4] * 1.5 / at[2])
    assert front_scale(SimpleNamespace(front_scales=runs[2:]), dep, spec) == pytest.approx(1.5)
    plain = front_scale(perf, dep)
    assert plain == front_scale(SimpleNamespace(front_scales=runs[:2]), dep, spec) and 0.4 < plain < 0.8
    big = Deployment(colocated=True, torch_threads=2, cores=2, max_num_seqs=16)
    assert front_scale(perf, big, spec) == front_scale(perf, big)


def test_verifying_steps_take_the_speculative_steps_fit():
    """A step that verifies drafts costs the profile's spec_step fit (sampling every verified row), one
    without drafts the plain step fit; profiles without spec_step keep the plain fit for both."""
    p = profile(s=0.25)
    plain = ProfilePerf(p)
    p["fits"]["1"]["spec_step"] = fit(("seqs", "const", "verify_rows"), (0.0, 0.25 * MS, 0.1 * MS))
    perf = ProfilePerf(p)
    got = perf.step(np.array([4.0, 4.0]), 1, verify_rows=np.array([0.0, 12.0]))
    assert got == pytest.approx([0.25 * MS, (0.25 + 1.2) * MS])
    assert plain.step(np.array([4.0]), 1, verify_rows=np.array([12.0])) == pytest.approx([0.25 * MS])


def test_short_prompts_are_decode_rows_where_the_profile_timed_them_so():
    """As ModelRunner.prompts_as_rows: where the profiled model has the native decode step and the profile
    timed prompt chunks both ways (its fits have `eager`), a step whose chunks read at most
    PROMPT_ROWS_KEY_READS keys computes them as decode rows (no prefill features, not eager), a longer one
    as chunks; the step's own prompt tokens (admitting them) count either way. Older profiles: chunks."""
    from attention_nodes.model_runner import PROMPT_ROWS_KEY_READS

    p = profile(a=1.0, layers=2)
    p["fits"]["1"]["attention"] = fit(("tokens", "const", "prefill_tokens", "eager", "mixed"), (0.0, MS, MS, MS, MS))
    old = sim(profile(a=1.0, layers=2))
    p["fits"]["1"]["native_decode"] = fit(("tokens", "const"), (0.0, 0.0))
    new = sim(p)
    n = 1
    while n * (n + 1) // 2 <= PROMPT_ROWS_KEY_READS:
        n += 1
    short, long = batch([n - 1, 1]), batch([n, 1])
    for s, b, chunks in ((new, short, False), (new, long, True), (old, short, True)):
        tok, kv, rows, out, seqs, ptok, pkv, prompt, _ = s._shape([b])
        assert prompt[0] == b.num_new_tokens[0] and tok[0, 0] == b.num_new_tokens[0] + 1
        assert ptok[0, 0] == (b.num_new_tokens[0] if chunks else 0)
    # a step of chunks pays eager and mixed (1 ms each) and its prefill tokens (1 ms each) on every layer
    assert new.step_time(0.0, [long]) - new.step_time(0.0, [short]) == pytest.approx(2 * (2 + n) * MS)


def test_drafts_stop_at_the_end_of_a_sequences_blocks_and_near_max_tokens():
    """As ModelRunner.mtp_draft: a chain stops at the end of the sequence's last block (a sequence whose
    cached positions fill its blocks gets one draft); max_tokens cuts it too."""
    from planner.simulate import Speculation

    p = spec_profile()
    s = Simulator(ProfilePerf(p), SimModel.from_profile(p), Deployment(colocated=True),
                  spec=Speculation(3, (1.0, 1.0, 1.0), disable_by_batch_size=8))
    seq = Sequence("0", 0, [1] * 17, 16, SamplingParams(), 64, 0)
    seq.block_table = [0]
    assert s._room(seq, 1, 16) == 1 and s._room(seq, 1, 14) == 3 and s._room(seq, 62, 10) == 1
    seq.block_table = [0, 1]
    assert s._room(seq, 1, 16) == 3


def test_simulate_command_models_speculative_mtp(tmp_path, capsys):
    from server.cli import main

    prof, out = tmp_path / "p.json", tmp_path / "r.json"
    prof.write_text(json.dumps(spec_profile()))
    base = ["simulate", "--profile", str(prof), "--colocated", "--num-prompts", "2", "--input-len", "8",
            "--output-len", "16", "--json", str(out)]
    assert main(base + ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']) == 0
    r = json.loads(out.read_text())
    assert r["speculative"]["acceptance"] == [0.5, 0.25] and r["speculative"]["mean_accept_len"] == 1.75
    assert main(base + ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
                        "--spec-acceptance", "0.9"]) == 0
    assert json.loads(out.read_text())["speculative"]["acceptance"] == [0.9]
    capsys.readouterr()
    assert main(base + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']) == 2
    assert "models speculative method mtp" in capsys.readouterr().err
    assert main(base + ["--spec-acceptance", "0.5"]) == 2
    assert "--spec-acceptance needs --speculative-config" in capsys.readouterr().err
    no_mtp = tmp_path / "q.json"
    no_mtp.write_text(json.dumps(profile()))
    assert main(["simulate", "--profile", str(no_mtp), "--colocated", "--speculative-config",
                 '{"method": "mtp", "num_speculative_tokens": 1}']) == 2
    assert "no MTP drafting samples" in capsys.readouterr().err
    assert main(["simulate", "--plan", str(no_mtp), "--speculative-config",
                 '{"method": "mtp", "num_speculative_tokens": 1}']) == 2
    assert "--speculative-config needs --profile" in capsys.readouterr().err
