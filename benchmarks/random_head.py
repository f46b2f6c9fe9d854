"""A useless draft head for the benchmarks: the shipped head's files with every floating-point
weight redrawn at random (same shapes, dtype and scale), so its drafts are essentially never
accepted. Imported by the scripts beside it, which run from the repository root as
`python benchmarks/bench_*.py`."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafting.shipped_heads import shipped_head


def useless_head(model: str, out: Path, seed: int = 0) -> Path:
    """Write the random head for `model` (an alias with a shipped head) into `out`."""
    shipped = shipped_head(model)
    shutil.copytree(shipped, out, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: _redrawn(w, generator) for name, w in load_file(shipped / "model.safetensors").items()
    }
    save_file(weights, out / "model.safetensors")
    return out


def _redrawn(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random values of the weight's shape, dtype and scale; integer tensors (an EAGLE-3 head's
    vocabulary maps d2t and t2d) are kept, as a head needs them valid to load."""
    if not weight.is_floating_point():
        return weight
    return (torch.randn(weight.shape, generator=generator) * weight.float().std()).to(weight.dtype)
