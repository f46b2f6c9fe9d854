"""oneDNN linears: fp32 matmuls on CPU that read each weight once, however few the rows.

A decode step multiplies a few rows (one token, a verify pass over draft trees, a batch of
sequences each adding one token) by every weight of the model, so reading the weights should
dominate and a few rows should cost about what one does. The BLAS kernels behind `F.linear` fall
short of that on this project's CPU (an AMD EPYC with AVX2): MKL runs up to three rows as one GEMV
each (3.8 ms a row for the default model's lm_head), and from four rows a GEMM that takes 9-11 ms
up to 8 rows, even with its weight packed once (`cblas_sgemm_pack`). oneDNN's inner-product
primitive (`torch.ops.mkldnn._linear_pointwise`) on a weight laid out once at load for its blocked
kernel (`torch.ops.mkldnn._reorder_linear_weight`, as inductor's freezing does for low-precision
weights) does read it once: in ad hoc timings, 30 of the default model's [3072, 576] MLP weights
took 3.3-3.6 ms for 1 to 4 rows and 4.6 ms for 8, where the same weights as a plain oneDNN tensor
took 4.0 ms for one row and 8.5 ms for 2 to 4. Whole target passes of the default model (benchmarks/
bench_weight_layout.py, best of 5) take 14.2 ms for one token, 15.1 for 4 and 22.0 for 16, where
MKL's packed GEMM took 25.2, 42.8 and 54.0.

The oneDNN tensor is a second copy of the weight, beside the nn.Linear's own (which stays for ties,
such as the lm_head's with the embedding, and for anything that reads `.weight`). Results agree
with `F.linear` to float rounding (the kernels sum in another order), as results of different BLAS
kernels do. Inference only: the op has no gradient.

On some CPUs BLAS's GEMV on the plain weight beats oneDNN for a pass of one to a few rows (an Intel
Xeon with AVX-512: 32.5 against 39.5 ms for a one-token pass of the default model): passes of at
most `blas_max_rows` rows run `F.linear` instead, a number the engine measures at start-up
(engine/linear_kernels.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.direct_call import DirectCallModule

_LAYOUT_HINT_ROWS = 16  # oneDNN lays the weight out for this many rows; it computes any number


def can_use_onednn(weight: torch.Tensor) -> bool:
    """Whether this weight can run through oneDNN: fp32, on CPU, in a PyTorch built with it."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


class OneDnnLinear(DirectCallModule):
    """An inference-only nn.Linear whose matmul runs on a oneDNN copy of its weight."""

    def __init__(self, linear: nn.Linear, blas_max_rows: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied
        self.blas_max_rows = blas_max_rows  # passes of at most this many rows run F.linear
        # [out, in] in the blocked layout oneDNN's kernel for about this many rows reads
        onednn_weight = torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach().contiguous(), _LAYOUT_HINT_ROWS
        )
        self.register_buffer("onednn_weight", onednn_weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        if rows.shape[0] <= self.blas_max_rows:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(
            rows, self.onednn_weight, self.bias, "none", [], ""
        )  # [M, out]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def use_onednn_linears(module: nn.Module) -> None:
    """Replace every nn.Linear inside `module` that oneDNN can run by a OneDnnLinear."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and can_use_onednn(child.weight):
                setattr(parent, name, OneDnnLinear(child))


def onednn_linears(module: nn.Module) -> list[OneDnnLinear]:
    return [layer for layer in module.modules() if isinstance(layer, OneDnnLinear)]


def use_blas_up_to(module: nn.Module, max_rows: int) -> None:
    """Let BLAS serve the passes of at most `max_rows` rows in every OneDnnLinear of `module`."""
    for layer in onednn_linears(module):
        layer.blas_max_rows = max_rows
