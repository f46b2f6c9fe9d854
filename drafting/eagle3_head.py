"""The EAGLE-3 draft head, in the format vLLM, SGLang and SpecForge load and write.

The target hands out its residual stream entering three of its layers (low, middle, high: the
`feature_layers`), concatenated [3 * target_hidden]; `fc` projects that to the head's width. The
first decoder layer (`midlayer`) attends over [input_layernorm(embedding) ; hidden_norm(feature)]
(2 * hidden wide) and keeps the feature as its residual; further layers (`layers.1`, ... where
`num_hidden_layers` > 1, as vLLM reads them) are plain decoder layers on its output. The head
returns the last layer's pre-norm output, which deeper drafting steps read back as their feature
without `fc`. Draft logits are `lm_head(norm(output))` over a reduced draft vocabulary; draft id i
stands for target id i + d2t[i].
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
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
from engine.execution.models.decoder import DecoderLayer
from engine.execution.models.spec import ModelSpec

ARCHITECTURE = "LlamaForCausalLMEagle3"
_REQUIRED_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
# fields of EAGLE-3 variants that vLLM computes and this head does not: refused, never ignored
_UNSUPPORTED_VARIANTS = ("norm_before_fc", "fc_norm", "norm_output")
_TOP_LEVEL = ("fc.", "embed_tokens.", "norm.", "lm_head.", "d2t")  # outside any decoder layer


def default_feature_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The layers whose inputs vLLM hands an EAGLE-3 head when its config names none."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def feature_layers_fit(layers: tuple[int, ...], num_target_layers: int) -> bool:
    """Whether every feature layer is one of the target's (a layer's input is read)."""
    return all(0 <= layer < num_target_layers for layer in layers)


@dataclass(frozen=True)
class Eagle3Spec:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]  # target layers whose input residual stream is read
    rms_norm_eps: float
    qkv_bias: bool
    norm_before_residual: bool  # the residual is the normed feature (some SpecForge heads)
    has_embedding: bool
    o_bias: bool = False  # vLLM gives o_proj a bias too where the config says attention_bias
    # decoder layers: the first reads [embedding ; feature], each later one the layer below
    num_layers: int = 1

    @classmethod
    def from_config(cls, config: dict, weights: dict, target: ModelSpec, folder) -> Eagle3Spec:
        missing = [k for k in _REQUIRED_CONFIG_KEYS if config.get(k) is None]
        if missing:
            raise ModelLoadError(f"draft head {folder}: config.json lacks {', '.join(missing)}")
        num_layers = config.get("num_hidden_layers")
        num_layers = 1 if num_layers is None else num_layers
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ModelLoadError(f"draft head {folder}: num_hidden_layers must be at least 1")
        variants = [k for k in _UNSUPPORTED_VARIANTS if _flag(config, k)]
        if variants:
            raise ModelLoadError(
                f"draft head {folder}: EAGLE-3 variants with {', '.join(variants)} are not "
                "supported"
            )
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        layers = _feature_layers(config) or default_feature_layers(target.num_layers)
        return cls(
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            vocab_size=config["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or hidden,
            feature_layers=tuple(layers),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            qkv_bias=any(_module_name(k) == "self_attn.q_proj.bias" for k in weights),
            o_bias=any(_module_name(k) == "self_attn.o_proj.bias" for k in weights),
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            has_embedding="embed_tokens.weight" in weights,
            num_layers=num_layers,
        )

    @classmethod
    def for_target(
        cls,
        target: ModelSpec,
        draft_vocab_size: int,
        feature_layers: tuple[int, ...],
        num_layers: int = 1,
    ) -> Eagle3Spec:
        """A new head of `num_layers` layers shaped like `target`'s, reading `feature_layers`."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            feature_layers=tuple(feature_layers),
            rms_norm_eps=target.rms_norm_eps,
            qkv_bias=False,
            norm_before_residual=False,
            has_embedding=False,
            num_layers=num_layers,
        )

    def upper_layer_spec(self) -> ModelSpec:
        """The shape of the layers after the first: plain Llama decoder layers of the head's
        width (DecoderLayer reads no vocabulary or position limit from it)."""
        return ModelSpec(
            model_type="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers - 1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=0,
            tie_word_embeddings=False,
            qkv_bias=self.qkv_bias,
            o_bias=self.o_bias,
        )

    def config(self) -> dict:
        """The config.json fields of this head (rope fields are the caller's)."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_config": {
                "use_aux_hidden_state": True,
                "eagle_aux_hidden_state_layer_ids": list(self.feature_layers),
            },
            "rms_norm_eps": self.rms_norm_eps,
            # vLLM builds the q/k/v and o_proj biases and picks the residual from these fields,
            # not from the weights present (save_eagle3_head writes any bias absent as zeros)
            "attention_bias": self.qkv_bias or self.o_bias,
            "norm_before_residual": self.norm_before_residual,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }


def _flag(config: dict, key: str) -> bool:
    """A boolean field where vLLM reads it: top level or in `eagle_config`."""
    return bool(config.get(key) or (config.get("eagle_config") or {}).get(key))


def _feature_layers(config: dict) -> list[int] | None:
    """Aux layer ids where the config names them: top level or in `eagle_config`."""
    nested = config.get("eagle_config") or {}
    return config.get("eagle_aux_hidden_state_layer_ids") or nested.get(
        "eagle_aux_hidden_state_layer_ids"
    )


class Eagle3Head(HeadLayers):
    def __init__(self, spec: Eagle3Spec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, h) if spec.has_embedding else None
        self.fc = nn.Linear(len(spec.feature_layers) * spec.target_hidden_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.self_attn = Attention(
            h,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            qkv_bias=spec.qkv_bias,
            o_bias=spec.o_bias,
            input_size=2 * h,
        )
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.mlp = GatedMLP(h, spec.intermediate_size)
        upper = spec.upper_layer_spec()
        self.upper_layers = nn.ModuleList(DecoderLayer(upper) for _ in range(upper.num_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.rotary = rotary
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.spec.feature_layers

    @property
    def draft_vocab(self) -> torch.Tensor:  # [V_draft] the target id of each draft id
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def project_features(self, features: torch.Tensor) -> torch.Tensor:  # [T, F] -> [T, hidden]
        """Target features (three layers' states) through fc; the head's own outputs as they are."""
        if features.shape[-1] == self.spec.hidden_size:
            return features
        return self.fc(features)

    def draft_logits(self, outputs: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V_draft]
        return self.lm_head(self.norm(outputs))

    def _layer_input(self, input_ids, features, target_embedding):
        """The attention input [T, 2 * hidden] and the residual [T, hidden]."""
        embedding = (self.embed_tokens or target_embedding)(input_ids)  # [T, hidden]
        feature = self.project_features(features).to(embedding.dtype)  # [T, hidden]
        normed = self.hidden_norm(feature)
        residual = normed if self.spec.norm_before_residual else feature
        return torch.cat((self.input_layernorm(embedding), normed), dim=-1), residual


def deepened(head: Eagle3Head, num_layers: int) -> Eagle3Head:
    """`head` with decoder layers added on top up to `num_layers`, each starting as the identity
    (o_proj and down_proj zero: its attention and MLP add nothing to the residual stream), so
    the deeper head drafts exactly as `head` did until training moves them."""
    deeper = Eagle3Head(replace(head.spec, num_layers=num_layers), head.rotary)
    deeper.to(head.fc.weight)
    deeper.load_state_dict(head.state_dict(), strict=False)  # the new layers: fresh weights
    with torch.no_grad():
        for layer in deeper.upper_layers[head.num_layers - 1 :]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return deeper


def load_eagle3_head(
    folder: Path, config: dict, weights: dict[str, torch.Tensor], target: ModelSpec, rotary
) -> Eagle3Head:
    """An EAGLE-3 head from its files, checked against its target."""
    spec = Eagle3Spec.from_config(config, weights, target, folder)
    _check_against_target(spec, target, weights, folder)
    head = Eagle3Head(spec, rotary)
    flat = {_module_name(name): t for name, t in weights.items() if name != "t2d"}
    if "d2t" not in flat:
        if spec.draft_vocab_size != spec.vocab_size:
            raise ModelLoadError(f"draft head {folder}: a reduced draft vocabulary needs d2t")
        flat["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.long)
    load_named_weights(head, flat, f"draft head {folder}")
    head.d2t.copy_(flat["d2t"].long())
    _check_vocabulary_map(head, target, folder)
    return head


def save_eagle3_head(head: Eagle3Head, folder: Path, rope: dict, dtype: torch.dtype) -> None:
    """Write `head` as vLLM and SGLang read it: `midlayer.*` (and `layers.N.*` after it) unfused,
    `d2t` and `t2d` maps."""
    spec = head.spec
    sizes = fused_split_sizes(
        spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    )
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    tensors = unfused(state, sizes, _checkpoint_name)
    if spec.qkv_bias or spec.o_bias:
        tensors |= _zero_biases_vllm_expects(spec, tensors)
    t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
    t2d[head.draft_vocab.cpu()] = True
    tensors["t2d"] = t2d
    write_head_files(folder, {**spec.config(), **rope}, tensors, dtype)


def _zero_biases_vllm_expects(spec: Eagle3Spec, tensors: dict) -> dict[str, torch.Tensor]:
    """Zeros for the q/k/v or o_proj biases a head lacks while having the others: one
    `attention_bias` gives vLLM all four, so the file then means what Aerie computes."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": spec.hidden_size}
    layers = ["midlayer."] + [f"layers.{n}." for n in range(1, spec.num_layers)]
    names = (f"{layer}self_attn.{proj}.bias" for layer in layers for proj in sizes)
    return {name: torch.zeros(sizes[name.split(".")[-2]]) for name in names if name not in tensors}


