"""The paged KV cache: one pool of fixed-size blocks per layer, K and V, shared block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerShape:
    num_kv_heads: int
    head_dim: int


class KVCache:
    """Per layer, K and V tensors [num_blocks, block_size, num_kv_heads, head_dim]. The target's
    layers come first; a draft head's layers follow, addressed by the same block tables."""

    def __init__(
        self,
        layers: list[LayerShape],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.layers = [
            tuple(
                torch.zeros(
                    num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device
                )
                for _ in range(2)
            )
            for s in layers
        ]

    @staticmethod
    def bytes_per_block(layers: list[LayerShape], block_size: int, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return sum(2 * block_size * s.num_kv_heads * s.head_dim * element_size for s in layers)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every layer: copy-on-write of shared partial blocks."""
        if not copies:
            return
        device = self.layers[0][0].device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]

    def move_slots(self, src: list[int], dst: list[int], num_layers: int) -> None:
        """Copy single slots src[i] -> dst[i] in the first `num_layers` layers: compacts an accepted
        draft path into place. All sources are read before any write, so overlaps are safe."""
        device = self.layers[0][0].device
        src_t = torch.tensor(src, device=device)
        dst_t = torch.tensor(dst, device=device)
        for k, v in self.layers[:num_layers]:
            for cache in (k, v):
                flat = cache.view(-1, *cache.shape[2:])  # [num_slots, KV, D]
                flat[dst_t] = flat[src_t]
