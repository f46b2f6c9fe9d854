"""Loading checkpoint tensors into our modules by name, stacking the ones we fuse."""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import ModelLoadError

# Our fused parameters and the checkpoint tensors they are stacked from, in order.
FUSED_WEIGHTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def load_named_weights(module: nn.Module, weights: dict[str, torch.Tensor], owner: str) -> None:
    """Copy `weights` (names relative to `module`) into its parameters; `owner` names the
    checkpoint in errors. Raises ModelLoadError on a missing tensor or a shape mismatch."""
    missing = []
    for name, param in module.named_parameters():
        tensor = _checkpoint_tensor(weights, name)
        if tensor is None:
            missing.append(name)
            continue
        if tensor.shape != param.shape:
            raise ModelLoadError(
                f"{owner}: weight {name} has shape {tuple(tensor.shape)}, "
                f"but the config implies {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
    if missing:
        raise ModelLoadError(f"{owner} lacks {len(missing)} weights, e.g. {missing[:3]}")


def _checkpoint_tensor(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    if name in weights:
        return weights[name]
    for fused, parts in FUSED_WEIGHTS.items():
        if fused in name:
            names = [name.replace(fused, part) for part in parts]
            if all(n in weights for n in names):
                return torch.cat([weights[n] for n in names], dim=0)
    return None
