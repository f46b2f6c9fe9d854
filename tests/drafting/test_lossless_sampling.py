"""Speculative sampling is lossless: the first three tokens keep exactly the target's distribution.

On a tiny model with an 8-token vocabulary, 20,000 seeded samples of the first three generated
tokens are compared (chi-square) with the exact distribution computed from transformers' logits,
for three sampling settings with a random head, a trained one and a trained EAGLE-3 head. The same
test, run with a deliberately broken acceptance rule, must fail: it is sensitive enough to catch
one.
"""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch
import transformers

import drafting.eagle_drafter
from engine import LLM, SamplingParams
from engine.execution.verify_cost import VerifyCost
from engine.sampling.logits_processing import target_probabilities
from engine.spec.draft_budget import DraftBudget
from tests.drafting.conftest import SMALL_VOCAB, AlternateDrafting

VOCAB = SMALL_VOCAB
PROMPT = [1, 3, 4, 5, 3]
NUM_SAMPLES = 20_000
NUM_TOKENS = 3
SETTINGS = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.7, top_p 0.8": dict(temperature=0.7, top_p=0.8),
    "top_k 3": dict(temperature=1.0, top_k=3),
}
TREE = dict(draft_top_k=2, draft_depth=3, draft_total_tokens=8, adaptive_draft_budget=False)


def exact_distribution(target, settings: dict) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) from transformers' logits, each step processed as the sampler does."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    params = SamplingParams(**settings)
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_TOKENS):
        prefixes = list(probs)
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()  # [P, vocab]
        step = target_probabilities(logits, [params] * len(prefixes))
        probs = {
            (*p, t): probs[p] * float(step[i, t])
            for i, p in enumerate(prefixes)
            for t in range(VOCAB)
            if step[i, t] > 0
        }
    return probs


def sampled_counts(
    target, head, settings: dict, configure=None, min_accepted=NUM_SAMPLES, **options
) -> dict[tuple[int, ...], int]:
    llm = LLM(
        str(target),
        draft=str(head),
        max_num_seqs=512,
        max_num_batched_tokens=8192,
        num_kv_blocks=8192,
        block_size=8,
        **{**TREE, **options},
    )
    if configure is not None:
        configure(llm.engine)
    params = [
        SamplingParams(max_tokens=NUM_TOKENS + 3, ignore_eos=True, seed=seed, **settings)
        for seed in range(NUM_SAMPLES)
    ]
    outputs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    assert accepted > min_accepted, "the head should get drafts accepted, or nothing is tested"
    counts: dict[tuple[int, ...], int] = {}
    for output in outputs:
        key = tuple(output.outputs[0].token_ids[:NUM_TOKENS])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_p_value(counts: dict, expected: dict) -> float:
    """p-value of the counts under `expected`, pooling outcomes expected fewer than 5 times."""
    assert set(counts) <= set(expected), "sampled an outcome the target gives probability 0"
    observed, predicted, rare_obs, rare_exp = [], [], 0, 0.0
    for outcome, p in expected.items():
        if p * NUM_SAMPLES < 5:
            rare_obs, rare_exp = rare_obs + counts.get(outcome, 0), rare_exp + p * NUM_SAMPLES
        else:
            observed.append(counts.get(outcome, 0))
            predicted.append(p * NUM_SAMPLES)
    if rare_exp > 0:
        observed.append(rare_obs)
        predicted.append(rare_exp)
    scale = sum(observed) / sum(predicted)  # exact up to float rounding
    return float(scipy.stats.chisquare(observed, [e * scale for e in predicted]).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["random", "trained", "eagle3"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_sampling_matches_the_target_distribution(small_vocab, head, setting):
    expected = exact_distribution(small_vocab["target"], SETTINGS[setting])
    counts = sampled_counts(small_vocab["target"], small_vocab[head], SETTINGS[setting])
    assert chi_square_p_value(counts, expected) > 0.001


@pytest.mark.slow
def test_trees_cut_by_the_adaptive_budget_stay_lossless(small_vocab):
    """A verify cost under which only likely nodes pay, and drafting and plain steps in
    turn: trees of every size from empty to whole, and plain steps."""
    steps = []

    def partial_budget(engine):
        # 512 roots take 10 s; a node pays when its acceptance chance is above about 0.5, and
        # drafting (real time, a fraction of a second) is cheap beside a pass
        cost = VerifyCost((1, 8192), (5.0, 5.0 + 8191 / 102.4))
        engine.policy.budget = DraftBudget(cost, learn=False)
        engine.policy.controller = AlternateDrafting()
        engine.stats_listeners.append(steps.append)

    setting = SETTINGS["temperature 1"]
    expected = exact_distribution(small_vocab["target"], setting)
    counts = sampled_counts(
        small_vocab["target"],
        small_vocab["trained"],
        setting,
        configure=partial_budget,
        min_accepted=NUM_SAMPLES // 4,  # half the steps are plain, and trees are cut
        adaptive_draft_budget=True,
    )
    assert chi_square_p_value(counts, expected) > 0.001
    full_trees = TREE["draft_total_tokens"] - 1
    budgets = [s.draft_budget for s in steps if s.draft_budget is not None]
    assert any(0 < s.num_draft_tokens < s.num_drafts * full_trees for s in steps)
    assert 0 in budgets, "some steps should decode plainly"


def accept_with_draft_probability(tree, children, p, generator):
    """A broken rule: accepts a child with its draft probability q instead of the target's p."""
    for child in children:
        q = math.exp(tree.values[child] - tree.values[tree.parents[child]])
        if float(torch.rand((), generator=generator)) < q:
            return child, None
    return None, int(torch.multinomial(p, 1, generator=generator))


@pytest.mark.slow
def test_the_check_catches_a_broken_acceptance_rule(small_vocab, monkeypatch):
    monkeypatch.setattr(drafting.eagle_drafter, "accept_at_node", accept_with_draft_probability)
    setting = SETTINGS["temperature 1"]
    expected = exact_distribution(small_vocab["target"], setting)
    counts = sampled_counts(small_vocab["target"], small_vocab["trained"], setting)
    assert chi_square_p_value(counts, expected) < 0.001


def test_exact_distribution_sums_to_one(small_vocab):
    for setting in SETTINGS.values():
        total = sum(exact_distribution(small_vocab["target"], setting).values())
        assert math.isclose(total, 1.0, rel_tol=1e-5)
