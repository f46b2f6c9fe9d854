"""The start-up choice of linear kernels: what the timings say is applied to every linear of the
target, the head and the draft lm_head, and decoding stays exact whichever kernel serves a pass."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.execution import linear_kernels
from engine.execution.layers.cpu_linear import (
    MKL_PACKED,
    ONEDNN,
    CpuLinear,
    LinearKernels,
    cpu_linears,
    formats_available,
)
from engine.execution.layers.fp16_linear import Fp16Linear
from tests.drafting.test_speculative_generation import (
    acceptance_length,
    assert_same_or_near_tie,
    generate,
    mixed_prompts,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="needs a PyTorch built with oneDNN"
)


def timings(rows_limit: int, mkl_share: float):
    """Pass timings where BLAS takes half the time of the packed copy up to `rows_limit` rows and
    more above, and MKL-packed takes `mkl_share` of oneDNN's time."""

    def fastest_passes(runner, kernels, candidates, rows: int) -> list[float]:
        if candidates[0].blas_max_rows:  # BLAS against the chosen format
            return [0.5, 1.0] if rows <= rows_limit else [1.0, 0.9]
        return [mkl_share if c.packed_format == MKL_PACKED else 1.0 for c in candidates]

    return fastest_passes


def test_a_small_model_is_not_timed_and_keeps_onednn(bigram_target, monkeypatch):
    def never(*args):
        raise AssertionError("a model that fits in cache was timed")

    monkeypatch.setattr(linear_kernels, "_fastest_passes", never)
    llm_runner = generate(bigram_target, None, [[5, 6, 7]])[0].engine.runner
    assert llm_runner.linear_kernels == LinearKernels(ONEDNN, blas_max_rows=0)
    layers = cpu_linears(llm_runner.model)
    assert all(layer.kernels is llm_runner.linear_kernels for layer in layers)
    assert all(list(layer.copies) == [ONEDNN] for layer in layers)


# unpadded passes of 1-8 sequences: 4 rows are faster than 1 or 2
PASS_TIMES = [1.0, 1.1, 0.97, 0.8, 0.85, 0.9, 1.0, 1.1]


def test_a_pass_is_padded_to_the_fastest_larger_size_only_where_clearly_faster():
    assert linear_kernels.padded_rows(PASS_TIMES, 0) == (4, 4, 4, 4, 5, 6, 7, 8)
    assert linear_kernels.padded_rows(PASS_TIMES, 1) == (1, 4, 4, 4, 5, 6, 7, 8)
    even = [1.0, 0.98, 0.97, 0.99]  # within the margin: nothing is padded
    assert linear_kernels.padded_rows(even, 0) == (1, 2, 3, 4)


CHOICES = [(0, 1.0), (2, 0.5), (8, 0.97)]  # (rows BLAS wins up to, MKL-packed's share of oneDNN)


@pytest.mark.parametrize("rows_limit,mkl_share", CHOICES)
def test_the_measured_choice_reaches_every_linear_and_speculation_stays_exact(
    bigram_target, trained_head, monkeypatch, rows_limit, mkl_share, tmp_path
):
    monkeypatch.setattr(linear_kernels, "_MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(linear_kernels, "_fastest_passes", timings(rows_limit, mkl_share))
    monkeypatch.setattr(linear_kernels, "_fastest_by_size", lambda runner, sizes: PASS_TIMES)
    has_mkl = MKL_PACKED in formats_available()
    expected_format = MKL_PACKED if has_mkl and mkl_share < linear_kernels._MARGIN else ONEDNN
    # a reduced draft vocabulary, so that the draft lm_head is a linear of its own
    head = shutil.copytree(trained_head, tmp_path / "head")
    (head / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(3, 256, 2))}))
    prompts = mixed_prompts(6, seed=3)
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    llm, speculative = generate(
        bigram_target, head, prompts, num_kv_blocks=1024, fp16_draft_weights=False
    )

    engine = llm.engine
    kernels = engine.runner.linear_kernels
    pad_to = linear_kernels.padded_rows(PASS_TIMES, rows_limit)
    assert kernels == LinearKernels(expected_format, rows_limit, pad_to)
    head_linears = cpu_linears(engine.drafter.head)
    assert head_linears and isinstance(engine.drafter.draft_logits, CpuLinear)
    linears = [*cpu_linears(engine.runner.model), *head_linears, engine.drafter.draft_logits]
    for layer in linears:  # one shared choice, and only the chosen copy kept
        assert layer.kernels is kernels and list(layer.copies) == [expected_format]
    for prompt, a, b in zip(prompts, plain, speculative):
        assert_same_or_near_tie(
            bigram_target, prompt, a.outputs[0].token_ids, b.outputs[0].token_ids
        )


@pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines, reason="needs FBGEMM (x86)"
)
@pytest.mark.parametrize("draft_vocab", [False, True])
def test_fp16_draft_weights_draft_as_fp32_ones_do_and_stay_exact(
    bigram_target, trained_head, tmp_path, draft_vocab
):
    head = shutil.copytree(trained_head, tmp_path / "head")
    if draft_vocab:
        (head / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(3, 256, 2))}))
    prompts = mixed_prompts(6, seed=4)
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    llm, fp16 = generate(bigram_target, head, prompts, num_kv_blocks=1024)
    _, fp32 = generate(bigram_target, head, prompts, num_kv_blocks=1024, fp16_draft_weights=False)

    drafter = llm.engine.drafter
    head_linears = [m for m in drafter.head.modules() if isinstance(m, Fp16Linear)]
    assert len(head_linears) == 6  # fc, qkv, kv (for store_kv), o, gate_up, down
    assert isinstance(drafter.draft_logits, Fp16Linear)
    assert not any(isinstance(m, Fp16Linear) for m in llm.engine.runner.model.modules())
    for prompt, a, b in zip(prompts, plain, fp16):
        assert_same_or_near_tie(
            bigram_target, prompt, a.outputs[0].token_ids, b.outputs[0].token_ids
        )
    # the drafts hardly move: the head accepts as much as with its fp32 weights
    assert acceptance_length(fp16) == pytest.approx(acceptance_length(fp32), rel=0.05)
    assert acceptance_length(fp16) > 1.3  # a trained head, not noise
