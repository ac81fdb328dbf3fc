"""The plan search at cluster scale against MegaScale-Infer's reported trends (estimated numbers).

    python bench/planner_cluster.py [--max-devices 64] [--tbt-slo-ms 150]

Mixtral-8x22B and DBRX (shipped configs, no weights) on catalogue A100-80GB devices (80 GB Ampere,
200 Gbps NICs, like the paper's testbed), decode with 512-token prompts and 256 output tokens:
- the best plan's n_a, n_e and batch, re-evaluated at m = 1..4: m=2 over m=1 (paper: about 1.9x)
  and m=3 over m=2 (paper: 1.10-1.38x);
- the m chosen against the paper's rule (m >= 3 when T_c < 0.5 T_f, else 4; T_f = max(T_a, T_e));
- the chosen n_a against the balance rule n_a = k1 n_e / (k3 K) (k1 E / (k3 K) when n_e = E), with
  k1 = T_a / b and k3 = T_e / (tokens per expert worker) at the plan's operating point;
- heterogeneous H20 attention + L40S experts against homogeneous H20, in throughput per cost.
Every number is a roofline estimate (planner/hardware.json). Writes bench/results/planner_cluster.json.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from planner.hardware import load_catalogue, parse_hardware  # noqa: E402
from planner.perf import RooflinePerf  # noqa: E402
from planner.search import evaluate, search  # noqa: E402
from planner.shapes import shape_from  # noqa: E402

INPUT, OUTPUT = 512, 256


def at(r: dict, n_a: int, n_e: int, m: int, B: int) -> int:
    hit = np.nonzero((r["n_a"] == n_a) & (r["n_e"] == n_e) & (r["m"] == m) & (r["B"] == B))[0]
    return int(hit[0])


def model_row(model: str, args: argparse.Namespace) -> dict:
    shape = shape_from(model)
    kinds, eff = load_catalogue()
    a100 = kinds["A100-80GB"]
    perf = RooflinePerf(shape, a100, a100, eff)
    ctx = INPUT + OUTPUT / 2
    best, _ = search(lambda a, e: perf, shape, [(a100, a100)], args.max_devices, args.tbt_slo_ms / 1e3, ctx,
                     INPUT + OUTPUT, top=1)
    b = best[0]
    r = evaluate(perf, shape, a100, a100, args.max_devices, ctx, INPUT + OUTPUT)
    tput = {m: float(r["throughput"][at(r, b.attention_workers, b.expert_workers, m, b.batch)]) for m in range(1, 5)}
    i = at(r, b.attention_workers, b.expert_workers, b.micro_batches, b.batch)
    t_a, t_e, t_c = float(r["t_a"][i]), float(r["t_e"][i]), float(r["t_c"][i])
    per_mb = b.batch / b.micro_batches
    k1 = t_a / per_mb
    k3 = t_e / (b.attention_workers * per_mb * shape.config.top_k / b.expert_workers)
    rule_m = "3+" if t_c < 0.5 * max(t_a, t_e) else "4"
    h20, l40s = parse_hardware("H20,L40S")
    homo, _ = search(lambda a, e: RooflinePerf(shape, a, e, eff), shape, [(h20, h20)], args.max_devices,
                     args.tbt_slo_ms / 1e3, ctx, INPUT + OUTPUT, top=1)
    het, _ = search(lambda a, e: RooflinePerf(shape, a, e, eff), shape, [(h20, l40s)], args.max_devices,
                    args.tbt_slo_ms / 1e3, ctx, INPUT + OUTPUT, top=1)
    return {"model": model, "n_a": b.attention_workers, "n_e": b.expert_workers, "m": b.micro_batches,
            "batch": b.batch, "tbt_ms": b.tbt_s * 1e3, "tok_s_per_device": b.throughput / b.devices,
            "m2/m1": tput[2] / tput[1], "m3/m2": tput[3] / tput[2], "m4/m3": tput[4] / tput[3],
            "T_a_ms": t_a * 1e3, "T_e_ms": t_e * 1e3, "T_c_ms": t_c * 1e3, "Tc/Tf": t_c / max(t_a, t_e),
            "rule_m": rule_m, "m_follows_rule": (b.micro_batches >= 3) if rule_m == "3+" else b.micro_batches == 4,
            "n_a_rule": k1 * b.expert_workers / (k3 * shape.config.top_k),
            "h20_per_cost": homo[0].per_cost if homo else None, "h20_l40s_per_cost": het[0].per_cost if het else None,
            "hetero_gain": het[0].per_cost / homo[0].per_cost if homo and het else None,
            "hetero_plan": f"{het[0].attention_workers} H20 + {het[0].expert_workers} L40S, m={het[0].micro_batches}"
            if het else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-devices", type=int, default=64)
    p.add_argument("--tbt-slo-ms", type=float, default=150.0)
    args = p.parse_args()
    rows = [model_row(m, args) for m in ("mixtral-8x22b", "dbrx")]
    print(f"estimated (roofline, planner/hardware.json): A100-80GB, 200 Gbps, <= {args.max_devices} devices, "
          f"TBT <= {args.tbt_slo_ms:g} ms, {INPUT} + {OUTPUT} tokens")
    print_table(rows, ["model", "n_a", "n_e", "m", "batch", "tbt_ms", "tok_s_per_device", "m2/m1", "m3/m2", "m4/m3"])
    print_table(rows, ["model", "T_a_ms", "T_e_ms", "T_c_ms", "Tc/Tf", "rule_m", "m_follows_rule", "n_a", "n_a_rule"])
    print_table(rows, ["model", "h20_per_cost", "h20_l40s_per_cost", "hetero_gain", "hetero_plan"])
    print(f"wrote {save('planner_cluster', {'config': vars(args), 'estimated': True, 'rows': rows})}")


if __name__ == "__main__":
    main()
