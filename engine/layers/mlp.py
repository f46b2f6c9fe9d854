"""The gated (SwiGLU) MLP, with gate and up projections fused into one matmul."""

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.direct_call import DirectCallModule


class GatedMLP(DirectCallModule):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # 2 x [T, inter]
        return self.down_proj(F.silu(gate) * up)
