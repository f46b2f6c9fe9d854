"""Column-major CPU weights change the memory layout only: same values, same ties, same outputs."""

from __future__ import annotations

import torch

from engine.execution.layers.cpu_linear import CpuLinear
from engine.execution.layers.weight_layout import use_column_major_weights
from tests.engine.helpers import tiny_engine


def test_the_loaded_model_is_column_major_and_keeps_its_ties(generation_model):
    model = tiny_engine(generation_model).runner.model
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, CpuLinear))]
    untied = [m for m in linears if m.weight is not model.embed_tokens.weight]
    assert untied and all(m.weight.t().is_contiguous() for m in untied)
    assert model.embed_tokens.weight.is_contiguous()  # lookups gather its rows
    if model.spec.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


def test_a_weight_tied_to_an_embedding_stays_row_major():
    module = torch.nn.ModuleDict(
        {"embed": torch.nn.Embedding(40, 16), "head": torch.nn.Linear(16, 40, bias=False)}
    )
    module["head"].weight = module["embed"].weight
    use_column_major_weights(module)
    assert module["head"].weight is module["embed"].weight
    assert module["embed"].weight.is_contiguous()


def test_relayout_keeps_every_value_and_result():
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    x = torch.randn(6, 48)
    before, expected = layer.weight.detach().clone(), layer(x)
    use_column_major_weights(layer)
    assert not layer.weight.is_contiguous() and layer.weight.t().is_contiguous()
    assert torch.equal(layer.weight, before)
    torch.testing.assert_close(layer(x), expected)
