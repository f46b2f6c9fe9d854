"""End-to-end generation through the LLM facade on a tiny random Llama.

Greedy output equals transformers' greedy `generate` token for token, however the engine batches,
chunks or preempts; a request's output does not depend on what shares its batch; n > 1, stop
strings, stop token ids, max_tokens, min_tokens and logprobs behave as in vLLM.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters as dynamo_counters

from engine import LLM, RequestOutput, SamplingParams
from tests.engine.helpers import (
    NEAR_TIE,
    Reference,
    assert_greedy_matches,
    hf_greedy,
    hf_logits,
    load_hf_model,
    random_prompt,
    tiny_llm,
)

MAX_TOKENS = 24
PROMPT_LENGTHS = [1, 4, 13, 22, 31, 40]
EOS = 2


def greedy(max_tokens: int = MAX_TOKENS, **options) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **options)


def seeded(seed: int, max_tokens: int = 16, **options) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, top_p=0.9, seed=seed, max_tokens=max_tokens, ignore_eos=True, **options
    )


def generate(llm: LLM, prompts, params) -> list[RequestOutput]:
    return llm.generate(prompts, params, use_tqdm=False)


def only_choice(output: RequestOutput):
    assert [o.index for o in output.outputs] == [0]
    return output.outputs[0]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [random_prompt(rng, length) for length in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def references(generation_model: Path, prompts) -> list[Reference]:
    hf = load_hf_model(generation_model)
    return [hf_greedy(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.fixture(scope="module")
def llm(generation_model: Path) -> LLM:
    return tiny_llm(generation_model)


# ------------------------------------------------------------------ greedy equals transformers

ENGINE_SETUPS = {
    "plain": {},
    "chunked-prefill": {"max_num_batched_tokens": 8},
    # 32 blocks of 4 tokens hold two of the longest sequences (40 + 24 tokens), not six.
    "preemption": {"block_size": 4, "num_kv_blocks": 32},
    # Both at once: preempted sequences are recomputed in chunks of at most 8 tokens, beside the
    # decodes and the other prompts' chunks; 20 blocks hold one longest sequence and a bit.
    "chunked-prefill-and-preemption": {
        "max_num_batched_tokens": 8,
        "block_size": 4,
        "num_kv_blocks": 20,
    },
    # Two slots: later prompts are prefilled beside others' steps, and the longer ones (over 16
    # new tokens) in a pass of their own.
    "torch-compile": {"enable_torch_compile": True, "max_num_seqs": 2},
}


@pytest.mark.parametrize(
    "setup",
    [pytest.param(s, marks=pytest.mark.slow) if s == "torch-compile" else s for s in ENGINE_SETUPS],
)
def test_greedy_matches_transformers(setup, generation_model, prompts, references) -> None:
    dynamo_counters.clear()
    options = ENGINE_SETUPS[setup]
    llm = tiny_llm(generation_model, **options)
    prompt_tokens_per_step: list[int] = []
    llm.engine.stats_listeners.append(lambda s: prompt_tokens_per_step.append(s.num_prompt_tokens))
    forward, passes = llm.engine.runner.forward, []
    llm.engine.runner.forward = lambda *args: passes.append(1) or forward(*args)

    outputs = generate(llm, prompts, greedy())

    for prompt, output, reference in zip(prompts, outputs, references):
        choice = only_choice(output)
        assert choice.finish_reason == "length"
        assert_greedy_matches(choice.token_ids, reference, f"{setup}, prompt of {len(prompt)}")
    if "max_num_batched_tokens" in options:  # it chunked
        assert max(prompt_tokens_per_step) <= 8
        assert sum(prompt_tokens_per_step) >= sum(PROMPT_LENGTHS)
    if "num_kv_blocks" in options:  # it preempted, and recomputed what it freed
        assert llm.engine.scheduler.num_preemptions > 0
        assert sum(prompt_tokens_per_step) > sum(PROMPT_LENGTHS)
    if setup == "torch-compile":
        assert len(passes) > len(prompt_tokens_per_step)  # some steps ran two passes
        # a graph break would leave the model (partly) eager: correct, but slow
        assert not dynamo_counters["graph_break"]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_llm_defaults_on_a_model_folder(generation_model, prompts, references) -> None:
    """`LLM(folder)` with every default (draft="auto": no head ships for a folder) decodes."""
    llm = LLM(str(generation_model), device="cpu", num_kv_blocks=64)
    (output,) = generate(llm, [prompts[2]], greedy())
    assert_greedy_matches(only_choice(output).token_ids, references[2], "LLM(folder)")


# ------------------------------------------------------------------ batch invariance


def batch_params(mode: str, count: int) -> list[SamplingParams]:
    if mode == "greedy":
        return [greedy(16)] * count
    return [seeded(1000 + i) for i in range(count)]


@pytest.mark.parametrize("mode", ["greedy", "seeded-sampling"])
def test_output_alone_equals_output_among_sixteen_others(mode, generation_model) -> None:
    rng = random.Random(1)
    prompts = [random_prompt(rng, rng.randint(1, 40)) for _ in range(17)]
    params = batch_params(mode, len(prompts))

    together = generate(tiny_llm(generation_model), prompts, params)

    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        (alone,) = generate(tiny_llm(generation_model), [prompt], sp)
        assert only_choice(alone).token_ids == only_choice(together[i]).token_ids, f"request {i}"
        assert only_choice(alone).text == only_choice(together[i]).text
    if mode == "seeded-sampling":  # it really sampled: the outputs are not the greedy ones
        greedy_outputs = generate(tiny_llm(generation_model), prompts, greedy(16))
        assert any(
            only_choice(s).token_ids != only_choice(g).token_ids
            for s, g in zip(together, greedy_outputs)
        )


# ------------------------------------------------------------------ n > 1


def test_greedy_n3_gives_three_copies_of_n1(llm, prompts) -> None:
    (single,) = generate(llm, [prompts[2]], greedy())
    (triple,) = generate(llm, [prompts[2]], greedy(n=3))
    assert [o.index for o in triple.outputs] == [0, 1, 2]
    for choice in triple.outputs:
        assert choice.token_ids == only_choice(single).token_ids
        assert choice.text == only_choice(single).text
        assert choice.finish_reason == "length"


def test_seeded_n2_is_reproducible(generation_model, prompts) -> None:
    params = seeded(7, n=2)
    first = generate(tiny_llm(generation_model), [prompts[3]], params)[0]
    second = generate(tiny_llm(generation_model), [prompts[3]], params)[0]
    assert [o.index for o in first.outputs] == [0, 1]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids, "the two choices are copies"


def test_each_choice_reads_its_own_kv(generation_model, prompts) -> None:
    """Sampled n=3 choices share the prompt's blocks, the partial last one included, and then
    diverge: each choice's logprobs equal transformers' for that choice's own tokens, so no choice
    wrote into another's cache (copy-on-write)."""
    llm = tiny_llm(generation_model, block_size=4)
    prompt = prompts[2]  # 13 tokens: the last block is partial when the choices fork
    (output,) = generate(llm, [prompt], seeded(11, n=3, logprobs=0))
    hf = load_hf_model(generation_model)
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3, "the choices did not diverge"
    for choice in output.outputs:
        logits = hf_logits(hf, prompt + choice.token_ids)[len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, dim=-1)
        expected = expected[torch.arange(len(choice.token_ids)), choice.token_ids]
        ours = torch.tensor([lp.logprob for lp in choice.logprobs])
        assert float((ours - expected).abs().max()) <= 1e-4, f"choice {choice.index}"


