"""One decoder-only transformer for the Llama family (Llama, Mistral, Qwen2, Qwen3).

The families differ only in the flags of ModelSpec (biases, q/k norm, sliding window), so one
implementation serves all four. `forward` returns the final-normed hidden states (EAGLE-1/2's
features), followed, when `feature_layers` is set, by the residual stream entering each of those
layers (EAGLE-3's features): [T, hidden * (1 + len(feature_layers))]; `split_features` takes them
apart. `compute_logits` applies the lm_head to just the rows that are sampled.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.execution.layers.attention import Attention
from engine.execution.layers.direct_call import DirectCallModule
from engine.execution.layers.mlp import GatedMLP
from engine.execution.layers.norm import RMSNorm
from engine.execution.layers.paged_attention import AttentionMetadata
from engine.execution.layers.rotary import RotaryEmbedding
from engine.execution.layers.weight_layout import use_column_major_weights
from engine.execution.layers.weights import load_named_weights
from engine.execution.models.spec import ModelSpec


class DecoderLayer(DirectCallModule):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            qkv_bias=spec.qkv_bias,
            o_bias=spec.o_bias,
            qk_norm_eps=spec.rms_norm_eps if spec.qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)

    def forward(
        self, x, residual, cos_sin, kv_cache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden]: the previous layer's MLP output, not yet added to the residual stream
        (residual [T, hidden]; None at the first layer, whose x is the embedding). Returns this
        layer's MLP output and the stream before it, so that each add fuses with the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        attended = self.self_attn(h, cos_sin, kv_cache, meta)  # [T, hidden]
        h, residual = self.post_attention_layernorm.add_and_norm(attended, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.rotary = rotary
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.feature_layers: tuple[int, ...] = ()  # set once, by a draft head that reads them
        self.tie_weights()

    @classmethod
    def from_state_dict(
        cls,
        spec: ModelSpec,
        rotary: RotaryEmbedding,
        state_dict: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
    ) -> DecoderModel:
        """Build without random initialisation (on the meta device), then load the weights."""
        with torch.device("meta"):
            model = cls(spec, RotaryEmbedding(torch.ones(1), 1.0, 1))
        model = model.to_empty(device=device)
        model.tie_weights()  # to_empty makes new tensors, which unties them
        model.rotary = rotary.to(device)
        model.load_weights(state_dict)
        model = model.to(dtype).eval()
        use_column_major_weights(model)
        return model

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: K, V blocks
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden * (1 + len(feature_layers))], after the final norm
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        residual, taps = None, {}
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if index in self.feature_layers:  # a copy: the layers add into the stream in place
                taps[index] = x.clone() if residual is None else x + residual  # [T, hidden]
            x, residual = layer(x, residual, cos_sin, kv_cache, meta)
        hidden = self.norm.add_and_norm(x, residual)[0]  # [T, hidden]
        if not taps:
            return hidden
        return torch.cat([hidden, *(taps[i] for i in self.feature_layers)], dim=-1)

    def split_features(self, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s output [T, F] -> (final hidden [T, hidden], the drafter's features)."""
        if not self.feature_layers:
            return output, output
        return output[:, : self.spec.hidden_size], output[:, self.spec.hidden_size :]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return self.lm_head(hidden).float()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face state dict by name, stacking q/k/v and gate/up into fused params."""
        weights = {name.removeprefix("model."): t for name, t in state_dict.items()}
        load_named_weights(self, weights, "checkpoint")
