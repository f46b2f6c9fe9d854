"""OneLayerHead: the pass both EAGLE head formats share, one decoder layer over a layer input.

A head turns each row's token embedding and feature into the layer's attention input and
residual (`_layer_input`, the format's own), then runs attention, the post-attention norm and the
MLP as a target layer does. Rows whose output no one reads only store their K/V: the layer has no
input norm after `_layer_input`, so its K/V depend on that input alone.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.execution.layers.paged_attention import AttentionMetadata


class OneLayerHead(nn.Module):
    """Subclasses build `self_attn`, `post_attention_layernorm`, `mlp` and `rotary`, and define
    `_layer_input(input_ids, features, target_embedding) -> (attention input, residual)`."""

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] the token after each feature's position
        features: torch.Tensor,  # [T, F] target (or drafted) features
        positions: torch.Tensor,  # [T] the features' positions
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        target_embedding: nn.Embedding,
    ) -> torch.Tensor:  # [T, hidden] the layer's output: the next step's feature
        x, residual = self._layer_input(input_ids, features, target_embedding)
        attended = self.self_attn(x, self.rotary.cos_sin(positions, x.dtype), kv_cache, meta)
        # attended is this pass's own tensor (residual may be the caller's features): the fused
        # kernel adds into its second argument in place
        h, residual = self.post_attention_layernorm.add_and_norm(residual, attended)
        return residual + self.mlp(h)

    def store_kv(
        self,
        input_ids: torch.Tensor,  # [T]
        features: torch.Tensor,  # [T, F]
        positions: torch.Tensor,  # [T]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,  # [T]
        target_embedding: nn.Embedding,
    ) -> None:
        """Only the K/V that `forward` would write for these rows: attention's output, o_proj
        and the MLP are skipped."""
        x, _ = self._layer_input(input_ids, features, target_embedding)
        self.self_attn.store_kv(x, self.rotary.cos_sin(positions, x.dtype), kv_cache, slot_mapping)

    def split_kv_projection(self) -> None:
        """For inference: `store_kv` projects onto K and V alone (Attention.split_kv_projection)."""
        self.self_attn.split_kv_projection()
