"""Speculative decoding's losslessness in bfloat16: on the CPU, and on a CUDA GPU (marker `cuda`:
skipped where torch sees none) with torch's attention and, where it is installed, flash-attn's
(whose tree verification merges two attentions by their log-sum-exp).

Greedy: plain and speculative output are both the target's greedy path, every token within bf16's
near-tie of transformers' fp32 choice (so they differ only where bf16 may break a tie either way).
Sampling: speculative samples have plain sampling's distribution, on the same GPU (a two-sample
test: bf16 shifts the target's probabilities a little, so both sides sample the same bf16 model),
and the test catches a broken acceptance rule; on the GPU only (20,000 samples a side).
"""

from __future__ import annotations

import pytest
import scipy.stats

import drafting.eagle_drafter
from engine import LLM, SamplingParams
from tests.drafting.test_lossless_sampling import (
    NUM_SAMPLES,
    NUM_TOKENS,
    PROMPT,
    TREE,
    accept_with_draft_probability,
)
from tests.drafting.test_speculative_generation import (
    FULL_TREES,
    SCENARIOS,
    assert_speculation_ran,
    mixed_prompts,
)
from tests.engine.helpers import (
    BF16_CPU,
    BF16_GPU,
    BF16_RTOL,
    assert_near_greedy,
    bf16_options,
    load_hf_model,
)

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize(("device", "backend"), [BF16_CPU, *BF16_GPU])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("head", ["random_head", "trained_head"])
def test_greedy_speculation_follows_the_targets_greedy_path(
    bigram_target, head, scenario, device, backend, request
):
    options = bf16_options(device, backend, block_size=4, **SCENARIOS[scenario])
    prompts = mixed_prompts(12)
    plain = LLM(str(bigram_target), draft=None, **options).generate(prompts, GREEDY, use_tqdm=False)
    draft = str(request.getfixturevalue(head))
    llm = LLM(str(bigram_target), draft=draft, **FULL_TREES, **options)
    speculative = llm.generate(prompts, GREEDY, use_tqdm=False)
    hf = load_hf_model(bigram_target)
    for prompt, a, b in zip(prompts, plain, speculative):
        for label, output in (("plain", a), ("speculative", b)):
            tokens = output.outputs[0].token_ids
            assert len(tokens) == GREEDY.max_tokens
            assert_near_greedy(hf, prompt, tokens, BF16_RTOL, f"{label}, {scenario}")
    assert_speculation_ran(llm, speculative, scenario, head)


def sampled_counts(target, head, options: dict) -> dict[tuple[int, ...], int]:
    """How often each sequence of the first NUM_TOKENS tokens comes out of NUM_SAMPLES seeded
    samples at temperature 1 (plain decoding where `head` is None)."""
    tree = TREE if head is not None else {}
    llm = LLM(
        str(target),
        draft=None if head is None else str(head),
        max_num_seqs=512,
        max_num_batched_tokens=8192,
        **{**options, "num_kv_blocks": 8192, "block_size": 8, **tree},
    )
    params = [
        SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS + 3, ignore_eos=True, seed=seed)
        for seed in range(NUM_SAMPLES)
    ]
    outputs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    if head is not None:
        accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
        assert accepted > NUM_SAMPLES, "the head should get drafts accepted, or nothing is tested"
    counts: dict[tuple[int, ...], int] = {}
    for output in outputs:
        key = tuple(output.outputs[0].token_ids[:NUM_TOKENS])
        counts[key] = counts.get(key, 0) + 1
    return counts


def same_distribution_p_value(a: dict, b: dict) -> float:
    """p-value of a chi-square test that two samples come from one distribution, pooling the
    outcomes seen fewer than 10 times in both together."""
    common = [o for o in a.keys() | b.keys() if a.get(o, 0) + b.get(o, 0) >= 10]
    rare = [o for o in a.keys() | b.keys() if o not in common]
    table = [[counts.get(o, 0) for o in common] for counts in (a, b)]
    if rare:
        for row, counts in zip(table, (a, b)):
            row.append(sum(counts.get(o, 0) for o in rare))
    return float(scipy.stats.chi2_contingency(table).pvalue)


@pytest.mark.parametrize(("device", "backend"), BF16_GPU)
def test_speculative_sampling_keeps_plain_samplings_distribution(small_vocab, device, backend):
    options = bf16_options(device, backend)
    plain = sampled_counts(small_vocab["target"], None, options)
    speculative = sampled_counts(small_vocab["target"], small_vocab["trained"], options)
    assert same_distribution_p_value(plain, speculative) > 0.001


@pytest.mark.cuda
def test_the_check_catches_a_broken_acceptance_rule(small_vocab, monkeypatch):
    options = bf16_options("cuda", "torch")
    plain = sampled_counts(small_vocab["target"], None, options)
    monkeypatch.setattr(drafting.eagle_drafter, "accept_at_node", accept_with_draft_probability)
    broken = sampled_counts(small_vocab["target"], small_vocab["trained"], options)
    assert same_distribution_p_value(plain, broken) < 0.001
