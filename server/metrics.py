"""Prometheus metrics of the server (GET /metrics), with prometheus_client.

Request metrics (counts, tokens, TTFT / TPOT / ITL / end-to-end latency histograms) are recorded
as requests run, by ServerMetrics acting as AsyncLLM's observer, so the HTTP and gRPC fronts count
alike. Engine state (running and waiting requests, KV cache use, tokens per expert, each pool's
busy fraction) is read from AsyncLLM.stats() when scraped. A pool worker's busy fraction is the
share of the time since the previous scrape that it spent computing (attention workers: attention,
norms, router, LM head; expert workers: the experts), from the busy time the workers report.

Expert load (pools): (token, expert) pairs each expert worker computed (one series per worker), the
imbalance ratio max/mean over expert workers since the previous scrape, and per MoE layer the
max/mean over its experts; per (layer, expert) counts only for the HOT_EXPERTS busiest pairs, so the
number of series stays bounded whatever the model (L x E can be 58 x 256). The placement version and
the number of live re-placements (EPLB) complete the picture.
"""
import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
HOT_EXPERTS = 8  # (layer, expert) pairs exported by name: the busiest ones
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    """The registry behind /metrics; pass it to AsyncLLM as `observer`, then call `bind(stats)`."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        self._label = model_name
        self.http_requests = Counter("shuttle_http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=r)
        self.requests = Counter("shuttle_request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("shuttle_prompt_tokens", "Prompt tokens of finished requests", ["model_name"],
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter("shuttle_generation_tokens", "Generated tokens", ["model_name"],
                                         registry=r).labels(**labels)
        self.ttft = Histogram("shuttle_time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        self.tpot = Histogram("shuttle_time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", ["model_name"], buckets=TOKEN_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram("shuttle_inter_token_latency_seconds", "Time between two outputs of a request",
                             ["model_name"], buckets=TOKEN_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("shuttle_e2e_request_latency_seconds", "Arrival to last token", ["model_name"],
                             buckets=LATENCY_BUCKETS, registry=r).labels(**labels)

    def bind(self, stats: Callable[[], dict]) -> None:
        """Export the engine's state, read from `stats` (AsyncLLM.stats) at each scrape."""
        self.registry.register(_EngineCollector(stats, self._label))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- RequestObserver ------------------------------------------------------------------------------
    def on_output(self, arrival: float, previous: float | None, now: float, new_tokens: int) -> None:
        self.generation_tokens.inc(new_tokens)
        if previous is None:
            self.ttft.observe(now - arrival)
        else:
            self.itl.observe(now - previous)

    def on_finished(self, output: RequestOutput, arrival: float, first: float | None, now: float) -> None:
        reasons = [o.finish_reason or "abort" for o in output.outputs]
        self.requests.labels(self._label, reasons[0] if len(set(reasons)) == 1 else "mixed").inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.e2e.observe(now - arrival)
        generated = max((len(o.token_ids) for o in output.outputs), default=0)
        if first is not None and generated > 1:
            self.tpot.observe((now - first) / (generated - 1))


