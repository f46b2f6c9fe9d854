"""Unit tests of sampling/logits_processing.py (and the sampler on top): filters, temperature,
penalties, logit bias, the min_tokens ban, greedy rows, and seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling.logits_processing import (
    LogitsContext,
    apply_penalties,
    sample_from,
    target_probabilities,
    token_logprobs,
)
from engine.sampling.sampler import sample
from engine.sampling.sampling_params import SamplingParams

EOS = 2
VOCAB = 8


def log_probs(*probs: float) -> torch.Tensor:
    """Logits [1, len(probs)] whose softmax is `probs`."""
    return torch.tensor([probs]).log()


def kept(probs: torch.Tensor) -> set[int]:
    """Token ids of a single row with non-zero probability."""
    return set(torch.nonzero(probs[0]).flatten().tolist())


def context(params: SamplingParams, prompt: list[int], output: list[int] = ()) -> LogitsContext:
    return LogitsContext(params, [*prompt, *output], len(prompt), frozenset({EOS}))


def filtered(logits: torch.Tensor, **options) -> torch.Tensor:
    return target_probabilities(logits, [SamplingParams(**options)])


# ------------------------------------------------------------------ filters and temperature

PROBS = (0.05, 0.5, 0.15, 0.3)  # ranked: 1, 3, 2, 0


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, {0, 1, 2, 3}),
        ({"top_k": 1}, {1}),
        ({"top_k": 2}, {1, 3}),
        ({"top_k": 3}, {1, 3, 2}),
        ({"top_k": 100}, {0, 1, 2, 3}),
        ({"top_k": 0}, {0, 1, 2, 3}),  # off
        ({"top_k": -1}, {0, 1, 2, 3}),  # off, as vLLM and the OpenAI servers spell it
        ({"top_k": -1, "top_p": 0.75}, {1, 3}),  # the other filters still apply
        ({"top_p": 0.4}, {1}),  # 0.5 alone covers 0.4
        ({"top_p": 0.75}, {1, 3}),  # 0.5 + 0.3 = 0.8 covers 0.75
        ({"top_p": 0.9}, {1, 3, 2}),
        ({"top_p": 0.99}, {0, 1, 2, 3}),
        ({"min_p": 0.2}, {1, 3, 2}),  # threshold 0.2 * 0.5 = 0.1
        ({"min_p": 0.5}, {1, 3}),  # threshold 0.25
        ({"min_p": 1.0}, {1}),
        ({"top_p": 0.82}, {1, 3, 2}),  # 0.5 + 0.3 falls short of 0.82
        ({"top_k": 3, "top_p": 0.82}, {1, 3}),  # top-p over the renormalised top 3: 0.53 + 0.32
    ],
)
def test_filters_keep_the_right_tokens(options, expected) -> None:
    probs = filtered(log_probs(*PROBS), **options)
    assert kept(probs) == expected
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    # The kept tokens keep their relative probabilities.
    ids = sorted(expected)
    original = torch.tensor([PROBS[i] for i in ids])
    assert torch.allclose(probs[0, ids], original / original.sum(), atol=1e-6)


@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_temperature_scales_logits(temperature) -> None:
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    probs = filtered(logits, temperature=temperature)
    assert torch.allclose(probs, torch.softmax(logits / temperature, dim=-1), atol=1e-6)


def test_temperature_applies_before_top_p() -> None:
    """A high temperature flattens the distribution, so top-p keeps more tokens."""
    logits = log_probs(*PROBS)
    assert kept(filtered(logits, top_p=0.75)) == {1, 3}
    assert kept(filtered(logits, top_p=0.75, temperature=5.0)) == {1, 3, 2}


def test_rows_are_filtered_independently() -> None:
    logits = log_probs(*PROBS).repeat(5, 1)
    params = [
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.75),
        SamplingParams(min_p=0.2),
        SamplingParams(),
        SamplingParams(top_k=-1),  # off, beside a row whose top-k is on
    ]
    probs = target_probabilities(logits, params)
    expected = [{1}, {1, 3}, {1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}]
    assert [kept(row[None]) for row in probs] == expected


def test_greedy_rows_are_one_hot_at_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 2.9], [0.1, 2.0, -1.0, 1.9]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams()]
    probs = target_probabilities(logits, params)
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.allclose(probs[2], torch.softmax(logits[2], dim=-1))
    assert sample_from(probs[:2], [None, None]).tolist() == [1, 0]


# ------------------------------------------------------------------ penalties, bias, min_tokens


def penalised(params: SamplingParams, prompt, output, logits: torch.Tensor) -> torch.Tensor:
    return apply_penalties(logits.clone()[None], [context(params, prompt, output)])[0]


def test_repetition_penalty_covers_prompt_and_output() -> None:
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0, 2.0, 4.0, 1.0, 1.0])
    params = SamplingParams(repetition_penalty=2.0)
    out = penalised(params, prompt=[0, 1], output=[2, 3, 3], logits=logits)
    # Seen tokens: positive logits halved, negative doubled; once, however often they occur.
    expected = torch.tensor([1.0, -4.0, 1.0, -4.0, 2.0, 4.0, 1.0, 1.0])
    assert torch.equal(out, expected)


def test_presence_and_frequency_penalties_cover_the_output_only() -> None:
    logits = torch.zeros(VOCAB)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = penalised(params, prompt=[0, 1, 1], output=[2, 3, 3, 3], logits=logits)
    expected = torch.zeros(VOCAB)
    expected[2] = -(0.5 + 0.25 * 1)
    expected[3] = -(0.5 + 0.25 * 3)
    assert torch.equal(out, expected)  # prompt tokens 0 and 1 untouched


def test_negative_presence_penalty_encourages_repeats() -> None:
    out = penalised(SamplingParams(presence_penalty=-1.0), [4], [5, 5], torch.zeros(VOCAB))
    assert out[5] == 1.0 and out[4] == 0.0


def test_logit_bias_adds_to_the_logits() -> None:
    logits = torch.arange(VOCAB, dtype=torch.float32)
    params = SamplingParams(logit_bias={3: 10.0, 6: -100.0})
    out = penalised(params, [1], [], logits)
    expected = logits.clone()
    expected[3] += 10.0
    expected[6] -= 100.0
    assert torch.equal(out, expected)


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(VOCAB)
    params = SamplingParams(min_tokens=3, stop_token_ids=[5])
    early = penalised(params, [1], [4, 4], logits)  # 2 of 3 tokens so far
    assert early[EOS] == -math.inf and early[5] == -math.inf
    assert torch.isfinite(early[[0, 1, 3, 4, 6, 7]]).all()
    reached = penalised(params, [1], [4, 4, 4], logits)
    assert torch.equal(reached, logits)


def test_min_tokens_keeps_eos_when_eos_is_ignored() -> None:
    params = SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[5])
    out = penalised(params, [1], [], torch.zeros(VOCAB))
    assert out[EOS] == 0.0 and out[5] == -math.inf


def test_sampler_applies_penalties_per_row_and_reports_raw_logprobs() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.9, 0.0], [0.0, 1.0, 0.9, 0.0]])
    contexts = [
        context(SamplingParams(temperature=0, logprobs=2), [3], [1]),
        context(SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=2), [3], [1]),
    ]
    result = sample(logits, contexts, [None, None])
    assert result.token_ids == [1, 2]  # the penalty moves only the second row off token 1
    raw = torch.log_softmax(logits[1], dim=-1)
    assert math.isclose(result.logprobs[1].logprob, float(raw[2]), abs_tol=1e-6)
    assert [i for i, _ in result.logprobs[1].top_logprobs] == [1, 2]


def test_token_logprobs_are_sorted_log_softmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    chosen_ids = torch.tensor([4, 0, 49])
    chosen, top_values, top_ids = token_logprobs(logits, chosen_ids, 5)
    expected = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(chosen, expected[torch.arange(3), chosen_ids])
    assert torch.allclose(top_values, expected.topk(5).values)
    assert torch.equal(top_ids, expected.topk(5).indices)
    assert (top_values[:, :-1] >= top_values[:, 1:]).all()


# ------------------------------------------------------------------ sampling


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_seeded_sampling_is_reproducible() -> None:
    probs = torch.softmax(torch.randn(1, 100, generator=seeded(1)), dim=-1)
    first = [int(sample_from(probs, [g])[0]) for g in [seeded(5)] for _ in range(20)]
    second = [int(sample_from(probs, [g])[0]) for g in [seeded(5)] for _ in range(20)]
    assert first == second
    assert len(set(first)) > 1  # the generator advances: not the same draw every time


def test_seeded_row_ignores_the_rest_of_the_batch() -> None:
    probs = torch.softmax(torch.randn(6, 100, generator=seeded(2)), dim=-1)
    alone = [int(sample_from(probs[:1], [g])[0]) for g in [seeded(9)] for _ in range(10)]
    torch.manual_seed(123)
    generator = seeded(9)
    others = [None, seeded(3), None, seeded(4), None]
    among = [int(sample_from(probs, [generator, *others])[0]) for _ in range(10)]
    assert alone == among


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([[0.1, 0.2, 0.0, 0.7]]).repeat(20_000, 1)
    torch.manual_seed(0)
    draws = sample_from(probs, [None] * len(probs))
    frequencies = torch.bincount(draws, minlength=4).float() / len(draws)
    assert frequencies[2] == 0.0
    assert torch.allclose(frequencies, probs[0], atol=0.015)


def test_seeded_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([[0.1, 0.2, 0.0, 0.7]])
    generator = seeded(0)
    draws = torch.tensor([int(sample_from(probs, [generator])[0]) for _ in range(4000)])
    frequencies = torch.bincount(draws, minlength=4).float() / len(draws)
    assert frequencies[2] == 0.0
    assert torch.allclose(frequencies, probs[0], atol=0.03)
