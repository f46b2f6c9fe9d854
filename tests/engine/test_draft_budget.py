"""The draft budget keeps the draft nodes worth their verify cost across the batch, and skips
drafting when plain decoding is predicted to be faster."""

from __future__ import annotations

import math

import pytest
import torch

from engine.execution.verify_cost import VerifyCost, measure_verify_cost, node_logits_with_pass
from engine.spec.draft_budget import DraftBudget, StepOutcome
from tests.engine.helpers import tiny_engine


def linear_cost(base: float, per_token: float) -> VerifyCost:
    return VerifyCost((1, 4096), (base + per_token, base + 4096 * per_token))


def values(*rows: list[float]) -> torch.Tensor:
    """[B, M] path log-probabilities from acceptance probabilities (0: may not keep)."""
    return torch.tensor([[math.log(p) if p else -math.inf for p in row] for row in rows])


def step(outside_pass: float, num_decoding: int = 4, prefilled=False) -> StepOutcome:
    """A step whose pass took 0.1 s and which spent `outside_pass` seconds around it."""
    return StepOutcome(0.1 + outside_pass, 0.1, num_decoding, prefilled)


def measure_a_plain_step(budget: DraftBudget, num_sequences: int, seconds: float) -> None:
    """A plain step that spent `seconds` outside its pass: drafting steps are weighed against it."""
    budget.observe_step(step(seconds, num_sequences))


def test_verify_cost_interpolates_and_extends_the_last_slope():
    cost = VerifyCost((1, 2, 4), (1.0, 1.0, 3.0))
    assert cost([0, 1, 3, 4, 8]).tolist() == [1.0, 1.0, 2.0, 3.0, 7.0]
    assert cost(2) == 1.0 and cost(16) == 15.0


def test_the_lm_head_cost_rises_from_nothing_through_its_measurements():
    cost = VerifyCost((1,), (1.0,), (1, 2, 4), (0.5, 0.5, 1.5))
    assert cost.logits([0, 0.5, 1, 2, 3, 4, 8]).tolist() == [0.0, 0.25, 0.5, 0.5, 1.0, 1.5, 3.5]


def test_a_dear_acceptance_walk_keeps_drafts_out_unless_the_pass_brings_their_logits():
    flat_verify = ((1, 4096), (1.0, 1.0))
    cheap_walk = DraftBudget(VerifyCost(*flat_verify, (1, 64), (0.01, 0.64)))
    # an lm_head whose calls cost 10 s, about as much for 8 rows as for one, 10 s a row beyond
    dear_walk = DraftBudget(VerifyCost(*flat_verify, (1, 8, 64), (10.0, 10.0, 570.0)))
    five = values(*[[0.9, 0.8]] * 5)  # 5 sequences: their roots and 3 nodes are 8 rows
    assert cheap_walk.allocate(five, 5) == [2] * 5
    # Beyond 8 rows the nodes' logits cost 10 s each, in the pass or the walk; up to 8 the
    # pass's own call brings them.
    assert dear_walk.allocate(five, 5) == [1, 1, 1, 0, 0]
    assert dear_walk.allocate(values([0.9, 0.8]), 1) == [2]


def test_a_pass_brings_its_nodes_logits_while_that_costs_less_than_a_walk_call():
    # the default model's lm_head on the AMD EPYC (ms by rows)
    cost = VerifyCost((1,), (30.0,), (1, 8, 16, 32, 64), (4.5, 4.8, 5.7, 9.9, 17.7))
    # 4 trees of 4 tokens: 12 nodes beside 4 roots cost 0.9 ms, a walk call over 4 rows 4.8
    assert node_logits_with_pass(cost, 4, 12, 4)
    # 16 trees of 4 tokens: 48 nodes cost 12 ms, a walk call 5.7
    assert not node_logits_with_pass(cost, 16, 48, 16)
    assert node_logits_with_pass(cost, 16, [0, 4, 48], 16).tolist() == [True, True, False]
    # unmeasured: as many rows as about cost one
    assert node_logits_with_pass(None, 4, 4, 4) and not node_logits_with_pass(None, 4, 12, 4)


