"""Loading EAGLE-1/2 heads: the published format and its checks against the target."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafting.head_loader import load_head
from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from engine.execution.layers.paged_attention import (
    SequenceAttention,
    build_attention_metadata,
    new_token_slots,
)
from engine.execution.model_files import load_config
from engine.execution.models.spec import ModelSpec


def target_spec(path) -> ModelSpec:
    return ModelSpec.from_hf_config(load_config(path))


def load(head, target):
    return load_head(head, target_spec(target), 512, torch.device("cpu"), torch.float32)


def rewrite_weights(folder, change) -> None:
    weights = load_file(str(folder / "model.safetensors"))
    change(weights)
    save_file(weights, str(folder / "model.safetensors"))


def test_published_key_names_and_an_optional_embedding(bigram_target, random_head, tmp_path):
    keys = set(load_file(str(random_head / "model.safetensors")))
    assert {
        "fc.weight",
        "fc.bias",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "layers.0.post_attention_layernorm.weight",
    } <= keys
    assert not any("input_layernorm" in k or k.startswith("embed") for k in keys)
    head = load(random_head, bigram_target)
    assert head.embed_tokens is None  # the target's embedding is used
    with_embedding = shutil.copytree(random_head, tmp_path / "embedded")
    rewrite_weights(
        with_embedding, lambda w: w.update({"embed_tokens.weight": torch.randn(256, 64)})
    )
    assert load(with_embedding, bigram_target).embed_tokens is not None


def test_a_pytorch_bin_head_loads(bigram_target, random_head, tmp_path):
    folder = tmp_path / "bin-head"
    folder.mkdir()
    shutil.copy(random_head / "config.json", folder / "config.json")
    torch.save(load_file(str(random_head / "model.safetensors")), folder / "pytorch_model.bin")
    reference = load(random_head, bigram_target)
    loaded = load(folder, bigram_target)
    for a, b in zip(reference.parameters(), loaded.parameters()):
        assert torch.equal(a, b)


def test_a_head_for_another_target_is_refused(bigram_target, random_head, tmp_path):
    wide = shutil.copytree(random_head, tmp_path / "wide")
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    with pytest.raises(ModelLoadError, match="hidden size 128"):
        load(wide, bigram_target)
    other_vocab = shutil.copytree(random_head, tmp_path / "vocab")
    (other_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    with pytest.raises(ModelLoadError, match="vocabulary 1000"):
        load(other_vocab, bigram_target)
    quantized = shutil.copytree(random_head, tmp_path / "int8")
    rewrite_weights(quantized, lambda w: w.update({"fc.weight": w["fc.weight"].to(torch.int8)}))
    with pytest.raises(ModelLoadError, match="floating point"):
        load(quantized, bigram_target)


def rewrite_config(folder, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "key", ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"]
)
@pytest.mark.parametrize("how", ["absent", "null"])
def test_a_config_without_a_required_key_is_named(bigram_target, random_head, tmp_path, key, how):
    broken = shutil.copytree(random_head, tmp_path / "broken")
    rewrite_config(broken, lambda c: c.pop(key) if how == "absent" else c.update({key: None}))
    with pytest.raises(ModelLoadError, match=f"config.json lacks {key}"):
        load(broken, bigram_target)


def test_a_config_that_is_not_an_object_is_refused(bigram_target, random_head, tmp_path):
    broken = shutil.copytree(random_head, tmp_path / "broken")
    (broken / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="not a JSON object"):
        load(broken, bigram_target)


def test_missing_or_broken_heads_are_clear_errors(bigram_target, random_head, tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load(tmp_path, bigram_target)
    partial = shutil.copytree(random_head, tmp_path / "partial")
    rewrite_weights(partial, lambda w: w.pop("layers.0.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError, match="lacks"):
        load(partial, bigram_target)
    with pytest.raises(ModelLoadError):
        LLM(str(bigram_target), draft=str(tmp_path / "nowhere"))


def test_step_statistics_report_speculation(bigram_target, trained_head):
    llm = LLM(
        str(bigram_target),
        draft=str(trained_head),
        num_kv_blocks=256,
        block_size=4,
        adaptive_draft_budget=False,
    )
    records = []
    llm.engine.stats_listeners.append(records.append)
    (output,) = llm.generate(
        [[5, 9, 14, 20]],
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        use_tqdm=False,
    )
    drafted = [r for r in records if r.num_drafts]
    assert drafted and all(r.propose_time_s > 0 and r.verify_time_s > 0 for r in drafted)
    assert sum(r.num_draft_tokens for r in records) == output.metrics.num_draft_tokens
    assert sum(r.num_accepted_tokens for r in records) == output.metrics.num_accepted_tokens
    for r in drafted:
        assert sum(r.accepted_per_position) == r.num_accepted_tokens
        assert list(r.accepted_per_position) == sorted(r.accepted_per_position, reverse=True)
    emitted = sum(r.num_generation_tokens for r in records)
    assert emitted == len(output.outputs[0].token_ids)
    assert output.metrics.num_decode_steps == len(drafted)


@pytest.mark.parametrize("kv_only", [False, True], ids=["qkv", "kv-only"])
def test_store_kv_writes_what_the_full_pass_writes(bigram_target, random_head, kv_only) -> None:
    head = load(random_head, bigram_target)
    if kv_only:
        head.split_kv_projection()
    spec, block_size, num_rows = head.spec, 4, 7
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(spec.vocab_size, spec.hidden_size)
    ids = torch.randint(spec.vocab_size, (num_rows,))
    features = torch.randn(num_rows, spec.hidden_size)
    positions = torch.arange(5, 5 + num_rows)
    rows = [SequenceAttention([2, 0, 3, 1], 5, num_rows)]  # blocks out of order, rows mid-block

    def empty_cache():
        shape = (4, block_size, spec.num_kv_heads, spec.head_dim)
        return torch.zeros(shape), torch.zeros(shape)

    full, stored = empty_cache(), empty_cache()
    meta = build_attention_metadata(rows, block_size, torch.device("cpu"))
    with torch.inference_mode():
        head(ids, features, positions, [full], meta, embedding)
        slots = new_token_slots(rows, block_size, torch.device("cpu"))
        head.store_kv(ids, features, positions, [stored], slots, embedding)
    assert torch.equal(slots, meta.slot_mapping)
    assert full[0].abs().sum() > 0 and full[1].abs().sum() > 0
    # the same matmul but for the output's width: equal up to the kernel's rounding
    tolerance = 1e-6 if kv_only else 0
    torch.testing.assert_close(stored, full, rtol=tolerance, atol=tolerance)
