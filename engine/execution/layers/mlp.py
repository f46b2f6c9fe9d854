"""The gated (SwiGLU) MLP, with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.layers.cpu_kernels import CpuKernels
from engine.execution.layers.direct_call import DirectCallModule


class GatedMLP(DirectCallModule):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.cpu_kernels: CpuKernels | None = None  # set by use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 * inter]
        if self.cpu_kernels is not None:
            return self.down_proj(self.cpu_kernels.silu_and_mul(gate_up.contiguous()))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # 2 x [T, inter]
        return self.down_proj(F.silu(gate) * up)
