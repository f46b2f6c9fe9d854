"""Prometheus metrics fed from the engine's StepStats records (engine/ never imports Prometheus).

Names follow vLLM's (`vllm:` becomes `aerie_`), in base units: seconds, tokens, ratios 0..1;
counters end in `_total` (prometheus-client appends it). Every series carries `model_name`.
docs/metrics.md lists them; configs/grafana/ holds the dashboard built on them.

Series that depend on the engine (the length buckets, which follow the context length, and the
speculative-decoding family, which exists only when a draft head is loaded) are registered by
`attach`, once the engine has loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.spec.draft_controller import batch_bucket
from engine.stats import StepStats

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

# No `*_created` series: they double the series count and no dashboard reads them (as in vLLM).
prometheus_client.disable_created_metrics()

# Seconds. Aerie serves from millisecond-scale tiny models on a CPU to 7B models on a GPU.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")
STEP_PHASES = ("propose", "verify", "accept", "other")


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... below `limit`, then `limit` itself (lengths, in tokens)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale >= limit:
                return tuple(float(b) for b in [*buckets, limit])
            buckets.append(mantissa * scale)
        scale *= 10


class Metrics:
    """One registry per server, so several apps (tests) never share series.

    `observe` runs on the engine thread after every step; prometheus-client's metrics are thread
    safe, and /metrics renders from the event loop's thread."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        # scheduler state
        self.running = Gauge(
            "aerie_num_requests_running", "Sequences in the running batch", labels, registry=r
        )
        self.waiting = Gauge(
            "aerie_num_requests_waiting", "Sequences waiting to be scheduled", labels, registry=r
        )
        self.kv_usage = Gauge(
            "aerie_kv_cache_usage_ratio",
            "Fraction of KV-cache blocks in use (0..1)",
            labels,
            registry=r,
        )
        self.preemptions = Counter(
            "aerie_num_preemptions",
            "Sequences preempted (freed, to be recomputed)",
            labels,
            registry=r,
        )
        self.prefix_queries = Counter(
            "aerie_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            labels,
            registry=r,
        )
        self.prefix_hits = Counter(
            "aerie_prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            labels,
            registry=r,
        )
        # tokens and requests
        self.prompt_tokens = Counter(
            "aerie_prompt_tokens", "Prompt tokens computed (prefill)", labels, registry=r
        )
        self.generation_tokens = Counter(
            "aerie_generation_tokens", "Output tokens generated", labels, registry=r
        )
        self.finished = Counter(
            "aerie_request_success",
            "Finished requests, by finish reason (stop, length, abort)",
            [*labels, "finished_reason"],
            registry=r,
        )
        # latencies
        self.ttft = Histogram(
            "aerie_time_to_first_token_seconds",
            "Time from arrival to the first output token",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "aerie_inter_token_latency_seconds",
            "Time per output token after the first (a step's interval over the tokens it emitted)",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "aerie_e2e_request_latency_seconds",
            "Time from arrival to the request's end",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "aerie_request_queue_time_seconds",
            "Time from arrival to first being scheduled",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_phase = Counter(
            "aerie_step_phase_seconds",
            "Engine time by step phase: propose (drafting), verify (target pass), accept",
            [*labels, "phase"],
            registry=r,
        )
        # registered by attach()
        self.prompt_lengths: Histogram | None = None
        self.generation_lengths: Histogram | None = None
        self.spec: _SpecDecodeMetrics | None = None
        self._init_children()

    def _init_children(self) -> None:
        """Create each series at zero, so it is scraped (and rate() works) before any traffic."""
        name = self.model_name
        for metric in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.preemptions,
            self.prefix_queries,
            self.prefix_hits,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
        ):
            metric.labels(name)
        for reason in FINISH_REASONS:
            self.finished.labels(name, reason)
        for phase in STEP_PHASES:
            self.step_phase.labels(name, phase)

    def attach(self, engine: LLMEngine) -> None:
        """Register the engine-dependent series and subscribe to the engine's stats."""
        r, name, labels = self.registry, self.model_name, ["model_name"]
        length_buckets = one_two_five_buckets(engine.max_model_len)
        self.prompt_lengths = Histogram(
            "aerie_request_prompt_tokens",
            "Prompt length of finished requests, in tokens",
            labels,
            buckets=length_buckets,
            registry=r,
        )
        self.generation_lengths = Histogram(
            "aerie_request_generation_tokens",
            "Output tokens of finished requests (over all n choices)",
            labels,
            buckets=length_buckets,
            registry=r,
        )
        self.prompt_lengths.labels(name)
        self.generation_lengths.labels(name)
        if engine.config.draft:
            self.spec = _SpecDecodeMetrics(r, name, engine.config.draft_depth)
        engine.stats_listeners.append(self.observe)

    def observe(self, stats: StepStats) -> None:
        """Called by the engine thread after every step (and after an abort)."""
        name = self.model_name
        self.running.labels(name).set(stats.num_running)
        self.waiting.labels(name).set(stats.num_waiting)
        self.kv_usage.labels(name).set(stats.kv_cache_usage)
        self.preemptions.labels(name).inc(stats.num_preemptions)
        self.prefix_queries.labels(name).inc(stats.num_prefix_cache_queries)
        self.prefix_hits.labels(name).inc(stats.num_prefix_cache_hits)
        self.prompt_tokens.labels(name).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(stats.num_generation_tokens)
        for phase, seconds in zip(
            STEP_PHASES,
            (stats.propose_time_s, stats.verify_time_s, stats.accept_time_s, stats.other_time_s),
        ):
            self.step_phase.labels(name, phase).inc(seconds)
        ttft, itl = self.ttft.labels(name), self.itl.labels(name)
        for seconds in stats.time_to_first_tokens_s:
            ttft.observe(seconds)
        for seconds in stats.inter_token_latencies_s:
            itl.observe(seconds)
        for request in stats.finished:
            self.finished.labels(name, request.finish_reason).inc()
            self.e2e.labels(name).observe(request.e2e_latency_s)
            self.queue_time.labels(name).observe(request.queue_time_s)
            if self.prompt_lengths is not None and self.generation_lengths is not None:
                self.prompt_lengths.labels(name).observe(request.num_prompt_tokens)
                self.generation_lengths.labels(name).observe(request.num_generation_tokens)
        if self.spec is not None:
            self.spec.observe(stats)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _SpecDecodeMetrics:
    """EAGLE-2 speculation: drafts verified, draft tokens, accepted tokens (in all and by tree
    depth), and the tokens each target pass emitted per sequence."""

    def __init__(self, registry: CollectorRegistry, model_name: str, depth: int) -> None:
        r, labels, self.model_name = registry, ["model_name"], model_name
        self.drafts = Counter(
            "aerie_spec_decode_num_drafts",
            "Draft trees verified (one per sequence and step)",
            labels,
            registry=r,
        )
        self.draft_tokens = Counter(
            "aerie_spec_decode_num_draft_tokens",
            "Draft tokens verified (tree nodes, root excluded)",
            labels,
            registry=r,
        )
        self.accepted_tokens = Counter(
            "aerie_spec_decode_num_accepted_tokens", "Draft tokens accepted", labels, registry=r
        )
        self.accepted_per_pos = Counter(
            "aerie_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each tree depth (position 1: the root's child)",
            [*labels, "position"],
            registry=r,
        )
        self.tokens_per_pass = Histogram(
            "aerie_spec_decode_tokens_per_pass",
            "Tokens a sequence emitted from one target pass (accepted drafts plus the bonus)",
            labels,
            buckets=tuple(float(k) for k in range(1, depth + 2)),
            registry=r,
        )
        self.draft_budget = Histogram(
            "aerie_spec_decode_draft_budget_tokens",
            "Draft tokens verified in a decode step, across the batch, as the draft controller "
            "and budget chose (0: the step decoded plainly)",
            labels,
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.plain_steps = Counter(
            "aerie_spec_decode_plain_steps",
            "Decode steps the draft controller ran without verifying drafts",
            labels,
            registry=r,
        )
        self.steps_by_batch = Counter(
            "aerie_spec_decode_steps_by_batch",
            "Decode steps by batch size (the draft controller's buckets: 1, 2-3, 4-7, ...)",
            [*labels, "batch"],
            registry=r,
        )
        self.drafting_steps_by_batch = Counter(
            "aerie_spec_decode_drafting_steps_by_batch",
            "Decode steps that verified drafts, by batch size (the draft controller's buckets)",
            [*labels, "batch"],
            registry=r,
        )
        for metric in (
            self.drafts,
            self.draft_tokens,
            self.accepted_tokens,
            self.tokens_per_pass,
            self.draft_budget,
            self.plain_steps,
        ):
            metric.labels(model_name)
        for position in range(1, depth + 1):
            self.accepted_per_pos.labels(model_name, str(position))
        for by_batch in (self.steps_by_batch, self.drafting_steps_by_batch):
            by_batch.labels(model_name, _bucket_label(1))  # the others appear as they occur

    def observe(self, stats: StepStats) -> None:
        name = self.model_name
        self.drafts.labels(name).inc(stats.num_drafts)
        self.draft_tokens.labels(name).inc(stats.num_draft_tokens)
        self.accepted_tokens.labels(name).inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position, start=1):
            self.accepted_per_pos.labels(name, str(position)).inc(count)
        per_pass = self.tokens_per_pass.labels(name)
        for tokens in stats.tokens_per_pass:
            per_pass.observe(tokens)
        if stats.draft_budget is not None:
            self.draft_budget.labels(name).observe(stats.draft_budget)
            self.plain_steps.labels(name).inc(stats.draft_budget == 0)
            batch = _bucket_label(stats.num_decoding)
            self.steps_by_batch.labels(name, batch).inc()
            self.drafting_steps_by_batch.labels(name, batch).inc(stats.draft_budget > 0)


def _bucket_label(num_decoding: int) -> str:
    """The draft controller's batch-size bucket of a step: "1", "2-3", "4-7", ..."""
    low, high = batch_bucket(num_decoding)
    return str(low) if low == high else f"{low}-{high}"
