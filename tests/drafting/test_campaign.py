"""`aerie head-campaign`: rounds of distillation, training and dev-set measurement that a rerun
resumes instead of redoing."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from drafting.training import campaign
from drafting.training.campaign import CampaignConfig, run_campaign
from drafting.training.dev_set import CATEGORIES, category_of
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


def conversations_in(round_folder) -> int:
    shards = round_folder.glob("features*/shard-*.safetensors")
    return sum(len(load_file(str(shard))["lengths"]) for shard in shards)


@pytest.mark.slow
def test_rounds_record_a_learning_curve_and_a_rerun_resumes(
    bigram_target, random_head, tmp_path, monkeypatch
):
    monkeypatch.setattr(campaign, "shipped_head", lambda target: random_head)
    data = write_multi_turn(tmp_path / "source.jsonl", [2, 1, 3, 1, 2, 2, 1, 1, 2, 1])
    config = CampaignConfig(
        str(bigram_target),
        tmp_path / "run",
        write_dev_set(tmp_path / "dev.jsonl"),
        data=str(data),
        rounds=(4, 8),
        epochs=1,
        draft_vocab_size=64,
        unroll_steps=2,
        max_tokens=12,
        eval_max_tokens=8,
        train=dict(batch_tokens=256, eval_conversations=1, eval_max_tokens=4, max_tokens=128),
    )
    curve_path = run_campaign(config)

    curve = json.loads(curve_path.read_text())
    assert [r["conversations"] for r in curve] == [4, 8]
    assert curve[0]["recipe"] == {"epochs": 1, "batch_tokens": 256}  # as trained, override too
    assert curve[1]["training_tokens_seen"] > curve[0]["training_tokens_seen"] > 0
    # each round trains on the conversations distilled since the last (the first is held out)
    assert conversations_in(tmp_path / "run" / "round-4") == 3
    assert conversations_in(tmp_path / "run" / "round-8") == 4
    for record in curve:
        for by_category in record["acceptance_length"].values():
            assert set(by_category) == {*CATEGORIES, "all"}
            assert all(length >= 1.0 for length in by_category.values())
    assert (tmp_path / "run" / "best-head" / "config.json").is_file()
    assert len((tmp_path / "run" / "distilled.jsonl").read_text().splitlines()) == 8
    shipped = json.loads((tmp_path / "run" / "shipped_head.json").read_text())
    assert shipped["head"] == str(random_head)
    assert shipped["acceptance_length"].keys() == curve[0]["acceptance_length"].keys()

    written = curve_path.read_text()
    run_campaign(config)  # nothing left to do
    assert curve_path.read_text() == written

    curve_path.write_text(json.dumps(curve[:1]))  # stopped before round 2 was measured
    run_campaign(config)
    again = json.loads(curve_path.read_text())
    assert [r["conversations"] for r in again] == [4, 8]