# ------------------------------------------------------------------ stopping


@pytest.fixture(scope="module")
def free_run(llm, prompts):
    """A prompt and the engine's own greedy continuation of it, with no stop condition."""
    prompt = prompts[4]
    (output,) = generate(llm, [prompt], greedy())
    choice = only_choice(output)
    assert len(choice.text) >= 20, "the reference text is too short to pick stop strings from"
    return prompt, choice


def first_tokens_containing(llm: LLM, tokens: list[int], text: str) -> int:
    """How many tokens it takes before their decoded text contains `text`."""
    decode = llm.get_tokenizer().decode
    return next(k for k in range(len(tokens) + 1) if text in decode(tokens[:k]))


def test_stop_string_cuts_the_text(llm, free_run) -> None:
    prompt, reference = free_run
    stop = reference.text[10:13]
    cut = reference.text.find(stop)

    (output,) = generate(llm, [prompt], greedy(stop=[stop]))
    choice = only_choice(output)
    assert choice.text == reference.text[:cut]
    assert stop not in choice.text
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
    num_tokens = first_tokens_containing(llm, reference.token_ids, stop)
    assert choice.token_ids == reference.token_ids[:num_tokens]

    (kept,) = generate(llm, [prompt], greedy(stop=[stop], include_stop_str_in_output=True))
    assert only_choice(kept).text == reference.text[: cut + len(stop)]
    assert (only_choice(kept).finish_reason, only_choice(kept).stop_reason) == ("stop", stop)


def test_earliest_of_several_stop_strings_wins(llm, free_run) -> None:
    prompt, reference = free_run
    late, early = reference.text[15:17], reference.text[5:8]
    cut = reference.text.find(early)
    assert reference.text.find(late) > cut, "pick stop strings that occur in this order"
    (output,) = generate(llm, [prompt], greedy(stop=[late, early]))
    assert only_choice(output).text == reference.text[:cut]
    assert only_choice(output).stop_reason == early


