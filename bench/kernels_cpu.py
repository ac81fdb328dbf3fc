"""Per-layer CPU kernel times at the shapes of the Mixtral-shaped ~425M checkpoint of bench/engine.py
(hidden 1024, 16 query / 4 kv heads of 64, 8 experts of 2048, top-2, pages of 16 tokens), a baseline
(the reference or unfused path named per op below) beside the current code, interleaved in one run:

  attention  decode attention over a paged cache (pages shuffled, contexts 0.5x..1x the nominal one),
             baseline kernels.attention.paged_decode_attention_reference, current paged_decode_attention
             (repeated calls reuse the step's gather layout, as a step's second to last layers do);
  moe        the MoE block (permute, per-expert SwiGLU GEMMs, combine) with router-like top-2 choices:
             float32 through oneDNN-packed weights as the engine runs it (fused_moe_packed), bf16
             through fused_moe (packed where this CPU can pack bf16; on a CPU with AVX-512 BF16 the
             current code is the engine's one native call per block, PackedExperts with
             kernels/native.fused_moe_bf16, against oneDNN's packed bf16 GEMMs); baseline without the float32
             upcast of emulated bf16 GEMMs (upcast_min_rows=None), and for packed weights the sorted
             path, whose 1-row batches fused_moe_packed computes without sort/gather/scatter
             (batch 1 is added where the dtype packs);
  qkv_proj   float32 decode q/k/v projections of 8 layers' weights in turn: baseline three packed
             GEMMs, current one GEMM of the stacked weights (models.cpu_inference.fuse_qkv), with
             GB/s and the memory floor (weight bytes over a measured read bandwidth);
  prefill    one chunk of `--chunk` tokens: attention (cached_attention vs cached_attention_reference)
             for a prompt from its start and a chunk after a cached prefix, and the MoE block at
             chunk tokens; tokens/s of the two together against their compute floor.

Each cell runs at 2 threads and 1 (torch.set_num_threads), so "x2/x1" says whether an op uses both
cores, and once more at 1 thread timed by the thread's CPU time ("cpu1": the steadiest number when
other processes load the machine). Floors: FLOPs over the measured rate of a 2048^3 matmul (1024^3
with --quick) in the same dtype (for float32 and for bf16, whose rate on AVX2-only CPUs is the
emulated one; the current code may beat that floor by
computing in float32). Times are the best of --repeats interleaved runs.

    python bench/kernels_cpu.py [--quick] [--dtypes bfloat16 float32]

--quick: batches 16/64/256 at contexts 32 and 512, 2 repeats (about 2 minutes on 2 quiet cores).
Writes bench/results/kernels_cpu.json (kernels_cpu_quick.json with --quick).
"""
import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from kernels.attention import (cached_attention, cached_attention_reference, paged_decode_attention,  # noqa: E402
                               paged_decode_attention_reference)
from kernels import native  # noqa: E402
from kernels.cpu_linear import CpuWeight, pack_weight, packed_linear, packing_available  # noqa: E402
from kernels.moe import fused_moe, fused_moe_packed, grouped_swiglu, permute, unpermute  # noqa: E402
from kernels.ops import torch_ops  # noqa: E402
from kernels.routing import topk_route  # noqa: E402
from models.cpu_inference import PackedExperts, fused_native_experts  # noqa: E402
from models.moe_decoder import Experts  # noqa: E402

