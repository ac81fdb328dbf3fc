"""M2N dispatch/combine over real endpoints (threads of one process, each with its own endpoint):
token routing with a placement map (replicated experts), empty chunks, and handles combined out of
order while several micro-batches are in flight."""
import threading

import pytest
import torch
from torch.distributed import TCPStore

from m2n_comm.endpoints import open_endpoint
from m2n_comm.m2n import M2NReceiver, M2NSender, Placement
from m2n_comm.transport import TransportConfig

D, K, E = 16, 2, 5


def fake_expert_out(x_RD: torch.Tensor, global_ids_RK: torch.Tensor, weights_RK: torch.Tensor) -> torch.Tensor:
    """What the 'experts' compute: expert e maps x to (e + 1) * x; y = sum_k w_k (e_k + 1) x."""
    scale = ((global_ids_RK + 1).float() * weights_RK.float()).sum(dim=1, keepdim=True)
    return (x_RD.float() * scale).to(x_RD.dtype)


def serve(ep, placement: Placement, worker: int, slots: list[tuple[int, int]], rounds: int) -> None:
    rx = M2NReceiver(ep, ["a0"], sorted({layer for layer, _ in slots}), max(mb for _, mb in slots) + 1)
    to_global = torch.tensor(placement.experts_on(worker))
    for _ in range(rounds):
        for layer, mb in slots:
            b = rx.recv(layer, mb)
            local = b.local_ids_RK
            glob = torch.where(local >= 0, to_global[local.clamp(min=0)], 0)
            w = torch.where(local >= 0, b.weights_RK, 0.0)
            rx.reply(b, fake_expert_out(b.x_RD, glob, w))


@pytest.mark.parametrize("backend,shares", [("shm", None), ("tcp", None), ("shm", ((1,), (1, 3), (1,), (2, 1), (1,)))])
def test_routing_replicas_and_out_of_order_combine(backend, shares):
    placement = Placement(E, 2, ((0,), (0, 1), (1,), (1, 0), (0,)), shares=shares)  # experts 1 and 3 on both workers
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = TransportConfig(backend, slot_bytes=1 << 16, heartbeat_s=0.2, dead_after_s=2.0)
    m, slots = 3, [(0, 0), (0, 1), (0, 2)]
    eps: dict[str, object] = {}

    def open_ep(name, peers):
        eps[name] = open_endpoint(cfg, store, f"m2n-{backend}", name, peers, m)

    openers = [threading.Thread(target=open_ep, args=(n, p)) for n, p in
               (("a0", ["e0", "e1"]), ("e0", ["a0"]), ("e1", ["a0"]))]
    for t in openers:
        t.start()
    for t in openers:
        t.join()
    rounds = 3
    experts = [threading.Thread(target=serve, args=(eps[f"e{w}"], placement, w, slots, rounds), daemon=True)
               for w in range(2)]
    for t in experts:
        t.start()
    try:
        tx = M2NSender(eps["a0"], placement, ["e0", "e1"], D, K)
        g = torch.Generator().manual_seed(0)
        for r in range(rounds):
            tx.begin_step()
            sizes = [(0, 1, 7), (7, 0, 1), (33, 2, 0)][r]
            inputs, handles = [], []
            for mb, T in enumerate(sizes):
                x = torch.randn(T, D, generator=g)
                ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.long)
                w = torch.rand(T, K, generator=g)
                inputs.append((x, ids, w))
                handles.append(tx.dispatch(0, None, x, ids, w, mb=mb))
            for mb in (2, 0, 1):  # out of order: each combine waits on its own handle only
                x, ids, w = inputs[mb]
                torch.testing.assert_close(tx.combine(handles[mb]), fake_expert_out(x, ids, w), rtol=1e-5, atol=1e-5)
            tx.end_step()
            assert not tx.peers_idle
    finally:
        for ep in eps.values():
            ep.close()


def test_replicas_split_tokens_by_their_shares():
    """A replicated expert's tokens go round-robin over its copies' slots: a copy with share k takes
    k of them, spread out (token indices 0..T-1 in turn)."""
    from m2n_comm.m2n import _Routes
    placement = Placement(3, 3, ((0, 1), (2,), (1, 2)), shares=((1, 3), (1,), (1, 1)))
    ncopies_E, copy_EC, _ = _Routes(placement).of(None, torch.device("cpu"))
    T = 400
    ids = torch.zeros(T, dtype=torch.long)
    worker = copy_EC[ids, torch.arange(T) % ncopies_E[ids]]
    assert torch.bincount(worker, minlength=3).tolist() == [100, 300, 0]
    assert worker[:4].tolist() == [1, 0, 1, 1]  # interleaved, not 1 then 3 in a row
    ids = torch.full((T,), 2)
    assert torch.bincount(copy_EC[ids, torch.arange(T) % ncopies_E[ids]], minlength=3).tolist() == [0, 200, 200]
    held = Placement(2, 2, ((0, 1), (0, 1)), shares=((0, 1), (3, 0)))  # copies held that get no tokens
    ncopies_E, copy_EC, _ = _Routes(held).of(None, torch.device("cpu"))
    assert ncopies_E.tolist() == [1, 3] and copy_EC[0, 0] == 1 and copy_EC[1].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="one positive per expert"):
        Placement(2, 2, ((0, 1), (0,)), shares=((0, 0), (1,)))


