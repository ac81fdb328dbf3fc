"""M2N dispatch + combine latency and throughput, against torch.distributed send/recv on gloo and a
bare blocking-socket ping-pong of the same bytes.

    python bench/m2n.py [--quick] [--repeats 3] [--mn 1 --mn 2] [--kinds shm,tcp,nixl,gloo,socket] [--spin-s 0.001]
    python bench/m2n.py --quick --repeats 2 --kinds shm,tcp,nixl,gloo,socket,ep-shm,ep-tcp   # about 5 minutes

M senders (attention workers) and N receivers (expert workers), M = N in {1, 2} (default), each a spawned
process on this host. One round: every sender dispatches a payload to every receiver through
M2NSender.dispatch (tokens of hidden 2048 in bfloat16, 4 KiB each, routed to one expert on each
receiver, so each (sender, receiver) pair carries the payload plus 8 bytes of routing per token);
each receiver gathers all senders' chunks (M2NReceiver.recv) and replies with the same rows
(reply); each sender's combine waits for all replies. gloo runs the same traffic with isend/irecv
of the same bytes (the payload plus routing, as one uint8 tensor per pair and direction); "socket" sends the same
bytes over one blocking TCP_NODELAY socket per pair (sendall, then recv_into a preallocated buffer):
the floor a Python process reaches on this kernel. "ep-tcp" / "ep-shm" / "ep-nixl" are the same
ping-pong on a bare endpoint (send, recv, release: the transport alone, no M2N dispatch/combine),
which splits an M2N round into the transport's share and the M2N layer's. "nixl" is the nixl backend with UCX over shared
memory (UCX_TLS=sm,self), "nixl-tcp" the same over UCX's tcp transport (UCX_NET_DEVICES=lo). For
tcp, sender 0's endpoint counts where its time went (TcpEndpoint.phases: building frames, sendmsg, recv_into, header parsing, blocked in
poll), reported per round next to the round time.
Waiting: the M2N endpoints poll for --spin-s, then block (spin_policy "fixed", the default); a kind
with ":adaptive" (shm:adaptive, tcp:adaptive) stops spinning at the first contended sched_yield, so both
policies can be measured side by side under the same load. "tcp:eager-release" is tcp with every
credit (RELEASE) in its own sendmsg, as before credits rode with the next frame (an A/B of that cut).
A kind with ":fp8" (shm:fp8, tcp:fp8) dispatches the same tokens as float8 e4m3 with a bf16 scale per
token (--m2n-dtype fp8): 2 + 2/HIDDEN bytes go out for every 4 of bf16 (the answers stay bf16); the
payload column and GB/s count the bf16 bytes, `dispatch_bytes` in the JSON what fp8 sends. With an fp8
kind the bench also times the conversions alone in its own process (kernels/fp8.py's native loops on each
payload's rows: quantize, and dequantize into bf16; AVX2 and, where the CPU has it, AVX-512; one thread,
as each bench worker runs, and two): the share of an fp8 round that is not the transport.
Latency: sender 0's round time (median, p99). Throughput: bytes moved per second in both
directions by all pairs, from the median round. Payloads 4 KiB to 4 MiB per pair.
Writes bench/results/m2n.json (--quick: m2n_quick.json; --name NAME: NAME.json).
"""
import argparse
import multiprocessing as mp
import os
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
    return max(10, n // 4) if quick else n // 3  # per pass (--repeats passes, 3 by default)


def m2n_worker(role: str, rank: int, M: int, backend: str, port: int, sizes: list[int], quick: bool, out,
               spin_s: float = 1e-3) -> None:
    from torch.distributed import TCPStore

    from m2n_comm.endpoints import open_endpoint
    from m2n_comm.m2n import M2NReceiver, M2NSender, Placement
    from m2n_comm.transport import TransportConfig

    torch.set_num_threads(1)
    name = backend
    if backend.startswith("nixl"):  # read by UCX when the endpoint's agent starts
        os.environ.update(UCX_TLS=UCX_TLS[backend.partition(":")[0]], UCX_NET_DEVICES="lo")
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    backend, _, policy = backend.partition(":")
    fp8, policy = policy == "fp8", ("" if policy == "fp8" else policy)
    policy = eager_release(policy)
    cfg = TransportConfig(backend.split("-")[0], slot_bytes=max(sizes) // (2 * HIDDEN) * (2 * HIDDEN + 8 * M) + (1 << 16),
                          spin_s=spin_s, spin_policy=policy or "fixed")
    senders, receivers = [f"a{i}" for i in range(M)], [f"e{j}" for j in range(M)]
    me, peers = (f"a{rank}", receivers) if role == "a" else (f"e{rank}", senders)
    ep = open_endpoint(cfg, store, f"bench-{name.replace(':', '-')}-{M}", me, peers, 1)
    try:
        if role == "e":
            rx = M2NReceiver(ep, senders, [0], 1)
            for size in sizes:
                for _ in range(rounds_for(size, quick) + 5):
                    batch = rx.recv(0, 0)
                    rx.reply(batch, batch.x_RD)
            return
        from m2n_comm.m2n import FP8

        tx = M2NSender(ep, Placement.balanced(M, M), receivers, HIDDEN, top_k=M, wire_dtype=FP8 if fp8 else None)
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
                if i == 4:
                    before = dict(getattr(ep, "phases", {}))
            # fp8: e4m3 keeps 3 mantissa bits (a relative step of 1/8 at most)
            assert torch.allclose(y.float(), x.float() * M, rtol=0.13 if fp8 else 2e-2, atol=0.02 if fp8 else 1e-8), \
                "M2N returned wrong rows"
            if rank == 0:
                phases = {k: (v - before[k]) / len(times) for k, v in getattr(ep, "phases", {}).items()}
                out.put(("m2n-" + name, M, size, times, phases))
    finally:
        ep.close()


def eager_release(policy: str) -> str:
    """The ":eager-release" A/B switch (tcp: every RELEASE in its own sendmsg, as before credits rode
    with the next frame); returns the spin policy left to apply."""
    if policy != "eager-release":
        return policy
    from m2n_comm.tcp import TcpEndpoint

    TcpEndpoint.coalesce_releases = False
    return ""


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
                out.put(("gloo", M, size, times, {}))
    finally:
        dist.destroy_process_group()


def socket_worker(role: str, rank: int, M: int, port: int, sizes: list[int], quick: bool, out) -> None:
    """The floor: blocking sockets, one per (sender, receiver) pair, the same bytes as gloo."""
    import socket

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    socks = []
    if role == "e":
        srv = socket.create_server(("127.0.0.1", 0))
        store.set(f"sock-{M}-e{rank}", str(srv.getsockname()[1]))
        conns = {}
        for _ in range(M):
            c, _ = srv.accept()
            conns[int(c.recv(1)[0])] = c
        socks = [conns[j] for j in range(M)]
        srv.close()
    else:
        for j in range(M):
            c = socket.create_connection(("127.0.0.1", int(store.get(f"sock-{M}-e{j}"))))
            c.sendall(bytes([rank]))
            socks.append(c)
    for c in socks:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def recv_exact(c, view) -> None:
        got = 0
        while got < len(view):
            got += c.recv_into(view[got:])

    try:
        for size in sizes:
            nbytes = size // (2 * HIDDEN) * (2 * HIDDEN + 8 * M)
            payload = memoryview(bytearray(nbytes))
            bufs = [memoryview(bytearray(nbytes)) for _ in range(M)]
            times = []
            for i in range(rounds_for(size, quick) + 5):
                t0 = time.perf_counter()
                if role == "a":
                    for c in socks:
                        c.sendall(payload)
                    for c, b in zip(socks, bufs):
                        recv_exact(c, b)
                else:
                    for c, b in zip(socks, bufs):
                        recv_exact(c, b)
                    for c, b in zip(socks, bufs):
                        c.sendall(b)
                if i >= 5:
                    times.append(time.perf_counter() - t0)
            if role == "a" and rank == 0:
                out.put(("socket", M, size, times, {}))
    finally:
        for c in socks:
            c.close()


def ep_worker(role: str, rank: int, M: int, backend: str, port: int, sizes: list[int], quick: bool, out,
              spin_s: float = 1e-3) -> None:
    """The socket ping-pong's bytes on a bare M2N endpoint of `backend`: senders send one uint8
    tensor to every receiver, then receive and release every reply; receivers echo from the slot."""
    from torch.distributed import TCPStore

    from m2n_comm.endpoints import open_endpoint
    from m2n_comm.transport import KIND_DATA, MessageMeta, TransportConfig

    torch.set_num_threads(1)
    if backend.startswith("nixl"):
        os.environ.update(UCX_TLS=UCX_TLS[backend], UCX_NET_DEVICES="lo")
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    backend, _, policy = backend.partition(":")
    cfg = TransportConfig(backend.split("-")[0], slot_bytes=max(sizes) // (2 * HIDDEN) * (2 * HIDDEN + 8 * M) + (1 << 16),
                          spin_s=spin_s, spin_policy=eager_release(policy) or "fixed")
    senders, receivers = [f"a{i}" for i in range(M)], [f"e{j}" for j in range(M)]
    me, peers = (f"a{rank}", receivers) if role == "a" else (f"e{rank}", senders)
    ep = open_endpoint(cfg, store, f"bench-ep-{backend}-{policy}-{M}", me, peers, 1)
    meta = MessageMeta(KIND_DATA)
    try:
        for size in sizes:
            payload = torch.ones(size // (2 * HIDDEN) * (2 * HIDDEN + 8 * M), dtype=torch.uint8)
            times = []
            for i in range(rounds_for(size, quick) + 5):
                t0 = time.perf_counter()
                if role == "a":
                    for p in peers:
                        ep.send(p, 0, meta, [payload])
                    for p in peers:
                        got = ep.recv(p, 0).tensors[0]
                        assert got.numel() == payload.numel()
                        ep.release(p, 0)
                else:
                    for p in peers:
                        ep.send(p, 0, meta, ep.recv(p, 0).tensors)
                        ep.release(p, 0)
                if i >= 5:
                    times.append(time.perf_counter() - t0)
            if role == "a" and rank == 0:
                out.put((f"ep-{backend}{':' if policy else ''}{policy}", M, size, times, {}))
    finally:
        ep.close()


def run_group(kind: str, M: int, sizes: list[int], quick: bool, spin_s: float = 1e-3) -> list[tuple]:
    from torch.distributed import TCPStore

    ctx = mp.get_context("spawn")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = []
    for role in ("e", "a"):
        for r in range(M):
            if kind in ("gloo", "socket"):
                args = (role, r, M, store.port, sizes, quick, out)
                procs.append(ctx.Process(target=gloo_worker if kind == "gloo" else socket_worker, args=args))
            elif kind.startswith("ep-"):
                args = (role, r, M, kind[3:], store.port, sizes, quick, out, spin_s)
                procs.append(ctx.Process(target=ep_worker, args=args))
            else:
                args = (role, r, M, kind, store.port, sizes, quick, out, spin_s)
                procs.append(ctx.Process(target=m2n_worker, args=args))
    for p in procs:
        p.start()
    results = [out.get(timeout=900) for _ in sizes]
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"{kind} M={M}: a worker exited with {p.exitcode}")
    return results


UCX_TLS = {"nixl": "sm,self", "nixl-tcp": "tcp"}
BACKENDS = ("shm", "tcp", *UCX_TLS)
PHASE_COLS = {"pack_ns": "pack", "send_ns": "sendmsg", "recv_ns": "recv", "parse_ns": "parse", "block_ns": "blocked"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds; writes bench/results/m2n_quick.json")
    ap.add_argument("--mn", type=int, action="append", help="M = N to run (repeat; default 1, 2)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved passes over all kinds, rounds pooled")
    ap.add_argument("--spin-s", type=float, default=1e-3, help="TransportConfig.spin_s of the M2N endpoints")
    ap.add_argument("--name", default=None, help="results file bench/results/NAME.json (default m2n / m2n_quick)")
    ap.add_argument("--kinds", default="shm,tcp,nixl,gloo,socket",
                    help="comma-separated: shm, tcp, nixl, nixl-tcp, gloo, socket, ep-shm, ep-tcp, ep-nixl, ep-nixl-tcp; a backend with "
                         "':fp8' dispatches tokens as float8 (--m2n-dtype fp8); a backend with ':adaptive' "
                         "(e.g. shm:adaptive) stops spinning at the first contended yield; tcp:eager-release "
                         "(or ep-tcp:eager-release) sends each credit on its own, as before credits rode with the next frame")
    args = ap.parse_args()
    mns = args.mn or [1, 2]
    kinds = args.kinds.split(",")
    # Every kind runs `repeats` times, interleaved (shm, tcp, gloo, socket, shm, ...), and the rounds
    # of all passes are pooled: load from other processes drifts over minutes, and this spreads it
    # over every column instead of favouring whichever ran in a quiet moment.
    samples: dict[tuple, list[float]] = {}
    phases: dict[tuple, list[dict]] = {}
    for _ in range(args.repeats):
        for M in mns:
            for kind in kinds:
                for name, _, size, times, ph in run_group(kind, M, SIZES, args.quick, args.spin_s):
                    samples.setdefault((name, M, size), []).extend(times)
                    if ph:
                        phases.setdefault((name, M, size), []).append(ph)
    table = {}
    for (name, M, size), times in samples.items():
        ts = sorted(times)
        med, p99 = statistics.median(ts), ts[min(len(ts) - 1, int(0.99 * len(ts)))]
        T = size // (2 * HIDDEN)
        sent = T * (HIDDEN + 2) if name.endswith(":fp8") else size  # x per pair and direction
        table[(name, M, size)] = {"median_us": med * 1e6, "p99_us": p99 * 1e6,
                                  "gbps": 2 * M * M * size / med / 1e9, "rounds": len(ts), "dispatch_bytes": sent}
    phases = {k: {f: statistics.fmean(p[f] for p in v) for f in v[0]} for k, v in phases.items()}
    rows = [summary_row(table, M, size, kinds) for M in mns for size in SIZES]
    cols = ["M=N", "payload"] + [c for k in kinds if k in ("gloo", "socket") or k.startswith("ep-")
                                 for c in (f"{k} med us", f"{k} p99 us")]
    for b in (k for k in kinds if k.partition(":")[0] in BACKENDS):
        cols += [f"{b} med us", f"{b} p99 us", f"{b} GB/s"] + ([f"{b} med/gloo", f"{b} p99/gloo"] if "gloo" in kinds else [])
    if "tcp" in kinds and "socket" in kinds:
        cols.append("tcp med/socket")
    cols += [f"{k} med/socket" for k in kinds if k.startswith("ep-") and "socket" in kinds]
    if "nixl" in kinds and "shm" in kinds:
        cols.append("nixl med/shm")
    cols += [f"{k} med/{k.partition(':')[0]}" for k in kinds if ":" in k and k.partition(":")[0] in kinds]
    print_table(rows, cols)
    prow = []
    for (name, M, size), ph in phases.items():
        if name == "m2n-tcp":
            r = {"M=N": M, "payload": f"{size >> 10} KiB", "round us": table[(name, M, size)]["median_us"]}
            r.update({f"{c} us": ph[k] / 1e3 for k, c in PHASE_COLS.items()})
            r.update(sends=ph["sends"], recvs=ph["recvs"], blocks=ph["blocks"])
            prow.append(r)
    if prow:
        print("\ntcp endpoint of sender 0, per round (mean over rounds; the median round for reference):")
        print_table(prow, list(prow[0]))
    conversions = fp8_conversions() if any(k.endswith(":fp8") for k in kinds) else []
    if conversions:
        print("\nfp8 conversions alone, per payload (quantize the rows, dequantize them into bf16; median us):")
        print_table(conversions, list(conversions[0]))
    payload = {"args": vars(args), "load_average": os.getloadavg(), "rows": rows, "tcp_phases_per_round": prow,
               "fp8_conversions": conversions,
               "raw": [{"kind": k[0], "M": k[1], "size": k[2], **v} for k, v in table.items()]}
    name = args.name or ("m2n_quick" if args.quick else "m2n")
    print(f"wrote {save(name, payload)} (load average {os.getloadavg()})")


def fp8_conversions(calls: int = 20) -> list[dict]:
    """kernels/fp8.py's native quantize and dequantize on each payload's (T, HIDDEN) bf16 rows: median us of
    `calls` calls per width (AVX2, AVX-512 where it runs) and thread count (1, 2)."""
    from kernels import native

    if not native.available():
        return []
    widths = [False] + [True] * native.fp8_avx512()
    threads, rows = torch.get_num_threads(), []
    try:
        for size in SIZES:
            x = torch.randn(size // (2 * HIDDEN), HIDDEN, dtype=torch.bfloat16)
            row = {"payload": f"{size >> 10} KiB"}
            for avx512 in widths:
                for n in (1, 2):
                    torch.set_num_threads(n)
                    q, s = native.fp8_quantize(x, avx512)
                    name = f"{'avx512' if avx512 else 'avx2'} x{n}"
                    for op, fn in (("quantize", lambda: native.fp8_quantize(x, avx512)),
                                   ("dequantize", lambda: native.fp8_dequantize(q, s, avx512))):
                        ts = []
                        for _ in range(calls):
                            t0 = time.perf_counter()
                            fn()
                            ts.append(time.perf_counter() - t0)
                        row[f"{name} {op}"] = statistics.median(ts) * 1e6
            rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return rows


def summary_row(table: dict, M: int, size: int, kinds: list[str]) -> dict:
    row: dict = {"M=N": M, "payload": f"{size >> 10} KiB"}
    for k in ("gloo", "socket", *(k for k in kinds if k.startswith("ep-"))):  # (ep-* after the backends)
        if k in kinds:
            row[f"{k} med us"], row[f"{k} p99 us"] = table[(k, M, size)]["median_us"], table[(k, M, size)]["p99_us"]
    for b in (k for k in kinds if k.partition(":")[0] in BACKENDS):
        r = table[(f"m2n-{b}", M, size)]
        row[f"{b} med us"], row[f"{b} p99 us"], row[f"{b} GB/s"] = r["median_us"], r["p99_us"], r["gbps"]
        if "gloo" in kinds:
            row[f"{b} med/gloo"] = r["median_us"] / row["gloo med us"]
            row[f"{b} p99/gloo"] = r["p99_us"] / row["gloo p99 us"]
    if "tcp" in kinds and "socket" in kinds:
        row["tcp med/socket"] = row["tcp med us"] / row["socket med us"]
    if "nixl" in kinds and "shm" in kinds:
        row["nixl med/shm"] = row["nixl med us"] / row["shm med us"]
    for k in kinds:
        if k.startswith("ep-") and "socket" in kinds:
            row[f"{k} med/socket"] = row[f"{k} med us"] / row["socket med us"]
    for k in kinds:
        base = k.partition(":")[0]
        if ":" in k and base in kinds:
            row[f"{k} med/{base}"] = row[f"{k} med us"] / row[f"{base} med us"]
    return row


if __name__ == "__main__":
    main()
