"""The draft budget keeps the draft nodes worth their verify cost across the batch; the pass
costs it weighs them against follow live passes, robust to a noisy start-up measurement."""

from __future__ import annotations

import math

import pytest
import torch

from engine.execution.verify_cost import (
    LiveVerifyCost,
    VerifyCost,
    measure_verify_cost,
    node_logits_with_pass,
)
from engine.spec.draft_budget import DraftBudget
from engine.spec.draft_policy import DraftPolicy, StepReport
from tests.engine.helpers import tiny_engine


def linear_cost(base: float, per_token: float) -> VerifyCost:
    return VerifyCost((1, 4096), (base + per_token, base + 4096 * per_token))


def values(*rows: list[float]) -> torch.Tensor:
    """[B, M] path log-probabilities from acceptance probabilities (0: may not keep)."""
    return torch.tensor([[math.log(p) if p else -math.inf for p in row] for row in rows])


def test_verify_cost_interpolates_and_extends_the_last_slope():
    cost = VerifyCost((1, 2, 4), (1.0, 1.0, 3.0))
    assert cost([0, 1, 3, 4, 8]).tolist() == [1.0, 1.0, 2.0, 3.0, 7.0]
    assert cost(2) == 1.0 and cost(16) == 15.0


def test_a_number_costs_what_the_same_number_in_an_array_costs():
    cost = VerifyCost((1, 2, 4, 16), (1.0, 1.5, 1.5, 9.0), (1, 8), (0.25, 0.5))
    live = LiveVerifyCost(cost)
    live.observe(3, 4.0)
    points = [0, 0.5, 1, 1.5, 2, 3, 4, 7.25, 16, 17, 100]
    for price in (cost, cost.logits, live):
        assert [price(x) for x in points] == pytest.approx(price(points).tolist(), abs=1e-12)


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


def test_a_collapsed_calibration_recovers_while_drafting_steps_verify_nothing():
    """A bad stretch drove the calibration to its floor, so the budget keeps every draft out and
    no verified tree can raise it again. Drafting steps that verify nothing let it drift back
    toward its prior, and confident drafts are verified again."""
    policy = DraftPolicy(DraftBudget(linear_cost(1.0, 0.1)))
    confident = values([0.9, 0.8, 0.6], [0.7, 0.5, 0.3])
    for _ in range(100):
        policy.budget.observe_acceptance(expected=2.0, accepted=0)
    assert policy.budget.allocate(confident, 2) == [0, 0]
    unverified = StepReport(
        seconds=1.2,
        pass_seconds=1.1,
        num_pass_tokens=2,
        num_decoding=2,
        prefilled=False,
        num_tokens=2,
        trees=[],
    )
    for _ in range(100):
        policy.drafted = True
        policy.observe_step(unverified)
    assert policy.budget.calibration > 0.9
    assert policy.budget.allocate(confident, 2) == [3, 2]


def test_measured_cost_grows_with_the_pass(generation_model):
    engine = tiny_engine(generation_model, max_num_batched_tokens=64)
    cost = measure_verify_cost(engine.runner, 64, tokens_per_sequence=4, repeats=1)
    assert cost.num_tokens == (1, 2, 4, 8, 16, 32, 64)
    assert all(b >= a > 0 for a, b in zip(cost.seconds, cost.seconds[1:]))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_live_passes_replace_a_start_up_measurement_a_busy_machine_fooled():
    """Start-up read 295.6 ms for every pass of 1 to 8 tokens (three servers starting at once);
    live passes take 30 ms plus 2 ms a token. A few of them per size, and the cost follows them;
    sizes not yet seen live are scaled by the median live ratio."""
    busy = VerifyCost((1, 2, 4, 8, 16), (0.2956, 0.2956, 0.2956, 0.2956, 0.2956))
    live = LiveVerifyCost(busy)
    for _ in range(3):
        for n in (1, 4, 8):
            live.observe(n, 0.030 + 0.002 * n)
    live.observe(8, 5.0)  # one pass beside a burst of other work: the median ignores it
    assert live(1) == pytest.approx(0.032)
    assert live(4) == pytest.approx(0.038)
    assert live(8) == pytest.approx(0.046)
    assert live(2) == pytest.approx(0.2956 * live.scale)  # not seen live: scaled
    assert live(16) == pytest.approx(0.046)  # scaled, but never less than a smaller pass
    assert live.scale < 0.2  # the start-up measurement was several times too slow
    assert live([1, 8]).tolist() == pytest.approx([0.032, 0.046])


def test_a_pass_size_no_longer_chosen_forgets_a_noisy_stretch():
    """A burst of other work made 4-token passes look dear, so the budget stopped choosing them
    and no live pass measured them again; once their passes are old, the start-up shape scaled
    by the recent plain passes prices them again, and the budget verifies drafts again."""
    cost = VerifyCost((1, 2, 4, 8), (0.032, 0.034, 0.038, 0.046))  # 30 ms + 2 ms a token
    budget = DraftBudget(cost)
    for _ in range(16):
        budget.observe_verify(4, 0.300)  # ten times what a 4-token pass takes
    for _ in range(16):
        budget.observe_verify(1, 0.032)
    assert budget.allocate(values([0.9, 0.8, 0.7]), 1) == [0]  # verifying looks ruinous
    for _ in range(256):  # plain passes only: the dear ones age out
        budget.observe_verify(1, 0.032)
    assert budget.pass_cost(4) == pytest.approx(cost(4), rel=0.01)
    assert budget.allocate(values([0.9, 0.8, 0.7]), 1) == [3]


def test_a_fixed_cost_does_not_learn():
    cost = VerifyCost((1, 8), (1.0, 2.0))
    fixed = LiveVerifyCost(cost, learn=False)
    for _ in range(5):
        fixed.observe(1, 0.001)
    assert fixed(1) == 1.0 and fixed.scale == 1.0


def test_the_budget_sizes_trees_by_what_live_passes_cost():
    """Flat start-up timings make every node look free; live passes show what a token costs."""
    flat = VerifyCost((1, 2, 4, 8), (0.3, 0.3, 0.3, 0.3))
    budget = DraftBudget(flat)
    shaky = values([0.9, 0.2, 0.1])
    assert budget.allocate(shaky, 1) == [3]
    for _ in range(3):
        for n in (1, 2, 4, 8):
            budget.observe_verify(n, 0.010 + 0.002 * n)  # live: each token costs a fifth
    assert budget.allocate(shaky, 1) == [1]
