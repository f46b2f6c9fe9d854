"""Head training: conversation data, loss masks, the two stages, checkpoints and resume."""

from __future__ import annotations

import gzip
import json
import random

import pytest
import torch

from drafting.head_loader import load_head
from drafting.training import trainer
from drafting.training.data import load_conversations, tokenize_conversation
from drafting.training.features import target_features
from drafting.training.objective import TrainingExample, head_losses, unrolled_predictions
from drafting.training.trainer import HeadTrainer, TrainConfig, train_head
from engine import LLM, SamplingParams
from engine.core.kv_cache import KVCache
from engine.errors import AerieError
from engine.execution.layers.paged_attention import SequenceAttention, build_attention_metadata
from engine.execution.model_files import load_tokenizer
from server.cli import main


def write_jsonl(path, count: int, seed: int = 0):
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            words = " ".join("".join(rng.choice("abcdefgh") for _ in range(4)) for _ in range(6))
            out.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": words},
                            {
                                "role": "assistant",
                                "content": [{"type": "text", "text": words.upper()}],
                            },
                        ]
                    }
                )
                + "\n"
            )
    return path


def test_loss_mask_covers_exactly_the_assistant_turns(tiny_models, tmp_path):
    tokenizer = load_tokenizer(tiny_models["llama"])
    messages = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "HELLO"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "WORLD"},
    ]
    tokenized = tokenize_conversation(tokenizer, messages, max_tokens=512)
    kept = tokenizer.decode([t for t, m in zip(tokenized.token_ids, tokenized.loss_mask) if m])
    assert "HELLO" in kept and "WORLD" in kept
    assert "hi there" not in kept and "again" not in kept
    cut = tokenize_conversation(tokenizer, messages, max_tokens=31)
    assert len(cut.token_ids) == len(cut.loss_mask) == 31
    assert tokenize_conversation(tokenizer, messages, max_tokens=5) is None  # no assistant token


def test_gzipped_jsonl_reads_as_the_plain_file(tmp_path):
    plain = write_jsonl(tmp_path / "data.jsonl", 5)
    packed = tmp_path / "data.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    conversations = list(load_conversations(str(packed)))
    assert len(conversations) == 5
    assert conversations == list(load_conversations(str(plain)))


def test_bad_data_source_is_a_clear_error(tmp_path):
    with pytest.raises(AerieError, match="jsonl"):
        list(load_conversations(str(tmp_path / "missing.jsonl")))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"no_messages": 1}\n')
    with pytest.raises(AerieError, match=r"broken\.jsonl:1"):
        list(load_conversations(str(broken)))
    with pytest.raises(AerieError, match="unroll-steps"):
        TrainConfig("smollm2-135m-instruct", str(broken), tmp_path, unroll_steps=0)


def test_flags_that_do_not_fit_the_head_are_refused(tmp_path):
    """A width for a head that is loaded, not built, and a negative regression weight are errors
    rather than silently ignored."""
    data = str(tmp_path / "data.jsonl")
    with pytest.raises(AerieError, match="init-head"):
        TrainConfig("m", data, tmp_path, intermediate_size=64, init_head=str(tmp_path))
    with pytest.raises(AerieError, match="feature-weight"):
        TrainConfig("m", data, tmp_path, arch="eagle3", feature_weight=-1.0)
    with pytest.raises(AerieError, match="freeze-lm-head"):
        TrainConfig("m", data, tmp_path, freeze_lm_head=True)
    with pytest.raises(AerieError, match="feature-layers"):
        TrainConfig("m", data, tmp_path, feature_layers=(0, 1, 1))  # EAGLE-2 reads one state
    with pytest.raises(AerieError, match="feature-layers"):
        TrainConfig("m", data, tmp_path, arch="eagle3", feature_layers=(0, 1), init_head="h")
    with pytest.raises(AerieError, match="head-layers"):
        TrainConfig("m", data, tmp_path, head_layers=2)  # EAGLE-1/2 heads have one layer
    with pytest.raises(AerieError, match="head-layers"):
        TrainConfig("m", data, tmp_path, arch="eagle3", head_layers=0)
    with pytest.raises(AerieError, match="norm-before-residual"):
        TrainConfig("m", data, tmp_path, norm_before_residual=True)


