"""M2N transfer time against bytes, measured with the real transport between two processes.

This process is the attention side (an M2NSender); a spawned process is one expert worker (an
M2NReceiver that replies with the rows it got). One round is dispatch + combine of T tokens of the
model's hidden size and dtype with top-k routing; one transfer is taken as half the median round
(both directions carry about the same bytes), after warm-up rounds. Both sides use one torch
thread, as the pools' workers do on a 2-core host.

A waiter polls for the transport's spin time (TransportConfig.spin_s) and then blocks; a message
that finds it blocked costs a wake-up on top. In the rounds above the answer comes back while the
sender still polls; in `wake_rounds` more, the expert side waits 3 spin times (busy) before it replies, so
the sender's wait has blocked: wake_s = median(those rounds) - the sleep - the polled round of the
same size (at least 0). The simulator adds wake_s to every wait longer than spin_s.
"""
import multiprocessing as mp
import statistics
import time

import torch

TOKENS = (1, 16, 64, 256, 1024)
WARMUP = 5
WAKE_TOKENS = 16  # the message size of the blocked rounds


def _rounds(quick: bool) -> int:
    return 15 if quick else 40


def _echo(backend: str, port: int, hidden: int, top_k: int, slot_bytes: int, total: int, delayed: int,
          delay_s: float) -> None:
    from torch.distributed import TCPStore

    from m2n_comm.endpoints import open_endpoint
    from m2n_comm.m2n import M2NReceiver
    from m2n_comm.transport import TransportConfig

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    ep = open_endpoint(TransportConfig(backend, slot_bytes=slot_bytes), store, "profile", "e0", ["a0"], 1)
    try:
        rx = M2NReceiver(ep, ["a0"], [0], 1)
        for i in range(total + delayed):
            batch = rx.recv(0, 0)
            if i >= total:  # let the sender's wait block; busy, so this side adds no wake-up of its own
                end = time.perf_counter() + delay_s
                while time.perf_counter() < end:
                    pass
            rx.reply(batch, batch.x_RD)
    finally:
        ep.close()


def measure_transfer(model: str, backend: str, dtype: torch.dtype, quick: bool = False) -> tuple[list[dict], dict]:
    """Samples {tokens, bytes, oneway_s} for the model's hidden size over `backend` (shm or tcp), and
    {"spin_s", "wake_s"}: how long a wait polls before it blocks, and what a blocked wait adds."""
    from torch.distributed import TCPStore

    from m2n_comm.endpoints import open_endpoint
    from m2n_comm.m2n import M2NSender, Placement, slot_bytes_for
    from m2n_comm.transport import TransportConfig
    from models.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model)
    D, K = cfg.hidden_size, cfg.top_k
    slot = slot_bytes_for(D, K, dtype, max(TOKENS))
    rounds = _rounds(quick)
    spin_s = TransportConfig(backend).spin_s
    delay_s, wake_rounds = 3 * spin_s, rounds
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_echo, args=(backend, store.port, D, K, slot, len(TOKENS) * (rounds + WARMUP),
                                           wake_rounds + WARMUP, delay_s), daemon=True)
    proc.start()
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    ep = open_endpoint(TransportConfig(backend, slot_bytes=slot), store, "profile", "a0", ["e0"], 1)
    elt = torch.empty((), dtype=dtype).element_size()
    samples = []
    try:
        tx = M2NSender(ep, Placement.balanced(cfg.num_experts, 1), ["e0"], D, K)
        for T in TOKENS:
            sends: list[float] = []
            times = _round_times(tx, T, D, K, dtype, rounds, sends)
            samples.append({"tokens": T, "bytes": T * (D * elt + 8 * K), "oneway_s": statistics.median(times) / 2,
                            "send_s": statistics.median(sends)})
        polled = next(2 * s["oneway_s"] for s in samples if s["tokens"] == WAKE_TOKENS)
        blocked = _round_times(tx, WAKE_TOKENS, D, K, dtype, wake_rounds)
        wake = {"spin_s": spin_s, "wake_s": max(statistics.median(blocked) - delay_s - polled, 0.0)}
    finally:
        ep.close()
        torch.set_num_threads(old)
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return samples, wake


def _round_times(tx, T: int, D: int, K: int, dtype: torch.dtype, rounds: int,
                 sends: list[float] | None = None) -> list[float]:
    """Wall times of `rounds` dispatch + combine rounds of T tokens, after WARMUP more; `sends` gets
    the time of each dispatch call (the sender's own work: packing and copying into the slot)."""
    x = torch.randn(T, D).to(dtype)
    ids = torch.arange(K).repeat(T, 1)
    w = torch.full((T, K), 1.0 / K)
    times = []
    for i in range(rounds + WARMUP):
        t0 = time.perf_counter()
        tx.begin_step()
        handle = tx.dispatch(0, None, x, ids, w, mb=0)
        t1 = time.perf_counter()
        tx.combine(handle)
        tx.end_step()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
            if sends is not None:
                sends.append(t1 - t0)
    return times
