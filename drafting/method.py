"""EagleMethod: EAGLE heads and their drafter, as the engine's `DraftMethod` entry point."""

from __future__ import annotations

from pathlib import Path

import torch

from drafting.eagle_drafter import EagleDrafter, TreeShape
from drafting.head_loader import DraftHead, load_head
from drafting.shipped_heads import shipped_head
from engine.config import EngineConfig
from engine.execution.models.decoder import DecoderModel
from engine.execution.models.spec import ModelSpec
from engine.spec.draft_policy import DraftPolicy


class EagleMethod:
    def shipped_head(self, model: str) -> Path | None:
        return shipped_head(model)

    def load_head(
        self,
        path: str,
        target: ModelSpec,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> DraftHead:
        return load_head(path, target, max_positions, device, dtype)

    def make_drafter(
        self,
        head: DraftHead,
        target: DecoderModel,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        config: EngineConfig,
        policy: DraftPolicy | None,
    ) -> EagleDrafter:
        shape = TreeShape(config.draft_top_k, config.draft_depth, config.draft_total_tokens)
        return EagleDrafter(
            head,
            target,
            kv_layers,
            config.block_size,
            shape,
            policy,
            config.fp16_draft_weights,
        )
