"""MKL-packed linear weights, for fast matmuls over a few rows on CPU.

A decode step multiplies a few rows (a verify pass over draft trees, a batch of sequences each
adding one token) by every weight of the model. That should cost about what one row costs, since
reading the weights dominates, yet MKL's plain fp32 GEMM re-packs its weight operand into its
kernel's tile layout on every call, and for a few rows that costs more than the multiplication.
MKL's packed GEMM (`cblas_sgemm_pack` once at load, `cblas_sgemm_compute` per call, reached
through `torch.ops.mkl`, the path inductor's freezing takes) skips the re-pack: whole passes of
the default model with 4 to 16 tokens run 6-24% faster than with column-major weights
(engine/layers/weight_layout.py). One row keeps the plain kernel, a GEMV that reads the weight
once and is slightly faster, which is why the unpacked weight stays beside the packed copy: the
cost is a second copy of the linear weights in memory. From 33 rows on (prefill chunks, big
batches) the plain kernel is as fast again and runs instead. benchmarks/bench_weight_layout.py
measures whole passes with each format.

Results agree with `F.linear` to float rounding (the kernels sum in another order), as results of
different BLAS kernels do; nothing else changes. Inference only: the packed op has no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_PACKED_ROWS = 2  # one row runs the plain kernel (a GEMV), slightly faster
MAX_PACKED_ROWS = 32  # beyond, packing gains nothing and the plain kernel is a little faster
_PACKING_HINT_ROWS = 16  # MKL tunes the packed layout for this many rows; it computes any number


def can_pack(weight: torch.Tensor) -> bool:
    """Whether MKL can pack this weight: fp32, on CPU, in a PyTorch built with MKL."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
    )


class PackedLinear(nn.Module):
    """An inference-only nn.Linear whose weight is also held in MKL's packed GEMM layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied
        packed = torch.ops.mkl._mkl_reorder_linear_weight(
            linear.weight.detach().contiguous(), _PACKING_HINT_ROWS
        )
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        if not MIN_PACKED_ROWS <= rows.shape[0] <= MAX_PACKED_ROWS:
            return F.linear(x, self.weight, self.bias)
        # The op runs the packed kernel when its last argument equals the number of rows.
        out = torch.ops.mkl._mkl_linear(
            rows, self.packed_weight, self.weight, self.bias, rows.shape[0]
        )  # [M, out]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def pack_linear_weights(module: nn.Module) -> None:
    """Replace every packable nn.Linear inside `module` by a PackedLinear."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and can_pack(child.weight):
                setattr(parent, name, PackedLinear(child))
