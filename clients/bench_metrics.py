"""Metrics of `shuttle bench serve`: per-request records in, vLLM's `bench serve` numbers out.

Nothing here touches the network: `calculate_metrics` is a pure function of a list of
`RequestRecord`s and the benchmark's wall time, so it is tested on hand-built records. The table
(`format_table`), the JSON result (`metrics_dict`) and the figure (`plot_results`) all read the
`BenchmarkMetrics` it returns. Times in records are seconds; reported latencies are milliseconds.
"""
from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
HEADERS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are `time.perf_counter()` seconds.

    ttft: send to the first chunk carrying text. itl: the gaps between consecutive text chunks
    (one per chunk after the first). latency: send to the end of the stream, `data: [DONE]` included
    (E2EL; vLLM stops at the last text chunk, normally well under a millisecond earlier).
    prompt_tokens / output_tokens: the server's final `usage` when `usage_reported`, else the
    prompt's estimated length and the number of streamed tokens (text chunks for HTTP).
    """

    success: bool = False
    error: str = ""
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, population std and the asked percentiles of one latency, in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: list[tuple[float, float]]


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The numbers of vLLM's `bench serve` table; throughputs per second of `duration_s`."""

    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    output_throughput_per_gpu: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    requests_without_usage: int
    latencies: dict[str, LatencyStats]


def latency_stats(values_s: list[float], percentiles: Sequence[float]) -> LatencyStats:
    """Stats of `values_s` (seconds) in milliseconds; all zeros for an empty list, as vLLM does."""
    v = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    return LatencyStats(float(np.mean(v)), float(np.median(v)), float(np.std(v)),
                        [(float(p), float(np.percentile(v, p))) for p in percentiles])


def request_tpot(r: RequestRecord) -> float:
    """Time per output token after the first, in seconds; 0 for requests of at most one token."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def latency_values(ok: list[RequestRecord]) -> dict[str, list[float]]:
    """Seconds of each latency metric over successful records: TTFT, TPOT (requests of more than
    one token), every inter-token gap, E2EL."""
    return {"ttft": [r.ttft for r in ok], "tpot": [request_tpot(r) for r in ok if r.output_tokens > 1],
            "itl": [g for r in ok for g in r.itl], "e2el": [r.latency for r in ok]}


def calculate_metrics(outputs: list[RequestRecord], duration: float, percentiles: Sequence[float] = (50, 90, 99),
                      goodput_slos_ms: dict[str, float] | None = None, num_gpus: int = 1) -> BenchmarkMetrics:
    """Aggregate per-request records over a benchmark that lasted `duration` seconds.

    TPOT is averaged over requests with more than one output token; ITL pools every gap of every
    request. Goodput counts successful requests whose TTFT, TPOT (0 for one-token requests) and
    E2EL are all within the given SLOs (milliseconds). Failed requests count only in `failed`.
    """
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration} s")
    ok = [r for r in outputs if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    values = latency_values(ok)
    goodput = None
    if goodput_slos_ms:
        goodput = sum(_meets_slos(r, goodput_slos_ms) for r in ok) / duration
    tokens_per_s = tokens_per_bin(ok, bin_s=1.0)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), duration_s=duration, total_input=total_in,
        total_output=total_out, request_throughput=len(ok) / duration, request_goodput=goodput,
        output_throughput=total_out / duration, output_throughput_per_gpu=total_out / duration / num_gpus,
        total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=float(tokens_per_s.max()) if tokens_per_s.size else 0.0,
        max_concurrent_requests=int(concurrency_steps(ok)[1].max(initial=0)),
        requests_without_usage=sum(not r.usage_reported for r in ok),
        latencies={m: latency_stats(values[m], list(percentiles)) for m in METRICS})


def _meets_slos(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": request_tpot(r), "e2el": r.latency}
    return all(got[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def chunk_times(r: RequestRecord) -> np.ndarray:
    """Arrival times (perf_counter seconds) of a request's text chunks: start + ttft + cumsum(itl)."""
    return r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])


