"""Plain records of what each engine step did, for metrics exporters (no Prometheus here).

Times are seconds (monotonic differences), counts are tokens or sequences as named. A listener in
`LLMEngine.stats_listeners` receives one `StepStats` per step, and one more after an abort, so
gauges move without a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str  # "stop", "length" or "abort" (n > 1: "stop" if any choice stopped)
    num_prompt_tokens: int
    num_generation_tokens: int  # over all n choices
    queue_time_s: float  # arrival to first scheduled (to the abort, if never scheduled)
    ttft_s: float | None  # arrival to first token; None if it never got one
    e2e_latency_s: float  # arrival to finish


@dataclass(frozen=True)
class StepStats:
    timestamp: float  # wall clock (time.time()) at the end of the step
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
    # Tokens each drafted sequence emitted from this step's target pass (accepted + bonus, cut
    # at a stop): one entry per entry of `num_drafts`.
    tokens_per_pass: tuple[int, ...] = ()
    # Draft tokens the draft policy chose to verify across the batch (0: the step decoded
    # plainly); None without the adaptive policy or when no sequence could draft.
    draft_budget: int | None = None
    num_decoding: int = 0  # decoding sequences of the step (prefill chunks aside), where counted
    propose_time_s: float = 0.0
    verify_time_s: float = 0.0
    accept_time_s: float = 0.0
    other_time_s: float = 0.0  # the rest of the step: scheduling, the draft controller, commit
    # One entry per request whose first token came in this step: arrival to this step's commit.
    time_to_first_tokens_s: tuple[float, ...] = ()
    # One entry per later token emitted in this step: the time since the request's previous
    # delta, spread evenly over the tokens of this delta (a pass that emits 3 tokens 30 ms after
    # the last gives three 10 ms entries), so the mean is the time per output token.
    inter_token_latencies_s: tuple[float, ...] = ()
    finished: tuple[FinishedRequestStats, ...] = field(default_factory=tuple)
