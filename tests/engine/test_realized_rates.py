"""RealizedRates: the wall clock's verdict on drafting, per batch-size bucket, once it is clear."""

from __future__ import annotations

import random

from engine.spec.realized_rates import RealizedRates


def record_steps(rates: RealizedRates, drafted: bool, tokens: list[float], seconds: float) -> None:
    """Steps of one sequence each, emitting `tokens[i]` tokens in `seconds`."""
    for num_tokens in tokens:
        rates.record(drafted, 1, num_tokens, seconds)


def assert_plain_step_due_after(rates: RealizedRates, num_drafts: int) -> None:
    """One sequence's bucket is due a plain step after `num_drafts` drafting decisions, not
    before."""
    for _ in range(num_drafts - 1):
        rates.decided(1, drafts=True)
    assert not rates.plain_probe_due(1)
    rates.decided(1, drafts=True)
    assert rates.plain_probe_due(1)


def test_no_verdict_until_both_kinds_have_been_seen_enough():
    rates = RealizedRates(min_drafted=4, min_plain=4)
    record_steps(rates, True, [3, 3, 3, 3], 0.02)
    record_steps(rates, False, [1, 1, 1], 0.02)
    assert rates.drafting_wins(1) is None  # three plain steps: not yet
    rates.record(False, 1, 1, 0.02)
    assert rates.drafting_wins(1) is True


def test_a_difference_within_the_noise_of_the_steps_gives_no_verdict():
    """At one sequence a drafting step emits 1 to 4 tokens: four lucky or unlucky steps must
    not settle anything."""
    rates = RealizedRates()
    record_steps(rates, True, [2, 3, 1, 2], 0.025)  # 2 tokens a step: 80 tokens/s ...
    record_steps(rates, False, [1] * 4, 0.02)  # ... against 50
    assert rates.drafting_wins(1) is None
    record_steps(rates, True, [2, 3, 1, 2] * 3, 0.025)  # 16 such steps: now it is clear
    assert rates.drafting_wins(1) is True


def test_a_head_that_wins_by_a_fifth_is_never_judged_losing():
    """Steps drawn as a weak head gives them at one sequence (1.5 tokens a step on average, for
    a quarter more time: 1.2x plain decoding), decided on after every step, with the windows
    sliding: no streak may turn the verdict against drafting, which would stick (it backs the
    probes off)."""
    rng, rates, verdicts = random.Random(0), RealizedRates(), set()
    for _ in range(2000):
        tokens = rng.choices([1, 2, 3, 4], weights=[0.65, 0.25, 0.05, 0.05])[0]
        rates.record(True, 1, tokens, 0.025)
        rates.record(False, 1, 1, rng.uniform(0.019, 0.021))
        verdicts.add(rates.drafting_wins(1))
    assert False not in verdicts
    assert True in verdicts  # and the gain does show


def test_a_steady_loss_is_a_verdict_and_buckets_stay_apart():
    rates = RealizedRates(min_drafted=4, min_plain=4)
    for num_sequences in (4, 5, 7):  # one bucket: 4 to 7 sequences
        rates.record(True, num_sequences, num_sequences * 1.2, 0.03)
        rates.record(False, num_sequences, num_sequences, 0.02)
    rates.record(True, 6, 7.2, 0.03)
    rates.record(False, 6, 6, 0.021)
    assert rates.drafting_wins(4) is False  # 40 tokens/s a sequence against 49
    assert rates.drafting_wins(8) is None  # 8 to 15: nothing seen


def test_a_drafting_bucket_is_due_a_plain_step_after_its_interval():
    rates = RealizedRates(plain_probe_interval=3, min_drafted=2, min_plain=2)
    record_steps(rates, True, [2, 2], 0.02)
    assert rates.plain_probe_due(1)  # drafted often, never plain: compare
    record_steps(rates, False, [1, 1], 0.02)
    assert not rates.plain_probe_due(1)
    for _ in range(3):
        rates.decided(1, drafts=True)
    assert rates.plain_probe_due(1)
    rates.decided(1, drafts=False)
    assert not rates.plain_probe_due(1)


def test_a_bucket_drafting_without_a_verdict_refreshes_its_plain_rate_sooner():
    """Drafting chosen by a lead within the noise goes by a plain window that may be a slow
    minute old: with a lead of 5% it is refreshed every `unsure_probe_interval` drafting
    decisions, not every `plain_probe_interval`."""
    rates = RealizedRates(plain_probe_interval=32, unsure_probe_interval=4, min_drafted=4)
    record_steps(rates, True, [2, 1, 1, 1.25], 0.025)  # 52.5 tokens/s, give or take 20 ...
    record_steps(rates, False, [1] * 4, 0.02)  # ... against 50: no verdict
    assert rates.drafting_wins(1) is None
    assert_plain_step_due_after(rates, 4)
    record_steps(rates, True, [2] * 16, 0.025)  # now drafting clearly wins: the long interval
    assert rates.drafting_wins(1) is True
    assert not rates.plain_probe_due(1)


def test_plain_steps_without_a_verdict_come_further_apart_the_larger_the_lead():
    """A plain step gives up what drafting leads by: at a lead of a fifth (one sequence, whose
    drafting steps' 1 to 2 tokens leave that short of a verdict), one every 4 drafting steps
    gave up 3% of the time, so they come every 16, keeping that to 1%."""
    rates = RealizedRates(plain_probe_interval=32, unsure_probe_interval=4, min_drafted=4)
    record_steps(rates, True, [2, 1, 1, 2], 0.025)  # 60 tokens/s, give or take 23 ...
    record_steps(rates, False, [1] * 4, 0.02)  # ... against 50: no verdict, a lead of 1.2x
    assert rates.drafting_wins(1) is None
    assert_plain_step_due_after(rates, 16)


def test_a_verdict_needs_fewer_drafting_steps_the_more_sequences_each_has():
    """Sixteen sequences average out a step's luck: four drafting steps settle what sixteen
    must at one sequence; the floor of four steps stays."""
    for num_sequences, needed in ((1, 16), (2, 8), (4, 4), (16, 4), (32, 4)):
        rates = RealizedRates()
        for _ in range(4):
            rates.record(False, num_sequences, num_sequences, 0.020)
        for step in range(needed):
            assert rates.drafting_wins(num_sequences) is None, (num_sequences, step)
            rates.record(True, num_sequences, 1.5 * num_sequences, 0.021 + 0.0001 * step)
        assert rates.drafting_wins(num_sequences) is True, num_sequences


def test_lost_seconds_is_a_drafting_step_less_the_plain_time_of_its_tokens():
    rates = RealizedRates()
    assert rates.lost_seconds(1) is None
    record_steps(rates, False, [1, 1], 0.02)  # 50 tokens/s
    record_steps(rates, True, [1, 2], 0.04)  # 1.5 tokens: 0.03 s of plain steps
    assert abs(rates.lost_seconds(1) - 0.01) < 1e-9
    record_steps(rates, True, [4, 4], 0.04)  # now 2.75 tokens a step in 0.04 s: a gain
    assert rates.lost_seconds(1) == 0.0


def test_extra_seconds_is_what_a_drafting_step_takes_beyond_a_plain_one():
    rates = RealizedRates()
    assert rates.extra_seconds(16) is None
    rates.record(True, 16, 20, 0.30)
    rates.record(True, 16, 20, 0.26)
    assert rates.extra_seconds(16) is None  # no plain step to compare with yet
    rates.record(False, 16, 16, 0.12)
    assert abs(rates.extra_seconds(16) - 0.16) < 1e-9
    assert rates.extra_seconds(1) is None  # another bucket
