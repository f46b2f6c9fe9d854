"""CPU linears: fp32 matmuls that read each weight once, however few the rows.

A decode step multiplies a few rows (one token, a verify pass over draft trees, a batch of
sequences each adding one token) by every weight, so a few rows should cost about what one does.
BLAS's `F.linear` falls short of that: from about four rows MKL runs a GEMM that re-packs the
weight on every call. So each CpuLinear keeps a second copy of its weight, laid out once at load
for a library kernel that reads it once for any number of rows:

- oneDNN: the inner-product primitive (`torch.ops.mkldnn._linear_pointwise`) on the blocked layout
  of `torch.ops.mkldnn._reorder_linear_weight` (as inductor's freezing does);
- MKL-packed: `cblas_sgemm_pack` once (`torch.ops.mkl._mkl_reorder_linear_weight`) and
  `cblas_sgemm_compute` per call (`torch.ops.mkl._mkl_linear`), for passes of up to
  `MKL_PACKED_MAX_ROWS` rows; larger ones run on the plain weight.

Passes of at most `blas_max_rows` rows run BLAS's GEMV on the plain weight instead. Which kernel
is fastest depends on the CPU (benchmarks/bench_weight_layout.py), so the engine measures it at
start-up (engine/execution/linear_kernels.py) into one `LinearKernels` shared by the target's
linears, its head's and the draft lm_head.

The plain weight stays (for ties, such as the lm_head's with the embedding, and for anything that
reads `.weight`); the copy costs as much memory again. Results agree with `F.linear` to float
rounding. Inference only: the ops have no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.layers.direct_call import DirectCallModule

ONEDNN, MKL_PACKED = "oneDNN", "MKL-packed"
# the packed copy is laid out for, and serves, passes of up to this many rows
MKL_PACKED_MAX_ROWS = 16


def can_use_cpu_linear(weight: torch.Tensor) -> bool:
    """Whether a CpuLinear can run this weight: fp32, on CPU, in a PyTorch built with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


def formats_available() -> tuple[str, ...]:
    """The second-copy formats this PyTorch can run (MKL only in builds with it)."""
    return (ONEDNN, MKL_PACKED) if torch.backends.mkl.is_available() else (ONEDNN,)


@dataclass
class LinearKernels:
    """How every CpuLinear that shares this object runs: passes of at most `blas_max_rows` rows
    through BLAS on the plain weight, larger ones on the copy in `packed_format`, a pass of m rows
    padded with zero rows to `pad_to[m - 1]` rows where that is longer: a kernel can be faster for
    a few more rows on some CPUs (execution/linear_kernels.py), and each row's result does not
    depend on the others."""

    packed_format: str = ONEDNN
    blas_max_rows: int = 0
    pad_to: tuple[int, ...] = ()  # rows computed for a pass of 1, 2, ... rows; beyond: as many

    def rows_to_compute(self, num_rows: int) -> int:
        return self.pad_to[num_rows - 1] if num_rows <= len(self.pad_to) else num_rows


class CpuLinear(DirectCallModule):
    """An inference-only nn.Linear whose matmul runs on a copy of its weight laid out for a library
    kernel, or on its plain weight through BLAS, as its shared `kernels` say."""

    def __init__(self, linear: nn.Linear, kernels: LinearKernels | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied
        self.kernels = kernels or LinearKernels()
        self.copies: dict[str, torch.Tensor] = {}  # format -> the weight laid out for it
        self.lay_out(self.kernels.packed_format)

    def lay_out(self, packed_format: str) -> None:
        """Make the copy of the weight in `packed_format`, if there is none yet."""
        if packed_format in self.copies:
            return
        weight = self.weight.detach().contiguous()  # [out, in]
        if packed_format == ONEDNN:  # blocked for about 16 rows; it computes any number
            self.copies[ONEDNN] = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        elif packed_format == MKL_PACKED:
            self.copies[MKL_PACKED] = torch.ops.mkl._mkl_reorder_linear_weight(
                weight, MKL_PACKED_MAX_ROWS
            )
        else:
            raise ValueError(f"unknown linear weight format {packed_format!r}")

    def keep_only(self, packed_format: str) -> None:
        """Free every copy but the one in `packed_format`."""
        self.lay_out(packed_format)
        self.copies = {packed_format: self.copies[packed_format]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        num_rows, packed_format = rows.shape[0], self.kernels.packed_format
        mkl = packed_format == MKL_PACKED
        if num_rows <= self.kernels.blas_max_rows or (mkl and num_rows > MKL_PACKED_MAX_ROWS):
            return F.linear(x, self.weight, self.bias)
        computed = self.kernels.rows_to_compute(num_rows)
        if computed > num_rows:
            rows = torch.cat([rows, rows.new_zeros(computed - num_rows, rows.shape[1])])  # [P, in]
        if mkl:  # the op runs the packed kernel when its last argument equals the number of rows
            out = torch.ops.mkl._mkl_linear(
                rows, self.copies[MKL_PACKED], self.weight, self.bias, computed
            )  # [P, out]
        else:
            out = torch.ops.mkldnn._linear_pointwise(
                rows, self.copies[ONEDNN], self.bias, "none", [], ""
            )  # [P, out]
        return out[:num_rows].reshape(*x.shape[:-1], out.shape[-1])


def use_cpu_linears(module: nn.Module, kernels: LinearKernels | None = None) -> None:
    """Replace every nn.Linear inside `module` that a CpuLinear can run by one, all sharing
    `kernels` (new ones, oneDNN for every pass, by default)."""
    kernels = kernels or LinearKernels()
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and can_use_cpu_linear(child.weight):
                setattr(parent, name, CpuLinear(child, kernels))


def cpu_linears(module: nn.Module) -> list[CpuLinear]:
    return [layer for layer in module.modules() if isinstance(layer, CpuLinear)]
