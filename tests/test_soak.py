"""The short soak (`make soak` runs 30 minutes): a real `shuttle serve` under Poisson load above
its capacity, with clients that hang up and clients that send bad input, for SHUTTLE_SOAK_S
seconds (90 by default; with start-up and drain about 2 minutes), in bf16. bench/soak.py judges it: every response is a 200, a 400 for bad input or
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
    seconds = float(os.environ.get("SHUTTLE_SOAK_S", "90"))
    out = tmp_path / "soak.json"
    # bf16 as the checkpoint stores it: served in float32 (--dtype auto on this AVX2 CPU) the workers'
    # RSS still grew 5.6% (expert) and 11.2% (attention) over this short run's last two thirds, with
    # oneDNN's primitive cache capped (kernels/cpu_linear.py); whether that levels off is open (`make soak`).
    proc = subprocess.run([sys.executable, "bench/soak.py", "--duration-s", str(seconds), "--sample-s", "3",
                           "--rate", "30", "--server-arg=--dtype=bfloat16", "--out", str(out)], cwd=ROOT,
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
