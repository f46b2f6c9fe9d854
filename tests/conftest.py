"""Shared fixtures: tiny random models of each supported family, saved as Hugging Face folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "vocab_size": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def tiny_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    kwargs = {**TINY, **overrides}
    if model_type == "llama":
        return transformers.LlamaConfig(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **{"tie_word_embeddings": True, **kwargs},
        )
    if model_type == "mistral":
        return transformers.MistralConfig(sliding_window=None, **kwargs)
    if model_type == "qwen2":
        return transformers.Qwen2Config(**kwargs)
    if model_type == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **kwargs)
    raise ValueError(model_type)


def save_tiny_model(
    path: Path, model_type: str, seed: int = 0, residual_scale: float = 1.0, **overrides
) -> Path:
    """A random model plus a character-level tokenizer, as a folder the engine can load.

    `residual_scale` < 1 shrinks what attention and MLP add to the residual stream, making the
    model nearly a bigram model: predictable enough for a quickly trained draft head.
    """
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(residual_scale)
    model.save_pretrained(path)
    _byte_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def _randomize_norms(model) -> None:
    """Norm weights start at 1 (and biases at 0); make them random so a mix-up shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.normal_(1.0 if "norm" in name else 0.0, 0.2)


def _byte_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A tokenizer whose tokens are single characters: enough for exact text tests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = [chr(c) for c in range(32, 32 + vocab_size - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (  # `preamble`: a variable for chat_template_kwargs to set
        "{% if preamble is defined %}{{ preamble }}{% endif %}"
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return fast


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` need a CUDA GPU: where torch sees none, they are skipped (only they)."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (marker `cuda`)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(no_gpu)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Test models are tiny: one thread is faster than several, and far faster on a shared
    machine, where torch's threads spin waiting for each other (5 s instead of 12 s for the
    random-traffic test on two busy cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {t: save_tiny_model(root / t, t) for t in ("llama", "mistral", "qwen2", "qwen3")}


def _model_spec(target: Path):
    from engine.execution.models.spec import ModelSpec

    return ModelSpec.from_hf_config(transformers.AutoConfig.from_pretrained(target))


def save_random_head(path: Path, target: Path, seed: int = 0) -> Path:
    """A randomly initialised EAGLE head for the tiny model in `target` (acceptance near zero)."""
    from drafting.head import EagleHead, HeadSpec
    from drafting.head_loader import save_head
    from engine.execution.layers.rotary import RotaryEmbedding

    torch.manual_seed(seed)
    spec = HeadSpec.for_target(_model_spec(target))
    head = EagleHead(spec, RotaryEmbedding(torch.ones(spec.head_dim // 2), 1.0, 1))
    return save_head(head, path, {"rope_theta": 10000.0}, torch.float32)


def save_random_eagle3_head(
    path: Path,
    target: Path,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    num_layers: int = 1,
) -> Path:
    """A randomly initialised EAGLE-3 head of `num_layers` layers for the tiny model in `target`:
    its draft vocabulary the first `draft_vocab_size` target ids after a shift (so d2t is not all
    zeros)."""
    from drafting.eagle3_head import Eagle3Head, Eagle3Spec
    from drafting.head_loader import save_head
    from engine.execution.layers.rotary import RotaryEmbedding

    target_spec = _model_spec(target)
    torch.manual_seed(seed)
    vocab = target_spec.vocab_size
    draft_vocab = draft_vocab_size or vocab
    layers = (0, 1, target_spec.num_layers - 1)  # vLLM's default needs 6 layers
    spec = Eagle3Spec.for_target(target_spec, draft_vocab, layers, num_layers)
    head = Eagle3Head(spec, RotaryEmbedding(torch.ones(spec.head_dim // 2), 1.0, 1))
    target_ids = (torch.arange(draft_vocab) + (vocab - draft_vocab)) % vocab  # [V_draft]
    head.d2t.copy_(target_ids - torch.arange(draft_vocab))
    return save_head(head, path, {"rope_theta": 10000.0}, torch.float32)
