"""File conventions shared by the EAGLE head formats: config.json, rope fields, unfused weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.execution.layers.rotary import RotaryEmbedding, rope_inverse_frequencies
from engine.execution.layers.weights import FUSED_WEIGHTS

_ROPE_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
)


def read_config(folder: Path) -> dict:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"draft head {folder}: no config.json (expected an EAGLE head folder)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"draft head {folder}: unreadable config.json ({exc})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"draft head {folder}: config.json is not a JSON object")
    return config


def rope_fields(hf_config) -> dict:
    """The target's rope fields, as a head's config.json carries them (its rotary is the
    target's)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    fields = {
        "rope_theta": params.get("rope_theta", 10000.0),
        "max_position_embeddings": hf_config.max_position_embeddings,
    }
    if params.get("rope_type", "default") != "default":
        fields["rope_scaling"] = params
    return fields


def rotary_for(config: dict, head_dim: int, max_positions: int) -> RotaryEmbedding:
    """The rotary embedding a head's config describes (transformers reads its rope fields)."""
    from transformers import LlamaConfig

    fields = {k: config[k] for k in _ROPE_KEYS if config.get(k) is not None}
    inv_freq, scaling = rope_inverse_frequencies(LlamaConfig(**fields), head_dim)
    return RotaryEmbedding(inv_freq, scaling, max_positions)


def unfused(
    state: dict[str, torch.Tensor], split_sizes: dict[str, list[int]], rename
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of a module's state: fused q/k/v and gate/up split into their published
    parts (`split_sizes[fused]`), and each name mapped through `rename`."""
    tensors = {}
    for name, tensor in state.items():
        fused = next((f for f in FUSED_WEIGHTS if f in name), None)
        if fused is None:
            tensors[rename(name)] = tensor
            continue
        pieces = tensor.split(split_sizes[fused], dim=0)
        for part, piece in zip(FUSED_WEIGHTS[fused], pieces):
            tensors[rename(name.replace(fused, part))] = piece
    return tensors


def fused_split_sizes(num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int):
    kv = num_kv_heads * head_dim
    return {
        "self_attn.qkv_proj": [num_heads * head_dim, kv, kv],
        "mlp.gate_up_proj": [intermediate, intermediate],
    }


def write_head_files(
    folder: Path, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    """config.json and model.safetensors; floating tensors cast to `dtype`, ids kept."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    cast = {
        k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
        for k, v in tensors.items()
    }
    save_file(cast, str(folder / "model.safetensors"))