class _EngineCollector(Collector):
    """Engine gauges and counters, computed when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict], model_name: str):
        self.stats, self.model_name = stats, model_name
        self._previous: dict[str, tuple[int, float]] = {}  # worker -> (busy ns, scrape time)
        self._previous_load: dict = {}  # expert worker or layer -> tokens at the previous scrape

    def collect(self) -> Iterator[Metric]:
        s, m = self.stats(), [self.model_name]
        for name, doc, value in (("num_requests_running", "Requests in the running batch", s["running"]),
                                 ("num_requests_waiting", "Requests waiting to be scheduled", s["waiting"]),
                                 ("num_requests_queued", "Requests waiting for their first token (bounded by "
                                  "--max-waiting)", s.get("queued", 0)),
                                 ("kv_cache_usage_perc", "Share of the KV cache blocks in use (0 to 1)",
                                  s["kv_cache_usage"]),
                                 ("kv_cache_blocks", "KV cache blocks in all attention workers", s["num_blocks"]),
                                 ("kv_cache_free_blocks", "Free KV cache blocks", s["free_blocks"]),
                                 ("kv_cache_tokens", "KV cache capacity in tokens in all attention workers",
                                  s.get("kv_cache_tokens", 0)),
                                 ("linear_state_slots", "Per-sequence states kept outside the KV blocks in all "
                                  "attention workers (Qwen3-Next's linear attention, DeepSeek-V4's windows and "
                                  "compressors; 0: none), the most sequences that run at once",
                                  s.get("state_slots", 0))):
            g = GaugeMetricFamily(f"shuttle_{name}", doc, labels=["model_name"])
            g.add_metric(m, value)
            yield g
        for name, doc, key in (("prefix_cache_queries", "Prompt blocks looked up in the prefix cache",
                                "prefix_cache_queries"),
                               ("prefix_cache_hits", "Prompt blocks found in the prefix cache", "prefix_cache_hits"),
                               ("num_preemptions", "Sequences preempted for lack of KV blocks", "preemptions"),
                               ("engine_steps", "Engine steps taken (pools: by the busiest attention worker; they "
                                "step in lock-step)", "steps"),
                               ("worker_restarts", "Worker processes restarted after a failure", "worker_restarts"),
                               ("recomputed_tokens", "Prompt and delivered tokens sent to be prefilled again for "
                                "requests resumed after an attention worker failed", "recomputed_tokens")):
            c = CounterMetricFamily(f"shuttle_{name}", doc, labels=["model_name"])
            c.add_metric(m, s.get(key, 0))
            yield c
        yield from self._spec_decode(s.get("spec_decode"))
        experts = CounterMetricFamily("shuttle_expert_tokens", "Tokens routed to each expert, summed over "
                                      "MoE layers", labels=["model_name", "expert"])
        for e, n in s.get("expert_tokens", {}).items():
            experts.add_metric([self.model_name, str(e)], n)
        yield experts
        yield from self._busy(s.get("busy", []))
        yield self._weights(s)
        yield from self._timings(s.get("timings", []))
        yield from self._expert_load(s)

    def _spec_decode(self, spec: dict | None) -> Iterator[Metric]:
        """Speculative decoding's counters, as vLLM's vllm:spec_decode_* (none without speculation)."""
        if spec is None:
            return
        m = [self.model_name]
        for name, doc in (("num_drafts", "Sequences a step drafted for"), ("num_draft_tokens", "Draft tokens proposed"),
                          ("num_accepted_tokens", "Draft tokens the target model accepted")):
            c = CounterMetricFamily(f"shuttle_spec_decode_{name}", doc, labels=["model_name"])
            c.add_metric(m, spec[name])
            yield c
        per_pos = CounterMetricFamily("shuttle_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted "
                                      "at each draft position (0: the first draft)", labels=["model_name", "position"])
        for pos, n in enumerate(spec["accepted_per_pos"]):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos

    def _busy(self, workers: list[dict]) -> Iterator[Metric]:
        busy_s = CounterMetricFamily("shuttle_pool_busy_seconds", "Time each worker spent computing",
                                     labels=["pool", "worker"])
        fraction = GaugeMetricFamily("shuttle_pool_busy_fraction", "Share of the time since the previous scrape "
                                     "that each worker spent computing (0 to 1)", labels=["pool", "worker"])
        now = time.monotonic()
        for w in workers:
            busy_s.add_metric([w["pool"], w["worker"]], w["busy_ns"] / 1e9)
            before = self._previous.get(w["worker"])
            if before is None:  # first scrape: over the worker's whole life
                f = w["busy_ns"] / max(w["uptime_ns"], 1)
            else:
                f = (w["busy_ns"] - before[0]) / 1e9 / max(now - before[1], 1e-9)
            fraction.add_metric([w["pool"], w["worker"]], min(max(f, 0.0), 1.0))
            self._previous[w["worker"]] = (w["busy_ns"], now)
        yield busy_s
        yield fraction

    @staticmethod
    def _weights(s: dict) -> Metric:
        """Resident weight bytes per worker and kind (pools: each worker's; colocated: the engine's)."""
        rows = s.get("weights")
        if rows is None:
            rows = [{"pool": "colocated", "worker": "engine", "kind": k, "bytes": n}
                    for k, n in s.get("weight_bytes", {}).items()]
        g = GaugeMetricFamily("shuttle_weight_bytes", "Bytes the model's weights hold in each worker as served "
                              "(packed, quantised): embedding, experts, other", labels=["pool", "worker", "kind"])
        for r in rows:
            g.add_metric([r["pool"], r["worker"], r["kind"]], r["bytes"])
        return g

    @staticmethod
    def _timings(rows: list[dict]) -> Iterator[Metric]:
        if not rows:
            return
        score = GaugeMetricFamily("shuttle_worker_straggler_score", "The share of the last 10 s the other pool's "
                                  "workers waited on this worker, over the median of its pool's other workers "
                                  "(pools/stragglers.py; 1: like the others)", labels=["pool", "worker"])
        waited = GaugeMetricFamily("shuttle_worker_waited_on_fraction", "The share of the last 10 s the other "
                                   "pool's workers spent waiting on this worker (summed over them)",
                                   labels=["pool", "worker"])
        speed = GaugeMetricFamily("shuttle_worker_speed", "The speed expert placement (EPLB) gives this worker: 1, "
                                  "lower while it is a straggler (pools/stragglers.py)", labels=["pool", "worker"])
        for r in rows:
            score.add_metric([r["pool"], r["worker"]], r["score"])
            speed.add_metric([r["pool"], r["worker"]], r.get("speed", 1.0))
            if r["waited_on"] is not None:
                waited.add_metric([r["pool"], r["worker"]], r["waited_on"])
        yield score
        yield waited
        yield speed

    def _expert_load(self, s: dict) -> Iterator[Metric]:
        workers, layers = s.get("expert_worker_tokens", {}), s.get("expert_layer_tokens", {})
        if not workers:
            return
        per_worker = CounterMetricFamily("shuttle_expert_worker_tokens", "(token, expert) pairs each expert "
                                         "worker computed", labels=["worker"])
        for w, n in workers.items():
            per_worker.add_metric([w], n)
        yield per_worker
        ratio = GaugeMetricFamily("shuttle_expert_load_imbalance", "max/mean of the expert workers' (token, "
                                  "expert) pairs since the previous scrape (1 = balanced)", labels=["model_name"])
        ratio.add_metric([self.model_name], _max_over_mean(self._since_last("w", workers)))
        yield ratio
        per_layer = GaugeMetricFamily("shuttle_expert_layer_imbalance", "max/mean of the tokens routed to each "
                                      "expert of a MoE layer since the previous scrape", labels=["layer"])
        hot: list[tuple[int, int, int]] = []
        for layer, row in layers.items():
            per_layer.add_metric([str(layer)], _max_over_mean(self._since_last(f"l{layer}", dict(enumerate(row)))))
            hot.extend((n, layer, e) for e, n in enumerate(row))
        yield per_layer
        busiest = GaugeMetricFamily("shuttle_expert_hot_tokens", f"Tokens routed to the {HOT_EXPERTS} busiest "
                                    "(layer, expert) pairs since start", labels=["layer", "expert"])
        for n, layer, e in sorted(hot, key=lambda t: (-t[0], t[1], t[2]))[:HOT_EXPERTS]:
            busiest.add_metric([str(layer), str(e)], n)
        yield busiest
        version = GaugeMetricFamily("shuttle_expert_placement_version", "Version of the expert placement in use",
                                    labels=["model_name"])
        version.add_metric([self.model_name], s.get("placement_version", 0))
        yield version
        changes = CounterMetricFamily("shuttle_expert_placement_changes", "Live expert re-placements completed",
                                      labels=["model_name"])
        changes.add_metric([self.model_name], s.get("placement_changes", 0))
        yield changes

    def _since_last(self, key: str, counts: dict) -> list[int]:
        """Each count minus its value at the previous scrape (the whole count at the first)."""
        before = self._previous_load.get(key, {})
        self._previous_load[key] = dict(counts)
        return [n - before.get(k, 0) for k, n in counts.items()]


def _max_over_mean(values: list[int]) -> float:
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean > 0 else 1.0