def test_free_verification_keeps_every_node_a_sequence_may_keep():
    budget = DraftBudget(VerifyCost((1, 2), (0.1, 0.1)))
    assert budget.allocate(values([0.9, 0.2, 0.01], [0.5, 0.0, 0.0]), 2) == [3, 1]


def test_the_best_nodes_across_the_batch_win():
    # AR: 2 tokens in 1.2 s. A node of acceptance p pays while p > 0.1 * rate: 0.9, 0.8 and 0.5
    # do (4.2 tokens in 1.5 s), 0.1 no longer does.
    budget = DraftBudget(linear_cost(1.0, 0.1))
    assert budget.allocate(values([0.9, 0.8, 0.05], [0.5, 0.1, 0.01]), 2) == [2, 1]


def test_verification_dearer_than_any_draft_means_plain_decoding():
    budget = DraftBudget(linear_cost(0.01, 1.0))
    assert budget.allocate(values([0.9, 0.8], [0.7, 0.6]), 2) == [0, 0]


def test_an_overconfident_head_is_calibrated_down():
    budget = DraftBudget(linear_cost(1.0, 0.1))
    confident = values([0.9, 0.8, 0.6], [0.7, 0.5, 0.3])
    assert budget.allocate(confident, 2) == [3, 2]
    for _ in range(100):
        budget.observe_acceptance(expected=2.0, accepted=0)  # the drafts are never right
    assert budget.calibration < 0.1
    assert budget.allocate(confident, 2) == [0, 0]


def test_drafting_is_skipped_when_it_costs_more_than_it_saves_and_probed_again():
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=4)
    assert budget.should_draft(8, 8)  # nothing known yet: draft, and measure
    budget.allocate(values(*[[0.3, 0.1]] * 8), 8)
    budget.observe_draft(8, 0.5)  # drafting takes longer than a whole pass
    decisions = [budget.should_draft(8, 8) for _ in range(6)]
    assert decisions == [False, False, False, False, True, False]
    assert not budget.should_draft(0, 4)  # nobody decodes: nothing to draft for


def test_cheap_drafting_with_good_drafts_goes_ahead():
    budget = DraftBudget(linear_cost(0.1, 0.001))
    budget.allocate(values(*[[0.9, 0.8, 0.7]] * 4), 4)
    budget.observe_draft(4, 0.01)
    assert all(budget.should_draft(4, 4) for _ in range(20))


@pytest.mark.parametrize("spread", [(4, 10), (4, 4)])
def test_drafting_time_is_fitted_against_the_batch(spread):
    budget = DraftBudget(linear_cost(0.1, 0.001))
    for size in spread:
        budget.observe_draft(size, 0.01 + 0.002 * size)
    expected = 0.01 + 0.002 * 7 if spread[0] != spread[1] else 0.01 + 0.002 * 4
    assert budget._draft_seconds(7) == pytest.approx(expected)


def test_measured_cost_grows_with_the_pass(generation_model):
    engine = tiny_engine(generation_model, max_num_batched_tokens=64)
    cost = measure_verify_cost(engine.runner, 64, tokens_per_sequence=4, repeats=1)
    assert cost.num_tokens == (1, 2, 4, 8, 16, 32, 64)
    assert all(b >= a > 0 for a, b in zip(cost.seconds, cost.seconds[1:]))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def realize(budget: DraftBudget, num_sequences: int, drafting_speedup: float, times: int = 16):
    """Steps of both kinds at this batch size, drafting ones `drafting_speedup` times as fast."""
    for _ in range(times):
        budget.realized.record(False, num_sequences, num_sequences, 0.1)
        budget.realized.record(True, num_sequences, num_sequences * drafting_speedup, 0.1)


