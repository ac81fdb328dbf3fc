"""M2N dispatch + combine latency and throughput, against torch.distributed send/recv on gloo.

    python bench/m2n.py [--quick]

M senders (attention workers) and N receivers (expert workers), M = N in {1, 2, 4}, each a spawned
process on this host. One round: every sender dispatches a payload to every receiver through
M2NSender.dispatch (tokens of hidden 2048 in bfloat16, 4 KiB each, routed to one expert on each
receiver, so each (sender, receiver) pair carries the payload plus 8 bytes of routing per token);
each receiver gathers all senders' chunks (M2NReceiver.recv) and replies with the same rows
(reply); each sender's combine waits for all replies. gloo runs the same traffic with isend/irecv
of the same bytes (the payload plus routing, as one uint8 tensor per pair and direction).
Latency: sender 0's round time (median, p99). Throughput: bytes moved per second in both
directions by all pairs, from the median round. Payloads 4 KiB to 4 MiB per pair.
Writes bench/results/m2n.json.
"""
import argparse
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402

HIDDEN = 2048
SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def rounds_for(size: int, quick: bool) -> int:
    n = 400 if size <= 64 << 10 else 150 if size <= 1 << 20 else 40
    return max(10, n // 4) if quick else n


def m2n_worker(role: str, rank: int, M: int, backend: str, port: int, sizes: list[int], quick: bool, out) -> None:
    from torch.distributed import TCPStore

    from m2n_comm.m2n import M2NReceiver, M2NSender, Placement
    from m2n_comm.transport import TransportConfig, open_endpoint

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    cfg = TransportConfig(backend, slot_bytes=max(sizes) // (2 * HIDDEN) * (2 * HIDDEN + 8 * M) + (1 << 16))
    senders, receivers = [f"a{i}" for i in range(M)], [f"e{j}" for j in range(M)]
    me, peers = (f"a{rank}", receivers) if role == "a" else (f"e{rank}", senders)
    ep = open_endpoint(cfg, store, f"bench-{backend}-{M}", me, peers, 1)
    try:
        if role == "e":
            rx = M2NReceiver(ep, senders, [0], 1)
            for size in sizes:
                for _ in range(rounds_for(size, quick) + 5):
                    batch = rx.recv(0, 0)
                    rx.reply(batch, batch.x_RD)
            return
        tx = M2NSender(ep, Placement.balanced(M, M), receivers, HIDDEN, top_k=M)
        for size in sizes:
            T = size // (2 * HIDDEN)
            x = torch.randn(T, HIDDEN, dtype=torch.bfloat16)
            ids = torch.arange(M).repeat(T, 1)
            w = torch.ones(T, M)
            times = []
            for i in range(rounds_for(size, quick) + 5):
                t0 = time.perf_counter()
                tx.begin_step()
                y = tx.combine(tx.dispatch(0, None, x, ids, w, mb=0))
                tx.end_step()
                if i >= 5:
                    times.append(time.perf_counter() - t0)
            assert torch.allclose(y.float(), x.float() * M, rtol=2e-2), "M2N returned wrong rows"
            if rank == 0:
                out.put(("m2n-" + backend, M, size, times))
    finally:
        ep.close()


def gloo_worker(role: str, rank: int, M: int, port: int, sizes: list[int], quick: bool, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = 2 * M
    me = rank if role == "a" else M + rank
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gloo-{M}", store), rank=me, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        for size in sizes:
            T = size // (2 * HIDDEN)
            nbytes = T * (2 * HIDDEN + 8 * M)
            times = []
            for i in range(rounds_for(size, quick) + 5):
                t0 = time.perf_counter()
                if role == "a":
                    bufs = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(M)]
                    payload = torch.ones(nbytes, dtype=torch.uint8)
                    reqs = [dist.isend(payload, M + j) for j in range(M)]
                    reqs += [dist.irecv(bufs[j], M + j) for j in range(M)]
                else:
                    bufs = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(M)]
                    for r in [dist.irecv(bufs[j], j) for j in range(M)]:
                        r.wait()
                    reqs = [dist.isend(bufs[j], j) for j in range(M)]
                for r in reqs:
                    r.wait()
                if i >= 5:
                    times.append(time.perf_counter() - t0)
            if role == "a" and rank == 0:
                out.put(("gloo", M, size, times))
    finally:
        dist.destroy_process_group()


def run_group(kind: str, M: int, sizes: list[int], quick: bool) -> list[tuple]:
    from torch.distributed import TCPStore

    ctx = mp.get_context("spawn")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = []
    for role in ("e", "a"):
        for r in range(M):
            if kind == "gloo":
                args = (role, r, M, store.port, sizes, quick, out)
                procs.append(ctx.Process(target=gloo_worker, args=args))
            else:
                args = (role, r, M, kind, store.port, sizes, quick, out)
                procs.append(ctx.Process(target=m2n_worker, args=args))
    for p in procs:
        p.start()
    results = [out.get(timeout=900) for _ in sizes]
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"{kind} M={M}: a worker exited with {p.exitcode}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds, M = N in {1, 2}")
    ap.add_argument("--mn", type=int, action="append", help="M = N to run (repeat; default 1, 2, 4)")
    args = ap.parse_args()
    mns = args.mn or ([1, 2] if args.quick else [1, 2, 4])
    table = {}
    for M in mns:
        for kind in ("shm", "tcp", "gloo"):
            for name, _, size, times in run_group(kind, M, SIZES, args.quick):
                ts = sorted(times)
                med, p99 = statistics.median(ts), ts[min(len(ts) - 1, int(0.99 * len(ts)))]
                table[(name, M, size)] = {"median_us": med * 1e6, "p99_us": p99 * 1e6,
                                          "gbps": 2 * M * M * size / med / 1e9, "rounds": len(ts)}
    rows = []
    for M in mns:
        for size in SIZES:
            g = table[("gloo", M, size)]
            row = {"M=N": M, "payload": f"{size >> 10} KiB", "gloo med us": g["median_us"], "gloo p99 us": g["p99_us"]}
            for b in ("shm", "tcp"):
                r = table[(f"m2n-{b}", M, size)]
                row[f"{b} med us"], row[f"{b} p99 us"], row[f"{b} GB/s"] = r["median_us"], r["p99_us"], r["gbps"]
                row[f"{b} med cut"] = 1 - r["median_us"] / g["median_us"]
                row[f"{b} p99 cut"] = 1 - r["p99_us"] / g["p99_us"]
            rows.append(row)
    cols = ["M=N", "payload", "gloo med us", "gloo p99 us"]
    for b in ("shm", "tcp"):
        cols += [f"{b} med us", f"{b} p99 us", f"{b} GB/s", f"{b} med cut", f"{b} p99 cut"]
    print_table(rows, cols)
    if not args.quick:
        payload = {"rows": rows, "raw": [{"kind": k[0], "M": k[1], "size": k[2], **v} for k, v in table.items()]}
        print(f"wrote {save('m2n', payload)}")


if __name__ == "__main__":
    main()