D, N, K, H, I, E, TOP_K, PAGE = 1024, 16, 4, 64, 2048, 8, 2, 16
LAYERS = 8


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float] = time.perf_counter
                ) -> dict[str, float]:
    """Best time of each function (s) by `clock`, the functions taking turns so load shifts hit all alike."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = clock()
            f()
            times[k].append(clock() - t0)
    return {k: min(v) for k, v in times.items()}


def at_threads(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """interleaved() wall times at 2 threads and at 1 (keys NAME@2, NAME@1), and at 1 thread the CPU
    time of the calling thread, which does all the work then (NAME@cpu1): on a loaded machine the
    least disturbed of the three, though shared caches and memory bandwidth still are."""
    out = {}
    old = torch.get_num_threads()
    for threads in (2, 1):
        torch.set_num_threads(threads)
        out.update({f"{k}@{threads}": v for k, v in interleaved(fns, repeats).items()})
    out.update({f"{k}@cpu1": v for k, v in interleaved(fns, repeats, time.thread_time).items()})
    torch.set_num_threads(old)
    return out


def matmul_rate(dtype: torch.dtype, n: int = 2048) -> float:
    """FLOP/s of an n^3 matmul in dtype at 2 threads (best of 3)."""
    a = torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / min(interleaved({"mm": lambda: a @ a}, 3).values())


def paged_cache(B: int, ctx: int, dtype: torch.dtype) -> tuple:
    """q, k/v pages (shuffled), block table and lengths (ctx/2..ctx, the first exactly ctx)."""
    g = torch.Generator().manual_seed(B * 7919 + ctx)
    pages = -(-ctx // PAGE)
    P = B * pages + 1
    k, v = (torch.randn(P, PAGE, K, H, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(P, generator=g)[:B * pages].view(B, pages).int()
    lens = torch.randint(ctx // 2 + 1, ctx + 1, (B,), generator=g)
    lens[0] = ctx
    return torch.randn(B, N, H, generator=g).to(dtype), k, v, table, lens


def attention_rows(dtype: torch.dtype, batches: list[int], contexts: list[int], repeats: int) -> list[dict]:
    rows = []
    for B in batches:
        for ctx in contexts:
            q, k, v, table, lens = paged_cache(B, ctx, dtype)
            ref = paged_decode_attention_reference(q, k, v, table, lens, H ** -0.5)
            err = (paged_decode_attention(q, k, v, table, lens, H ** -0.5).float() - ref.float()).abs().max().item()
            assert err < 5e-2, f"decode attention B={B} ctx={ctx}: max error {err}"
            t = at_threads({"base": lambda: paged_decode_attention_reference(q, k, v, table, lens, H ** -0.5),
                            "new": lambda: paged_decode_attention(q, k, v, table, lens, H ** -0.5)}, repeats)
            kv_bytes = 2 * int(lens.sum()) * K * H * dtype.itemsize
            rows.append({"op": "decode_attention", "dtype": str(dtype)[6:], "batch": B, "context": ctx,
                         **_times(t), "new_GBps": kv_bytes / t["new@2"] / 1e9})
            print(rows[-1], flush=True)
    return rows


def _times(t: dict[str, float]) -> dict:
    """Milliseconds, the speed-up of new over base, and each one's 2-thread over 1-thread speed-up."""
    return {"base_ms": 1e3 * t["base@2"], "new_ms": 1e3 * t["new@2"], "speedup": t["base@2"] / t["new@2"],
            "base_x2/x1": t["base@1"] / t["base@2"], "new_x2/x1": t["new@1"] / t["new@2"],
            "new_1thread_ms": 1e3 * t["new@1"], "base_cpu1_ms": 1e3 * t["base@cpu1"],
            "new_cpu1_ms": 1e3 * t["new@cpu1"], "speedup_cpu1": t["base@cpu1"] / t["new@cpu1"]}


class MoE:
    """One layer's experts at the benchmark's shapes, as the engine holds them for `dtype`."""

    def __init__(self, dtype: torch.dtype):
        g = torch.Generator().manual_seed(0)
        self.w13 = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).to(dtype)
        self.w2 = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(dtype)
        self.packed = packing_available(dtype)
        self.fused = None  # the engine's whole-block native kernel where it runs (bf16 on AVX-512 BF16)
        if self.packed:  # as the engine holds them (CpuWeight), and their oneDNN-packed part alone
            self.c13, self.c2 = [CpuWeight(w) for w in self.w13], [CpuWeight(w) for w in self.w2]
            self.p13, self.p2 = [pack_weight(w) for w in self.w13], [pack_weight(w) for w in self.w2]
            experts = Experts(E, D, I, torch_ops()).to(dtype)
            experts.w13.data, experts.w2.data = self.w13, self.w2
            if fused_native_experts(experts):
                self.fused = PackedExperts(experts)

    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, upcast: bool) -> torch.Tensor:
        if not self.packed:
            return fused_moe(x, self.w13, self.w2, weights, ids, **({} if upcast else {"upcast_min_rows": None}))
        if upcast and self.fused is not None:  # the engine's path here: one native call for the block
            return self.fused(x, ids, weights)
        if upcast:  # the engine's path (a 1-row batch takes fused_moe_packed's shortcut)
            return fused_moe_packed(x, self.c13, self.c2, weights, ids)
        x_ND, perm = permute(x, ids, E)
        return unpermute(grouped_swiglu(x_ND, perm.counts_E, self.p13, self.p2, linear=packed_linear), perm, weights)


