"""A slow expert worker: does EPLB move its load off it, and does that pay?

    python bench/straggler.py [--quick] [--redundant 8] [--throttle quota|stop] [--quota 0.25]

A random Mixtral-shaped checkpoint (float32, hidden 256, 4 layers, 8 experts of 2048, top-2,
vocabulary 2048; its router is random, so the experts' loads are about even) is served by two
deployments up at once, each 1 attention + 2 expert workers over shm with 1 torch thread per worker:
`static` (the contiguous placement, e0: experts 0-3, e1: 4-7) and `eplb` (--eplb with --redundant
copies per layer and an interval too long to matter here, so only a change of a worker's speed
re-places). Rounds of BATCH requests (PROMPT random tokens, NEW tokens each, EOS ignored) alternate
between the two, so drifting load from other jobs on the host hits both alike, in three phases:

  healthy    no fault (EPLB finds nothing to gain with even loads and equal speeds)
  throttled  expert worker e1 of both deployments slowed down: `quota` (default) moves it into a
             cpu cgroup allowed --quota of one CPU (cgroup v1 cpu.cfs_quota_us or v2 cpu.max, 10 ms
             periods; needs root), `stop` SIGSTOPs it --stop-s of every --cycle-s. Warm-up rounds
             run until the eplb deployment named e1 a straggler, lowered its speed and put a
             placement with copies in use (pools/stragglers.py, pools/eplb.py), then the timed rounds
  recovered  the throttling stopped: rounds until e1's speed is back (one doubling per RECOVER_S of
             no waiting; --recover-s shortens that wait for the bench), then the timed rounds

Per deployment and phase: the median tokens/s of the timed rounds, e1's share of the (token, expert)
pairs computed in them, e1's speed and the placement version in use at the end of the phase.
Writes bench/results/straggler.json.

A quota slows a worker in proportion to its work, so moving work off it pays. A stop/continue
cycle is an outage every cycle: a step that routes any token to the stopped worker waits for it to
run again however few tokens it got, so EPLB's shares lower its work but not the waits.
"""
import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pools.stragglers  # noqa: E402
from attention_nodes.config import CacheConfig, EngineConfig, ParallelConfig  # noqa: E402
from bench.common import print_table, save  # noqa: E402
from bench.eplb import decode, worker_pairs  # noqa: E402
from models.builtin import make_random_checkpoint  # noqa: E402
from pools.engine import PoolEngine  # noqa: E402

VOCAB = 2048


def checkpoint(out: Path) -> Path:
    from transformers import MixtralConfig

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=2048, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=512, bos_token_id=0, eos_token_id=0)
    return make_random_checkpoint(out, cfg, seed=0, dtype="float32", tokenizer_dir=None)


def start(ckpt: Path, eplb: bool, args: argparse.Namespace) -> PoolEngine:
    par = ParallelConfig(False, 1, 2, 1, "shm", torch_threads=1, eplb=eplb, eplb_interval=10 ** 6,
                         num_redundant_experts=args.redundant if eplb else 0)
    return PoolEngine(EngineConfig(str(ckpt), cache=CacheConfig(num_blocks=2048), parallel=par), {0})


def expert_pid(engine: PoolEngine, name: str) -> int:
    """The pid of the engine's (current) worker process `name`."""
    return next(p.pid for p in engine._procs if p.name == name and p.is_alive())