def test_probes_that_find_drafting_losing_cost_one_percent_and_reset_when_it_wins():
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=4)
    hopeless = values(*[[0.01, 0.01]] * 8)
    budget.observe_draft(8, 0.05)  # a probe's drafting: half a plain step (0.108 s)
    realize(budget, 8, drafting_speedup=0.8)  # drafting steps have been slower
    assert budget.should_draft(8, 8)  # nothing known of the drafts yet: a probe
    budget.allocate(hopeless, 8)
    gaps = []
    for _ in range(3):
        plain = 0
        while not budget.should_draft(8, 8):
            plain += 1
        gaps.append(plain)
        budget.allocate(hopeless, 8)
    assert gaps == [47, 47, 47]  # 0.05 s of drafting is 1% of 47 plain steps' 5.1 s
    realize(budget, 8, drafting_speedup=1.3, times=32)  # the traffic changed: drafting wins
    assert budget.should_draft(8, 8)
    assert budget.interval == 4  # when plain steps follow, probes come often again


def test_losing_probes_back_off_by_all_a_drafting_step_really_costs():
    """A probe costs its drafting and also its larger pass and walk: with drafting steps that
    took 0.3 s beside plain ones of 0.1 s, 1% of the time is one probe in 186 steps (a plain
    pass of 0.108 s), where the drafting time alone (0.05 s) would allow one in 47."""
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=4)
    budget.observe_draft(8, 0.05)
    for _ in range(32):
        budget.realized.record(False, 8, 8, 0.1)
        budget.realized.record(True, 8, 8 * 1.2, 0.3)  # more tokens, for thrice the time
    assert budget.should_draft(8, 8)  # a probe
    budget.allocate(values(*[[0.01, 0.01]] * 8), 8)
    assert budget.interval == 186


def test_probes_stay_frequent_until_the_realized_rates_say_drafting_loses():
    """A cost model made pessimistic by its first probes must not back the probes off: they are
    what would show it wrong."""
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=4)
    budget.observe_draft(16, 0.05)  # drafting for 16 sequences: half a pass
    assert budget.should_draft(16, 16)  # nothing known yet: a probe
    one_good_node_each_in_two = values(*[[0.9, 0.01]] * 2, *[[0.01, 0.01]] * 14)
    assert sum(budget.allocate(one_good_node_each_in_two, 16)) == 2
    assert budget.interval == 4  # the model says drafting loses; nothing realized says so yet
    realize(budget, 16, drafting_speedup=0.9)
    while not budget.should_draft(16, 16):
        pass  # plain until the next probe
    budget.allocate(one_good_node_each_in_two, 16)
    assert budget.interval == 44  # now it does: 1% of 44 steps of 0.116 s


def test_realized_rates_overrule_the_cost_model_both_ways():
    # probes aside: they would draft now and then whatever the verdict
    cheap_and_good = DraftBudget(linear_cost(0.1, 0.001), probe_interval=1000)
    cheap_and_good.allocate(values(*[[0.9, 0.8, 0.7]] * 4), 4)
    cheap_and_good.observe_draft(4, 0.01)
    assert cheap_and_good.should_draft(4, 4)  # the model predicts drafting wins ...
    realize(cheap_and_good, 4, drafting_speedup=0.9)
    assert not any(cheap_and_good.should_draft(4, 4) for _ in range(15))  # ... it did not
    dear_and_poor = DraftBudget(linear_cost(0.1, 0.001), probe_interval=1000)
    dear_and_poor.allocate(values(*[[0.2, 0.1]] * 4), 4)
    dear_and_poor.observe_draft(4, 0.2)
    assert not dear_and_poor.should_draft(4, 4)  # the model predicts drafting loses ...
    realize(dear_and_poor, 4, drafting_speedup=1.1)
    assert all(dear_and_poor.should_draft(4, 4) for _ in range(20))  # ... it won


