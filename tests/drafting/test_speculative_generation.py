"""Speculative decoding changes speed, never output: greedy text equals plain decoding token for
token under continuous batching, chunked prefill, prefix caching and preemption, with a head that
is never right and one that often is; and the KV blocks all come back."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.execution.model_runner import ForwardOutput, ModelRunner
from tests.engine.helpers import assert_block_invariants

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
NEAR_TIE = 1e-4


def mixed_prompts(count: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 45))] for _ in range(count)]


# The adaptive draft budget may verify less than the whole tree, or nothing; these tests verify
# every tree at full size so that the verification machinery is exercised on every step.
FULL_TREES = dict(adaptive_draft_budget=False)


def generate(target, draft, prompts, params=GREEDY, **options):
    options = {**FULL_TREES, **options} if draft is not None else options
    llm = LLM(str(target), draft=None if draft is None else str(draft), block_size=4, **options)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def assert_same_or_near_tie(target, prompt: list[int], plain: list[int], speculative: list[int]):
    """Equal, or first different where both tokens' logits are within NEAR_TIE of the target's
    best: a tie between the two tokens chosen, not any two."""
    assert len(plain) == len(speculative), f"{len(plain)} tokens against {len(speculative)}"
    if plain == speculative:
        return
    first = next(i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b)
    model = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + plain[:first]])).logits[0, -1]
    best = logits.max()
    gap = max(float(best - logits[token]) for token in (plain[first], speculative[first]))
    assert gap < NEAR_TIE, (
        f"outputs diverge at token {first} ({plain[first]} against {speculative[first]}), "
        f"{gap:.3g} below the best logit"
    )


def acceptance_length(outputs) -> float:
    """Tokens emitted per target pass after prefill (the bonus token included)."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    passes = sum(o.metrics.num_decode_steps for o in outputs)
    return tokens / passes


SCENARIOS = {
    "continuous batching": dict(num_kv_blocks=1024),
    "chunked prefill": dict(num_kv_blocks=1024, max_num_batched_tokens=24),
    "forced preemption": dict(num_kv_blocks=48, max_num_seqs=8),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(
    "head",
    [
        "random_head",
        "trained_head",
        "random_eagle3_head",
        "trained_eagle3_head",
        "trained_two_layer_eagle3_head",
    ],
)
def test_greedy_speculation_equals_plain_decoding(bigram_target, head, scenario, request):
    draft = request.getfixturevalue(head)
    prompts = mixed_prompts(12)
    options = SCENARIOS[scenario]
    _, plain = generate(bigram_target, None, prompts, **options)
    llm, speculative = generate(bigram_target, draft, prompts, **options)
    for prompt, a, b in zip(prompts, plain, speculative):
        assert_same_or_near_tie(
            bigram_target, prompt, a.outputs[0].token_ids, b.outputs[0].token_ids
        )
    assert_speculation_ran(llm, speculative, scenario, head)


@pytest.mark.slow
def test_a_compiled_target_speculates_as_the_eager_one_decodes(bigram_target, trained_head):
    """torch.compile (fused kernels, frozen weights) verifying trees of many sequences at once
    gives the eager engine's plain greedy output."""
    prompts = mixed_prompts(8, seed=5)
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    llm, compiled = generate(
        bigram_target, trained_head, prompts, num_kv_blocks=1024, enable_torch_compile=True
    )
    for prompt, a, b in zip(prompts, plain, compiled):
        assert_same_or_near_tie(
            bigram_target, prompt, a.outputs[0].token_ids, b.outputs[0].token_ids
        )
    assert acceptance_length(compiled) > 1.5, "the compiled target should still accept drafts"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prefix_caching_with_speculation(bigram_target, trained_head):
    shared = mixed_prompts(1, seed=5)[0] * 2  # a long common prefix
    prompts = [shared + tail for tail in mixed_prompts(6, seed=6)]
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    llm = LLM(
        str(bigram_target),
        draft=str(trained_head),
        block_size=4,
        num_kv_blocks=1024,
        **FULL_TREES,
    )
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # now served from the prefix cache
    assert sum(o.metrics.num_cached_tokens for o in again) > 0
    for prompt, a, b, c in zip(prompts, plain, first, again):
        assert_same_or_near_tie(
            bigram_target, prompt, a.outputs[0].token_ids, b.outputs[0].token_ids
        )
        assert b.outputs[0].token_ids == c.outputs[0].token_ids


def test_logprobs_and_stops_match_plain_decoding(bigram_target, trained_head):
    prompts = mixed_prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    _, plain = generate(bigram_target, None, prompts, params, num_kv_blocks=1024)
    _, speculative = generate(bigram_target, trained_head, prompts, params, num_kv_blocks=1024)
    for a, b in zip(plain, speculative):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.token_id == y.token_id
            assert abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]
    # a stop token inside an accepted run ends the request exactly where plain decoding ends
    stop_token = plain[0].outputs[0].token_ids[7]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token])
    _, plain = generate(bigram_target, None, prompts[:1], params, num_kv_blocks=1024)
    _, speculative = generate(bigram_target, trained_head, prompts[:1], params, num_kv_blocks=1024)
    assert plain[0].outputs[0].token_ids == speculative[0].outputs[0].token_ids
    assert speculative[0].outputs[0].finish_reason == "stop"
    assert speculative[0].outputs[0].token_ids[-1] == stop_token