def test_feature_layers_flag_reads_comma_separated_layers(tmp_path, monkeypatch):
    configs = []
    monkeypatch.setattr(trainer, "train_head", lambda config: configs.append(config) or "")
    main(["train-head", "--out", str(tmp_path), "--arch", "eagle3", "--feature-layers", "2,15,29"])
    main(["train-head", "--out", str(tmp_path), "--arch", "eagle3"])
    assert [c.feature_layers for c in configs] == [(2, 15, 29), ()]
    with pytest.raises(SystemExit):
        main(["train-head", "--out", str(tmp_path), "--feature-layers", "2,last"])


@pytest.mark.parametrize(("flags", "weight"), [([], None), (["--feature-weight", "0.5"], 0.5)])
def test_train_head_flags_are_typed_by_their_fields(flags, weight, tmp_path, monkeypatch):
    """An optional float field (None: the head format's own weight) is left None when its flag
    is absent and reads a float when given, as the other flags read their fields' types."""
    configs = []
    monkeypatch.setattr(trainer, "train_head", lambda config: configs.append(config) or "")
    main(["train-head", "--out", str(tmp_path), "--arch", "eagle3", "--lr", "3e-4", *flags])
    assert (configs[0].feature_weight, configs[0].lr) == (weight, 3e-4)
    assert configs[0].epochs == TrainConfig.epochs  # an absent flag keeps its field's default


def quick_config(target, tmp_path, num_conversations: int, **overrides) -> TrainConfig:
    """A few seconds of training on `num_conversations` made-up conversations."""
    data = write_jsonl(tmp_path / "data.jsonl", num_conversations)
    settings = dict(
        epochs=1, batch_tokens=512, warmup_steps=2, eval_conversations=2, eval_max_tokens=8
    )
    return TrainConfig(str(target), str(data), tmp_path / "run", **{**settings, **overrides})


