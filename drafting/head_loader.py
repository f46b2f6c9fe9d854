"""Loading and writing draft heads of either published format: EAGLE-1/2 or EAGLE-3."""

from __future__ import annotations

from pathlib import Path

import torch

from drafting.eagle3_head import ARCHITECTURE as EAGLE3
from drafting.eagle3_head import Eagle3Head, load_eagle3_head, save_eagle3_head
from drafting.head import EagleHead, load_eagle_head, save_eagle_head
from drafting.head_format import read_config, rotary_for
from engine.execution.layers.weight_layout import use_column_major_weights
from engine.execution.model_files import load_state_dict
from engine.execution.models.spec import ModelSpec

DraftHead = EagleHead | Eagle3Head


def is_eagle3(config: dict, weights: dict) -> bool:
    architectures = " ".join(config.get("architectures") or [])
    return EAGLE3.lower() in architectures.lower() or any(
        k.startswith("midlayer.") for k in weights
    )


def load_head(
    path: str | Path,
    target: ModelSpec,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
) -> DraftHead:
    """Load and check a head folder against its target; refuse what would load wrongly."""
    folder = Path(path)
    config = read_config(folder)
    weights = load_state_dict(folder)
    head_dim = config.get("head_dim") or (
        config.get("hidden_size", 0) // max(config.get("num_attention_heads") or 1, 1)
    )
    rotary = rotary_for(config, head_dim, max_positions)
    load = load_eagle3_head if is_eagle3(config, weights) else load_eagle_head
    head = load(folder, config, weights, target, rotary)
    head = head.to(device=device, dtype=dtype).eval()  # float casts leave the ids alone
    use_column_major_weights(head)
    return head


def save_head(head: DraftHead, folder: str | Path, rope: dict, dtype: torch.dtype) -> Path:
    """Write `head` in its published format; `rope` holds the target's rope fields."""
    folder = Path(folder)
    save = save_eagle3_head if isinstance(head, Eagle3Head) else save_eagle_head
    save(head, folder, rope, dtype)
    return folder
