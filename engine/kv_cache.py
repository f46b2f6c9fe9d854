"""The paged KV cache: one pool of fixed-size blocks per layer, K and V."""

from __future__ import annotations

import torch


class KVCache:
    """Per layer, K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.layers = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size

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