def tokens_per_bin(records: list[RequestRecord], bin_s: float = 1.0) -> np.ndarray:
    """Output tokens arriving in each `bin_s`-second bin from the first request's send time.

    A request's `output_tokens` are spread evenly over its chunks (a chunk may carry several).
    """
    if not records:
        return np.zeros(0)
    t0 = min(r.start_time for r in records)
    end = max(r.start_time + r.latency for r in records)
    bins = np.zeros(int((end - t0) // bin_s) + 1)
    for r in records:
        times = chunk_times(r)
        idx = np.clip(((times - t0) // bin_s).astype(int), 0, bins.size - 1)
        np.add.at(bins, idx, r.output_tokens / times.size)
    return bins


def concurrency_steps(records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Requests in flight as a step function: (times in s from the first send, count from each time on).

    Intervals are half-open [send, end), so a request ending as another starts does not overlap it.
    """
    if not records:
        return np.zeros(0), np.zeros(0, dtype=int)
    t0 = min(r.start_time for r in records)
    events = sorted([(r.start_time - t0, 1) for r in records] + [(r.start_time + r.latency - t0, -1) for r in records])
    times = np.array([t for t, _ in events])
    return times, np.cumsum([d for _, d in events])


def parse_goodput(text: str) -> dict[str, float]:
    """Parse `ttft:MS,tpot:MS,e2el:MS` (any subset) into {metric: milliseconds}; an argparse type."""
    slos: dict[str, float] = {}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            names = ", ".join(SLO_METRICS)
            raise argparse.ArgumentTypeError(f"goodput SLO {item!r} is not NAME:MS with NAME in {names}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"goodput SLO {item!r}: {value!r} is not a number of ms") from None
        if slos[name] < 0:
            raise argparse.ArgumentTypeError(f"goodput SLO {item!r} is negative")
    if not slos:
        raise argparse.ArgumentTypeError("goodput: give at least one of ttft:MS, tpot:MS, e2el:MS")
    return slos


def percentile_word(p: float) -> str:
    """99.0 -> '99', 99.9 -> '99.9': the P-label of vLLM's table and JSON keys."""
    return str(int(p)) if int(p) == p else str(p)


def format_table(m: BenchmarkMetrics, metrics: Sequence[str] = METRICS, max_concurrency: int | None = None,
                 request_rate: float = float("inf")) -> str:
    """vLLM's `Serving Benchmark Result` table (plus output throughput per GPU), as one string."""
    row = "{:<40} {:<10}".format
    num = lambda label, v: "{:<40} {:<10.2f}".format(label, v)  # noqa: E731
    lines = ["{:=^50}".format(" Serving Benchmark Result "), row("Successful requests:", m.completed),
             row("Failed requests:", m.failed)]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(num("Request rate configured (RPS):", request_rate))
    lines += [num("Benchmark duration (s):", m.duration_s), row("Total input tokens:", m.total_input),
              row("Total generated tokens:", m.total_output), num("Request throughput (req/s):", m.request_throughput)]
    if m.request_goodput is not None:
        lines.append(num("Request goodput (req/s):", m.request_goodput))
    lines += [num("Output token throughput (tok/s):", m.output_throughput),
              num("Output throughput per GPU (tok/s/GPU):", m.output_throughput_per_gpu),
              num("Peak output token throughput (tok/s):", m.max_output_tokens_per_s),
              row("Peak concurrent requests:", m.max_concurrent_requests),
              num("Total token throughput (tok/s):", m.total_token_throughput)]
    for name in metrics:
        label, header = HEADERS[name]
        s = m.latencies[name]
        lines += ["{:-^50}".format(header), num(f"Mean {label} (ms):", s.mean_ms),
                  num(f"Median {label} (ms):", s.median_ms)]
        lines += [num(f"P{percentile_word(p)} {label} (ms):", v) for p, v in s.percentiles_ms]
    lines.append("=" * 50)
    return "\n".join(lines)


def metrics_dict(m: BenchmarkMetrics, metrics: Sequence[str] = METRICS) -> dict[str, Any]:
    """The aggregate numbers under vLLM's JSON keys (`completed`, `mean_ttft_ms`, `p99_itl_ms`, ...)."""
    d: dict[str, Any] = {
        "duration": m.duration_s, "completed": m.completed, "failed": m.failed, "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output, "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput, "output_throughput": m.output_throughput,
        "output_throughput_per_gpu": m.output_throughput_per_gpu, "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s, "max_concurrent_requests": m.max_concurrent_requests,
        "requests_without_usage": m.requests_without_usage}
    for name in metrics:
        s = m.latencies[name]
        d.update({f"mean_{name}_ms": s.mean_ms, f"median_{name}_ms": s.median_ms, f"std_{name}_ms": s.std_ms})
        d.update({f"p{percentile_word(p)}_{name}_ms": v for p, v in s.percentiles_ms})
    return d


def per_request_dict(records: list[RequestRecord]) -> dict[str, list]:
    """vLLM's per-request lists (seconds); failed requests report 0 output tokens and their error."""
    t0 = min((r.start_time for r in records), default=0.0)
    return {"input_lens": [r.prompt_tokens for r in records],
            "output_lens": [r.output_tokens if r.success else 0 for r in records],
            "ttfts": [r.ttft for r in records], "itls": [r.itl for r in records],
            "latencies": [r.latency for r in records], "start_times": [r.start_time - t0 for r in records],
            "generated_texts": [r.generated_text for r in records], "errors": [r.error for r in records]}


_SPEC_PREFIXES = ("shuttle_spec_decode_", "vllm:spec_decode_")  # (ours, and a vLLM server's)


def spec_counters(metrics_text: str) -> dict[str, Any] | None:
    """Speculative decoding's counters from a Prometheus /metrics page (Shuttle's or vLLM's names):
    drafts, draft tokens, accepted tokens and accepted tokens per position, summed over label sets;
    None where the page has none (no speculation)."""
    out: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "per_pos": {}}
    found = False
    for line in metrics_text.splitlines():
        prefix = next((p for p in _SPEC_PREFIXES if line.startswith(p)), None)
        if prefix is None:
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split("{")[0][len(prefix):]
        if not metric.endswith("_total"):
            continue
        found, metric = True, metric.removesuffix("_total")
        try:
            v = int(float(value))
        except ValueError:
            continue
        if metric == "num_accepted_tokens_per_pos" and 'position="' in name:
            pos = int(name.split('position="')[1].split('"')[0])
            out["per_pos"][pos] = out["per_pos"].get(pos, 0) + v
        elif metric in out:
            out[metric] += v
    return out if found else None


def spec_decode_stats(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's speculative-decoding summary of a run from the counters before and after it: acceptance
    rate (% of draft tokens), acceptance length (1 + accepted tokens per draft: tokens a verifying
    step emits per sequence), per-position acceptance; None without drafts."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    if d["num_draft_tokens"] <= 0:
        return None
    per_pos = [(after["per_pos"].get(p, 0) - before["per_pos"].get(p, 0)) / d["num_drafts"]
               for p in sorted(after["per_pos"])]
    return {"num_drafts": d["num_drafts"], "draft_tokens": d["num_draft_tokens"],
            "accepted_tokens": d["num_accepted_tokens"],
            "acceptance_rate": 100 * d["num_accepted_tokens"] / d["num_draft_tokens"],
            "acceptance_length": 1 + d["num_accepted_tokens"] / d["num_drafts"], "per_position_acceptance_rates": per_pos}


def format_spec_table(stats: dict[str, Any]) -> str:
    """The "Speculative Decoding" section of the report, as vLLM prints it."""
    lines = ["{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"),
             "{:<40} {:<10.2f}".format("Acceptance rate (%):", stats["acceptance_rate"]),
             "{:<40} {:<10.2f}".format("Acceptance length:", stats["acceptance_length"]),
             "{:<40} {:<10}".format("Drafts:", stats["num_drafts"]),
             "{:<40} {:<10}".format("Draft tokens:", stats["draft_tokens"]),
             "{:<40} {:<10}".format("Accepted tokens:", stats["accepted_tokens"])]
    if stats["per_position_acceptance_rates"]:
        lines.append("Per-position acceptance (%):")
        lines += ["{:<40} {:<10.2f}".format(f"  Position {i}:", 100 * r)
                  for i, r in enumerate(stats["per_position_acceptance_rates"])]
    return "\n".join(lines + ["=" * 50])


def error_summary(records: list[RequestRecord], limit: int = 5) -> list[str]:
    """The most frequent error texts of failed requests, as 'N x text' lines."""
    counts = Counter(r.error for r in records if not r.success)
    return [f"{n} x {text}" for text, n in counts.most_common(limit)]


def plot_results(records: list[RequestRecord], path: str | Path, title: str = "") -> None:
    """Save a PNG (Agg): histograms of TTFT, TPOT, ITL, E2EL (ms) of the successful requests, and
    output tokens per 1 s bin and requests in flight over time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in records if r.success]
    fig = Figure(figsize=(15, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    values = latency_values(ok)
    for ax, name in zip(axes.flat, METRICS):
        ms = np.asarray(values[name]) * 1000.0
        ax.hist(ms, bins=min(50, max(ms.size, 1)), color="tab:blue")
        ax.set(title=HEADERS[name][1], xlabel=f"{HEADERS[name][0]} (ms)",
               ylabel="token gaps" if name == "itl" else "requests")
    tokens = tokens_per_bin(ok, bin_s=1.0)
    axes[1, 1].bar(np.arange(tokens.size), tokens, width=1.0, align="edge", color="tab:green")
    axes[1, 1].set(title="Output throughput", xlabel="time (s)", ylabel="tokens per 1 s bin")
    times, counts = concurrency_steps(ok)
    axes[1, 2].step(np.concatenate([[0.0], times]), np.concatenate([[0], counts]), where="post", color="tab:red")
    axes[1, 2].set(title="Concurrent requests", xlabel="time (s)", ylabel="requests in flight")
    fig.suptitle(title or "shuttle bench serve")
    fig.savefig(str(path), dpi=80)
