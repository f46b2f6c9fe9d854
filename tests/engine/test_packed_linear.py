"""MKL-packed linears compute what nn.Linear computes, and the eager CPU engine uses them."""

from __future__ import annotations

import pytest
import torch

from engine.layers.packed_linear import PackedLinear, can_pack, pack_linear_weights
from tests.engine.helpers import tiny_engine

pytestmark = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="needs MKL")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_nn_linear_for_every_number_of_rows(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear)
    for rows in (1, 2, 3, 4, 7, 16, 33, 100):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 5, 96)  # leading dimensions are kept
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_packing_replaces_fp32_linears_only_and_shares_their_weights():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model[2].to(torch.bfloat16)
    kept, weight = model[2], model[0].weight
    pack_linear_weights(model)
    assert isinstance(model[0], PackedLinear) and model[0].weight is weight
    assert model[2] is kept
    assert not can_pack(torch.zeros(2, 2, dtype=torch.bfloat16))


def test_the_eager_cpu_engine_packs_its_linears_and_keeps_its_ties(generation_model):
    model = tiny_engine(generation_model).runner.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 4 * len(model.layers) + 1
    if model.spec.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
