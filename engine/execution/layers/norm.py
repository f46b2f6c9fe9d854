"""RMSNorm, computed in float32 as the reference implementations do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.layers.cpu_kernels import CpuKernels
from engine.execution.layers.direct_call import DirectCallModule


class RMSNorm(DirectCallModule):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.cpu_kernels: CpuKernels | None = None  # set by use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        if self.cpu_kernels is not None:
            return self.cpu_kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x, residual: [T, size]
        """The residual stream after adding x, normed, and that stream: (norm(x + residual),
        x + residual). The fused kernel adds into `residual` in place."""
        if self.cpu_kernels is not None:
            return self.cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual
