"""Column-major linear weights on CPU, for fast matmuls over a few rows.

`F.linear(x, W)` with W stored row-major ([out, in], PyTorch's default) runs the BLAS "NT" kernel;
the same tensor stored column-major (W.T's memory contiguous) runs the "NN" kernel, which on some
CPUs is much faster from a few rows on and on others about the same. Only the memory layout
changes: every value, and so every result, stays the same. The eager engine's fp32 CPU linears
use this layout for the passes BLAS serves (layers/cpu_linear.py); a compiled model, and linears
those kernels cannot run, use it throughout (benchmarks/bench_weight_layout.py).
"""

from __future__ import annotations

import torch
from torch import nn


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) with the same values, stored column-major."""
    return weight.t().contiguous().t()


def use_column_major_weights(module: nn.Module) -> None:
    """Re-lay every CPU nn.Linear weight of `module` column-major, but for weights tied to one
    of its embeddings: a lookup gathers whole rows, and column-major a row's values lie a whole
    vocabulary apart, which makes lookups several times slower."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    for layer in module.modules():
        if (
            isinstance(layer, nn.Linear)
            and layer.weight.device.type == "cpu"
            and id(layer.weight) not in embeddings
        ):
            layer.weight.data = column_major(layer.weight.data)
