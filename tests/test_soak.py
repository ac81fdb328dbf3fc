"""The short soak (`make soak` runs 30 minutes): a real `shuttle serve` under Poisson load above
its capacity, with clients that hang up and clients that send bad input, for SHUTTLE_SOAK_S
seconds (60 by default; with start-up and drain about 90 s), in bf16. bench/soak.py judges it: every response is a 200, a 400 for bad input or
a 503 queue_full; no KV block is held and no request runs at the end; no process's RSS grew by more
than 10% over the last two thirds of the run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_soak_short(tmp_path):
    seconds = float(os.environ.get("SHUTTLE_SOAK_S", "60"))
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
