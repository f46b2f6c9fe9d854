"""HeadLayers: the pass both EAGLE head formats share, decoder layers over a format's layer input.

A head turns each row's token embedding and feature into its first layer's attention input and
residual (`_layer_input`, the format's own), then runs attention, the post-attention norm and the
MLP as a target layer does. EAGLE-3 heads may stack further plain decoder layers on it
(`upper_layers`, vLLM's `num_hidden_layers` > 1), each with its own K/V. In a one-layer head, rows
whose output no one reads only store their K/V: the layer has no input norm after
`_layer_input`, so its K/V depend on that input alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.core.kv_cache import LayerShape
from engine.execution.layers.paged_attention import AttentionMetadata

KVLayer = tuple[torch.Tensor, torch.Tensor]  # one layer's K and V blocks


class HeadLayers(nn.Module):
    """Subclasses build `self_attn`, `post_attention_layernorm`, `mlp`, `rotary` and
    `upper_layers` (decoder layers after the first; empty for one-layer heads), and define
    `_layer_input(input_ids, features, target_embedding) -> (attention input, residual)`."""

    upper_layers: nn.ModuleList

    @property
    def num_layers(self) -> int:
        return 1 + len(self.upper_layers)

    @property
    def kv_layer_shapes(self) -> tuple[LayerShape, ...]:
        """One layer of the engine's paged KV pool per head layer."""
        shape = LayerShape(self.self_attn.num_kv_heads, self.self_attn.head_dim)
        return (shape,) * self.num_layers

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] the token after each feature's position
        features: torch.Tensor,  # [T, F] target (or drafted) features
        positions: torch.Tensor,  # [T] the features' positions
        kv_layers: Sequence[KVLayer],  # one per head layer
        meta: AttentionMetadata,
        target_embedding: nn.Embedding,
    ) -> torch.Tensor:  # [T, hidden] the last layer's output: the next step's feature
        x, residual = self._layer_input(input_ids, features, target_embedding)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        attended = self.self_attn(x, cos_sin, kv_layers[0], meta)
        # attended is this pass's own tensor (residual may be the caller's features): the fused
        # kernel adds into its second argument in place
        h, residual = self.post_attention_layernorm.add_and_norm(residual, attended)
        x = self.mlp(h)  # [T, hidden], not yet added to the residual stream
        for layer, kv_layer in zip(self.upper_layers, kv_layers[1:]):
            x, residual = layer(x, residual, cos_sin, kv_layer, meta)
        return residual + x

    def store_kv(
        self,
        input_ids: torch.Tensor,  # [T]
        features: torch.Tensor,  # [T, F]
        positions: torch.Tensor,  # [T]
        kv_layers: Sequence[KVLayer],
        slot_mapping: torch.Tensor,  # [T]
        target_embedding: nn.Embedding,
    ) -> None:
        """Only the K/V that `forward` would write for these rows, in a one-layer head: attention's
        output, o_proj and the MLP are skipped. (A deeper layer's K/V need the full pass below.)"""
        assert not self.upper_layers, "a multi-layer head stores K/V through forward"
        x, _ = self._layer_input(input_ids, features, target_embedding)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        self.self_attn.store_kv(x, cos_sin, kv_layers[0], slot_mapping)

    def split_kv_projection(self) -> None:
        """For inference: `store_kv` projects onto K and V alone (Attention.split_kv_projection)."""
        if not self.upper_layers:
            self.self_attn.split_kv_projection()
