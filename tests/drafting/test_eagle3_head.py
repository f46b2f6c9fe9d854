"""EAGLE-3 heads in the published format (what vLLM, SGLang and SpecForge write and load): key
names and config fields, the layers' arithmetic against a plain-torch reading of that format (one
layer, and two as vLLM stacks them), the target's three-layer features, a write/load round trip,
and refusals of heads that cannot work."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from drafting.head_loader import load_head
from engine import LLM, SamplingParams
from engine.core.kv_cache import KVCache
from engine.errors import ModelLoadError
from engine.execution.layers.paged_attention import SequenceAttention, build_attention_metadata
from engine.execution.model_files import load_config
from engine.execution.models.spec import ModelSpec
from tests.drafting.test_training import write_jsonl

PUBLISHED_KEYS = {
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def load(head, target):
    spec = ModelSpec.from_hf_config(load_config(target))
    return load_head(head, spec, 512, torch.device("cpu"), torch.float32)


def run_in_one_block(head, ids, aux, positions, embedding):
    """The head's output for the rows of one sequence written into an empty 8-slot block, and the
    K/V layers it wrote."""
    cpu = torch.device("cpu")
    cache = KVCache(list(head.kv_layer_shapes), 1, 8, torch.float32, cpu)
    meta = build_attention_metadata([SequenceAttention([0], 0, len(ids))], 8, cpu)
    return head(ids, aux, positions, cache.layers, meta, embedding), cache.layers


def edit(folder, tmp_path, weights=None, config=None):
    copy = shutil.copytree(folder, tmp_path / "edited")
    if weights:
        tensors = load_file(str(copy / "model.safetensors"))
        weights(tensors)
        save_file(tensors, str(copy / "model.safetensors"))
    if config:
        values = json.loads((copy / "config.json").read_text())
        config(values)
        (copy / "config.json").write_text(json.dumps(values))
    return copy


def test_the_files_have_the_published_names_and_fields(random_eagle3_head):
    tensors = load_file(str(random_eagle3_head / "model.safetensors"))
    assert set(tensors) == PUBLISHED_KEYS
    assert tensors["fc.weight"].shape == (64, 3 * 64)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * 64)
    assert tensors["lm_head.weight"].shape == (192, 64)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    draft_to_target = torch.arange(192) + tensors["d2t"]
    assert tensors["t2d"].sum() == 192 and tensors["t2d"][draft_to_target].all()
    config = json.loads((random_eagle3_head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 192 and config["vocab_size"] == 256
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    # vLLM sizes q/k/v biases and picks the residual from these fields alone
    assert config["attention_bias"] is False and config["norm_before_residual"] is False


UPPER_LAYER_KEYS = {  # a second layer, as vLLM reads it: a plain decoder layer
    f"layers.1.{name}.weight"
    for name in (
        "input_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
}


def test_a_two_layer_head_writes_its_second_layer_where_vllm_reads_it(
    random_two_layer_eagle3_head,
):
    tensors = load_file(str(random_two_layer_eagle3_head / "model.safetensors"))
    assert set(tensors) == PUBLISHED_KEYS | UPPER_LAYER_KEYS
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * 64)
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (64, 64)  # reads the layer below
    config = json.loads((random_two_layer_eagle3_head / "config.json").read_text())
    assert config["num_hidden_layers"] == 2


def reference_head(tensors: dict, config: dict, ids, aux, embedding) -> torch.Tensor:
    """The published EAGLE-3 head for one causal sequence, read straight off the tensors: fc over
    the three states; attention over [norm(embedding) ; norm(feature)] with the feature as the
    residual; MLP; then each `layers.N` a plain decoder layer; the pre-norm output. No rotary:
    every position here is 0."""
    eps = config["rms_norm_eps"]
    layers = [{k.removeprefix("midlayer."): v.float() for k, v in tensors.items()}]
    for n in range(1, config["num_hidden_layers"]):
        prefix = f"layers.{n}."
        layers.append(
            {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        )

    def norm(x, w, name):
        return F.rms_norm(x, x.shape[-1:], w[name], eps)

    feature = aux @ layers[0]["fc.weight"].T  # [T, hidden]
    x = torch.cat(
        [
            norm(embedding(ids), layers[0], "input_layernorm.weight"),
            norm(feature, layers[0], "hidden_norm.weight"),
        ],
        -1,
    )
    residual = feature
    for index, w in enumerate(layers):
        if index > 0:
            x = norm(residual, w, "input_layernorm.weight")
        residual = residual + reference_attention(w, x, config["num_attention_heads"])
        h = norm(residual, w, "post_attention_layernorm.weight")
        gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        residual = residual + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    return residual


def reference_attention(w: dict, x: torch.Tensor, heads: int, kv_heads: int = 2) -> torch.Tensor:
    """Causal grouped-query attention of one layer's weights `w` over x [T, in] -> [T, hidden]."""
    length = len(x)

    def project(name, x):  # with the layer's bias, where it has one
        return F.linear(x, w[f"self_attn.{name}.weight"], w.get(f"self_attn.{name}.bias"))

    q = project("q_proj", x).view(length, heads, -1).transpose(0, 1)
    k = project("k_proj", x).view(length, kv_heads, -1).transpose(0, 1)
    v = project("v_proj", x).view(length, kv_heads, -1).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [heads, T, D]
    return project("o_proj", attended.transpose(0, 1).reshape(length, -1))