def test_stop_string_before_min_tokens_is_ignored(llm, free_run) -> None:
    prompt, reference = free_run
    assert len(reference.text) == len(reference.token_ids)  # one character per token
    start = next(i for i in range(4) if reference.text.count(reference.text[i : i + 2]) == 1)
    stop = reference.text[start : start + 2]  # occurs once, ending by the 5th token

    (output,) = generate(llm, [prompt], greedy(stop=[stop], min_tokens=8))
    choice = only_choice(output)
    assert choice.text == reference.text
    assert choice.token_ids == reference.token_ids
    assert choice.finish_reason == "length"


def test_stop_token_id(llm, free_run) -> None:
    prompt, reference = free_run
    stop_token = reference.token_ids[8]
    first = reference.token_ids.index(stop_token)
    decode = llm.get_tokenizer().decode

    (output,) = generate(llm, [prompt], greedy(stop_token_ids=[stop_token]))
    choice = only_choice(output)
    assert choice.token_ids == reference.token_ids[: first + 1]  # the stop token is in the ids
    assert choice.text == decode(reference.token_ids[:first])  # but not in the text
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop_token)


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens(llm, free_run, max_tokens) -> None:
    prompt, reference = free_run
    (output,) = generate(llm, [prompt], greedy(max_tokens))
    choice = only_choice(output)
    assert choice.token_ids == reference.token_ids[:max_tokens]
    assert (choice.finish_reason, choice.stop_reason) == ("length", None)


def test_eos_stops_only_after_min_tokens(llm, free_run) -> None:
    """A logit bias makes EOS the greedy choice everywhere; min_tokens bans it for 5 tokens."""
    prompt, reference = free_run
    assert EOS not in reference.token_ids[:5]
    forced_eos = {"temperature": 0, "max_tokens": 20, "logit_bias": {EOS: 100}}

    (at_once,) = generate(llm, [prompt], SamplingParams(**forced_eos))
    assert only_choice(at_once).token_ids == [EOS]
    assert (only_choice(at_once).finish_reason, only_choice(at_once).stop_reason) == ("stop", None)

    (delayed,) = generate(llm, [prompt], SamplingParams(min_tokens=5, **forced_eos))
    choice = only_choice(delayed)
    assert choice.token_ids == [*reference.token_ids[:5], EOS]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", None)


def test_stop_token_banned_before_min_tokens(llm, free_run) -> None:
    prompt, reference = free_run
    stop_token = reference.token_ids[3]
    first = reference.token_ids.index(stop_token)
    min_tokens = first + 3

    (output,) = generate(llm, [prompt], greedy(stop_token_ids=[stop_token], min_tokens=min_tokens))
    choice = only_choice(output)
    assert choice.token_ids[:first] == reference.token_ids[:first]
    assert stop_token not in choice.token_ids[:min_tokens]
    if choice.finish_reason == "stop":  # it may stop on the token later, never before min_tokens
        assert choice.token_ids[-1] == stop_token and len(choice.token_ids) > min_tokens
    else:
        assert len(choice.token_ids) == MAX_TOKENS


# ------------------------------------------------------------------ logprobs


def test_logprobs_match_transformers(llm, prompts, references) -> None:
    outputs = generate(llm, prompts[1:4], greedy(logprobs=5))
    for output, reference in zip(outputs, references[1:4]):
        choice = only_choice(output)
        assert len(choice.logprobs) == len(choice.token_ids)
        expected = torch.log_softmax(reference.logits, dim=-1)  # [steps, vocab]
        for step, (token, logprob) in enumerate(zip(choice.token_ids, choice.logprobs)):
            if token != reference.tokens[step]:
                assert_greedy_matches(choice.token_ids, reference)  # only at a near-tie
                break
            assert logprob.token_id == token
            assert abs(logprob.logprob - float(expected[step, token])) <= 1e-4
            ids = [i for i, _ in logprob.top_logprobs]
            values = [v for _, v in logprob.top_logprobs]
            assert len(ids) == 5
            assert values == sorted(values, reverse=True)
            assert token in ids
            if float(expected[step].topk(2).values.diff().abs()) > NEAR_TIE:
                assert ids[0] == token
            top = expected[step].topk(5).values.tolist()
            assert max(abs(a - b) for a, b in zip(values, top)) <= 1e-4


def test_logprobs_zero_gives_only_the_chosen_token(llm, prompts) -> None:
    (output,) = generate(llm, [prompts[1]], greedy(4, logprobs=0))
    choice = only_choice(output)
    assert [lp.token_id for lp in choice.logprobs] == choice.token_ids
    assert all(lp.top_logprobs == () and lp.logprob <= 0 for lp in choice.logprobs)
    (without,) = generate(llm, [prompts[1]], greedy(4))
    assert only_choice(without).logprobs is None
