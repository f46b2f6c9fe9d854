"""A seeded request samples the same tokens with speculation as without.

The acceptance walk draws each emitted token as plain decoding does (one uniform draw per
position, from the request's own generator), so neither the drafts, nor the trees' sizes (which
the adaptive draft budget picks from wall-clock timings), nor the rest of the batch can change a
seeded request's output. The distribution itself is checked in test_lossless_sampling.py.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.execution.verify_cost import VerifyCost
from engine.spec.draft_budget import DraftBudget
from tests.drafting.conftest import AlternateDrafting
from tests.drafting.test_speculative_generation import mixed_prompts

SETTINGS = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.7, top_p 0.8": dict(temperature=0.7, top_p=0.8),
    "top_k 3, min_p 0.05": dict(temperature=1.0, top_k=3, min_p=0.05),
    "penalties": dict(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.3),
}


def seeded(settings: dict, count: int, n: int = 1) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, ignore_eos=True, seed=1000 + i, n=n, **settings)
        for i in range(count)
    ]


def tokens(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[choice.token_ids for choice in o.outputs] for o in outputs]


def cut_trees_and_plain_steps(llm: LLM) -> None:
    """A verify cost under which only likely nodes pay, and drafting and plain steps in
    turn: trees of every size from none to whole, and plain steps."""
    cost = VerifyCost((1, 8192), (5.0, 5.0 + 8191 / 102.4))
    llm.engine.policy.budget = DraftBudget(cost, learn=False)
    llm.engine.policy.controller = AlternateDrafting()


@pytest.fixture
def target_and_head(request, bigram_target, random_head, small_vocab):
    """A head that is never right on a 256-token target, or one that often is on an 8-token
    target (on the larger one, sampled text is too spread out for drafts to be accepted)."""
    if request.param == "random head":
        return bigram_target, random_head
    return small_vocab["target"], small_vocab["trained"]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("target_and_head", ["random head", "trained head"], indirect=True)
def test_seeded_speculation_samples_plain_decodings_tokens(target_and_head, setting):
    target, head = target_and_head
    prompts = mixed_prompts(6, seed=11, vocab=8)
    params = seeded(SETTINGS[setting], len(prompts))
    plain = LLM(str(target), draft=None, block_size=4, num_kv_blocks=1024)
    expected = tokens(plain, prompts, params)
    whole_trees = LLM(
        str(target), draft=str(head), block_size=4, num_kv_blocks=1024,
        adaptive_draft_budget=False,
    )  # fmt: skip
    outputs = whole_trees.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    if head.name == "trained-head":  # drafts did get accepted, or nothing was tested
        assert sum(o.metrics.num_accepted_tokens for o in outputs) > len(prompts)
    budgeted = LLM(str(target), draft=str(head), block_size=4, num_kv_blocks=1024)
    cut_trees_and_plain_steps(budgeted)
    assert tokens(budgeted, prompts, params) == expected


def test_a_seeded_request_samples_the_same_alone_and_in_a_batch(bigram_target, trained_head):
    prompts = mixed_prompts(8, seed=4)
    params = seeded(SETTINGS["temperature 1"], len(prompts), n=2)
    llm = LLM(str(bigram_target), draft=str(trained_head), block_size=4, num_kv_blocks=1024)
    together = tokens(llm, prompts, params)
    alone = tokens(llm, prompts[2:3], params[2:3])
    assert alone[0] == together[2]
    assert together[2][0] != together[2][1]  # choice j samples with seed + j