def test_realized_rates_too_close_to_call_still_outweigh_the_cost_model():
    """Drafting steps 0.9x as fast as plain ones, but so uneven that the two rates stand within
    two standard errors: the clock's lean, not the model's optimism, decides (probes aside)."""
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=1000)
    budget.allocate(values(*[[0.9, 0.8, 0.7]] * 4), 4)
    budget.observe_draft(4, 0.01)
    assert budget.should_draft(4, 4)  # the model predicts drafting wins
    for tokens_per_sequence in [0.5, 1.3] * 8:  # mean 0.9 a step, plain steps 1.0
        budget.realized.record(False, 4, 4, 0.1)
        budget.realized.record(True, 4, 4 * tokens_per_sequence, 0.1)
    assert budget.realized.drafting_wins(4) is None  # too close for a verdict ...
    assert not any(budget.should_draft(4, 4) for _ in range(20))  # ... but plain is ahead


def test_a_lead_within_the_noise_and_under_five_percent_decodes_plainly():
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=1000)
    budget.allocate(values(*[[0.9, 0.8, 0.7]] * 4), 4)
    budget.observe_draft(4, 0.01)
    for tokens_per_sequence in [0.53, 1.53] * 8:  # mean 1.03 a step, plain steps 1.0
        budget.realized.record(False, 4, 4, 0.1)
        budget.realized.record(True, 4, 4 * tokens_per_sequence, 0.1)
    assert budget.realized.drafting_wins(4) is None
    assert not any(budget.should_draft(4, 4) for _ in range(20))
    for tokens_per_sequence in [0.6, 1.6] * 16:  # mean 1.1: a lead worth taking
        budget.realized.record(True, 4, 4 * tokens_per_sequence, 0.1)
    assert budget.realized.drafting_wins(4) is None
    assert budget.should_draft(4, 4)


def test_probes_come_four_times_as_far_apart_while_drafting_trails_within_the_noise():
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=4)
    for tokens_per_sequence in [0.5, 1.3] * 8:  # drafting at 0.9x, too uneven for a verdict
        budget.realized.record(False, 4, 4, 0.1)
        budget.realized.record(True, 4, 4 * tokens_per_sequence, 0.1)
    assert budget.should_draft(4, 4)  # nothing known of the drafts yet: a probe
    budget.allocate(values(*[[0.5, 0.4]] * 4), 4)
    plain = 0
    while not budget.should_draft(4, 4):
        plain += 1
    assert plain == 16


def test_probes_trailing_by_more_come_further_apart():
    """Drafting at 0.8x (0.02 s lost a step against plain steps of 0.1 s), still too uneven for
    a verdict: probes 20 plain steps apart, where a 1% share of passes of 0.104 s lands."""
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=4)
    for tokens_per_sequence in [0.2, 1.4] * 8:
        budget.realized.record(False, 4, 4, 0.1)
        budget.realized.record(True, 4, 4 * tokens_per_sequence, 0.1)
    assert budget.realized.drafting_wins(4) is None
    assert abs(budget.realized.lost_seconds(4) - 0.02) < 1e-9
    assert budget.should_draft(4, 4)
    budget.allocate(values(*[[0.5, 0.4]] * 4), 4)
    plain = 0
    while not budget.should_draft(4, 4):
        plain += 1
    assert plain == 20


def test_steps_with_prompt_tokens_draft_only_on_a_clear_verdict():
    """A prefill chunk beside 4 decodes: neither a due probe nor the model's optimism drafts
    there, only realized rates that clearly favour drafting."""
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=4)
    assert not budget.should_draft(4, 4 + 64)  # no value curve yet: a probe, but not here
    assert budget.should_draft(4, 4)  # the probe comes at the next decode-only step
    budget.allocate(values(*[[0.9, 0.8, 0.7]] * 4), 4)
    budget.observe_draft(4, 0.01)
    assert budget.should_draft(4, 4)  # the model predicts drafting wins ...
    assert not budget.should_draft(4, 4 + 64)  # ... not enough beside a chunk
    realize(budget, 4, drafting_speedup=1.3)
    assert budget.should_draft(4, 4 + 64)


