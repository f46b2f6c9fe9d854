"""Speculation composes with the sampling features: with a trained head, greedy output equals plain
decoding's under penalties, logit bias and min_tokens (each tree node is processed on its own
path); stops that land inside an accepted run end a request where plain decoding ends it; n = 2
greedy choices equal plain decoding's."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.sampling.logits_processing import LogitsContext, apply_penalties
from engine.stats import StepStats
from tests.drafting.test_speculative_generation import NEAR_TIE, mixed_prompts

OPTIONS = dict(block_size=4, num_kv_blocks=1024)
MAX_TOKENS = 30


def greedy(**options) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, **options})


def plain_llm(target: Path) -> LLM:
    return LLM(str(target), draft=None, **OPTIONS)


def speculative_llm(target: Path, head: Path) -> LLM:
    # Whole trees verified on every step (no adaptive budget), so every step drafts.
    return LLM(str(target), draft=str(head), adaptive_draft_budget=False, **OPTIONS)


@pytest.fixture(scope="module")
def plain(bigram_target) -> LLM:
    return plain_llm(bigram_target)


@pytest.fixture(scope="module")
def speculative(bigram_target, trained_head) -> LLM:
    return speculative_llm(bigram_target, trained_head)


def run(llm: LLM, prompts, params) -> tuple[list, list[StepStats]]:
    """The outputs of `prompts` and the StepStats of the steps that produced them."""
    steps: list[StepStats] = []
    llm.engine.stats_listeners.append(steps.append)
    try:
        return llm.generate(prompts, params, use_tqdm=False), steps
    finally:
        llm.engine.stats_listeners.remove(steps.append)


@functools.cache
def hf_model(target: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(target).eval()


def same_or_near_tie(llm: LLM, target: Path, prompt, params, plain: list, speculative: list):
    """True if equal. Otherwise they must first differ where the two best of the target's
    processed logits (penalties, bias and bans applied, as the engine does) are within NEAR_TIE;
    then False: what follows cannot be compared."""
    if plain == speculative:
        return True
    first = next(i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b)
    tokens = prompt + plain[:first]
    with torch.no_grad():
        logits = hf_model(target)(torch.tensor([tokens])).logits[0, -1:].float()
    context = LogitsContext(params, tokens, len(prompt), llm.engine.eos_token_ids)
    top2 = apply_penalties(logits, [context])[0].topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"outputs diverge at token {first} with a top-2 logit gap of {gap}"
    return False


def assert_matches_plain(plain, speculative, target, prompts, params) -> list:
    """Plain decoding's outputs, having checked that speculation gives the same."""
    (ar, _), (spec, steps) = run(plain, prompts, params), run(speculative, prompts, params)
    for prompt, a, b in zip(prompts, ar, spec):
        assert len(a.outputs) == len(b.outputs) == params.n
        for x, y in zip(a.outputs, b.outputs):
            if same_or_near_tie(plain, target, prompt, params, x.token_ids, y.token_ids):
                assert (x.text, x.finish_reason, x.stop_reason) == (
                    y.text,
                    y.finish_reason,
                    y.stop_reason,
                )
    assert sum(s.num_accepted_tokens for s in steps) > 0, "no draft was ever accepted"
    return ar


# ------------------------------------------------------------------ penalties and logit bias