def moe_rows(dtype: torch.dtype, batches: list[int], repeats: int, rate: float) -> list[dict]:
    moe, rows = MoE(dtype), []
    for B in batches:
        g = torch.Generator().manual_seed(B)
        x = torch.randn(B, D, generator=g).to(dtype)
        weights, ids = topk_route(torch.randn(B, E, generator=g), TOP_K, "softmax", True)
        t = at_threads({"base": lambda: moe.run(x, weights, ids, False),
                        "new": lambda: moe.run(x, weights, ids, True)}, repeats)
        flops = 2 * B * TOP_K * 3 * I * D
        rows.append({"op": "moe", "dtype": str(dtype)[6:], "batch": B, "packed": moe.packed, **_times(t),
                     "compute_floor_ms": 1e3 * flops / rate, "new_vs_floor": t["new@2"] * rate / flops})
        print(rows[-1], flush=True)
    return rows


def qkv_rows(batches: list[int], repeats: int, read_bw: float) -> list[dict]:
    """float32 q/k/v projections of LAYERS layers (each call moves to the next layer's weights, so
    they stream from memory as in a decode step): baseline three packed GEMMs (N*H, K*H, K*H rows),
    current one packed GEMM of the stacked weights (models.cpu_inference.fuse_qkv) split three ways."""
    g = torch.Generator().manual_seed(1)
    sizes = (N * H, K * H, K * H)
    ws = [[torch.randn(n, D, generator=g) / D ** 0.5 for n in sizes] for _ in range(LAYERS)]
    three = [[pack_weight(w) for w in layer] for layer in ws]
    fused = [pack_weight(torch.cat(layer)) for layer in ws]
    rows = []
    for B in batches:
        x = torch.randn(B, D, generator=g)
        turn = {"base": 0, "new": 0}

        def base() -> list[torch.Tensor]:
            turn["base"] = (turn["base"] + 1) % LAYERS
            return [packed_linear(x, w) for w in three[turn["base"]]]

        def new() -> tuple[torch.Tensor, ...]:
            turn["new"] = (turn["new"] + 1) % LAYERS
            return packed_linear(x, fused[turn["new"]]).split(sizes, dim=-1)

        for a, b in zip(base(), new()):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        t = at_threads({"base": base, "new": new}, repeats * LAYERS)
        nbytes = sum(sizes) * D * 4
        rows.append({"op": "qkv_proj", "dtype": "float32", "batch": B, **_times(t), "new_GBps": nbytes / t["new@2"] / 1e9,
                     "base_GBps": nbytes / t["base@2"] / 1e9, "mem_floor_ms": 1e3 * nbytes / read_bw})
        print(rows[-1], flush=True)
    return rows


def skinny_rows(row_counts: list[int], repeats: int, read_bw: float) -> list[dict]:
    """One expert's w13-sized GEMM (2I x D) at few rows, 8 distinct weights taking turns so they
    stream from memory: baseline oneDNN's packed float32, current the native bf16 kernel
    (kernels/native.py), which kernels.cpu_linear.cpu_linear uses up to SKINNY_MAX_ROWS rows."""
    if not native.available():
        print("native kernels unavailable here: no skinny rows", flush=True)
        return []
    g = torch.Generator().manual_seed(2)
    ws = [(torch.randn(2 * I, D, generator=g) / D ** 0.5).bfloat16() for _ in range(8)]
    packed = [pack_weight(w.float()) for w in ws]
    rows = []
    for T in row_counts:
        x = torch.randn(T, D, generator=g)
        turn = {"base": 0, "new": 0}

        def base() -> torch.Tensor:
            turn["base"] = (turn["base"] + 1) % len(ws)
            return packed_linear(x, packed[turn["base"]])

        def new() -> torch.Tensor:
            turn["new"] = (turn["new"] + 1) % len(ws)
            return native.gemm_bf16(x, ws[turn["new"]])

        torch.testing.assert_close(base(), new(), atol=1e-4, rtol=1e-4)
        t = at_threads({"base": base, "new": new}, repeats * len(ws))
        nbytes = 2 * I * D * 2  # the bf16 weight the kernel streams
        rows.append({"op": "skinny_gemm", "dtype": "bf16 in float32", "batch": T, **_times(t),
                     "new_GBps": nbytes / t["new@2"] / 1e9, "mem_floor_ms": 1e3 * nbytes / read_bw})
        print(rows[-1], flush=True)
    return rows