def with_attention_biases(weights: dict) -> None:
    """q/k/v and o_proj biases in every layer, as vLLM builds them for `attention_bias`."""
    layers = {k.split("self_attn.")[0] for k in weights if "self_attn." in k}
    for layer in layers:
        for part, size in (("q", 64), ("k", 32), ("v", 32), ("o", 64)):
            weights[f"{layer}self_attn.{part}_proj.bias"] = torch.randn(size)


@pytest.mark.parametrize("biases", [False, True], ids=["", "attention-biases"])
@pytest.mark.parametrize("folder", ["random_eagle3_head", "random_two_layer_eagle3_head"])
def test_the_layers_compute_what_the_format_means(bigram_target, folder, biases, request, tmp_path):
    folder = request.getfixturevalue(folder)
    if biases:
        folder = edit(folder, tmp_path, weights=with_attention_biases)
    head = load(folder, bigram_target)
    tensors = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    embedding = torch.nn.Embedding(256, 64)
    ids, aux = torch.tensor([5, 9, 17, 30]), torch.randn(4, 3 * 64)
    positions = torch.zeros(4, dtype=torch.long)  # rotary is the identity at position 0
    with torch.no_grad():
        ours, kv_layers = run_in_one_block(head, ids, aux, positions, embedding)
        expected = reference_head(tensors, config, ids, aux, embedding)
        assert torch.allclose(ours, expected, atol=1e-4)
        logits = head.draft_logits(ours)  # [T, V_draft]: lm_head over norm(output)
        normed = F.rms_norm(ours, (64,), tensors["norm.weight"], config["rms_norm_eps"])
        assert torch.allclose(logits, normed @ tensors["lm_head.weight"].T, atol=1e-4)
    assert torch.equal(head.draft_vocab, torch.arange(192) + tensors["d2t"])
    assert all(k.abs().sum() > 0 for k, _ in kv_layers)  # every layer wrote its K/V


def test_the_target_hands_out_the_residual_stream_entering_its_feature_layers(bigram_target):
    import transformers

    llm = LLM(str(bigram_target), draft=None)
    model = llm.engine.runner.model
    model.feature_layers = (0, 1, 1)
    ids = [5, 9, 17, 30, 41]
    lengths = [len(ids)]
    from drafting.training.features import target_features

    hidden, features = model.split_features(target_features(model, [ids])[0])
    reference = transformers.AutoModelForCausalLM.from_pretrained(bigram_target).eval()
    with torch.no_grad():
        states = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
    # transformers: states[i] enters layer i (states[0] the embedding), states[-1] is final-normed
    expected = torch.cat([states[0][0], states[1][0], states[1][0]], dim=-1)
    assert features.shape == (lengths[0], 3 * 64)
    assert torch.allclose(features, expected, atol=1e-4)
    assert torch.allclose(hidden, states[-1][0], atol=1e-4)


def test_a_deepened_head_drafts_as_the_head_it_grew_from(
    bigram_target, trained_eagle3_head, tmp_path
):
    from drafting.eagle3_head import deepened
    from drafting.head_loader import save_head

    head = load(trained_eagle3_head, bigram_target)
    deeper = deepened(head, 3)
    assert deeper.num_layers == 3 and deeper.draft_vocab.equal(head.draft_vocab)
    embedding = torch.nn.Embedding(256, 64)
    rows = (torch.tensor([5, 9, 17, 30]), torch.randn(4, 3 * 64), torch.arange(4))
    with torch.no_grad():
        torch.testing.assert_close(
            run_in_one_block(deeper, *rows, embedding)[0],
            run_in_one_block(head, *rows, embedding)[0],
        )
    written = save_head(deeper, tmp_path / "deeper", {"rope_theta": 10000.0}, torch.float32)
    assert json.loads((written / "config.json").read_text())["num_hidden_layers"] == 3
    assert load(written, bigram_target).num_layers == 3