class Quota:
    """Processes moved into a cpu cgroup that allows them `share` of one CPU, until stopped (then
    they go back to the root group)."""

    PERIOD_US = 10_000

    def __init__(self, pids: list[int], share: float):
        self.pids, self.dir = pids, None
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        quota = max(1000, int(share * self.PERIOD_US))
        if (v1 / "cpu.cfs_quota_us").exists():
            self.root, self.dir = v1, v1 / f"shuttle-straggler-{os.getpid()}"
            self.dir.mkdir()
            (self.dir / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self.dir / "cpu.cfs_quota_us").write_text(str(quota))
        elif "cpu" in (v2 / "cgroup.controllers").read_text(errors="ignore").split():
            self.root, self.dir = v2, v2 / f"shuttle-straggler-{os.getpid()}"
            self.dir.mkdir()
            (self.dir / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
        else:
            raise SystemExit("no cpu cgroup to throttle with here: use --throttle stop")
        for pid in pids:
            (self.dir / "cgroup.procs").write_text(str(pid))

    def stop(self) -> None:
        for pid in self.pids:
            try:
                (self.root / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # it exited
        self.dir.rmdir()


class Throttle:
    """Stop and continue processes on a cycle, in a thread, until stopped (then they run)."""

    def __init__(self, pids: list[int], stop_s: float, cycle_s: float):
        self.pids, self.stop_s, self.cycle_s, self._done = pids, stop_s, cycle_s, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            for pid in self.pids:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(self.stop_s)
            for pid in self.pids:
                os.kill(pid, signal.SIGCONT)
            time.sleep(self.cycle_s - self.stop_s)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        for pid in self.pids:
            os.kill(pid, signal.SIGCONT)


def e1_speed(engine: PoolEngine) -> float:
    return engine.stragglers.speeds(["e1"])[0]


def settled(e: PoolEngine) -> bool:
    """EPLB acted on e1's slowness and is done: e1's speed lowered, no longer a straggler (or at the
    lowest speed), and the placement for that speed in use."""
    return (e1_speed(e) < 1 and ("e1" not in e.stragglers.flagged or e1_speed(e) == pools.stragglers.MIN_SPEED)
            and e.placements.pending is None and e.placements._speeds_used == e.placements.speeds())


def phase(engines: dict[str, PoolEngine], name: str, ready, args: argparse.Namespace, seed: int) -> list[dict]:
    """Warm-up rounds until ready(eplb engine) (at most --warmup-s), then timed rounds alternating."""
    t0, warmup_rounds = time.monotonic(), 0
    while not ready(engines["eplb"]) and time.monotonic() - t0 < args.warmup_s:
        for e in engines.values():
            decode(e, args.batch, args.prompt, args.new, seed=seed + warmup_rounds)
        warmup_rounds += 1
    became_ready = ready(engines["eplb"])
    waited = time.monotonic() - t0
    pairs0 = {k: worker_pairs(e) for k, e in engines.items()}
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.rounds):
        for k, e in engines.items():
            tokens, seconds = decode(e, args.batch, args.prompt, args.new, seed=seed + 1000 + r)
            rates[k].append(tokens / seconds)
    rows = []
    for k, e in engines.items():
        pairs = [a - b for a, b in zip(worker_pairs(e), pairs0[k])]
        rows.append({"phase": name, "deployment": k, "tok_s": statistics.median(rates[k]), "tok_s_rounds": rates[k],
                     "e1_share": pairs[1] / max(sum(pairs), 1), "pairs": pairs, "e1_speed": e1_speed(e),
                     "placement_version": e.placements.current.version, "warmup_rounds": warmup_rounds,
                     "warmup_s": round(waited, 1), "ready": became_ready})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller rounds, for a smoke run (no JSON)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--redundant", type=int, default=8, help="--num-redundant-experts of the eplb deployment")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per deployment and phase")
    ap.add_argument("--throttle", choices=("quota", "stop"), default="quota")
    ap.add_argument("--quota", type=float, default=0.1, help="--throttle quota: the share of one CPU e1 gets")
    ap.add_argument("--stop-s", type=float, default=0.2)
    ap.add_argument("--cycle-s", type=float, default=0.3)
    ap.add_argument("--warmup-s", type=float, default=240.0, help="longest warm-up of a phase")
    ap.add_argument("--recover-s", type=float, default=20.0, help="RECOVER_S for this run (the server's: 60)")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.new, args.rounds = 16, 16, 1
    pools.stragglers.RECOVER_S = args.recover_s  # the front is this process
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = checkpoint(Path(tmp) / "ckpt")
        engines = {"static": start(ckpt, False, args), "eplb": start(ckpt, True, args)}
        try:
            rows = phase(engines, "healthy", lambda e: True, args, seed=10_000)
            pids = [expert_pid(e, "e1") for e in engines.values()]
            throttle = Quota(pids, args.quota) if args.throttle == "quota" else Throttle(pids, args.stop_s, args.cycle_s)
            try:
                rows += phase(engines, "throttled", settled, args, seed=20_000)
            finally:
                throttle.stop()
            rows += phase(engines, "recovered", lambda e: e1_speed(e) == 1.0 and e.placements.pending is None,
                          args, seed=30_000)
        finally:
            for e in engines.values():
                e.shutdown()
    base = {r["phase"]: r["tok_s"] for r in rows if r["deployment"] == "static"}
    for r in rows:
        r["vs_static"] = r["tok_s"] / base[r["phase"]]
    print(f"decode, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens; 1 attention + 2 expert workers; "
          f"e1 {f'at {args.quota:g} of a CPU' if args.throttle == 'quota' else f'stopped {args.stop_s} s of every {args.cycle_s} s'}"
          f" while throttled; tok/s: median of {args.rounds} "
          f"alternating rounds")
    print_table(rows, ["phase", "deployment", "warmup_s", "ready", "placement_version", "e1_speed", "e1_share", "tok_s",
                       "vs_static"])
    if not args.quick:
        load = os.getloadavg()[0]
        print(f"load average {load:.1f} at the end (other jobs on this machine share its cores)")
        print(f"wrote {save('straggler', {'config': vars(args), 'rows': rows, 'load_average': load})}")


if __name__ == "__main__":
    main()