def test_each_batch_size_bucket_goes_by_its_own_realized_rates():
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=1000)
    budget.allocate(values([0.5, 0.5]), 1)
    realize(budget, 1, drafting_speedup=1.2)
    realize(budget, 4, drafting_speedup=0.9)
    assert budget.should_draft(1, 1)
    assert not budget.should_draft(5, 5)  # 4 to 7 sequences share a bucket
    assert budget.should_draft(1, 1)


def test_a_drafting_bucket_takes_a_plain_step_every_32_drafts():
    budget = DraftBudget(linear_cost(0.1, 0.001))
    budget.allocate(values([0.5, 0.5]), 1)
    realize(budget, 1, drafting_speedup=1.2)
    decisions = [budget.should_draft(1, 1) for _ in range(66)]
    assert [i for i, drafts in enumerate(decisions) if not drafts] == [32, 65]


def test_one_good_probe_after_a_plain_stretch_turns_drafting_back_on():
    """The value estimate ages with the steps skipped: a probe after a long plain stretch
    outweighs the stale drafts before it."""
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=16)
    budget.observe_draft(1, 0.05)  # drafting costs half a pass: it takes good drafts to pay
    for _ in range(40):  # a long bad stretch: drafts nearly worthless
        budget.should_draft(1, 1)
        budget.allocate(values([0.02, 0.01]), 1)
    while not budget.should_draft(1, 1):
        pass  # plain until the probe
    budget.allocate(values([0.95, 0.9]), 1)  # the drafts have turned good
    assert budget.should_draft(1, 1)


def test_plain_steps_catch_the_head_up_every_32nd_step():
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=1000)
    budget.allocate(values(*[[0.01, 0.01]] * 2), 2)
    budget.observe_draft(2, 0.5)
    due = []
    for _ in range(64):
        assert not budget.should_draft(2, 2)
        due.append(budget.head_catch_up_due())
    assert due == [i % 32 == 31 for i in range(64)]


def test_drafting_cost_is_what_a_drafting_step_adds_outside_the_pass():
    budget = DraftBudget(linear_cost(0.1, 0.001), probe_interval=1)
    assert budget.should_draft(4, 4)  # nothing known yet: a probe
    budget.allocate(values(*[[0.5, 0.5]] * 4), 4)  # drafting for 4 sequences ...
    budget.observe_step(step(0.032))  # ... spent 32 ms outside the pass
    assert budget._draft_seconds(4) == pytest.approx(0.032)  # no plain step to weigh it against
    measure_a_plain_step(budget, 2, 0.001)
    measure_a_plain_step(budget, 6, 0.003)  # a plain step: 0.5 ms a sequence outside its pass
    assert budget.plain_fit == (pytest.approx(0.0), pytest.approx(0.0005))
    assert budget.should_draft(4, 4)
    budget.allocate(values(*[[0.5, 0.5]] * 4), 4)
    budget.observe_step(step(0.032))
    assert budget.draft_times[-1] == (4, pytest.approx(0.030))  # 2 ms of it a plain step's
    assert budget.should_draft(4, 4)
    budget.allocate(values(*[[0.5, 0.5]] * 4), 4)
    budget.observe_step(step(0.5, prefilled=True))  # a step that prefilled a prompt chunk too
    assert len(budget.draft_times) == 2


def test_a_drafting_cost_measured_on_whole_steps_turns_a_losing_batch_plain():
    """Verifying is cheap here and the drafts are fair: drafting for four sequences pays if it
    costs 5 ms a step, and loses if the whole step spends 40 ms around its pass."""

    def after_a_probe_costing(seconds: float) -> bool:
        budget = DraftBudget(linear_cost(0.06, 0.001), probe_interval=1000)
        assert budget.should_draft(4, 4)  # nothing known yet: a probe
        budget.allocate(values(*[[0.45, 0.25]] * 4), 4)
        budget.observe_step(step(seconds))
        return budget.should_draft(4, 4)

    assert after_a_probe_costing(0.005)
    assert not after_a_probe_costing(0.040)
