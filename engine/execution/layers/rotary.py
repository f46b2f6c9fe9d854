"""Rotary position embeddings, with the static scalings (linear, llama3, yarn) from transformers."""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import UnsupportedArchitectureError

# Scalings whose frequencies depend on the current sequence length are not supported: they would
# make a token's K/V depend on how long the sequence later grows, which a KV cache cannot honour.
_SEQ_LEN_DEPENDENT = ("dynamic", "longrope")


def rope_inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the attention scaling of the config's rope type."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return (1.0 / (base**exponents)).float(), 1.0
    if rope_type in _SEQ_LEN_DEPENDENT:
        raise UnsupportedArchitectureError(f"rope scaling '{rope_type}' is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedArchitectureError(f"unknown rope scaling '{rope_type}'")
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings by position, from cos/sin tables built once for max_positions."""

    def __init__(
        self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int
    ) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        # [max_positions, head_dim]: rotate-half's sign folded into the table (see apply_rotary)
        self.register_buffer("signed_sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and signed sin rows [T, 1, head_dim] of positions [T], computed once per step."""
        cos, signed_sin = self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)
        if cos.dtype == dtype:
            return cos, signed_sin
        return cos.to(dtype), signed_sin.to(dtype)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:  # x: [T, heads, head_dim]; cos, signed_sin: [T, 1, head_dim]
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1) for x's halves x1, x2.
    With the sign in the table (signed_sin = cat(-sin, sin)) that is the halves swapped, one flip:
    three kernels fewer per layer than slicing, negating and concatenating, and the same values."""
    num_tokens, num_heads, head_dim = x.shape
    swapped = x.view(num_tokens, num_heads, 2, head_dim // 2).flip(2).view(x.shape)  # [x2, x1]
    return x * cos + swapped * signed_sin
