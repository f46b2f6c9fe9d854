"""Block accounting under load, and the prefix cache end to end (LLMEngine add/step/abort).

500 randomised requests (prompts of 1-60 tokens, 1-20 new tokens, n up to 3, some aborted at a
random moment) run through a KV pool small enough to force preemption, with chunked prefill. After
every step the reference counts equal the block tables; at the end every block is free and every
request got exactly one finished delta.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from engine import RequestOutput, SamplingParams
from engine.llm_engine import LLMEngine
from tests.engine.helpers import assert_block_invariants, random_prompt, run_engine, tiny_engine

NUM_REQUESTS = 500
BLOCK_SIZE = 4


@dataclass(frozen=True)
class Plan:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    abort_after_steps: int | None  # steps after arrival at which it is aborted, or never


def make_plans(rng: random.Random) -> list[Plan]:
    shared_prefixes = [random_prompt(rng, 60) for _ in range(4)]  # so the prefix cache is used
    plans = []
    for i in range(NUM_REQUESTS):
        length = rng.randint(1, 60)
        if rng.random() < 0.3:
            prompt = rng.choice(shared_prefixes)[:length]
        else:
            prompt = random_prompt(rng, length)
        sampled = rng.random() < 0.5
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 2, 3]),
            temperature=1.0 if sampled else 0.0,
            seed=i if sampled else None,
            max_tokens=rng.randint(1, 20),
        )
        abort = rng.randint(0, 10) if rng.random() < 0.15 else None
        plans.append(Plan(f"r{i}", prompt, params, abort))
    return plans


class DeltaLog:
    """Every delta per request; checks that nothing follows a request's finished delta."""

    def __init__(self) -> None:
        self.outputs: dict[str, RequestOutput] = {}
        self.num_finished: Counter[str] = Counter()

    def record(self, deltas: list[RequestOutput] | RequestOutput | None) -> None:
        if deltas is None:
            return
        for delta in [deltas] if isinstance(deltas, RequestOutput) else deltas:
            rid = delta.request_id
            assert self.num_finished[rid] == 0, f"{rid}: a delta after its finished delta"
            self.num_finished[rid] += delta.finished
            if rid in self.outputs:
                self.outputs[rid].merge(delta)
            else:
                self.outputs[rid] = delta


def assert_complete_output(plan: Plan, output: RequestOutput) -> None:
    choices = output.outputs
    assert [c.index for c in choices] == list(range(plan.params.n)), plan.request_id
    for choice in choices:
        assert choice.finish_reason in ("stop", "length", "abort"), plan.request_id
        assert len(choice.token_ids) <= plan.params.max_tokens
        if choice.finish_reason == "length":
            assert len(choice.token_ids) == plan.params.max_tokens
        if plan.abort_after_steps is None:
            assert choice.finish_reason != "abort", plan.request_id


def test_every_block_is_free_after_random_traffic(tiny_models) -> None:
    rng = random.Random(0)
    plans = make_plans(rng)
    engine = tiny_engine(
        tiny_models["llama"],
        block_size=BLOCK_SIZE,
        num_kv_blocks=40,  # 160 token slots: one 80-token request fits, a dozen do not
        max_num_batched_tokens=32,
        max_num_seqs=16,
    )
    cache_hits = []
    engine.stats_listeners.append(lambda stats: cache_hits.append(stats.num_prefix_cache_hits))
    log = DeltaLog()
    arrivals: dict[str, int] = {}
    to_add = list(reversed(plans))
    step = 0
    while to_add or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if to_add:
                plan = to_add.pop()
                engine.add_request(plan.request_id, plan.prompt, plan.params)
                arrivals[plan.request_id] = step
        for plan in plans:
            due = plan.abort_after_steps
            if due is not None and arrivals.get(plan.request_id) == step - due:
                log.record(engine.abort_request(plan.request_id))
        log.record(engine.step())
        assert_block_invariants(engine)
        step += 1
        assert step < 20_000, "the engine stalled"

    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(block.ref_count == 0 for block in engine.block_manager.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
    assert {p.request_id for p in plans} == set(log.outputs)
    assert all(log.num_finished[p.request_id] == 1 for p in plans)
    for plan in plans:
        assert_complete_output(plan, log.outputs[plan.request_id])
    # The run exercised what it is meant to: preemption, aborts mid-way, the prefix cache.
    assert engine.scheduler.num_preemptions > 0
    aborted = [
        o for o in log.outputs.values() if any(c.finish_reason == "abort" for c in o.outputs)
    ]
    assert any(any(c.token_ids for c in o.outputs) for o in aborted), "no abort mid-generation"
    assert sum(cache_hits) > 0


# ------------------------------------------------------------------ the prefix cache end to end


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_one(engine: LLMEngine, request_id: str, prompt: list[int]) -> RequestOutput:
    engine.add_request(request_id, prompt, greedy())
    return run_engine(engine)[request_id]


def test_repeated_prompt_hits_the_prefix_cache(generation_model) -> None:
    engine = tiny_engine(generation_model, block_size=BLOCK_SIZE)
    hits: list[int] = []
    engine.stats_listeners.append(lambda stats: hits.append(stats.num_prefix_cache_hits))
    prompt = random_prompt(random.Random(5), 30)

    first = run_one(engine, "first", prompt)
    assert sum(hits) == 0
    second = run_one(engine, "second", prompt)
    # 7 full blocks (28 tokens) are reused; the last prompt token is recomputed for its logits.
    assert sum(hits) == 28
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].text == first.outputs[0].text


def test_shared_prefix_reuse_gives_the_uncached_output(generation_model) -> None:
    rng = random.Random(6)
    prefix = random_prompt(rng, 21)
    prompts = [prefix + random_prompt(rng, 9), prefix + random_prompt(rng, 4)]
    cached = tiny_engine(generation_model, block_size=BLOCK_SIZE)
    hits: list[int] = []
    cached.stats_listeners.append(lambda stats: hits.append(stats.num_prefix_cache_hits))
    run_one(cached, "warm", prompts[0])
    reused = run_one(cached, "reuse", prompts[1])
    assert sum(hits) == 20  # the 5 full blocks of the shared 21-token prefix
    uncached = tiny_engine(generation_model, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    assert (
        reused.outputs[0].token_ids == run_one(uncached, "fresh", prompts[1]).outputs[0].token_ids
    )


def test_request_metrics_count_cached_prompt_tokens(generation_model) -> None:
    """RequestMetrics.num_cached_tokens ("prompt tokens served from the prefix cache")."""
    engine = tiny_engine(generation_model, block_size=BLOCK_SIZE)
    prompt = random_prompt(random.Random(5), 30)
    first = run_one(engine, "first", prompt)
    second = run_one(engine, "second", prompt)
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == 28, (
        "the scheduler reused 28 cached prompt tokens but RequestMetrics.num_cached_tokens says "
        f"{second.metrics.num_cached_tokens}: nothing in the engine sets it"
    )
