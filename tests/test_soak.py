"""The short soak (`make soak` runs 30 minutes): a real `shuttle serve` under Poisson load above
its capacity, with clients that hang up and clients that send bad input, for SHUTTLE_SOAK_S
seconds (45 by default; with start-up and drain about 60 s), in bf16. bench/soak.py judges it: every response is a 200, a 400 for bad input or
a 503 queue_full; no KV block is held and no request runs at the end; no process's RSS grew by more
than 10% over the last two thirds of the run. Unit level: the --faults schedule, RSS series of
restarted workers, and each fault's window of the load's record."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import Run, rss_growth, served_dtype
from bench.soak_faults import fault_outcomes, fault_server_flags, parse_faults

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_soak_short(tmp_path):
    seconds = float(os.environ.get("SHUTTLE_SOAK_S", "45"))
    out = tmp_path / "soak.json"
    # bf16 as the checkpoint stores it: served in float32 (--dtype auto on this AVX2 CPU) the workers'
    # RSS still grew 5.6% (expert) and 11.2% (attention) over this short run's last two thirds, with
    # oneDNN's primitive cache capped (kernels/cpu_linear.py); whether that levels off is open (`make soak`).
    # Above capacity on any of our hosts: at most 2 requests decode at once (about 17 requests/s on
    # the 2-core AVX-512 EPYC, where 32 at once kept up with 30/s and nothing was ever refused) and
    # 4 may wait, so 30/s overflows the queue and queue_full is exercised.
    proc = subprocess.run([sys.executable, "bench/soak.py", "--duration-s", str(seconds), "--sample-s", "3",
                           "--rate", "30", "--max-num-seqs", "2", "--max-waiting", "4",
                           "--server-arg=--dtype=bfloat16", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True,
                          timeout=seconds + 400)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    verdict = result["verdict"]
    counts = result["counts"]
    assert verdict["unexpected"] == 0, result["unexpected_examples"]
    assert verdict["kv_blocks_in_use"] == 0 and verdict["running"] == 0, verdict
    assert verdict["max_rss_growth_pct"] <= 10, result["rss"]
    # The load did what it is for: requests completed, hung up, were refused as bad and as too many.
    assert all(counts.get(k, 0) > 0 for k in ("ok", "hung_up", "bad_input", "queue_full")), counts
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_fault_schedule():
    """every=S cycles through the four kinds from a third into the run while a fault and 30 s to
    recover fit; a straggler brings a second expert worker; a target must be a worker of its pool."""
    s = parse_faults("every=150", 1800)
    assert [(f.at_s, f.kind, f.worker) for f in s.faults] == [
        (600, "kill-expert", "e0"), (750, "kill-attention", "a0"), (900, "stop", "e0"), (1050, "straggler", "e1"),
        (1200, "kill-expert", "e0"), (1350, "kill-attention", "a0"), (1500, "stop", "e0"), (1650, "straggler", "e1")]
    assert fault_server_flags(s) == ["--max-worker-restarts", "11", "--expert-workers", "2"]
    s = parse_faults("every=20,start=10,kinds=stop@a0+kill-expert@e1,stop-s=1,straggler-s=5", 100)
    assert [(f.at_s, f.kind, f.worker) for f in s.faults] == [(10, "stop", "a0"), (30, "kill-expert", "e1"),
                                                              (50, "stop", "a0"), (70, "kill-expert", "e1")]
    assert s.stop_s == 1 and fault_server_flags(s) == ["--max-worker-restarts", "7"]
    assert parse_faults(None, 100) is None and parse_faults("none", 100) is None
    for bad in ("start=5", "every=10,kinds=kill-expert@a0", "every=10,kinds=nap", "every=10,foo=1", "every=0",
                "every=10,start=90"):
        with pytest.raises(ValueError, match="--faults"):
            parse_faults(bad, 100)


def test_rss_series_of_restarted_workers():
    """A process that lived through the run grows from the run's one third; one a fault ended or
    started from a third of its own life; only those alive at the end that lived a third of the run
    are judged."""
    mib = 2 ** 20
    samples = [{"t": t, "front": 100 * mib, "expert-e0": (100 + t) * mib if t < 50 else None,
                "expert-e0.2": (200 + t) * mib if t >= 55 else None, "expert-e0.3": None} for t in range(0, 151, 5)]
    samples[-1]["expert-e0.3"] = 300 * mib  # one sample: started just before the end
    g = rss_growth(samples, 150)
    assert g["front"]["growth_pct"] == 0 and g["front"]["growth_from_s"] == 50 and g["front"]["judged"]
    first, second = g["expert-e0"], g["expert-e0.2"]
    assert first["growth_from_s"] == 15 and first["rss_end_mib"] == 145 and not first["judged"]
    assert second["growth_from_s"] == 85 and second["rss_end_mib"] == 350 and second["judged"]
    assert not g["expert-e0.3"]["judged"]


def test_fault_windows():
    """Each fault's window runs to the next: restarts from the counters, the longest pause in the
    token flow, unexpected responses and greedy checks in it."""
    run = Run({"p": "ref"}, exact=True, start=0.0)
    run.token_times = [0.5, 1.0, 10.1, 13.5, 14.0, 20.1, 20.2, 25.0]
    run.unexpected = [(12.0, "unexpected:timeout")]
    run.greedy_checks = [(9.0, 12.0), (15.0, 16.0)]
    run.greedy_differed = [{"sent": 9.0, "finished": 12.0, "prompt": "p", "text": "x"}]
    records = [{"kind": "kill-attention", "worker": "a0", "_t0": 10.0, "_restarts": 0.0, "_recomputed": 0.0},
               {"kind": "straggler", "worker": "e1", "_t0": 20.0, "_restarts": 1.0, "_recomputed": 50.0}]
    final = ('shuttle_worker_restarts_total{model_name="m"} 1.0\n'
             'shuttle_recomputed_tokens_total{model_name="m"} 50.0\n')
    a, b = fault_outcomes(records, run, 30.0, final)
    assert (a["restarts"], a["recomputed_tokens"], a["first_token_s"], a["pause_s"], a["tokens_again_s"]) == \
        (1, 50, 0.1, 3.4, 3.5)
    assert (a["unexpected"], a["greedy_in_flight"], a["greedy_differed"]) == (1, 1, 1) and "_t0" not in a
    assert (b["restarts"], b["pause_s"], b["tokens_again_s"], b["unexpected"]) == (0, 4.8, 5.0, 0)


def test_served_dtype():
    assert served_dtype(["--dtype", "float32", "--dtype=bf16"], None, "") == "bfloat16"
    log = "dtype: this CPU has no native bfloat16 GEMMs, so --dtype auto serves the bfloat16 checkpoint in float32"
    assert served_dtype([], None, log) == "float32"
    assert served_dtype(["--dtype", "auto"], None, "") == "bfloat16"  # the built-in checkpoint's