def assert_decodes_as_plain(target, head) -> None:
    """Greedy decoding with the head (whole trees every step) equals decoding without it."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(target), draft=None).generate([[5, 6, 7]], params, use_tqdm=False)
    drafted = LLM(str(target), draft=str(head), adaptive_draft_budget=False).generate(
        [[5, 6, 7]], params, use_tqdm=False
    )
    assert plain[0].outputs[0].token_ids == drafted[0].outputs[0].token_ids


def test_a_later_round_reads_the_conversations_after_the_earlier_ones(bigram_target, tmp_path):
    """first_conversation splits the data without a gap or an overlap: the held-out slice stays
    every 50th conversation of the whole file, not of the part read."""
    config = quick_config(bigram_target, tmp_path, 120)

    def read(first: int, stop: int) -> list[list[int]]:
        part = {"first_conversation": first, "max_conversations": stop}
        trainer = HeadTrainer(TrainConfig(**{**config.__dict__, **part}))
        return [c.token_ids for c in trainer._training_conversations()]

    everything = read(0, 120)
    assert len(everything) == 120 - 3  # 0, 50 and 100 held out
    assert read(0, 60) + read(60, 120) == everything
    with pytest.raises(AerieError, match="first-conversation"):
        TrainConfig(**{**config.__dict__, "first_conversation": 8, "max_conversations": 8})


@pytest.mark.slow
def test_train_head_end_to_end_and_resume(bigram_target, tmp_path):
    config = quick_config(bigram_target, tmp_path, 60, shard_tokens=1500, checkpoint_every=3)
    head = train_head(config)
    assert (head / "config.json").is_file() and (head / "model.safetensors").is_file()
    shards = sorted((tmp_path / "run" / "features").glob("shard-*.safetensors"))
    assert len(shards) > 1
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").open()]
    steps = [r["step"] for r in log if "step" in r]
    assert [r["epoch"] for r in log if "acceptance_length" in r] == [1]
    assert_decodes_as_plain(bigram_target, head)  # the published format loads in the engine
    # resuming for a second epoch continues from the checkpoint's step, reusing the features
    train_head(TrainConfig(**{**config.__dict__, "epochs": 2, "resume": True}))
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").open()]
    more = [r["step"] for r in log if "step" in r][len(steps) :]
    assert more[0] == steps[-1] + 1
    assert sorted((tmp_path / "run" / "features").glob("shard-*.safetensors")) == shards
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert saved["state"]["epoch"] == 2
    # OUT/head is the epoch that measured best, OUT/last-head the latest
    first, second = [r["acceptance_length"] for r in log if "acceptance_length" in r]
    best_is_last = (head / "model.safetensors").read_bytes() == (
        tmp_path / "run" / "last-head" / "model.safetensors"
    ).read_bytes()
    assert best_is_last == (second > first)
    assert saved["state"]["best_acceptance_length"] == max(first, second)


@pytest.mark.slow
def test_a_reduced_vocabulary_head_is_trained_on_its_tokens(bigram_target, tmp_path):
    """An EAGLE-3 head with a reduced vocabulary (its answers' most frequent tokens) and its own
    MLP width (--intermediate-size) loads with both and drafts losslessly."""
    overrides = dict(draft_vocab_size=24, arch="eagle3", intermediate_size=72)
    head = train_head(quick_config(bigram_target, tmp_path, 30, **overrides))
    spec = LLM(str(bigram_target), draft=None).engine.spec
    loaded = load_head(head, spec, 256, torch.device("cpu"), torch.float32)
    assert loaded.spec.intermediate_size == 72 != spec.intermediate_size
    vocab = loaded.draft_vocab.tolist()
    tokenizer = load_tokenizer(str(bigram_target))
    assistant_tokens = {tokenizer.convert_tokens_to_ids(c) for c in "ABCDEFGH"}
    assert len(vocab) == 24 and assistant_tokens <= set(vocab)
    assert_decodes_as_plain(bigram_target, head)


@pytest.mark.slow
def test_feature_layers_shape_the_head_and_its_cached_features(bigram_target, tmp_path):
    """--feature-layers: the head reads and publishes the layers asked for and drafts losslessly
    with them; asking for other layers in the same folder is refused, not trained on the features
    cached from the first ones (a cache without a record counts as the default layers'); a layer
    the target lacks is refused; training the head further reads its own layers."""
    overrides = dict(arch="eagle3", draft_vocab_size=24, feature_layers=(1, 0, 1))
    config = quick_config(bigram_target, tmp_path, 30, **overrides)
    folder = train_head(config)
    published = json.loads((folder / "config.json").read_text())["eagle_config"]
    assert published["eagle_aux_hidden_state_layer_ids"] == [1, 0, 1]
    assert_decodes_as_plain(bigram_target, folder)
    with pytest.raises(AerieError, match=r"features of layers \[1, 0, 1\]"):
        train_head(TrainConfig(**{**config.__dict__, "feature_layers": ()}))
    (config.out / "features-eagle3" / "feature_layers.json").unlink()  # a cache from before it
    with pytest.raises(AerieError, match=r"features of layers \[0, 1, 1\]"):
        train_head(config)
    with pytest.raises(AerieError, match="outside the target's"):
        HeadTrainer(TrainConfig(**{**config.__dict__, "feature_layers": (0, 1, 2)}))
    further = {"feature_layers": (), "init_head": str(folder), "out": tmp_path / "further"}
    continued = HeadTrainer(TrainConfig(**{**config.__dict__, **further}))
    assert continued.target.feature_layers == (1, 0, 1)  # a continued head keeps its layers


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trained"])
def test_freeze_lm_head_keeps_the_targets_rows(bigram_target, tmp_path, frozen):
    """--freeze-lm-head: the EAGLE-3 head's norm and lm_head are still the target's after training
    (its rows of the draft vocabulary, as saved in fp16); without it they move. Either drafts
    losslessly."""
    overrides = dict(draft_vocab_size=24, arch="eagle3", freeze_lm_head=frozen, lr=1e-2)
    folder = train_head(quick_config(bigram_target, tmp_path, 30, **overrides))
    llm = LLM(str(bigram_target), draft=None)
    head = load_head(folder, llm.engine.spec, 256, torch.device("cpu"), torch.float32)
    target = llm.engine.runner.model
    as_saved = target.lm_head.weight[head.draft_vocab].half().float()  # [V_draft, hidden]
    kept = torch.equal(head.lm_head.weight, as_saved)
    kept_norm = torch.equal(head.norm.weight, target.norm.weight.half().float())
    assert (kept, kept_norm) == (frozen, frozen)
    assert_decodes_as_plain(bigram_target, folder)


def test_an_eagle2_head_with_a_reduced_vocabulary_is_refused(bigram_target, tmp_path):
    with pytest.raises(AerieError, match="only in the EAGLE-3 format"):
        quick_config(bigram_target, tmp_path, 30, draft_vocab_size=24)


def test_reduced_vocabulary_loss_ignores_the_other_lm_head_rows(bigram_target, random_head):
    llm = LLM(str(bigram_target), draft=None)
    target = llm.engine.runner.model
    head = load_head(random_head, llm.engine.spec, 256, torch.device("cpu"), torch.float32)
    ids = torch.tensor([5, 9, 14, 20, 31, 7, 9, 14])
    example = TrainingExample(ids, target_features(target, [ids.tolist()])[0], ids > 0)
    head.draft_vocab = torch.arange(3, 40)

    def losses() -> tuple[float, float]:
        torch.manual_seed(0)  # the same feature noise each time
        with torch.no_grad():
            _, parts = head_losses(head, target, [example])
        return parts.feature, parts.token

    before = losses()
    with torch.no_grad():
        target.lm_head.weight[40:] = torch.randn_like(target.lm_head.weight[40:])
    assert losses() == before
    head.draft_vocab = None  # over the whole vocabulary those rows count
    after_full = losses()
    with torch.no_grad():
        target.lm_head.weight[40:] *= 3
    assert losses()[1] != after_full[1]


def draft_chain_prediction(head, embedding, tokens, features, end: int, depth: int) -> torch.Tensor:
    """What drafting computes at depth `depth` (0-based) for the path ending at position `end`:
    the target-fed head over the positions before the path, then one node per level, each reading
    the previous level's predicted feature and attending to the context and its ancestors."""
    root = end - depth
    cache = KVCache(list(head.kv_layer_shapes), 1, 64, features.dtype, features.device)

    def run(first: int, count: int, fed: torch.Tensor) -> torch.Tensor:  # [count, hidden]
        meta = build_attention_metadata(
            [SequenceAttention([0], first, count)], 64, torch.device("cpu")
        )
        where = slice(first, first + count)
        return head(
            tokens[where], fed, torch.arange(first, first + count), cache.layers, meta, embedding
        )

    if root > 0:
        run(0, root, features[:root])  # the context, as the engine feeds accepted tokens
    predicted = run(root, 1, features[root : root + 1])  # the first level reads a target feature
    for position in range(root + 1, end + 1):
        predicted = run(position, 1, predicted)  # deeper levels read their parent's prediction
    return predicted[0]


@pytest.mark.slow
def test_unrolled_training_sees_exactly_what_a_draft_chain_sees(bigram_target, random_head):
    llm = LLM(str(bigram_target), draft=None)
    target = llm.engine.runner.model
    head = load_head(random_head, llm.engine.spec, 256, torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    lengths = [9, 14, 6]
    tokens = torch.randint(3, llm.engine.spec.vocab_size, (sum(lengths),))  # [N]
    features = torch.randn(sum(lengths), llm.engine.spec.hidden_size)  # [N, hidden]
    with torch.no_grad():
        steps = unrolled_predictions(head, target.embed_tokens, tokens, features, lengths, 3)
        start = 0
        for n in lengths:
            own = slice(start, start + n)
            for depth, predicted in enumerate(steps):
                for end in range(depth, n):
                    expected = draft_chain_prediction(
                        head, target.embed_tokens, tokens[own], features[own], end, depth
                    )
                    torch.testing.assert_close(predicted[start + end], expected)
            start += n


@pytest.mark.slow
def test_fine_tuning_a_head_unrolled_starts_from_its_weights(bigram_target, trained_head, tmp_path):
    def first_step(run: str, **overrides) -> dict:
        (tmp_path / run).mkdir()
        config = quick_config(bigram_target, tmp_path / run, 30, **overrides)
        head = train_head(config)
        assert_decodes_as_plain(bigram_target, head)
        return json.loads((config.out / "train_log.jsonl").open().readline())

    scratch = first_step("scratch", unroll_steps=3)
    tuned = first_step("tuned", unroll_steps=3, init_head=str(trained_head))
    assert len(scratch["accuracy"]) == len(tuned["accuracy"]) == 3  # one per drafting depth
    assert tuned["feature"] < scratch["feature"]  # the trained head already predicts features


@pytest.mark.slow
def test_prompt_loss_also_teaches_the_user_turns_and_keeps_the_answers_vocabulary(
    bigram_target, tmp_path
):
    """With prompt_loss the head learns the target's next token inside user turns too (its loss
    there drops below a head trained on the answers only), while its draft vocabulary is still
    the answers' most frequent tokens."""

    def trained(prompt_loss: bool):
        folder = tmp_path / str(prompt_loss)
        folder.mkdir()
        overrides = dict(arch="eagle3", epochs=3, draft_vocab_size=48, prompt_loss=prompt_loss)
        config = quick_config(bigram_target, folder, 40, **overrides)
        return load_head(train_head(config), spec, 256, torch.device("cpu"), torch.float32)

    def user_turn_loss(head) -> float:
        torch.manual_seed(0)  # the same feature noise for both heads
        with torch.no_grad():
            return head_losses(head, target, user_turns)[1].token

    llm = LLM(str(bigram_target), draft=None)
    spec, target = llm.engine.spec, llm.engine.runner.model
    answers_only, with_prompts = trained(False), trained(True)
    assert torch.equal(answers_only.draft_vocab, with_prompts.draft_vocab)
    tokenizer = load_tokenizer(str(bigram_target))
    held_out = write_jsonl(tmp_path / "held_out.jsonl", 8, seed=1)
    user_turns = []
    for messages in load_conversations(str(held_out)):
        tokenized = tokenize_conversation(tokenizer, messages, max_tokens=128)
        ids = torch.tensor(tokenized.token_ids)
        features = target_features(target, [tokenized.token_ids])[0]
        user_turns.append(TrainingExample(ids, features, ~torch.tensor(tokenized.loss_mask)))
    assert user_turn_loss(with_prompts) < user_turn_loss(answers_only)


def test_feature_weight_trains_an_eagle3_heads_normed_output_toward_the_targets_states(
    bigram_target, random_eagle3_head
):
    """An EAGLE-3 head is trained on its cross-entropy alone by default (its format's recipe): only
    with a feature weight does training pull its normed output toward the target's next states."""
    llm = LLM(str(bigram_target), draft=None)
    spec, target = llm.engine.spec, llm.engine.runner.model.requires_grad_(False)
    rng = random.Random(0)
    sequences = [[rng.randrange(3, spec.vocab_size) for _ in range(24)] for _ in range(8)]

    def feature_loss_after_training(weight: float | None) -> float:
        torch.manual_seed(0)
        head = load_head(random_eagle3_head, spec, 256, torch.device("cpu"), torch.float32)
        target.feature_layers = head.feature_layers
        examples = [
            TrainingExample(torch.tensor(s), f, torch.ones(len(s), dtype=torch.bool))
            for s, f in zip(sequences, target_features(target, sequences))
        ]
        optimizer = torch.optim.AdamW(head.train().parameters(), lr=3e-3)
        for _ in range(30):
            loss, parts = head_losses(head, target, examples, feature_weight=weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return parts.feature

    with_weight, by_default = feature_loss_after_training(1.0), feature_loss_after_training(None)
    assert with_weight < 0.5 * by_default
