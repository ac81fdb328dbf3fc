"""Simulated requests -> the metrics of `shuttle bench serve` (the same function computes both)."""
import numpy as np

from clients.bench_metrics import RequestRecord, calculate_metrics, metrics_dict


def summarize(send_s: np.ndarray, token_times_s: list[list[float]], input_len: int) -> dict:
    """send_s[r]: when request r was sent; token_times_s[r]: when each of its tokens was produced
    (seconds on the simulated clock, which starts with the benchmark). Returns bench serve's JSON
    keys (output_throughput, mean/median/p99 TTFT, TPOT, ITL, E2EL in ms, ...)."""
    records = []
    for start, times in zip(send_s, token_times_s):
        times = np.asarray(times)
        records.append(RequestRecord(success=True, start_time=float(start), ttft=float(times[0] - start),
                                     itl=np.diff(times).tolist(), latency=float(times[-1] - start),
                                     prompt_tokens=input_len, output_tokens=len(times), usage_reported=True))
    duration = max(float(max(t[-1] for t in token_times_s)), 1e-9)
    return metrics_dict(calculate_metrics(records, duration))


def lower_median(items, key):
    """The item at the lower middle of `items` ranked by `key` (the median one for an odd count):
    one run kept whole (its wall time, its prompts), where averaging two would mix them."""
    ranked = sorted(items, key=key)
    return ranked[(len(ranked) - 1) // 2]
