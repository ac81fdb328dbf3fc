"""Failover against restart: how long the token flow stops when an expert worker is SIGKILLed under
streaming load, with copies of its experts on another expert worker (failover: the attention workers
route around it) and without (the restart path: kill, respawn, reload; the attention workers keep
their requests and caches, so only the step that broke is computed again).

    python bench/failover.py [--quick] [--rounds 2] [--requests 48 --concurrency 16]

One real `shuttle serve` (the built-in model unless --model; 1 attention + 2 expert workers) whose
placement gives e0 every expert and e1 experts 4-7: killing e1 is a failover, killing e0 a restart
(its experts 0-3 have no copy). Each round kills e1, waits until it is added back, then kills e0,
each time under load from the official `openai` client (streams, greedy, one seeded prompt). Per
fault: the first token after the kill, the longest pause in the token flow from the kill on, failed
requests (must be 0), tokens sent to be prefilled again (shuttle_recomputed_tokens_total: 0 on both
paths) and streams whose text differs from the reference run; a "no fault" row runs
the same load undisturbed first, since in bf16 (the built-in model) the batch composition alone can
change a greedy token (tests/test_supervision.py checks exact texts on a float32 checkpoint).
Prints a table and writes bench/results/failover.json. The machine's load moves these numbers a
lot: compare the rows of one run.
"""
import argparse
import json
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from clients.live_server import LiveServer  # noqa: E402

REPLICATED = {str(e): [0] if e < 4 else [0, 1] for e in range(8)}  # the built-in model has 8 experts


def metric(srv, name: str) -> float:
    for line in httpx.get(f"{srv.url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def placement_version(srv) -> float:
    return metric(srv, "shuttle_expert_placement_version")


def fault(srv, victim: str, sup, requests: int, concurrency: int) -> dict:
    recomputed = metric(srv, "shuttle_recomputed_tokens_total")
    out = sup.fault_under_load(srv, f"shuttle-expert-{victim}", signal.SIGKILL, requests, concurrency)
    results = out["results"].items()
    failed = sum(isinstance(r, Exception) for _, r in results)
    wrong = sorted({sup.PROMPTS[i % len(sup.PROMPTS)] for i, r in results
                    if not isinstance(r, Exception) and r != srv.reference[sup.PROMPTS[i % len(sup.PROMPTS)]]})
    return {"killed": victim, "path": "failover" if victim == "e1" else "restart",
            "first_token_s": round(out["first_after_s"], 3), "pause_s": round(out["pause_s"], 3),
            "requests": len(out["results"]), "failed": failed,
            "recomputed_tokens": int(metric(srv, "shuttle_recomputed_tokens_total") - recomputed),
            "wrong_text": sum(not isinstance(r, Exception) and sup.PROMPTS[i % len(sup.PROMPTS)] in wrong
                              and r != srv.reference[sup.PROMPTS[i % len(sup.PROMPTS)]] for i, r in results),
            "wrong_prompts": wrong}


def control(srv, sup, requests: int, concurrency: int) -> dict:
    """The same load with no fault: bf16 results may differ from the reference run with the batch
    composition alone (another GEMM blocking sums in another order), which this row shows."""
    prompts = [sup.PROMPTS[i % len(sup.PROMPTS)] for i in range(requests)]
    with ThreadPoolExecutor(concurrency) as pool:
        texts = list(pool.map(lambda q: sup.complete(srv, q), prompts))
    wrong = sorted({q for q, t in zip(prompts, texts) if t != srv.reference[q]})
    return {"killed": "-", "path": "no fault", "requests": requests, "failed": 0,
            "wrong_text": sum(t != srv.reference[q] for q, t in zip(prompts, texts)), "wrong_prompts": wrong}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory with 8 experts (default: the built-in model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="one round of 12 requests at concurrency 6")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.requests, args.concurrency = 1, 12, 6
    from bench import fault_load as sup

    placement = Path(tempfile.mkdtemp()) / "placement.json"
    placement.write_text(json.dumps(REPLICATED))
    flags = (["--model", args.model] if args.model else []) + [
        "--attention-workers", "1", "--expert-workers", "2", "--placement", str(placement),
        "--max-worker-restarts", str(2 * args.rounds + 1)]
    rows = []
    with LiveServer(flags) as srv:
        srv.model = json.loads(httpx.get(f"{srv.url}/v1/models").text)["data"][0]["id"]
        srv.client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)
        with ThreadPoolExecutor(len(sup.PROMPTS)) as pool:
            srv.reference = dict(zip(sup.PROMPTS, pool.map(lambda q: sup.complete(srv, q), sup.PROMPTS)))
        for r in range(args.rounds):
            rows.append({"round": r, **control(srv, sup, args.requests, args.concurrency)})
            version = placement_version(srv)
            rows.append({"round": r, **fault(srv, "e1", sup, args.requests, args.concurrency)})
            deadline = time.monotonic() + 120
            while placement_version(srv) < version + 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            rows[-1]["added_back"] = placement_version(srv) >= version + 2
            rows.append({"round": r, **fault(srv, "e0", sup, args.requests, args.concurrency)})
    print_table(rows, ["round", "killed", "path", "first_token_s", "pause_s", "requests", "failed", "recomputed_tokens",
                       "wrong_text"])
    path = save("failover", {"config": vars(args), "faults": rows})
    print(f"wrote {path}")
    ok = all(x["failed"] == 0 for x in rows) and all(
        x.get("added_back", True) for x in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
