"""The StepStats records the engine emits (what server/metrics turns into Prometheus series):
token counts, time to first token and inter-token latencies, queue time, and the speculation
counts, checked against what the requests did."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.stats import StepStats
from tests.conftest import save_random_head
from tests.engine.helpers import cpu_options, tiny_llm


def recorded(llm: LLM) -> list[StepStats]:
    records: list[StepStats] = []
    llm.engine.stats_listeners.append(records.append)
    return records


def run(llm: LLM) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def greedy(max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **options)


def test_every_token_is_counted_once(generation_model) -> None:
    llm = tiny_llm(generation_model)
    records = recorded(llm)
    for i in range(3):
        llm.engine.add_request(f"r{i}", [5 + i, 6, 7], greedy(10))
    llm.engine.add_request("n2", [9, 9], greedy(10, n=2))
    run(llm)
    assert sum(r.num_generation_tokens for r in records) == 3 * 10 + 2 * 10
    assert sum(len(r.time_to_first_tokens_s) for r in records) == 4
    # one latency per token after the first; the two choices of n=2 decode side by side
    assert sum(len(r.inter_token_latencies_s) for r in records) == 4 * 9
    by_tokens = sorted(f.num_generation_tokens for r in records for f in r.finished)
    assert by_tokens == [10, 10, 10, 20]
    assert {f.finish_reason for r in records for f in r.finished} == {"length"}


def test_latencies_of_a_lone_request_add_up(generation_model) -> None:
    llm = tiny_llm(generation_model)
    records = recorded(llm)
    llm.engine.add_request("alone", [5, 6, 7], greedy(12))
    run(llm)
    (done,) = [f for r in records for f in r.finished]
    (ttft,) = [t for r in records for t in r.time_to_first_tokens_s]
    itls = [t for r in records for t in r.inter_token_latencies_s]
    assert ttft == done.ttft_s
    assert 0 <= done.queue_time_s <= done.ttft_s <= done.e2e_latency_s
    assert sum(itls) == pytest.approx(done.e2e_latency_s - done.ttft_s, abs=1e-9)


def test_queue_time_is_the_wait_for_a_slot(generation_model) -> None:
    """With one slot, the second of two simultaneous requests waits while the first runs."""
    llm = tiny_llm(generation_model, max_num_seqs=1)
    records = recorded(llm)
    arrival = time.monotonic()
    for name in ("first", "second"):
        llm.engine.add_request(
            name, llm.engine.make_request(name, [5, 6], greedy(8), arrival_time=arrival)
        )
    run(llm)
    first, second = [f for r in records for f in r.finished]
    assert first.queue_time_s < first.ttft_s
    assert second.queue_time_s >= first.e2e_latency_s


def test_a_request_aborted_while_waiting_queued_all_along(generation_model) -> None:
    llm = tiny_llm(generation_model)
    records = recorded(llm)
    llm.engine.add_request("gone", [5, 6], greedy(8))
    llm.engine.abort_request("gone")
    ((aborted,),) = [r.finished for r in records if r.finished]
    assert aborted.finish_reason == "abort" and aborted.ttft_s is None
    assert aborted.queue_time_s == aborted.e2e_latency_s > 0
    assert records[-1].num_running == records[-1].num_waiting == 0


def test_speculative_steps_report_each_pass(generation_model, tmp_path: Path) -> None:
    depth = 3
    head = save_random_head(tmp_path / "head", generation_model)
    llm = LLM(
        str(generation_model),
        draft=str(head),
        draft_depth=depth,
        draft_top_k=2,
        draft_total_tokens=6,
        adaptive_draft_budget=False,
        **cpu_options(),
    )
    records = recorded(llm)
    llm.engine.add_request("a", [5, 6, 7], greedy(9))
    llm.engine.add_request("b", [8, 9], greedy(5))
    run(llm)
    for r in records:
        assert len(r.tokens_per_pass) == r.num_drafts
        assert all(1 <= t <= depth + 1 for t in r.tokens_per_pass)
        assert sum(r.tokens_per_pass) <= r.num_generation_tokens
        assert sum(r.accepted_per_position) == r.num_accepted_tokens
        assert r.num_draft_tokens <= r.num_drafts * 5
    # every token but each request's first (from its prefill) comes from a speculative pass
    assert sum(sum(r.tokens_per_pass) for r in records) == (9 - 1) + (5 - 1)
    assert sum(r.num_generation_tokens for r in records) == 9 + 5
