"""oneDNN linears compute what nn.Linear computes, and the eager CPU engine uses them."""

from __future__ import annotations

import pytest
import torch

from engine.layers.onednn_linear import OneDnnLinear, can_use_onednn, use_onednn_linears
from tests.engine.helpers import tiny_engine

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="needs a PyTorch built with oneDNN"
)


@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_nn_linear_for_every_number_of_rows(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias)
    fast = OneDnnLinear(linear)
    with torch.inference_mode():
        for rows in (0, 1, 2, 3, 4, 7, 16, 33, 100):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 5, 96)  # leading dimensions are kept
        torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(4, 200)[:, :96]  # a strided view, as a slice of hidden states is
        torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-5)


def test_only_fp32_cpu_linears_are_replaced_and_their_weights_are_shared():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model[2].to(torch.bfloat16)
    kept, weight = model[2], model[0].weight
    use_onednn_linears(model)
    assert isinstance(model[0], OneDnnLinear) and model[0].weight is weight
    assert model[2] is kept
    assert not can_use_onednn(torch.zeros(2, 2, dtype=torch.bfloat16))


def test_the_eager_cpu_engine_runs_its_linears_through_onednn_and_keeps_its_ties(
    generation_model,
):
    model = tiny_engine(generation_model).runner.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(isinstance(m, OneDnnLinear) for m in model.modules()) == 4 * len(model.layers) + 1
    if model.spec.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


def test_passes_of_few_rows_run_blas_and_larger_ones_onednn():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160)
    onednn_only, mixed = OneDnnLinear(linear), OneDnnLinear(linear, blas_max_rows=3)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 9):
            x = torch.randn(rows, 96)
            expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
            if rows > 3:
                expected = onednn_only(x)
            assert torch.equal(mixed(x), expected), f"{rows} rows ran the other kernel"
