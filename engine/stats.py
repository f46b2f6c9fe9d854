"""Plain records of what each engine step did, for metrics exporters (no Prometheus here)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time_s: float  # arrival to first scheduled
    ttft_s: float | None  # arrival to first token
    e2e_latency_s: float


@dataclass(frozen=True)
class StepStats:
    timestamp: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_prompt_tokens: int  # prompt tokens computed in this step
    num_generation_tokens: int  # tokens emitted in this step
    num_preemptions: int
    num_prefix_cache_queries: int  # tokens looked up in the prefix cache
    num_prefix_cache_hits: int
    num_drafts: int = 0  # sequences that verified a draft tree
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # accepted drafts by depth (index 0: depth 1)
    propose_time_s: float = 0.0
    verify_time_s: float = 0.0
    accept_time_s: float = 0.0
    time_to_first_tokens_s: tuple[float, ...] = ()
    inter_token_latencies_s: tuple[float, ...] = ()
    finished: tuple[FinishedRequestStats, ...] = field(default_factory=tuple)
