"""RMSNorm, computed in float32 as the reference implementations do."""

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.direct_call import DirectCallModule


class RMSNorm(DirectCallModule):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)
