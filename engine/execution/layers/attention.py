"""Self-attention of a decoder layer: fused QKV, optional q/k norm, rotary, paged attention (the
torch backend, or flash-attn's when the step's metadata is built for it)."""

from __future__ import annotations

import torch
from torch import nn

from engine.execution.layers.cpu_kernels import CpuKernels
from engine.execution.layers.direct_call import DirectCallModule
from engine.execution.layers.flash_attention import FlashAttentionMetadata, flash_paged_attention
from engine.execution.layers.norm import RMSNorm
from engine.execution.layers.paged_attention import AttentionMetadata, paged_attention, store_kv
from engine.execution.layers.rotary import apply_rotary


class Attention(DirectCallModule):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,  # Qwen3 normalises q and k per head before rotary
        input_size: int | None = None,  # EAGLE-3's layer reads [embedding ; feature]: 2 * hidden
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        qkv_size = (num_heads + 2 * num_kv_heads) * head_dim
        self.qkv_proj = nn.Linear(input_size or hidden_size, qkv_size, qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.cpu_kernels: CpuKernels | None = None  # set by use_cpu_kernels
        self.kv_proj: nn.Linear | None = None  # set by split_kv_projection

    def forward(
        self,
        x: torch.Tensor,  # [T, input_size]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # 2 x [T, 1, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, KV, D]
        meta: AttentionMetadata | FlashAttentionMetadata,  # its type picks the backend
    ) -> torch.Tensor:  # [T, hidden]
        q, k, v = self._project(x, cos_sin)
        if isinstance(meta, FlashAttentionMetadata):
            out = flash_paged_attention(q, k, v, *kv_cache, meta, self.scale)  # [T, H * D]
        elif self.cpu_kernels is not None:
            out = self.cpu_kernels.paged_attention(q, k, v, *kv_cache, meta, self.scale)
        else:
            out = paged_attention(q, k, v, *kv_cache, meta, self.scale)  # [T, H * D]
        return self.o_proj(out)

    def store_kv(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # 2 x [T, 1, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, KV, D]
        slot_mapping: torch.Tensor,  # [T]
    ) -> None:
        """Write the K/V of `x`'s tokens to the cache without attending: for tokens whose
        output no one reads, only later tokens' attention to them."""
        k, v = (
            self._project(x, cos_sin)[1:] if self.kv_proj is None else self._project_kv(x, cos_sin)
        )
        if self.cpu_kernels is not None:
            self.cpu_kernels.store_kv(k, v, *kv_cache, slot_mapping)
        else:
            store_kv(k, v, *kv_cache, slot_mapping)

    def split_kv_projection(self) -> None:
        """Give `store_kv` a projection of its own onto K and V alone (qkv_proj's rows after q's,
        sharing their memory), so that storing skips q's share of the matmul. Call it on the
        nn.Linear, before any swap for a kernel: those copy the weight they are given."""
        q_size = self.num_heads * self.head_dim
        qkv = self.qkv_proj
        self.kv_proj = nn.Linear(qkv.in_features, qkv.out_features - q_size, qkv.bias is not None)
        self.kv_proj.weight = nn.Parameter(qkv.weight.detach()[q_size:], requires_grad=False)
        if qkv.bias is not None:
            self.kv_proj.bias = nn.Parameter(qkv.bias.detach()[q_size:], requires_grad=False)

    def _project_kv(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        """k [T, KV, D] (normed and rotated) and v [T, KV, D] of `x` [T, input_size]."""
        num_tokens, num_kv_heads, head_dim = x.shape[0], self.num_kv_heads, self.head_dim
        kv = self.kv_proj(x)  # [T, 2 * KV * D]
        k = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
        v = kv[:, num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return self._rotated(k, cos_sin), v

    def _project(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        """q [T, H, D], k [T, KV, D] (normed and rotated) and v [T, KV, D] of `x` [T, hidden]."""
        num_tokens, num_heads, num_kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # [T, (H + 2 * KV) * D]
        split = (num_heads + num_kv_heads) * self.head_dim
        qk = qkv[:, :split].view(num_tokens, num_heads + num_kv_heads, self.head_dim)
        v = qkv[:, split:].view(num_tokens, num_kv_heads, self.head_dim)  # [T, KV, D]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :num_heads]), self.k_norm(qk[:, num_heads:])), dim=1)
        qk = self._rotated(qk, cos_sin)  # [T, H + KV, D]: q and k rotated in one pass
        q, k = qk.split([num_heads, num_kv_heads], dim=1)  # [T, H, D], [T, KV, D]
        return q, k, v

    def _rotated(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        """x [T, heads, D], this pass's own buffer, rotated (in place by the CPU kernel)."""
        if self.cpu_kernels is not None:
            self.cpu_kernels.rotary_(x, *cos_sin)
            return x
        return apply_rotary(x, *cos_sin)
