"""Unit tests of the Scheduler: token budget, running before waiting, chunked prefill, preemption
of the newest sequence, max_num_seqs, and prefix-cache hits. Steps are simulated as the engine does
them (computed tokens advance; a sequence whose chunk reaches its end gains a sampled token)."""

from __future__ import annotations

import itertools

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.request import Request, Sequence, SequenceStatus
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.outputs import RequestMetrics
from engine.sampling.sampling_params import SamplingParams

BLOCK_SIZE = 4
SAMPLED_TOKEN = 7
_ids = itertools.count()


def make_scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 64, **options) -> Scheduler:
    config = EngineConfig(
        block_size=BLOCK_SIZE, max_num_batched_tokens=max_num_batched_tokens, **options
    )
    return Scheduler(config, BlockManager(num_blocks, BLOCK_SIZE))


def make_seq(prompt: int | list[int], n: int = 1) -> Sequence:
    """The first sequence of a fresh request; an int prompt is that many tokens of its own."""
    seq_id = next(_ids)
    if isinstance(prompt, int):
        prompt = list(range(1000 * seq_id, 1000 * seq_id + prompt))
    request = Request(
        f"r{seq_id}", None, prompt, SamplingParams(n=n), 10_000, frozenset(), RequestMetrics(0.0)
    )
    seq = Sequence(seq_id, request, 0, list(prompt), len(prompt), None)
    request.sequences.append(seq)
    return seq


def add(scheduler: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        scheduler.add(seq)


def complete(scheduler: Scheduler, batch: SchedulerOutput) -> None:
    """What the engine does after the forward pass of `batch`."""
    for item in batch.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        scheduler.block_manager.cache_computed_blocks(item.seq)
        if samples:
            item.seq.token_ids.append(SAMPLED_TOKEN)


def step(scheduler: Scheduler) -> SchedulerOutput:
    batch = scheduler.schedule()
    complete(scheduler, batch)
    return batch


def layout(batch: SchedulerOutput) -> list[tuple[int, int]]:
    """(seq id, tokens computed this step) in batch order."""
    return [(item.seq.seq_id, item.num_new_tokens) for item in batch.scheduled]


def test_token_budget_is_respected() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    a, b, c = make_seq(10), make_seq(10), make_seq(10)
    add(scheduler, a, b, c)
    first = step(scheduler)
    assert layout(first) == [(a.seq_id, 10), (b.seq_id, 6)]  # b's prompt is cut to the budget
    assert first.num_batched_tokens == 16
    assert list(scheduler.waiting) == [c]
    second = step(scheduler)
    assert layout(second) == [(a.seq_id, 1), (b.seq_id, 4), (c.seq_id, 10)]
    assert second.num_batched_tokens == 15
    for _ in range(5):
        assert step(scheduler).num_batched_tokens <= 16


def test_running_sequences_go_before_waiting_ones() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    old = make_seq(5)
    add(scheduler, old)
    step(scheduler)
    new = make_seq(20)
    add(scheduler, new)
    batch = step(scheduler)
    assert layout(batch) == [(old.seq_id, 1), (new.seq_id, 7)]
    assert scheduler.running == [old, new]
    assert new.status == SequenceStatus.RUNNING


def test_chunked_prefill_splits_a_long_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(20)
    add(scheduler, seq)
    chunks, samples = [], []
    while seq.num_output_tokens == 0:
        (item,) = scheduler.schedule().scheduled
        chunks.append(item.num_new_tokens)
        samples.append(item.samples)
        complete(scheduler, SchedulerOutput([item]))
    assert chunks == [8, 8, 4]
    assert samples == [False, False, True]  # only the chunk reaching the last token samples
    assert len(seq.block_table) == 5
    (decode,) = scheduler.schedule().scheduled
    assert decode.num_new_tokens == 1 and decode.samples


def test_without_chunked_prefill_a_prompt_waits_for_room_in_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b = make_seq(10), make_seq(10)
    add(scheduler, a, b)
    assert layout(step(scheduler)) == [(a.seq_id, 10)]  # b does not fit in the 6 left
    assert layout(step(scheduler)) == [(a.seq_id, 1), (b.seq_id, 10)]


def test_newest_sequence_is_preempted_when_blocks_run_out() -> None:
    scheduler = make_scheduler(num_blocks=6)
    a, b, c = make_seq(6), make_seq(8), make_seq(7)
    add(scheduler, a, b, c)
    step(scheduler)  # each holds 2 blocks: the pool is full
    assert scheduler.block_manager.num_free_blocks == 0
    late = make_seq(1)
    add(scheduler, late)

    batch = step(scheduler)  # a's 7th token fits its blocks; b's 9th needs a third block

    assert batch.preempted == [c]
    assert layout(batch) == [(a.seq_id, 1), (b.seq_id, 1)]  # nobody admitted in this step
    assert scheduler.num_preemptions == 1
    assert scheduler.running == [a, b]
    assert list(scheduler.waiting) == [c, late]  # the preempted one is first in line
    assert c.status == SequenceStatus.WAITING
    assert c.num_computed_tokens == 0 and c.block_table == []
    assert c.num_tokens == 8  # its sampled token is kept and will be recomputed
    assert (len(a.block_table), len(b.block_table)) == (2, 3)


def test_preempted_sequence_recomputes_before_newer_ones_start() -> None:
    scheduler = make_scheduler(num_blocks=6)
    a, b, c = make_seq(8), make_seq(8), make_seq(7)
    add(scheduler, a, b, c)
    step(scheduler)
    step(scheduler)  # preempts c
    late = make_seq(5)
    add(scheduler, late)
    scheduler.finish(a, SequenceStatus.FINISHED_LENGTH)  # frees 3 blocks
    assert a.block_table == []
    batch = step(scheduler)
    assert layout(batch) == [(b.seq_id, 1), (c.seq_id, 8)]  # c recomputes prompt + its token
    assert list(scheduler.waiting) == [late]  # 1 block left, it needs 2
    assert scheduler.block_manager.num_free_blocks == 1


def test_a_sequence_that_cannot_fit_preempts_itself_last() -> None:
    scheduler = make_scheduler(num_blocks=4)
    a, b = make_seq(8), make_seq(8)
    add(scheduler, a, b)
    step(scheduler)
    batch = step(scheduler)  # a needs a block: b goes; then a fits
    assert batch.preempted == [b]
    assert layout(batch) == [(a.seq_id, 1)]


def test_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3) for _ in range(5)]
    add(scheduler, *seqs)
    assert [i.seq for i in step(scheduler).scheduled] == seqs[:2]
    assert len(step(scheduler).scheduled) == 2
    scheduler.finish(seqs[0], SequenceStatus.FINISHED_STOPPED)
    batch = step(scheduler)
    assert [i.seq for i in batch.scheduled] == [seqs[1], seqs[2]]
    assert len(scheduler.running) == 2


