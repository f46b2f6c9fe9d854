"""The EAGLE-1/2 draft head: fc over [embedding, feature], then one decoder layer.

It predicts the target's next feature (the input of the target's lm_head) from the current feature
and the embedding of the next token, and reuses the target's lm_head (and, when the checkpoint has
none, the target's embedding). Layer 0 has no input norm and there is no final norm, as in the
published heads, whose format (config.json plus pytorch_model.bin or model.safetensors) it loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from drafting.head_format import fused_split_sizes, unfused, write_head_files
from drafting.head_layers import HeadLayers
from engine.errors import ModelLoadError
from engine.execution.layers.attention import Attention
from engine.execution.layers.mlp import GatedMLP
from engine.execution.layers.norm import RMSNorm
from engine.execution.layers.rotary import RotaryEmbedding
from engine.execution.layers.weights import load_named_weights
from engine.execution.models.spec import ModelSpec

_LAYER = "layers.0."
_REQUIRED_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
DRAFT_VOCAB_FILE = "draft_vocab.json"


@dataclass(frozen=True)
class HeadSpec:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    fc_bias: bool
    qkv_bias: bool
    has_embedding: bool

    @classmethod
    def from_files(
        cls, config: dict, weights: dict[str, torch.Tensor], folder: str | Path = ""
    ) -> HeadSpec:
        missing = [k for k in _REQUIRED_CONFIG_KEYS if config.get(k) is None]
        if missing:
            raise ModelLoadError(f"draft head {folder}: config.json lacks {', '.join(missing)}")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        return cls(
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            fc_bias="fc.bias" in weights,
            qkv_bias=f"{_LAYER}self_attn.q_proj.bias" in weights,
            has_embedding="embed_tokens.weight" in weights,
        )

    @classmethod
    def for_target(cls, target: ModelSpec) -> HeadSpec:
        """A new head shaped like one layer of `target` (fc with bias, no embedding)."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            rms_norm_eps=target.rms_norm_eps,
            fc_bias=True,
            qkv_bias=False,
            has_embedding=False,
        )


class EagleHead(HeadLayers):
    def __init__(self, spec: HeadSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, h) if spec.has_embedding else None
        self.fc = nn.Linear(2 * h, h, bias=spec.fc_bias)
        self.self_attn = Attention(
            h, spec.num_heads, spec.num_kv_heads, spec.head_dim, qkv_bias=spec.qkv_bias
        )
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.mlp = GatedMLP(h, spec.intermediate_size)
        self.upper_layers = nn.ModuleList()  # EAGLE-1/2 heads have one layer
        self.rotary = rotary
        # Optional reduced draft vocabulary (target token ids the head may propose), kept in
        # draft_vocab.json beside the weights so the weights stay in the published format.
        self.register_buffer("draft_vocab", None, persistent=False)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return ()  # it reads the target's final hidden states

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        return features  # its fc reads the feature beside the embedding

    def _layer_input(self, input_ids, features, target_embedding):
        """fc over [embedding ; feature]: the attention input and the residual [T, hidden]."""
        embedding = (self.embed_tokens or target_embedding)(input_ids)  # [T, hidden]
        x = self.fc(torch.cat((embedding, features.to(embedding.dtype)), dim=-1))  # [T, hidden]
        return x, x


def load_eagle_head(
    folder: Path, config: dict, weights: dict[str, torch.Tensor], target: ModelSpec, rotary
) -> EagleHead:
    """An EAGLE-1/2 head from its files, checked against its target."""
    spec = HeadSpec.from_files(config, weights, folder)
    _check_against_target(spec, target, weights, folder)
    head = EagleHead(spec, rotary)
    _load_weights(head, weights, folder)
    head.draft_vocab = _read_draft_vocab(folder, target.vocab_size)
    return head


def _read_draft_vocab(folder: Path, vocab_size: int) -> torch.Tensor | None:
    path = folder / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"draft head {folder}: unreadable {DRAFT_VOCAB_FILE} ({exc})"
        ) from None
    if (
        not ids
        or len(set(ids)) != len(ids)
        or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids)
    ):
        raise ModelLoadError(
            f"draft head {folder}: {DRAFT_VOCAB_FILE} must list distinct token "
            f"ids in [0, {vocab_size})"
        )
    return torch.tensor(ids, dtype=torch.long)


def _check_against_target(spec: HeadSpec, target: ModelSpec, weights: dict, folder: Path):
    problems = []
    if spec.hidden_size != target.hidden_size:
        problems.append(f"hidden size {spec.hidden_size} != target's {target.hidden_size}")
    if spec.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {spec.vocab_size} != target's {target.vocab_size}")
    if any(not t.is_floating_point() for t in weights.values()):
        problems.append("weights are not floating point (quantized heads are not supported)")
    fc = weights.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (spec.hidden_size, 2 * spec.hidden_size):
        problems.append(
            f"fc.weight has shape {tuple(fc.shape)}, expected "
            f"({spec.hidden_size}, {2 * spec.hidden_size})"
        )
    if problems:
        raise ModelLoadError(
            f"draft head {folder} does not fit the target model: " + "; ".join(problems)
        )


def _load_weights(head: EagleHead, weights: dict[str, torch.Tensor], folder: Path) -> None:
    flat = {name.removeprefix(_LAYER): t for name, t in weights.items()}
    load_named_weights(head, flat, f"draft head {folder}")


def save_eagle_head(head: EagleHead, folder: Path, rope: dict, dtype: torch.dtype) -> None:
    """Write `head` in the published EAGLE format: a one-layer Llama config.json plus
    model.safetensors with unfused q/k/v and gate/up weights under `layers.0.`."""
    spec = head.spec
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "bias": spec.fc_bias,
        "hidden_act": "silu",
        **rope,
    }
    sizes = fused_split_sizes(
        spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    )
    tensors = unfused(head.state_dict(), sizes, _checkpoint_name)
    write_head_files(folder, config, tensors, dtype)
    if head.draft_vocab is not None:  # Aerie's own side file: a published head needs EAGLE-3
        ids = head.draft_vocab.tolist()
        (folder / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": ids}) + "\n")


def _checkpoint_name(name: str) -> str:
    return name if name.startswith(("fc.", "embed_tokens.")) else _LAYER + name