@pytest.mark.parametrize("folder", ["trained_eagle3_head", "trained_two_layer_eagle3_head"])
def test_written_heads_load_back_identical(bigram_target, folder, tmp_path, request):
    from drafting.head_loader import save_head

    head = load(request.getfixturevalue(folder), bigram_target)
    copy = save_head(head, tmp_path / "copy", {"rope_theta": 10000.0}, torch.float32)
    again = load(copy, bigram_target)
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_rewritten_heads_keep_biases_and_the_residual_choice_in_the_fields_vllm_reads(
    bigram_target, random_two_layer_eagle3_head, tmp_path
):
    """q/k/v biases alone (a Qwen2-style layer) are written with a zero o_proj bias beside them:
    vLLM builds all four from one `attention_bias`, and must read what Aerie computes."""
    from drafting.head_loader import save_head

    def add_qkv_biases(weights):
        with_attention_biases(weights)
        for layer in ("midlayer.", "layers.1."):
            weights.pop(f"{layer}self_attn.o_proj.bias")

    variant = edit(
        random_two_layer_eagle3_head,
        tmp_path,
        weights=add_qkv_biases,
        config=lambda c: c.update(norm_before_residual=True),
    )
    head = load(variant, bigram_target)
    copy = save_head(head, tmp_path / "copy", {"rope_theta": 10000.0}, torch.float32)
    config = json.loads((copy / "config.json").read_text())
    assert config["attention_bias"] is True and config["norm_before_residual"] is True
    tensors = load_file(str(copy / "model.safetensors"))
    for layer in ("midlayer.", "layers.1."):
        assert tensors[f"{layer}self_attn.q_proj.bias"].abs().sum() > 0
        assert torch.equal(tensors[f"{layer}self_attn.o_proj.bias"], torch.zeros(64))
    again = load(copy, bigram_target)
    assert again.spec == replace(head.spec, o_bias=True)
    rows = (torch.tensor([5, 9, 17]), torch.randn(3, 3 * 64), torch.zeros(3, dtype=torch.long))
    embedding = torch.nn.Embedding(256, 64)
    with torch.no_grad():
        torch.testing.assert_close(
            run_in_one_block(head, *rows, embedding)[0],
            run_in_one_block(again, *rows, embedding)[0],
        )


def test_heads_naming_the_first_layer_layers_0_load_as_vllm_loads_them(
    bigram_target, random_two_layer_eagle3_head, tmp_path
):
    """vLLM reads `midlayer.` as `layers.0.` and builds a `hidden_norm` in every layer, which
    some writers fill: the same head under those names loads the same."""

    def rename(weights):
        for name in [k for k in weights if k.startswith("midlayer.")]:
            weights[name.replace("midlayer.", "layers.0.")] = weights.pop(name)
        weights["layers.1.hidden_norm.weight"] = torch.ones(64)

    renamed = edit(random_two_layer_eagle3_head, tmp_path, weights=rename)
    head, again = load(random_two_layer_eagle3_head, bigram_target), load(renamed, bigram_target)
    assert head.spec == again.spec
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "breakage, message",
    [
        (dict(weights=lambda w: w.update(d2t=w["d2t"] + 1000)), "d2t must map"),
        (dict(weights=lambda w: w.pop("d2t")), "reduced draft vocabulary needs d2t"),
        (
            dict(
                config=lambda c: c["eagle_config"].update(
                    eagle_aux_hidden_state_layer_ids=[0, 1, 7]
                )
            ),
            "feature layers",
        ),
        (dict(config=lambda c: c.update(target_hidden_size=128)), "target_hidden_size"),
        (dict(config=lambda c: c.update(vocab_size=512)), "vocabulary"),
        (dict(config=lambda c: c.update(num_hidden_layers=2)), "lacks 6 weights"),
        (dict(config=lambda c: c.update(num_hidden_layers=0)), "num_hidden_layers must be"),
        (dict(weights=lambda w: w.pop("midlayer.hidden_norm.weight")), "lacks 1 weights"),
        (dict(config=lambda c: c.update(norm_output=True)), "variants with norm_output"),
        (dict(config=lambda c: c.update(fc_norm=True)), "variants with fc_norm"),
        (
            dict(config=lambda c: c["eagle_config"].update(norm_before_fc=True)),
            "variants with norm_before_fc",
        ),
    ],
)
def test_heads_that_cannot_work_are_refused_with_the_reason(
    bigram_target, random_eagle3_head, tmp_path, breakage, message
):
    broken = edit(random_eagle3_head, tmp_path, **breakage)
    with pytest.raises(ModelLoadError, match=message):
        load(broken, bigram_target)


@pytest.mark.slow
def test_train_head_writes_an_eagle3_head_the_engine_drafts_with(bigram_target, tmp_path):
    """Here of two layers whose residual starts normed (`--head-layers 2 --norm-before-residual`):
    the file vLLM reads, and drafts the engine runs."""
    from drafting.training.trainer import TrainConfig, train_head

    data = write_jsonl(tmp_path / "data.jsonl", 60)
    config = TrainConfig(
        str(bigram_target),
        str(data),
        tmp_path / "run",
        arch="eagle3",
        epochs=1,
        batch_tokens=512,
        draft_vocab_size=64,
        unroll_steps=2,
        head_layers=2,
        norm_before_residual=True,
        eval_conversations=2,
        eval_max_tokens=8,
    )
    folder = train_head(config)
    written = json.loads((folder / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLMEagle3"]
    assert written["num_hidden_layers"] == 2 and written["norm_before_residual"] is True
    assert set(load_file(str(folder / "model.safetensors"))) >= UPPER_LAYER_KEYS
    head = load(folder, bigram_target)
    assert len(head.draft_vocab) == 64 and head.num_layers == 2
    llm = LLM(str(bigram_target), draft=str(folder), num_kv_blocks=256)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (output,) = llm.generate([[5, 9, 17, 30]], greedy, use_tqdm=False)
    assert output.metrics.num_draft_tokens > 0
