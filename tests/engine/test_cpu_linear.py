"""CPU linears compute what nn.Linear computes in either weight format, run the kernel their shared
choice names for each pass size, and the eager CPU engine uses them."""

from __future__ import annotations

import pytest
import torch

from engine.execution.layers.cpu_linear import (
    MKL_PACKED,
    MKL_PACKED_MAX_ROWS,
    ONEDNN,
    CpuLinear,
    LinearKernels,
    can_use_cpu_linear,
    formats_available,
    use_cpu_linears,
)
from tests.engine.helpers import tiny_engine

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="needs a PyTorch built with oneDNN"
)
FORMATS = formats_available()


@pytest.mark.parametrize("packed_format", FORMATS)
@pytest.mark.parametrize("bias", [False, True])
def test_a_cpu_linear_matches_nn_linear_for_every_number_of_rows(packed_format, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias)
    fast = CpuLinear(linear, LinearKernels(packed_format))
    with torch.inference_mode():
        for rows in (0, 1, 2, 3, 4, 7, 16, 17, 33, 100):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 5, 96)  # leading dimensions are kept
        torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(4, 200)[:, :96]  # a strided view, as a slice of hidden states is
        torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed_format", FORMATS)
def test_a_padded_pass_computes_its_rows_among_zero_rows_and_returns_only_them(packed_format):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160)
    kernels = LinearKernels(packed_format, pad_to=(4, 4, 3, 4, 6, 6))
    padded, plain = CpuLinear(linear, kernels), CpuLinear(linear, LinearKernels(packed_format))
    with torch.inference_mode():
        for rows, computed in ((1, 4), (2, 4), (3, 3), (4, 4), (5, 6), (6, 6), (7, 7)):
            x = torch.randn(rows, 96)
            zeros = torch.zeros(computed - rows, 96)
            expected = plain(torch.cat([x, zeros]))[:rows]  # the kernel over the padded rows
            assert kernels.rows_to_compute(rows) == computed
            assert torch.equal(padded(x), expected), f"{rows} rows were not computed as {computed}"
            torch.testing.assert_close(padded(x), linear(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 1, 96)  # leading dimensions are kept
        assert padded(x).shape == (2, 1, 160)


def test_only_fp32_cpu_linears_are_replaced_and_their_weights_are_shared():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model[2].to(torch.bfloat16)
    kept, weight = model[2], model[0].weight
    use_cpu_linears(model)
    assert isinstance(model[0], CpuLinear) and model[0].weight is weight
    assert model[2] is kept
    assert not can_use_cpu_linear(torch.zeros(2, 2, dtype=torch.bfloat16))


def test_the_eager_cpu_engine_runs_its_linears_as_cpu_linears_and_keeps_its_ties(
    generation_model,
):
    runner = tiny_engine(generation_model).runner
    model = runner.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    layers = [m for m in model.modules() if isinstance(m, CpuLinear)]
    assert len(layers) == 4 * len(model.layers) + 1
    assert all(layer.kernels is runner.linear_kernels for layer in layers)
    if model.spec.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("packed_format", FORMATS)
def test_each_pass_runs_the_kernel_its_shared_choice_names(packed_format):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160)
    weight, bias = linear.weight.detach(), linear.bias.detach()
    kernels = LinearKernels(ONEDNN, blas_max_rows=0)
    layer = CpuLinear(linear, kernels)
    layer.lay_out(packed_format)
    kernels.packed_format, kernels.blas_max_rows = packed_format, 3
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 9, MKL_PACKED_MAX_ROWS, MKL_PACKED_MAX_ROWS + 1, 40):
            x = torch.randn(rows, 96)
            if rows <= 3 or (packed_format == MKL_PACKED and rows > MKL_PACKED_MAX_ROWS):
                expected = torch.nn.functional.linear(x, weight, bias)
            elif packed_format == ONEDNN:
                expected = torch.ops.mkldnn._linear_pointwise(
                    x, layer.copies[ONEDNN], bias, "none", [], ""
                )
            else:
                expected = torch.ops.mkl._mkl_linear(
                    x, layer.copies[MKL_PACKED], weight, bias, rows
                )
            assert torch.equal(layer(x), expected), f"{rows} rows ran another kernel"
    layer.keep_only(packed_format)
    assert list(layer.copies) == [packed_format]