FEATURES = {
    "repetition-penalty": dict(repetition_penalty=1.3),
    "presence-and-frequency-penalties": dict(presence_penalty=0.8, frequency_penalty=0.5),
    "logit-bias": dict(logit_bias={100: 1.5}),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_greedy_speculation_equals_plain_decoding_with(feature, bigram_target, plain, speculative):
    prompts = mixed_prompts(8, seed=11)
    params = greedy(ignore_eos=True, **FEATURES[feature])
    ar = assert_matches_plain(plain, speculative, bigram_target, prompts, params)
    unchanged, _ = run(plain, prompts, greedy(ignore_eos=True))
    assert any(a.outputs[0].token_ids != u.outputs[0].token_ids for a, u in zip(ar, unchanged))
    if feature == "logit-bias":  # pushed, not forced
        pushed = [o.outputs[0].token_ids.count(100) for o in ar]
        assert sum(pushed) > sum(o.outputs[0].token_ids.count(100) for o in unchanged)
        assert 0 < sum(pushed) < sum(len(o.outputs[0].token_ids) for o in ar) / 2


# ------------------------------------------------------------------ stops inside accepted runs


@pytest.fixture(scope="module")
def stop_point(speculative) -> tuple[list[int], list[int], int]:
    """A prompt, its greedy output, and a position p in it where the token is an accepted draft
    (not the last token its step emitted) and occurs for the first time, p >= 1."""
    engine = speculative.engine
    for i, prompt in enumerate(mixed_prompts(8, seed=12)):
        engine.add_request(f"probe-{i}", prompt, greedy(ignore_eos=True))
        groups: list[list[int]] = []  # the tokens each step emitted
        while engine.has_unfinished_requests():
            groups += [d.outputs[0].token_ids for d in engine.step()]
        tokens = [t for g in groups for t in g]
        start = 0
        for group in groups:
            for p in range(max(start, 1), start + len(group) - 1):
                if tokens[p] not in tokens[:p]:
                    return prompt, tokens, p
            start += len(group)
    raise AssertionError("the trained head never had a draft accepted")


@pytest.fixture(scope="module")
def eos_target(bigram_target, stop_point, tmp_path_factory) -> Path:
    """The bigram target with the stop point's token as its EOS (the weights are the same, so the
    trained head drafts that token where plain decoding emits it)."""
    _, tokens, p = stop_point
    folder = shutil.copytree(bigram_target, tmp_path_factory.mktemp("eos") / "llama")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, "eos_token_id": tokens[p]}))
    return folder


@pytest.fixture(scope="module")
def eos_llms(eos_target, trained_head) -> tuple[LLM, LLM]:
    return plain_llm(eos_target), speculative_llm(eos_target, trained_head)


def test_stops_inside_an_accepted_run_end_where_plain_decoding_does(
    bigram_target, eos_target, eos_llms, plain, speculative, stop_point
) -> None:
    prompt, tokens, p = stop_point
    stop_string = speculative.get_tokenizer().decode(tokens[p - 1 : p + 1])
    cases = {  # name: (target, params, finish reason), each ending the request at token p
        "eos": (eos_target, greedy(), "stop"),
        "stop-string": (bigram_target, greedy(ignore_eos=True, stop=[stop_string]), "stop"),
        "stop-token-ids": (
            bigram_target,
            greedy(ignore_eos=True, stop_token_ids=[tokens[p]]),
            "stop",
        ),
        "max-tokens": (bigram_target, greedy(ignore_eos=True, max_tokens=p + 1), "length"),
    }
    accepted_on_the_last_step = {}
    for name, (target, params, finish_reason) in cases.items():
        ar_llm, spec_llm = eos_llms if target == eos_target else (plain, speculative)
        ((a,), _), ((b,), steps) = run(ar_llm, [prompt], params), run(spec_llm, [prompt], params)
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == tokens[: len(x.token_ids)] and len(x.token_ids) in (p, p + 1), name
        assert x.finish_reason == finish_reason, name
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
            y.token_ids,
            y.text,
            y.finish_reason,
            y.stop_reason,
        ), name
        (last,) = [s for s in steps if s.finished]
        accepted_on_the_last_step[name] = last.num_accepted_tokens
    assert any(n >= 1 for n in accepted_on_the_last_step.values()), accepted_on_the_last_step


def test_min_tokens_bans_eos_inside_the_trees(eos_target, eos_llms, stop_point) -> None:
    """EOS (not ignored) is the head's likely draft at token p; min_tokens bans it there."""
    prompt, tokens, p = stop_point
    plain, speculative = eos_llms
    params = greedy(min_tokens=p + 4)
    prompts = [prompt, *mixed_prompts(6, seed=13)]
    ar = assert_matches_plain(plain, speculative, eos_target, prompts, params)
    eos = tokens[p]
    assert eos not in ar[0].outputs[0].token_ids[: p + 4]
    assert len(ar[0].outputs[0].token_ids) >= p + 4
    (unbanned,), _ = run(plain, [prompt], greedy())
    assert unbanned.outputs[0].token_ids[-1] == eos and len(unbanned.outputs[0].token_ids) <= p + 1


# ------------------------------------------------------------------ n > 1


def test_n2_greedy_choices_equal_plain_decoding(bigram_target, plain, speculative) -> None:
    prompts = mixed_prompts(4, seed=14)
    ar = assert_matches_plain(
        plain, speculative, bigram_target, prompts, greedy(ignore_eos=True, n=2)
    )
    (single, _) = run(plain, prompts, greedy(ignore_eos=True))
    for a, s in zip(ar, single):
        assert [c.token_ids for c in a.outputs] == [s.outputs[0].token_ids] * 2
