"""Prometheus metrics fed from the engine's StepStats records (engine/ never imports Prometheus)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.stats import StepStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class Metrics:
    """One registry per server, so several apps (tests) never share series."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels, self._label = ["model_name"], {"model_name": model_name}
        r = self.registry
        self.running = Gauge("aerie_num_requests_running", "Sequences running", labels, registry=r)
        self.waiting = Gauge("aerie_num_requests_waiting", "Sequences waiting", labels, registry=r)
        self.kv_usage = Gauge(
            "aerie_kv_cache_usage_ratio", "Fraction of KV blocks in use", labels, registry=r
        )
        self.prompt_tokens = Counter(
            "aerie_prompt_tokens", "Prompt tokens computed", labels, registry=r
        )
        self.generation_tokens = Counter(
            "aerie_generation_tokens", "Tokens generated", labels, registry=r
        )
        self.preemptions = Counter(
            "aerie_num_preemptions", "Preempted sequences", labels, registry=r
        )
        self.finished = Counter(
            "aerie_request_success",
            "Finished requests by finish reason",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "aerie_time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "aerie_e2e_request_latency_seconds",
            "End-to-end request latency",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def observe(self, stats: StepStats) -> None:
        """Called by the engine thread after every step."""
        label = self._label
        self.running.labels(**label).set(stats.num_running)
        self.waiting.labels(**label).set(stats.num_waiting)
        self.kv_usage.labels(**label).set(stats.kv_cache_usage)
        self.prompt_tokens.labels(**label).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(**label).inc(stats.num_generation_tokens)
        self.preemptions.labels(**label).inc(stats.num_preemptions)
        for request in stats.finished:
            self.finished.labels(**label, finished_reason=request.finish_reason).inc()
            if request.ttft_s is not None:
                self.ttft.labels(**label).observe(request.ttft_s)
            self.e2e.labels(**label).observe(request.e2e_latency_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
