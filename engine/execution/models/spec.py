"""ModelSpec: the architecture facts our decoder needs, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, config) -> ModelSpec:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"architecture {model_type!r} ({getattr(config, 'architectures', None)}) is not "
                f"supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported (only silu)")
        num_heads = config.num_attention_heads
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            **_family_flags(model_type, config),
        )


def _family_flags(model_type: str, config) -> dict:
    """What distinguishes the four families: biases, q/k norm, sliding window."""
    attention_bias = bool(getattr(config, "attention_bias", False))
    if model_type == "llama":
        return {
            "qkv_bias": attention_bias,
            "o_bias": attention_bias,
            "mlp_bias": bool(getattr(config, "mlp_bias", False)),
        }
    if model_type == "mistral":
        return {"sliding_window": getattr(config, "sliding_window", None)}
    if model_type == "qwen2":
        window = config.sliding_window if getattr(config, "use_sliding_window", False) else None
        return {"qkv_bias": True, "sliding_window": window}
    # qwen3
    window = config.sliding_window if getattr(config, "use_sliding_window", False) else None
    return {
        "qkv_bias": attention_bias,
        "o_bias": attention_bias,
        "qk_norm": True,
        "sliding_window": window,
    }
