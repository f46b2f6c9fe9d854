"""The draft controller, evidence and budget inside the engine: whatever they choose (whole trees,
parts of them, plain steps, some requests paused), greedy output is plain decoding's, the chosen
budget is reported, the KV blocks all come back, and a useless head ends up decoding plainly."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.execution.verify_cost import VerifyCost
from engine.spec.draft_budget import DraftBudget
from tests.drafting.conftest import AlwaysDraft
from tests.drafting.test_speculative_generation import (
    GREEDY,
    assert_same_or_near_tie,
    generate,
    mixed_prompts,
)

FREE = VerifyCost((1, 4096), (10.0, 10.0))  # passes are slow, but more tokens cost nothing
DEAR = VerifyCost((1, 4096), (0.001, 4096.0))  # each token costs a second


def run_with_cost(target, head, prompts, cost: VerifyCost | None, params=GREEDY, always=True):
    """Generate with the engine's budget weighing drafts against `cost` as given (None: as
    measured and learnt live), every decode step drafting where `always`. Returns the LLM, its
    outputs and the step stats."""
    llm = LLM(str(target), draft=str(head), block_size=4, num_kv_blocks=1024)
    if cost is not None:
        llm.engine.policy.budget = DraftBudget(cost, learn=False)
    if always:
        llm.engine.policy.controller = AlwaysDraft()
    records = []
    llm.engine.stats_listeners.append(records.append)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, outputs, records


def check_lossless(target, prompts, plain, outputs) -> None:
    for prompt, a, b in zip(prompts, plain, outputs):
        assert_same_or_near_tie(target, prompt, a.outputs[0].token_ids, b.outputs[0].token_ids)


def all_blocks_free(llm: LLM) -> bool:
    return llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_free_verification_verifies_whole_trees(bigram_target, trained_head):
    prompts = mixed_prompts(8, seed=3)
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    _, outputs, records = run_with_cost(bigram_target, trained_head, prompts, FREE)
    check_lossless(bigram_target, prompts, plain, outputs)
    decoding = [r for r in records if r.draft_budget is not None]
    assert decoding and all(r.draft_budget == r.num_draft_tokens for r in decoding)
    drafted = [r for r in decoding if r.num_drafts]
    full = 3  # draft_total_tokens - 1
    assert sum(r.num_draft_tokens for r in drafted) >= 0.9 * full * sum(
        r.num_drafts for r in drafted
    )
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0


def test_dear_verification_falls_back_to_plain_decoding(bigram_target, trained_head):
    prompts = mixed_prompts(8, seed=4)
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    llm, outputs, records = run_with_cost(bigram_target, trained_head, prompts, DEAR)
    check_lossless(bigram_target, prompts, plain, outputs)
    decoding = [r for r in records if r.draft_budget is not None]
    assert decoding and all(r.draft_budget == r.num_draft_tokens == 0 for r in decoding)
    assert all_blocks_free(llm)
    # the head catches up on prompts at once, so their blocks still reach the prefix cache
    longest = max(prompts, key=len)
    hits = []
    llm.engine.stats_listeners.append(lambda stats: hits.append(stats.num_prefix_cache_hits))
    llm.generate([longest], GREEDY, use_tqdm=False)
    assert sum(hits) >= (len(longest) - 1) // 4 * 4 > 0


def test_measured_costs_keep_speculation_lossless(bigram_target, trained_head):
    prompts = mixed_prompts(8, seed=5)
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    llm, outputs, records = run_with_cost(bigram_target, trained_head, prompts, None, always=False)
    check_lossless(bigram_target, prompts, plain, outputs)
    assert llm.engine.policy.budget.verify_cost.num_tokens[0] == 1
    assert any(r.draft_budget is not None for r in records)
    assert all_blocks_free(llm)


def test_a_useless_head_leaves_outputs_alone_and_the_engine_decoding_plainly(
    bigram_target, random_head
):
    """Random head weights: drafts are never accepted. Each request soon pauses its drafting,
    and the controller finds drafting steps slower; most decode steps are plain."""
    prompts = mixed_prompts(4, seed=7)
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    _, plain = generate(bigram_target, None, prompts, params, num_kv_blocks=1024)
    llm, outputs, records = run_with_cost(
        bigram_target, random_head, prompts, None, params, always=False
    )
    check_lossless(bigram_target, prompts, plain, outputs)
    decoding = [r for r in records if r.draft_budget is not None]
    drafted = [r for r in decoding if r.num_drafts]
    assert len(decoding) > 150
    assert len(drafted) <= 0.15 * len(decoding)
    assert all_blocks_free(llm)


def test_a_request_whose_drafts_fail_pauses_while_the_others_draft(small_vocab):
    """Two requests in one batch on the 8-token target with its trained head: a greedy one,
    whose drafts are accepted, and one sampled at a high temperature, whose drafts mostly are
    not. Every step offers to draft; once its failing is clear (a few dozen trees), the hot
    request drafts on far fewer of its steps."""
    llm = LLM(
        str(small_vocab["target"]), draft=str(small_vocab["trained"]), block_size=4,
        num_kv_blocks=1024,
    )  # fmt: skip
    llm.engine.policy.controller = AlwaysDraft()
    # the default break-even and whole trees, not priced from this (perhaps busy) machine's times
    llm.engine.policy.controller.break_even_drafts = lambda num_decoding: None
    llm.engine.policy.budget = DraftBudget(FREE, learn=False)
    greedy = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    hot = SamplingParams(temperature=50.0, max_tokens=400, ignore_eos=True, seed=1)
    prompt = mixed_prompts(1, seed=2, vocab=8)[0]
    cold_out, hot_out = llm.generate([prompt, prompt], [greedy, hot], use_tqdm=False)
    cold, hot = cold_out.metrics, hot_out.metrics
    assert cold.num_accepted_tokens / cold.num_decode_steps > 0.5
    # a tree is at most 3 draft tokens a step: the hot request drafted on under a third of its
    # steps, the greedy one on most of them
    assert hot.num_draft_tokens < 3 * hot.num_decode_steps / 3
    assert cold.num_draft_tokens > 3 * cold.num_decode_steps / 2


class NeverDraft(AlwaysDraft):
    def choose(self, num_decoding: int) -> bool:
        return False


def prefix_cache_hits(llm: LLM, prompts, params) -> int:
    hits = []
    llm.engine.stats_listeners.append(lambda stats: hits.append(stats.num_prefix_cache_hits))
    llm.generate(prompts, params, use_tqdm=False)
    llm.engine.stats_listeners.pop()
    return sum(hits)


def test_plain_steps_leave_the_prefix_cache_what_plain_decoding_leaves(bigram_target, trained_head):
    """With the controller choosing plain steps, a request's blocks still reach the prefix cache:
    sent again, its prompt hits as often as without a head; a follow-up turn (the prompt, its
    answer, more) hits its answer's blocks too, but for at most one block a request that the
    head had not caught up on when the request finished."""
    prompts = mixed_prompts(6, seed=11)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    hits = {}
    for name, head in (("plain", None), ("speculative", str(trained_head))):
        llm = LLM(str(bigram_target), draft=head, block_size=4, num_kv_blocks=1024)
        if head:
            llm.engine.policy.controller = NeverDraft()
        answers = llm.generate(prompts, params, use_tqdm=False)
        follow_ups = [p + a.outputs[0].token_ids + p[:5] for p, a in zip(prompts, answers)]
        hits[name] = (
            prefix_cache_hits(llm, prompts, params),
            prefix_cache_hits(llm, follow_ups, params),
        )
        assert all_blocks_free(llm)
    assert hits["speculative"][0] == hits["plain"][0] > 0
    assert hits["plain"][1] - 4 * len(prompts) <= hits["speculative"][1] <= hits["plain"][1]


def test_plain_steps_are_scheduled_as_plain_decoding_schedules_them(bigram_target, trained_head):
    """With the controller choosing plain steps, the speculative engine computes the same chunks
    in the same steps as `draft=None`, prompts beside decodes included: no draft scratch takes
    budget from a prompt, and the head catches up without changing what is scheduled."""
    prompts = mixed_prompts(12, seed=9)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(block_size=4, num_kv_blocks=1024, max_num_batched_tokens=32, max_num_seqs=6)
    plain = LLM(str(bigram_target), draft=None, **options)
    speculative = LLM(str(bigram_target), draft=str(trained_head), **options)
    speculative.engine.policy.controller = NeverDraft()
    layouts = {}
    for name, llm in (("plain", plain), ("speculative", speculative)):
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(str(i), prompt, params)
        layouts[name] = []
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            layouts[name].append(
                [(i.seq.request.request_id, i.num_new_tokens, i.num_lookahead)
                 for i in llm.engine.last_schedule.scheduled]
            )  # fmt: skip
    assert any(n > 1 for step in layouts["plain"] for _, n, _ in step)  # prompts beside decodes
    assert layouts["speculative"] == layouts["plain"]
    assert all_blocks_free(speculative)


def head_keys(llm: LLM, seq, num_positions: int):
    """The head layer's K and V of `seq`'s first `num_positions` positions [P, KV, D] each."""
    slots = [llm.engine._slot(seq, position) for position in range(num_positions)]
    k, v = llm.engine.runner.kv_cache.layers[-1]  # [num_blocks, block_size, KV, D] each
    return k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]


def test_plain_steps_leave_the_head_the_keys_drafting_steps_do(bigram_target, trained_head):
    """A request decoded plainly has, after every step, its head K/V stored up to its last full
    block before the newest token (features wait at most a block), and those keys are the ones an
    engine drafting every step stores for the same tokens."""
    prompt = mixed_prompts(1, seed=13)[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engines = {}
    for name, controller in (("plain", NeverDraft()), ("drafting", AlwaysDraft())):
        llm = LLM(str(bigram_target), draft=str(trained_head), block_size=4, num_kv_blocks=1024)
        llm.engine.policy.controller = controller
        llm.engine.add_request("0", prompt, params)
        seq = llm.engine.requests["0"].sequences[0]
        while seq.num_output_tokens < 30:
            llm.engine.step()
            if name == "plain":
                assert seq.num_head_computed_tokens == (seq.num_tokens - 2) // 4 * 4
        engines[name] = (llm, seq)
    (plain, plain_seq), (drafting, drafting_seq) = engines["plain"], engines["drafting"]
    num_final = min(plain_seq.num_head_computed_tokens, drafting_seq.num_head_computed_tokens)
    assert num_final >= len(prompt) + 20
    assert plain_seq.token_ids[:num_final] == drafting_seq.token_ids[:num_final]
    for a, b in zip(
        head_keys(plain, plain_seq, num_final), head_keys(drafting, drafting_seq, num_final)
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
