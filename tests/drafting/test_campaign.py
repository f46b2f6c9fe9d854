"""`aerie head-campaign`: rounds of training (on the source's answers, or the target's own) and
dev-set measurement that a rerun resumes instead of redoing."""

from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from drafting.training import campaign
from drafting.training.campaign import CampaignConfig, run_campaign
from drafting.training.data import load_conversations, training_conversations
from drafting.training.dev_set import CATEGORIES, category_of
from server.cli import main
from tests.drafting.test_distill import write_multi_turn


def write_dev_set(path):
    prompts = {"writing": "a poem about rain", "code": "a python function", "reasoning": "2 + 2"}
    lines = [
        json.dumps({"source": "test", "category": category, "prompt": prompt})
        for category, prompt in prompts.items()
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompts_are_sorted_into_categories():
    assert category_of("Write a Python function that reverses a list") == "code"
    assert category_of("```js\nconst x = 1\n```\nwhy does this fail?") == "code"
    assert category_of("Calculate the probability of two sixes") == "reasoning"
    assert category_of("What is 17 * 23?") == "reasoning"
    assert category_of("Write a travel blog post about Hawaii") == "writing"


def tokens_in(target, data, first: int, stop: int, max_tokens: int) -> int:
    """Training tokens in conversations [first, stop) of `data`, as the trainer selects them."""
    tokenizer = AutoTokenizer.from_pretrained(target)
    conversations = training_conversations(str(data), tokenizer, first, stop, max_tokens)
    return sum(len(c.token_ids) for c in conversations)


def campaign_config(target, tmp_path, data, self_distil: bool) -> CampaignConfig:
    return CampaignConfig(
        str(target),
        tmp_path / "run",
        write_dev_set(tmp_path / "dev.jsonl"),
        data=str(data),
        rounds=(4, 8),
        self_distil=self_distil,
        epochs=1,
        draft_vocab_size=64,
        unroll_steps=2,
        max_tokens=12,
        eval_max_tokens=8,
        train=dict(
            batch_tokens=256, epochs=2, eval_conversations=1, eval_max_tokens=4, max_tokens=128
        ),
    )


@pytest.fixture
def source(tmp_path, random_head, monkeypatch):
    """Ten multi-turn conversations, with the random head standing in for the shipped one."""
    monkeypatch.setattr(campaign, "shipped_head", lambda target: random_head)
    return write_multi_turn(tmp_path / "source.jsonl", [2, 1, 3, 1, 2, 2, 1, 1, 2, 1])


def assert_rounds_read_new_conversations_twice(curve, target, data) -> int:
    """Each round read, for 2 epochs, the conversations no earlier round read (the first is held
    out); returns the first round's tokens."""
    first, second = (tokens_in(target, data, a, b, 128) for a, b in [(0, 4), (4, 8)])
    assert curve[0]["training_tokens_seen"] == 2 * first
    assert curve[1]["training_tokens_seen"] == 2 * (first + second)
    return first


@pytest.mark.slow
def test_rounds_train_on_new_source_conversations_and_a_rerun_resumes(
    bigram_target, random_head, source, tmp_path
):
    config = campaign_config(bigram_target, tmp_path, source, self_distil=False)
    curve_path = run_campaign(config)

    curve = json.loads(curve_path.read_text())
    assert [r["conversations"] for r in curve] == [4, 8]
    assert curve[0]["recipe"] == {
        "epochs": 2,
        "batch_tokens": 256,
        "prompt_loss": True,
        "feature_weight": 1.0,
    }
    assert_rounds_read_new_conversations_twice(curve, bigram_target, source)
    for record in curve:
        for by_category in record["acceptance_length"].values():
            assert set(by_category) == {*CATEGORIES, "all"}
            assert all(length >= 1.0 for length in by_category.values())
    run = tmp_path / "run"
    assert not list(run.glob("round-*/features*"))  # measured rounds drop their features
    assert not (run / "distilled.jsonl").exists()
    assert (run / "best-head" / "config.json").is_file()
    shipped = json.loads((run / "shipped_head.json").read_text())
    assert shipped["head"] == str(random_head)
    assert shipped["acceptance_length"].keys() == curve[0]["acceptance_length"].keys()

    written = curve_path.read_text()
    run_campaign(config)  # nothing left to do
    assert curve_path.read_text() == written

    curve_path.write_text(json.dumps(curve[:1]))  # stopped before round 2 was measured
    run_campaign(config)
    again = json.loads(curve_path.read_text())
    assert [r["conversations"] for r in again] == [4, 8]


def write_seed(folder, curve, shipped):
    """What benchmarks/head_training.py commits: the curve without head paths, the last round's
    head beside it."""
    folder.mkdir()
    shutil.copytree(curve[-1]["head"], folder / "last-head")
    rounds = [{k: v for k, v in r.items() if k != "head"} for r in curve]
    seed = {"rounds": rounds, "last_head": "last-head", "shipped_head": shipped}
    (folder / "head_training.json").write_text(json.dumps(seed))
    return folder / "head_training.json"


@pytest.mark.slow
def test_a_new_machine_trains_on_from_the_committed_round(
    bigram_target, random_head, source, tmp_path
):
    config = campaign_config(bigram_target, tmp_path, source, self_distil=False)
    curve = json.loads(run_campaign(config).read_text())
    shipped = json.loads((tmp_path / "run" / "shipped_head.json").read_text())
    seed = write_seed(tmp_path / "committed", curve[:1], shipped)

    other = replace(config, out=tmp_path / "other", seed=seed, train={**config.train, "epochs": 3})
    assert campaign._adopt_seed(other, other.out, []) == []  # another recipe: not adopted

    fresh = replace(config, out=tmp_path / "new-machine", seed=seed)
    resumed = json.loads(run_campaign(fresh).read_text())
    assert not (fresh.out / "round-4" / "train_log.jsonl").exists()  # round 1 not trained again
    assert {**resumed[0], "head": None} == {**curve[0], "head": None}
    assert resumed[1]["training_tokens_seen"] == curve[1]["training_tokens_seen"]
    assert json.loads((fresh.out / "shipped_head.json").read_text()) == shipped
    assert (fresh.out / "best-head" / "config.json").is_file()


@pytest.mark.slow
def test_self_distilled_rounds_train_on_the_targets_answers(bigram_target, source, tmp_path):
    config = campaign_config(bigram_target, tmp_path, source, self_distil=True)
    curve = json.loads(run_campaign(config).read_text())

    distilled = tmp_path / "run" / "distilled.jsonl"
    assert len(distilled.read_text().splitlines()) == 8
    first = assert_rounds_read_new_conversations_twice(curve, bigram_target, distilled)
    assert first != tokens_in(bigram_target, source, 0, 4, 128)  # the target's answers, not these


@pytest.mark.slow
def test_later_rounds_train_on_the_first_turns_continued(
    bigram_target, source, tmp_path, monkeypatch
):
    trainings = []
    train_head = campaign.train_head
    monkeypatch.setattr(campaign, "train_head", lambda c: trainings.append(c) or train_head(c))
    config = replace(
        campaign_config(bigram_target, tmp_path, source, self_distil=True),
        later_rounds=(2, 4),
        later_turns=3,
    )
    config = replace(config, train={**config.train, "max_tokens": 512})  # room for later turns
    curve = json.loads(run_campaign(config).read_text())

    assert [(r["conversations"], r["later_turns"]) for r in curve] == [
        (4, False),
        (8, False),
        (2, True),
        (4, True),
    ]
    run = tmp_path / "run"
    first_turns = {
        r["source"]: r["messages"] for r in map(json.loads, (run / "distilled.jsonl").open())
    }
    later = [json.loads(line) for line in (run / "later_turns.jsonl").open()]
    assert sorted(r["source"] for r in later) == [2, 4, 5, 8]  # the multi-turn ones of 1-8
    for record in later:  # each continues its first-turn record with later turns
        assert record["messages"][:3] == first_turns[record["source"]]
        assert 2 <= sum(m["role"] == "assistant" for m in record["messages"]) <= 3
    later_path = run / "later_turns.jsonl"
    tokens = [tokens_in(bigram_target, later_path, a, b, 512) for a, b in [(0, 2), (2, 4)]]
    seen = [r["training_tokens_seen"] for r in curve]
    assert [seen[2] - seen[1], seen[3] - seen[2]] == [2 * tokens[0], 2 * tokens[1]]
    assert trainings[2].init_head == str(run / "round-8" / "head")  # trained on from there


def test_a_seeded_distillation_keeps_the_committed_answers_and_answers_the_rest(
    bigram_target, source, tmp_path
):
    seed = tmp_path / "committed.jsonl.gz"
    with gzip.open(seed, "wt") as out:
        for index, messages in enumerate(load_conversations(str(source))):
            if 1 <= index <= 4:  # index 0 is held out
                committed = [*messages[:2], {"role": "assistant", "content": "committed"}]
                out.write(json.dumps({"messages": committed, "source": index}) + "\n")
    config = replace(
        campaign_config(bigram_target, tmp_path, source, self_distil=True),
        distil_turns=1,
        distilled_seed=seed,
    )
    answers = campaign._round_data(config, tmp_path, campaign._Round(0, 8))
    records = [json.loads(line) for line in answers.open()]

    with gzip.open(seed, "rt") as committed:
        assert records[:4] == [json.loads(line) for line in committed]
    assert sorted(r["source"] for r in records[4:]) == [5, 6, 7, 8]
    for record in records[4:]:  # first turns only, the target's answers
        assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"]
        assert record["messages"][-1]["content"] != "not the target's answer"


def test_the_campaign_answers_only_first_turns_that_training_reads_whole(
    bigram_target, tmp_path, random_head, monkeypatch
):
    monkeypatch.setattr(campaign, "shipped_head", lambda target: random_head)
    source = write_multi_turn(tmp_path / "source.jsonl", [1] * 6)
    lines = source.read_text().splitlines()
    long = json.loads(lines[2])
    long["messages"][1]["content"] = "a very long question " * 40  # over 128 tokens
    lines[2] = json.dumps(long)
    source.write_text("\n".join(lines) + "\n")
    config = campaign_config(bigram_target, tmp_path, source, self_distil=True)
    answers = campaign._round_data(config, tmp_path, campaign._Round(0, 4))
    records = [json.loads(line) for line in answers.open()]

    assert sorted(r["source"] for r in records) == [1, 3, 4, 5]  # 0 is held out, 2 too long
    tokenizer = AutoTokenizer.from_pretrained(bigram_target)
    for record in records:  # prompt and answer within the training's 128 tokens
        assert len(tokenizer.apply_chat_template(record["messages"])) <= 128


def test_the_campaigns_answers_are_committed_after_the_committed_ones_when_more(tmp_path):
    committed = tmp_path / "answers.jsonl.gz"
    distilled = tmp_path / "distilled.jsonl"
    lines = [json.dumps({"source": i}) + "\n" for i in range(6)]
    distilled.write_text("".join(lines[:4]))
    campaign.commit_distilled(distilled, committed)
    first = committed.read_bytes()
    assert gzip.decompress(first).decode() == "".join(lines[:4])

    campaign.commit_distilled(distilled, committed)  # nothing new: the very same bytes
    assert committed.read_bytes() == first
    distilled.write_text("".join(lines) + '{"source": 6, "cut off mid-wr')
    campaign.commit_distilled(distilled, committed)
    assert gzip.decompress(committed.read_bytes()).decode() == "".join(lines)  # the whole lines
    distilled.write_text("".join(lines[:2]))  # fewer than committed (a replaced machine's start)
    campaign.commit_distilled(distilled, committed)
    assert gzip.decompress(committed.read_bytes()).decode() == "".join(lines)


@pytest.mark.parametrize(("flag", "self_distil"), [([], True), (["--no-self-distil"], False)])
def test_the_command_line_builds_the_campaign_it_names(flag, self_distil, tmp_path, monkeypatch):
    configs = []
    monkeypatch.setattr(campaign, "run_campaign", lambda config: configs.append(config) or "")
    argv = ["head-campaign", "--out", str(tmp_path), "--dev-set", "dev.jsonl", "--rounds", "5,9"]
    main(argv + flag + ["--epochs", "3", "--distilled-seed", "answers.jsonl.gz"])
    main(argv + flag + ["--later-rounds", "3,6", "--later-seed", "later.jsonl.gz"])
    assert configs[0].self_distil is self_distil
    assert (configs[0].rounds, configs[0].epochs) == ((5, 9), 3)
    assert configs[0].distilled_seed == Path("answers.jsonl.gz")
    assert configs[0].later_rounds == CampaignConfig.later_rounds
    assert (configs[1].later_rounds, configs[1].later_seed) == ((3, 6), Path("later.jsonl.gz"))
