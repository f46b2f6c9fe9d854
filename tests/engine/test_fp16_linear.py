"""Fp16Linear computes what nn.Linear computes on its weight rounded to fp16, for any rows."""

from __future__ import annotations

import pytest
import torch

from engine.execution.layers.fp16_linear import Fp16Linear, can_use_fp16_linear, use_fp16_linears

# The skip asks the build, not can_use_fp16_linear: a fault there must fail these tests.
pytestmark = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines,
    reason="needs a PyTorch with FBGEMM (x86)",
)


@pytest.mark.parametrize("bias", [False, True])
def test_an_fp16_linear_matches_nn_linear_on_the_rounded_weight(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias)
    rounded = torch.nn.Linear(96, 160, bias=bias)
    with torch.no_grad():
        rounded.weight.copy_(linear.weight.half().float())
        if bias:
            rounded.bias.copy_(linear.bias)
    fast = Fp16Linear(linear)
    with torch.inference_mode():
        for rows in (0, 1, 3, 4, 17, 100):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(fast(x), rounded(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 5, 96)  # leading dimensions are kept
        torch.testing.assert_close(fast(x), rounded(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(4, 200)[:, :96]  # a strided view
        torch.testing.assert_close(fast(x), rounded(x), rtol=1e-5, atol=1e-5)
        # and the rounding is what it costs: far closer than any draft needs
        x = torch.randn(8, 96)
        torch.testing.assert_close(fast(x), linear(x), rtol=0, atol=1e-2)


def test_only_fp32_cpu_linears_are_replaced():
    assert can_use_fp16_linear(torch.zeros(1))
    assert not can_use_fp16_linear(torch.zeros(1, dtype=torch.float16))
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).half())
    use_fp16_linears(module)
    assert isinstance(module[0], Fp16Linear)
    assert isinstance(module[1], torch.nn.Linear)  # an fp16 weight: not fp32, left as it is