def test_max_num_seqs_counts_the_choices_a_request_will_fork() -> None:
    """An n=3 request becomes 3 sequences after its prefill: it takes 3 of the max_num_seqs."""
    scheduler = make_scheduler(max_num_seqs=4)
    first, second, single = make_seq(3, n=3), make_seq(3, n=3), make_seq(3)
    add(scheduler, first, second, single)
    assert [i.seq for i in step(scheduler).scheduled] == [first]
    scheduler.waiting.remove(second)
    assert [i.seq for i in step(scheduler).scheduled] == [first, single]


def test_prefix_cache_hit_is_reported_and_skipped() -> None:
    scheduler = make_scheduler()
    a = make_seq(10)
    add(scheduler, a)
    first = step(scheduler)
    assert (first.num_cache_queried_tokens, first.num_cache_hit_tokens) == (10, 0)
    b = make_seq([*a.token_ids[:10], 5])
    add(scheduler, b)
    batch = step(scheduler)
    assert (batch.num_cache_queried_tokens, batch.num_cache_hit_tokens) == (11, 8)
    assert layout(batch)[-1] == (b.seq_id, 3)  # only the tokens after the 2 cached blocks
    assert b.block_table[:2] == a.block_table[:2]


def test_finish_frees_blocks_of_running_and_waiting_sequences() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = make_seq(6), make_seq(6)
    add(scheduler, a, b)
    step(scheduler)
    scheduler.finish(a, SequenceStatus.FINISHED_ABORTED)
    scheduler.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert scheduler.schedule().scheduled == []


def test_draft_scratch_goes_only_to_the_sequences_that_draft() -> None:
    """A plain step reserves no scratch, so the prompt chunk beside the decodes gets the budget
    plain decoding would give it; a drafting step reserves it for the chosen sequences only."""
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    scheduler = Scheduler(config, BlockManager(64, BLOCK_SIZE), num_lookahead_tokens=4)
    a, b = make_seq(3), make_seq(3)
    add(scheduler, a, b)
    step(scheduler)
    assert scheduler.decoding_sequences() == [a, b] and not scheduler.prompts_pending()
    long = make_seq(40)
    add(scheduler, long)
    assert scheduler.prompts_pending()

    batch = scheduler.schedule(drafts=set())
    assert [(i.num_new_tokens, i.num_lookahead, i.decoding) for i in batch.scheduled] == [
        (1, 0, True), (1, 0, True), (14, 0, False),
    ]  # fmt: skip
    complete(scheduler, batch)
    batch = scheduler.schedule(drafts={b.seq_id})
    assert [(i.num_new_tokens, i.num_lookahead) for i in batch.scheduled] == [
        (1, 0),
        (1, 4),
        (10, 0),
    ]
    complete(scheduler, batch)
    batch = scheduler.schedule()  # None: every decoding sequence may draft
    assert [(i.num_new_tokens, i.num_lookahead) for i in batch.scheduled] == [
        (1, 4),
        (1, 4),
        (6, 0),
    ]
