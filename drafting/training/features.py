"""Target features for head training: the target's final-normed hidden states of whole sequences."""

from __future__ import annotations

import torch

from engine.core.kv_cache import KVCache, LayerShape
from engine.execution.layers.paged_attention import SequenceAttention, build_attention_metadata
from engine.execution.models.decoder import DecoderModel


def scratch_attention(
    lengths: list[int], layers: list[LayerShape], dtype: torch.dtype, device: torch.device
):
    """A throwaway KV cache with one block per sequence, and the metadata to run them causally."""
    block_size = max(lengths)
    cache = KVCache(layers, len(lengths), block_size, dtype, device)
    meta = build_attention_metadata(
        [SequenceAttention([b], 0, n) for b, n in enumerate(lengths)], block_size, device
    )
    return cache, meta


@torch.inference_mode()
def target_features(model: DecoderModel, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Final features [len, hidden] of each token sequence, computed in one batched pass."""
    device = model.lm_head.weight.device
    spec = model.spec
    lengths = [len(s) for s in sequences]
    layers = [LayerShape(spec.num_kv_heads, spec.head_dim)] * spec.num_layers
    cache, meta = scratch_attention(lengths, layers, model.lm_head.weight.dtype, device)
    ids = torch.tensor([t for s in sequences for t in s], device=device)
    positions = torch.tensor([p for n in lengths for p in range(n)], device=device)
    hidden = model(ids, positions, cache.layers, meta)  # [sum(len), hidden]
    return list(hidden.split(lengths))
