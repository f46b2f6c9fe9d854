"""The start-up choice of linear kernels: what the timings say is applied to every linear of the
target, the head and the draft lm_head, and decoding stays exact whichever kernel serves a pass."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import linear_kernels
from engine.layers.onednn_linear import OneDnnLinear, onednn_linears
from tests.drafting.test_speculative_generation import (
    assert_same_or_near_tie,
    generate,
    mixed_prompts,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="needs a PyTorch built with oneDNN"
)


def blas_faster_up_to(rows_limit: int):
    """Timings where BLAS takes half the time of oneDNN up to `rows_limit` rows, more above."""

    def fastest_passes(runner, rows: int) -> tuple[float, float]:
        return (0.5, 1.0) if rows <= rows_limit else (1.0, 0.9)

    return fastest_passes


def test_a_small_model_is_not_timed_and_keeps_onednn(bigram_target, monkeypatch):
    def never(runner, rows):
        raise AssertionError("a model that fits in cache was timed")

    monkeypatch.setattr(linear_kernels, "_fastest_passes", never)
    llm_runner = generate(bigram_target, None, [[5, 6, 7]])[0].engine.runner
    assert llm_runner.blas_max_rows == 0
    assert all(layer.blas_max_rows == 0 for layer in onednn_linears(llm_runner.model))


@pytest.mark.parametrize("rows_limit", [0, 2, 8])
def test_the_measured_choice_reaches_every_linear_and_speculation_stays_exact(
    bigram_target, trained_head, monkeypatch, rows_limit, tmp_path
):
    monkeypatch.setattr(linear_kernels, "_MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(linear_kernels, "_fastest_passes", blas_faster_up_to(rows_limit))
    # a reduced draft vocabulary, so that the draft lm_head is a linear of its own
    head = shutil.copytree(trained_head, tmp_path / "head")
    (head / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(3, 256, 2))}))
    prompts = mixed_prompts(6, seed=3)
    _, plain = generate(bigram_target, None, prompts, num_kv_blocks=1024)
    llm, speculative = generate(bigram_target, head, prompts, num_kv_blocks=1024)

    engine = llm.engine
    assert engine.runner.blas_max_rows == rows_limit
    head_linears = onednn_linears(engine.drafter.head)
    assert head_linears and isinstance(engine.drafter.draft_lm_head, OneDnnLinear)
    linears = [*onednn_linears(engine.runner.model), *head_linears, engine.drafter.draft_lm_head]
    for layer in linears:
        assert layer.blas_max_rows == rows_limit
    for prompt, a, b in zip(prompts, plain, speculative):
        assert_same_or_near_tie(
            bigram_target, prompt, a.outputs[0].token_ids, b.outputs[0].token_ids
        )
