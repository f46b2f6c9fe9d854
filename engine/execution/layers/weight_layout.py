"""Column-major linear weights on CPU, for fast matmuls over a few rows.

`F.linear(x, W)` with W stored row-major ([out, in], PyTorch's default) runs the BLAS "NT" kernel;
the same [out, in] tensor stored column-major (W.T's memory contiguous) makes it run the "NN"
kernel instead. Which is faster depends on the CPU: on an AVX2 machine "NT" slowed sharply from 4
rows on and "NN" was 1.5-2.5x faster per layer; on an AVX-512 one, whole passes of the default
model cost about the same either way from 4 rows on, and one row is slightly faster column-major.
The engine stores its CPU weights this way. Only the memory layout changes: every value, and so
every result, stays the same. The eager engine runs its fp32 CPU linears on a second copy laid out
for oneDNN or MKL's packed GEMM instead (layers/cpu_linear.py), faster from a few rows on,
and on this layout for passes of fewer rows where BLAS measures faster at start-up
(execution/linear_kernels.py); this layout also serves a compiled model, and the linears those
kernels cannot run. benchmarks/bench_weight_layout.py
measures whole passes with each format.
"""

from __future__ import annotations

import torch
from torch import nn


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) with the same values, stored column-major."""
    return weight.t().contiguous().t()


def use_column_major_weights(module: nn.Module) -> None:
    """Re-lay every CPU nn.Linear weight of `module` column-major, but for weights tied to one
    of its embeddings: a lookup gathers whole rows, and column-major a row of the default model's
    embedding has its 576 values 49,152 floats apart (16 lookups, the tokens of a draft layer or
    a verify pass, took 0.42 ms instead of 0.13 with the weight out of cache, in an ad hoc
    timing of `F.embedding` after streaming 128 MB through the caches)."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    for layer in module.modules():
        if (
            isinstance(layer, nn.Linear)
            and layer.weight.device.type == "cpu"
            and id(layer.weight) not in embeddings
        ):
            layer.weight.data = column_major(layer.weight.data)