def record_node_logits(monkeypatch) -> dict[int, list[list[int]]]:
    """Rows of every `node_logits` call, per verify pass (the passes are kept alive meanwhile)."""
    calls: dict[int, list[list[int]]] = {}
    passes = []
    node_logits = ForwardOutput.node_logits

    def recording(self, rows):
        passes.append(self)
        calls.setdefault(id(self), []).append(list(rows))
        return node_logits(self, rows)

    monkeypatch.setattr(ForwardOutput, "node_logits", recording)
    return calls


def test_the_walks_compute_node_logits_once_and_only_where_they_reach(
    bigram_target, trained_head, monkeypatch
):
    """Beyond each tree's root, whose logits the verify pass computes, the acceptance walks
    compute the target's logits at or below the nodes they reach (to decide their children or
    sample the bonus there), each node at most once, a level's walks in one lm_head call."""
    calls = record_node_logits(monkeypatch)
    prompts = mixed_prompts(6, seed=5)
    big_trees = dict(draft_top_k=4, draft_depth=3, draft_total_tokens=16, num_kv_blocks=1024)
    _, outputs = generate(bigram_target, trained_head, prompts, **big_trees)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    verified = sum(o.metrics.num_draft_tokens for o in outputs)
    assert 0 < accepted < verified
    rows_per_pass = [[row for rows in pass_calls for row in rows] for pass_calls in calls.values()]
    assert all(len(rows) == len(set(rows)) for rows in rows_per_pass)
    assert accepted <= sum(map(len, rows_per_pass)) < verified
    assert max(len(rows) for pass_calls in calls.values() for rows in pass_calls) > 1


def test_a_small_tree_gets_its_node_logits_with_the_verify_pass(
    bigram_target, trained_head, monkeypatch
):
    """A default tree (3 draft nodes) of one request: the lm_head costs about as much for its
    few rows as for one, so the verify pass computes every node's logits with its root's, and the
    walks, which accept nodes, need no further lm_head call."""
    calls = record_node_logits(monkeypatch)
    passes = []
    execute = ModelRunner.execute

    def recording(self, batch, trees=None):
        passes.append(execute(self, batch, trees))
        return passes[-1]

    monkeypatch.setattr(ModelRunner, "execute", recording)
    _, outputs = generate(bigram_target, trained_head, mixed_prompts(1, seed=5), num_kv_blocks=64)
    assert outputs[0].metrics.num_accepted_tokens > 0
    assert not calls
    with_trees = [p for p in passes if p.tree_logits]
    assert with_trees and all(len(p.tree_logits) <= 3 for p in with_trees)


