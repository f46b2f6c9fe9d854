"""Fp16Linear: a linear whose weight is stored in fp16 and multiplied by FBGEMM's fp16 GEMM (fp32
activations in and out, fp32 accumulation), for the draft head and the draft lm_head on CPU.

Drafting reads the head's weights and the draft lm_head's rows at every layer of a tree, at memory
speed on a CPU. FBGEMM's fp16 kernel (the one behind `quantize_dynamic(..., dtype=torch.float16)`)
converts the weight to fp32 in registers, so it reads half the bytes at fp32's arithmetic speed
(benchmarks/bench_draft_weights.py). The shipped heads are fp16 files, so their weights lose
nothing; the draft lm_head's rows are rounded to fp16, which moves draft logits by about 1e-3.
Only drafts run here, never the target, which verifies every draft: the output does not change.
FBGEMM is x86-only; elsewhere (`can_use_fp16_linear` false) the head keeps its fp32 CpuLinears.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.execution.layers.direct_call import DirectCallModule


def can_use_fp16_linear(weight: torch.Tensor) -> bool:
    """Whether an Fp16Linear can stand in for a linear of this weight: fp32, on CPU, in a PyTorch
    with FBGEMM."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and "fbgemm" in torch.backends.quantized.supported_engines
        and hasattr(torch.ops.quantized, "linear_dynamic_fp16")
    )


class Fp16Linear(DirectCallModule):
    """An inference-only linear on an fp16 copy of `linear`'s weight, packed once for FBGEMM. The
    fp32 weight is not kept."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()  # [out, in]
        bias = None if linear.bias is None else linear.bias.detach()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        out = torch.ops.quantized.linear_dynamic_fp16(rows, self.packed)  # [M, out]
        return out.reshape(*x.shape[:-1], self.out_features)


def use_fp16_linears(module: nn.Module) -> None:
    """Replace every nn.Linear inside `module` that an Fp16Linear can run by one."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and can_use_fp16_linear(child.weight):
                setattr(parent, name, Fp16Linear(child))