def _module_name(checkpoint_name: str) -> str:
    """`midlayer.X` or `layers.0.X` -> X (the first layer's); `layers.N.X` -> `upper_layers.{N-1}.X`
    (vLLM reads `midlayer.` as `layers.0.`)."""
    if checkpoint_name.startswith("midlayer."):
        return checkpoint_name.removeprefix("midlayer.")
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", checkpoint_name)
    if match is None:
        return checkpoint_name
    index, rest = int(match[1]), match[2]
    return rest if index == 0 else f"upper_layers.{index - 1}.{rest}"


def _checkpoint_name(module_name: str) -> str:
    if module_name.startswith(_TOP_LEVEL):
        return module_name
    match = re.fullmatch(r"upper_layers\.(\d+)\.(.+)", module_name)
    if match is None:
        return "midlayer." + module_name
    return f"layers.{int(match[1]) + 1}.{match[2]}"


def _check_against_target(spec: Eagle3Spec, target: ModelSpec, weights: dict, folder) -> None:
    problems = []
    if spec.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {spec.vocab_size} != target's {target.vocab_size}")
    if spec.target_hidden_size != target.hidden_size:
        problems.append(
            f"target_hidden_size {spec.target_hidden_size} != target's {target.hidden_size}"
        )
    if spec.hidden_size != target.hidden_size and "embed_tokens.weight" not in weights:
        problems.append("the head's width differs from the target's and it has no embed_tokens")
    if not feature_layers_fit(spec.feature_layers, target.num_layers):
        problems.append(
            f"feature layers {list(spec.feature_layers)} outside the target's "
            f"{target.num_layers} layers"
        )
    if any(t.is_floating_point() is False and k not in ("d2t", "t2d") for k, t in weights.items()):
        problems.append("weights are not floating point (quantized heads are not supported)")
    if problems:
        raise ModelLoadError(
            f"draft head {folder} does not fit the target model: " + "; ".join(problems)
        )


def _check_vocabulary_map(head: Eagle3Head, target: ModelSpec, folder) -> None:
    ids = head.draft_vocab
    if ids.min() < 0 or ids.max() >= target.vocab_size or len(ids.unique()) != len(ids):
        raise ModelLoadError(
            f"draft head {folder}: d2t must map draft ids to distinct target ids in "
            f"[0, {target.vocab_size})"
        )