def test_single_worker_fast_path_and_deferred_work():
    """One expert worker: the router's ids travel as they are (int32 or int64), messages of changing
    shapes and dtypes come back right through the cached slot views, and work handed to `defer` runs
    right after the next step's first dispatch (or at `flush_deferred`), never before."""
    placement = Placement.balanced(E, 1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = TransportConfig("shm", slot_bytes=1 << 16, heartbeat_s=0.2, dead_after_s=2.0)
    eps: dict[str, object] = {}
    openers = [threading.Thread(target=lambda n=n, p=p: eps.update({n: open_endpoint(cfg, store, "m2n-one", n, p, 2)}))
               for n, p in (("a0", ["e0"]), ("e0", ["a0"]))]
    for t in openers:
        t.start()
    for t in openers:
        t.join()
    rounds, slots = 4, [(0, 0), (0, 1), (1, 0), (1, 1)]
    threading.Thread(target=serve, args=(eps["e0"], placement, 0, slots, rounds), daemon=True).start()
    try:
        tx, done, g = M2NSender(eps["a0"], placement, ["e0"], D, K), [], torch.Generator().manual_seed(1)
        for r in range(rounds):
            tx.begin_step()
            for layer in (0, 1):
                inputs, handles = [], []
                for mb in (0, 1):
                    T = (1, 5, 0, 3)[(r + 2 * layer + mb) % 4]
                    dtype, id_dtype = ((torch.float32, torch.int64), (torch.bfloat16, torch.int32))[(r + mb) % 2]
                    x = torch.randn(T, D, generator=g).to(dtype)
                    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(id_dtype) if T \
                        else torch.empty(0, K, dtype=id_dtype)
                    w = torch.rand(T, K, generator=g)
                    assert done == list(range(r if (layer, mb) != (0, 0) else max(r - 1, 0)))
                    handles.append(tx.dispatch(layer, None, x, ids, w, mb=mb))
                    assert done == list(range(r))  # the last step's deferred work ran right after this dispatch
                    inputs.append((x, ids, w))
                for (x, ids, w), h in zip(inputs, handles):
                    y = tx.combine(h)
                    assert y.dtype == x.dtype and y.shape == x.shape
                    torch.testing.assert_close(y.float(), fake_expert_out(x, ids.long(), w).float(), rtol=2e-2, atol=2e-2)
            tx.end_step()
            tx.defer(lambda r=r: done.append(r))
            assert done == list(range(r))
        tx.flush_deferred()
        assert done == list(range(rounds))
    finally:
        for ep in eps.values():
            ep.close()


def test_spin_policy_is_checked():
    assert TransportConfig(spin_policy="adaptive").spin_policy == "adaptive"
    with pytest.raises(ValueError, match="spin_policy must be adaptive or fixed, got 'busy'"):
        TransportConfig(spin_policy="busy")


@pytest.mark.parametrize("workers", [1, 2])
def test_fp8_dispatch(workers):
    """--m2n-dtype fp8: x crosses as float8 e4m3 with a scale per token (a fourth tensor), the expert
    worker computes on x dequantized into its dtype, answers come back in that dtype; an all-zero
    row and an empty micro-batch pass too."""
    from kernels.fp8 import FP8, quantize_fp8

    placement = Placement.balanced(E, 1) if workers == 1 else Placement(E, 2, ((0,), (0, 1), (1,), (1, 0), (0,)))
    peers = [f"e{w}" for w in range(workers)]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = TransportConfig("shm", slot_bytes=1 << 16, heartbeat_s=0.2, dead_after_s=2.0)
    eps: dict[str, object] = {}
    openers = [threading.Thread(target=lambda n=n, p=p: eps.update({n: open_endpoint(cfg, store, f"fp8-{workers}", n, p, 1)}))
               for n, p in [("a0", peers)] + [(e, ["a0"]) for e in peers]]
    for t in openers:
        t.start()
    for t in openers:
        t.join()
    seen = []

    def serve_fp8(ep, w):
        rx = M2NReceiver(ep, ["a0"], [0], 1)
        to_global = torch.tensor(placement.experts_on(w))
        for _ in range(3):
            b = rx.recv(0, 0)
            seen.append(b.x_RD.dtype)
            glob = torch.where(b.local_ids_RK >= 0, to_global[b.local_ids_RK.clamp(min=0)], 0)
            rx.reply(b, fake_expert_out(b.x_RD, glob, torch.where(b.local_ids_RK >= 0, b.weights_RK, 0.0)))

    for w, e in enumerate(peers):
        threading.Thread(target=serve_fp8, args=(eps[e], w), daemon=True).start()
    try:
        tx, g = M2NSender(eps["a0"], placement, peers, D, K, wire_dtype=FP8), torch.Generator().manual_seed(2)
        for T, dtype in ((9, torch.bfloat16), (0, torch.bfloat16), (4, torch.float32)):
            tx.begin_step()
            x = (torch.randn(T, D, generator=g) * 30).to(dtype)
            if T:
                x[1] = 0
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.long)
            wts = torch.rand(T, K, generator=g)
            y = tx.combine(tx.dispatch(0, None, x, ids, wts))
            tx.end_step()
            q, scale = quantize_fp8(x)
            assert q.dtype == FP8 and q.element_size() == 1 and scale.shape == (T, 1)
            assert y.dtype == dtype and y.shape == x.shape
            # exactly the experts on the dequantized x; within e4m3's step of the unquantized one
            torch.testing.assert_close(y.float(), fake_expert_out(q.to(dtype) * scale, ids, wts).float(), rtol=1e-2, atol=1e-2)
            if T:
                err = (y.float() - fake_expert_out(x, ids, wts).float()).abs().amax(dim=1)
                bound = fake_expert_out(x.abs(), ids, wts).float().abs().amax(dim=1) / 8
                assert bool((err <= bound + 1e-3).all()), (err, bound)
                assert y[1].abs().max() == 0
        assert set(seen) == {torch.bfloat16, torch.float32}
        with pytest.raises(ValueError, match="wire dtype"):
            M2NSender(eps["a0"], placement, peers, D, K, wire_dtype=torch.float16)
    finally:
        for ep in eps.values():
            ep.close()