def test_blocks_come_back_under_random_load_with_aborts(bigram_target, trained_head):
    llm = LLM(
        str(bigram_target),
        draft=str(trained_head),
        block_size=4,
        num_kv_blocks=96,
        **FULL_TREES,
        max_num_seqs=12,
        max_num_batched_tokens=64,
    )
    engine, rng = llm.engine, random.Random(7)
    finished: dict[str, int] = {}
    stats = []
    engine.stats_listeners.append(stats.append)

    def step() -> None:
        for output in engine.step():
            finished[output.request_id] = finished.get(output.request_id, 0) + output.finished
        assert_block_invariants(engine)

    # A third of the prompts extend one of three shared prefixes (full blocks and a partial one),
    # so sequences share cached blocks while others draft, get preempted or are aborted.
    shared = mixed_prompts(3, seed=9)
    prompts = [
        rng.choice(shared)[: rng.randrange(1, 45)] + tail if rng.random() < 0.35 else tail
        for tail in mixed_prompts(120, seed=8)
    ]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=rng.choice([0.0, 1.0]),
            max_tokens=rng.randrange(1, 30),
            n=rng.choice([1, 1, 2]),
            seed=i,
        )
        engine.add_request(str(i), prompt, params)
        if rng.random() < 0.5:
            step()
        if rng.random() < 0.15:
            victim = str(rng.randrange(i + 1))
            final = engine.abort_request(victim)
            if final is not None:
                finished[victim] = finished.get(victim, 0) + 1
            assert_block_invariants(engine)
    while engine.has_unfinished_requests():
        step()
    assert engine.scheduler.num_preemptions > 0
    assert sum(s.num_prefix_cache_hits for s in stats) > 0
    assert sum(s.num_accepted_tokens for s in stats) > 0
    assert sorted(finished, key=int) == [str(i) for i in range(len(prompts))]
    assert set(finished.values()) == {1}
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)


def test_reduced_draft_vocabulary_is_lossless_and_proposes_only_its_tokens(
    bigram_target, trained_head, tmp_path
):
    import json
    import shutil

    head = shutil.copytree(trained_head, tmp_path / "head")
    vocab = list(range(3, 256, 2))  # half the vocabulary: the drafts can only use these
    (head / "draft_vocab.json").write_text(json.dumps({"token_ids": vocab}))
    prompts = mixed_prompts(6, seed=9)
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    llm = LLM(str(bigram_target), draft=str(head), block_size=4, num_kv_blocks=1024, **FULL_TREES)
    proposed: list[int] = []
    propose = llm.engine.drafter.propose

    def spy(batch):
        trees = propose(batch)
        proposed.extend(t for tree in trees.values() for t in tree.tokens[1:])
        return trees

    llm.engine.drafter.propose = spy
    speculative = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, a, b in zip(prompts, plain, speculative):
        assert_same_or_near_tie(
            bigram_target, prompt, a.outputs[0].token_ids, b.outputs[0].token_ids
        )
    assert proposed and set(proposed) <= set(vocab)
    (head / "draft_vocab.json").write_text(json.dumps({"token_ids": [5, 5]}))
    with pytest.raises(ValueError, match="distinct"):
        LLM(str(bigram_target), draft=str(head))


def assert_speculation_ran(llm, speculative, scenario: str, head: str) -> None:
    """After a run: preemption happened where forced, no KV block leaked, trees were drafted,
    and a trained head was right often while a random one almost never was."""
    if scenario == "forced preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    drafted = sum(o.metrics.num_draft_tokens for o in speculative)
    accepted = sum(o.metrics.num_accepted_tokens for o in speculative)
    assert drafted > 0
    if head.startswith("trained"):
        assert acceptance_length(speculative) > 1.5, "the trained head should be right often"
    else:
        assert accepted < 0.05 * drafted, "a random head is almost never right"
