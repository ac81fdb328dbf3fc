"""First-run papercuts, tried as a new user would: each mistake is one line that says what to do,
early (before pools start or a model loads)."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _shuttle(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=timeout)


def test_serve_on_a_busy_port_fails_at_once():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = _shuttle("serve", "--port", str(port))
        elapsed = time.monotonic() - t0
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert errors == [f"shuttle serve: error: cannot listen on 127.0.0.1:{port}: already in use (pick another "
                      f"--port or stop what holds it)"], r.stderr
    assert "KV cache" not in r.stderr and "worker" not in r.stderr  # nothing was started or loaded
    assert elapsed < 30  # the interpreter and imports only (a second or two on a quiet machine)


def test_train_with_an_impossible_shape_fails_before_any_rank(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"line {i}"}) for i in range(4)))
    r = _shuttle("train", "--family", "mixtral", "--hidden-size", "96", "--num-heads", "32",
                 "--data", str(data), "--out", str(tmp_path / "run"), "--max-steps", "1", "--nproc-per-node", "2")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shuttle train: error:") and "head_dim (3)" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()  # no rank ran


@pytest.mark.slow
def test_pools_at_a_scripts_top_level_say_what_to_add(make_checkpoint, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        from server import LLM
        llm = LLM({str(make_checkpoint("qwen3_moe"))!r}, colocated=False, num_kv_blocks=16)
        print("pools started")
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=ENV, timeout=180)
    assert r.returncode != 0 and "pools started" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pools.supervision.WorkerFailedError:") and 'if __name__ == "__main__":' in last, r.stderr
    assert "bootstrapping phase" not in r.stderr  # multiprocessing's page per worker is gone
