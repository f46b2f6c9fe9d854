"""DraftMethod: how the engine reaches a speculative method it does not implement itself.

The engine owns this protocol and `Drafter`; implementations live outside it (drafting/ holds
EAGLE) and register under the `aerie.draft_methods` entry-point group in their package metadata,
so dependencies point one way: drafting -> engine. A head is an `nn.Module` whose KV layers (one per
head layer) the engine allocates in its own pool, after the target's layers.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from engine.errors import AerieError

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.execution.models.decoder import DecoderModel
    from engine.execution.models.spec import ModelSpec
    from engine.spec.draft_policy import DraftPolicy
    from engine.spec.drafter import Drafter

ENTRY_POINT_GROUP = "aerie.draft_methods"
DEFAULT_METHOD = "eagle"


class DraftHead(Protocol):
    kv_layer_shapes: tuple[tuple[int, int], ...]  # (num_kv_heads, head_dim) per head layer
    # target layers whose input residual stream the head reads as its features (EAGLE-3);
    # empty: it reads the target's final hidden states (EAGLE-1/2)
    feature_layers: tuple[int, ...]


class DraftMethod(Protocol):
    def shipped_head(self, model: str) -> Path | None:
        """The head shipped for `model` (an alias), which `draft="auto"` means; None if none."""

    def load_head(
        self,
        path: str,
        target: ModelSpec,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> DraftHead:
        """Load and check a head folder against its target; raise AerieError if it cannot work."""

    def make_drafter(
        self,
        head: DraftHead,
        target: DecoderModel,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        config: EngineConfig,
        policy: DraftPolicy | None,
    ) -> Drafter:
        """The drafter that speculates with `head`, its K/V in `kv_layers` of the engine's pool,
        for the sequences scheduled with draft scratch (the policy plans which), verifying the
        nodes `policy`'s budget keeps (None: every decoding sequence, whole trees)."""


def load_draft_method(name: str = DEFAULT_METHOD) -> DraftMethod:
    """The installed method registered as `name`."""
    found = entry_points(group=ENTRY_POINT_GROUP, name=name)
    if not found:
        raise AerieError(
            f"no draft method {name!r} is installed (entry-point group {ENTRY_POINT_GROUP!r}); "
            "reinstall Aerie with `pip install -e .`"
        )
    return next(iter(found)).load()()


def resolve_draft(model: str, draft: str | None) -> str | None:
    """ "auto" -> the shipped head or None; "none"/None -> None; anything else is a head path."""
    if draft is None or draft.lower() == "none":
        return None
    if draft == "auto":
        head = load_draft_method().shipped_head(model)
        return str(head) if head else None
    return draft
