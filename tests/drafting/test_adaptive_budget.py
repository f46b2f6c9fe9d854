"""The adaptive draft budget inside the engine: whatever it chooses (whole trees, parts of them,
or plain steps), greedy output is plain decoding's, the chosen budget is reported, and the KV
blocks all come back."""

from __future__ import annotations

from engine import LLM
from engine.execution.verify_cost import VerifyCost
from engine.spec.realized_rates import RealizedRates
from tests.drafting.test_speculative_generation import (
    GREEDY,
    assert_same_or_near_tie,
    generate,
    mixed_prompts,
)

FREE = VerifyCost((1, 4096), (10.0, 10.0))  # passes are slow, but more tokens cost nothing
DEAR = VerifyCost((1, 4096), (0.001, 4096.0))  # each token costs a second


def run_with_cost(target, head, prompts, cost: VerifyCost | None):
    """Generate with the engine's budget weighing drafts against `cost` (None: as measured).
    Returns the LLM, its outputs, the step stats and how many steps drafted."""
    llm = LLM(str(target), draft=str(head), block_size=4, num_kv_blocks=1024)
    if cost is not None:
        llm.engine.budget.verify_cost = cost
        # the wall clock's verdict would overrule the cost given: it never decides here
        llm.engine.budget.realized = RealizedRates(plain_probe_interval=10**9, min_drafted=10**9)
    records, drafting_steps = [], []
    llm.engine.stats_listeners.append(records.append)
    grow = llm.engine.drafter._grow

    def counted(*args):
        drafting_steps.append(args)
        return grow(*args)

    llm.engine.drafter._grow = counted
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return llm, outputs, records, len(drafting_steps)


def check_lossless(target, prompts, plain, outputs) -> None:
    for prompt, a, b in zip(prompts, plain, outputs):
        assert_same_or_near_tie(target, prompt, a.outputs[0].token_ids, b.outputs[0].token_ids)


def test_free_verification_verifies_whole_trees(bigram_target, trained_head):
    prompts = mixed_prompts(8, seed=3)
    fixed = LLM(
        str(bigram_target),
        draft=str(trained_head),
        block_size=4,
        num_kv_blocks=1024,
        adaptive_draft_budget=False,
    )
    whole_trees = []
    fixed.engine.stats_listeners.append(whole_trees.append)
    fixed.generate(prompts, GREEDY, use_tqdm=False)
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    _, outputs, records, drafted = run_with_cost(bigram_target, trained_head, prompts, FREE)
    check_lossless(bigram_target, prompts, plain, outputs)
    decoding = [r for r in records if r.draft_budget is not None]
    assert decoding and all(r.draft_budget == r.num_draft_tokens for r in decoding)
    assert drafted == len(decoding)
    assert [r.num_draft_tokens for r in records] == [r.num_draft_tokens for r in whole_trees]
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0


def test_dear_verification_falls_back_to_plain_decoding(bigram_target, trained_head):
    prompts = mixed_prompts(8, seed=4)
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    llm, outputs, records, drafted = run_with_cost(bigram_target, trained_head, prompts, DEAR)
    check_lossless(bigram_target, prompts, plain, outputs)
    decoding = [r for r in records if r.draft_budget is not None]
    assert decoding and all(r.draft_budget == r.num_draft_tokens == 0 for r in decoding)
    # the first step drafts to learn what drafts are worth, then one in probe_interval + 1
    assert 1 <= drafted <= 1 + len(decoding) // (llm.engine.budget.probe_interval + 1)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    # the head keeps up with plain steps, so their blocks still reach the prefix cache
    longest = max(prompts, key=len)
    hits = []
    llm.engine.stats_listeners.append(lambda stats: hits.append(stats.num_prefix_cache_hits))
    llm.generate([longest], GREEDY, use_tqdm=False)
    assert sum(hits) >= (len(longest) - 1) // 4 * 4 > 0


def test_measured_costs_keep_speculation_lossless(bigram_target, trained_head):
    prompts = mixed_prompts(8, seed=5)
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    llm, outputs, records, _ = run_with_cost(bigram_target, trained_head, prompts, None)
    check_lossless(bigram_target, prompts, plain, outputs)
    assert llm.engine.budget.verify_cost.num_tokens[0] == 1
    assert any(r.draft_budget is not None for r in records)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_every_decode_step_feeds_the_realized_rates(bigram_target, trained_head):
    def samples(cost: VerifyCost, kind: str) -> list[tuple[float, float]]:
        llm, _, _, _ = run_with_cost(bigram_target, trained_head, mixed_prompts(8, seed=6), cost)
        buckets = llm.engine.budget.realized.buckets
        assert set(buckets) <= {n.bit_length() for n in range(1, 9)}
        return [sample for bucket in buckets.values() for sample in getattr(bucket, kind)]

    drafted = samples(FREE, "drafted")
    assert drafted and all(tokens >= 1 and seconds > 0 for tokens, seconds in drafted)
    assert any(tokens > 1 for tokens, _ in drafted)  # accepted drafts count as tokens
    plain = samples(DEAR, "plain")
    assert plain and all(tokens == 1 and seconds > 0 for tokens, seconds in plain)