def read_bandwidth() -> float:
    """Bytes/s of a sum over 512 MiB of float32 at 2 threads (best of 3)."""
    src = torch.ones(1 << 27)
    return src.numel() * 4 / min(interleaved({"sum": lambda: src.sum()}, 3).values())


def prefill_rows(dtype: torch.dtype, chunk: int, prefix: int, repeats: int, rate: float) -> list[dict]:
    """A chunk of `chunk` tokens of one sequence after `prefix` cached ones: attention and MoE."""
    g = torch.Generator().manual_seed(chunk + prefix)
    S = prefix + chunk
    k, v = (torch.randn(1, S, K, H, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    q = torch.randn(chunk, N, H, generator=g).to(dtype)
    idx = (torch.zeros(chunk, dtype=torch.long), torch.arange(chunk), prefix + torch.arange(chunk), chunk, H ** -0.5)
    x = torch.randn(chunk, D, generator=g).to(dtype)
    weights, ids = topk_route(torch.randn(chunk, E, generator=g), TOP_K, "softmax", True)
    moe = MoE(dtype)
    t_att = at_threads({"base": lambda: cached_attention_reference(q, k, v, *idx),
                        "new": lambda: cached_attention(q, k, v, *idx)}, repeats)
    t_moe = at_threads({"base": lambda: moe.run(x, weights, ids, False),
                        "new": lambda: moe.run(x, weights, ids, True)}, repeats)
    t = {key: t_att[key] + t_moe[key] for key in t_att}
    att_flops = 4 * chunk * (prefix + (chunk + 1) / 2) * N * H  # causal: half the chunk's own keys
    flops = att_flops + 2 * chunk * TOP_K * 3 * I * D
    row = {"op": "prefill_chunk", "dtype": str(dtype)[6:], "batch": chunk, "context": S, **_times(t),
           "attention_base_ms": 1e3 * t_att["base@2"], "attention_new_ms": 1e3 * t_att["new@2"],
           "new_tok_s": chunk / t["new@2"], "compute_floor_tok_s": chunk * rate / flops,
           "new_vs_floor": t["new@2"] * rate / flops}
    print(row, flush=True)
    return [row]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer contexts and repeats (about 2 minutes)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="default 32 128 512 2048 (quick: 32 512)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (quick: 2)")
    args = ap.parse_args()
    contexts = args.contexts or ([32, 512] if args.quick else [32, 128, 512, 2048])
    repeats = args.repeats or (2 if args.quick else 5)
    rows, rates = [], {}
    if "float32" in args.dtypes:
        read_bw = read_bandwidth()
        print(f"read bandwidth {read_bw / 1e9:.1f} GB/s at 2 threads", flush=True)
        rows += qkv_rows(sorted({1, *args.batches}), repeats, read_bw)
        rows += skinny_rows([1, 2, 4, 8, 16, 32, 64], repeats, read_bw)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        rates[name] = rate = matmul_rate(dtype, 1024 if args.quick else 2048)
        print(f"{name}: matmul {rate / 1e9:.0f} GFLOP/s at 2 threads", flush=True)
        rows += attention_rows(dtype, args.batches, contexts, repeats)
        rows += moe_rows(dtype, sorted({1, *args.batches}) if packing_available(dtype) else args.batches, repeats,
                         rate)
        rows += prefill_rows(dtype, args.chunk, 0, repeats, rate)
        if not args.quick:
            rows += prefill_rows(dtype, args.chunk, 1536, repeats, rate)
    print(f"\nper-layer CPU kernels, the torch baseline vs our kernels; matmul GFLOP/s "
          + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in rates.items()))
    print_table(rows, ["op", "dtype", "batch", "context", "base_ms", "new_ms", "speedup", "base_x2/x1", "new_x2/x1",
                       "base_cpu1_ms", "new_cpu1_ms", "speedup_cpu1", "new_GBps", "compute_floor_ms", "mem_floor_ms", "new_tok_s",
                       "compute_floor_tok_s", "new_vs_floor"])
    name = "kernels_cpu_quick" if args.quick else "kernels_cpu"
    payload = {"benchmark": "kernels_cpu", "matmul_GFLOPs": {k: v / 1e9 for k, v in rates.items()}, "rows": rows,
               "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"wrote {save(name, payload)}")


if __name__ == "__main__":
    main()
