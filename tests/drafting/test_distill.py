"""`aerie distill-data`: conversations replayed turn by turn with the target's own answers, written
resumably as train-head data."""

from __future__ import annotations

import json

import pytest

from drafting.training.data import HOLDOUT_EVERY, load_conversations
from drafting.training.distill import DistillConfig, _answers, _is_sampled, _Replay, distill
from engine import LLM, SamplingParams
from tests.drafting.test_training import write_jsonl


def write_multi_turn(path, turns: list[int]):
    """Conversations of `turns[i]` user turns each (with ShareGPT-style assistant replies)."""
    with path.open("w") as out:
        for index, count in enumerate(turns):
            messages = [{"role": "system", "content": f"system {index}"}]
            for turn in range(count):
                messages.append({"role": "user", "content": f"question {index} {turn} " * 3})
                messages.append({"role": "assistant", "content": "not the target's answer"})
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def replay_by_hand(llm: LLM, source: list[dict], max_tokens: int) -> list[dict]:
    """What distillation must produce: each user turn answered greedily after earlier answers."""
    messages = [m for m in source[:1] if m["role"] == "system"]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    for message in source:
        if message["role"] == "user":
            messages.append(message)
            answer = llm.chat([messages], greedy, use_tqdm=False)[0].outputs[0].text
            messages.append({"role": "assistant", "content": answer})
    return messages


@pytest.mark.slow
def test_each_turn_is_answered_after_the_targets_own_earlier_answers(bigram_target, tmp_path):
    source = write_multi_turn(tmp_path / "source.jsonl", [1, 3, 2, 1, 4])
    out = tmp_path / "answers.jsonl"
    config = DistillConfig(str(bigram_target), str(source), out, max_conversations=3, max_tokens=8)
    distill(config)

    records = sorted((json.loads(line) for line in out.open()), key=lambda r: r["source"])
    sources = list(load_conversations(str(source)))
    kept = [i for i in range(len(sources)) if i % HOLDOUT_EVERY != 0][:3]
    assert [r["source"] for r in records] == kept
    llm = LLM(str(bigram_target), draft=None)
    for record, index in zip(records, kept):
        assert record["messages"] == replay_by_hand(llm, sources[index], max_tokens=8)


@pytest.mark.slow
def test_turns_stop_where_the_context_would_overflow(bigram_target, tmp_path):
    source = write_multi_turn(tmp_path / "source.jsonl", [1, 6])
    out = tmp_path / "answers.jsonl"
    config = DistillConfig(
        str(bigram_target), str(source), out, max_tokens=8, max_context_tokens=90
    )
    distill(config)

    messages = json.loads(out.read_text())["messages"]
    llm = LLM(str(bigram_target), draft=None)
    answered = sum(m["role"] == "assistant" for m in messages)
    assert 1 <= answered < 6
    assert messages[-1]["role"] == "assistant"
    assert len(llm.apply_chat_template(messages[:-1])) + 8 <= 90  # the last turn fitted
    next_turn = {"role": "user", "content": f"question 1 {answered} " * 3}
    assert len(llm.apply_chat_template([*messages, next_turn])) + 8 > 90  # the next would not


@pytest.mark.slow
def test_a_rerun_repairs_a_cut_line_and_continues(bigram_target, tmp_path):
    source = write_jsonl(tmp_path / "source.jsonl", 12)
    out = tmp_path / "answers.jsonl"
    config = DistillConfig(str(bigram_target), str(source), out, max_conversations=6, max_tokens=6)
    distill(config)
    whole = out.read_text()

    lines = whole.splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][:10])  # interrupted while writing record 4
    distill(config)
    rerun = out.read_text().splitlines(keepends=True)
    assert rerun[:3] == lines[:3] and sorted(rerun) == sorted(lines)


@pytest.mark.slow
def test_the_sampled_share_is_spread_evenly_and_seeded(bigram_target, tmp_path):
    assert [_is_sampled(i, 0.25) for i in range(8)] == [False, False, False, True] * 2
    assert not any(_is_sampled(i, 0.0) for i in range(50))
    assert all(_is_sampled(i, 1.0) for i in range(50))

    source = write_jsonl(tmp_path / "source.jsonl", 12)
    runs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.jsonl"
        config = DistillConfig(
            str(bigram_target), str(source), out, max_tokens=12, sampled_share=1.0
        )
        runs.append(distill(config).read_text())
    assert runs[0] == runs[1]
    greedy = DistillConfig(str(bigram_target), str(source), tmp_path / "g.jsonl", max_tokens=12)
    assert distill(greedy).read_text() != runs[0]


def records_by_source(path) -> dict[int, list[dict]]:
    return {r["source"]: r["messages"] for r in map(json.loads, path.open())}


@pytest.mark.slow
def test_later_turns_continue_the_earlier_records_answers(bigram_target, tmp_path):
    source = write_multi_turn(tmp_path / "source.jsonl", [1, 3, 2, 1, 4])

    def config(out, **fields):
        path = tmp_path / out
        return DistillConfig(str(bigram_target), str(source), path, max_tokens=8, **fields)

    first = distill(config("first.jsonl", max_turns=1))
    whole = records_by_source(distill(config("whole.jsonl", max_turns=3)))
    later = records_by_source(distill(config("later.jsonl", max_turns=3, continue_from=first)))

    multi_turn = {i: m for i, m in whole.items() if sum(x["role"] == "assistant" for x in m) > 1}
    assert set(multi_turn) == {1, 2, 4}  # 0 is held out, 3 has one user turn
    assert later == multi_turn  # the same answers as replaying whole conversations

    earlier = [json.loads(line) for line in first.open()]
    for record in earlier:  # the continuation reads each record's answer, not a new one
        record["messages"][-1]["content"] = f"an earlier answer {record['source']}"
    first.write_text("".join(json.dumps(r) + "\n" for r in earlier))
    edited = records_by_source(distill(config("edited.jsonl", max_turns=2, continue_from=first)))
    assert set(edited) == {1, 2, 4}
    for index, messages in edited.items():
        assert messages[:3] == next(r["messages"] for r in earlier if r["source"] == index)
        assert [m["role"] for m in messages[3:]] == ["user", "assistant"]


def test_an_invalid_share_is_refused():
    with pytest.raises(ValueError, match="sampled_share"):
        DistillConfig("m", "d", "o", sampled_share=1.5)


@pytest.mark.slow
def test_conversations_stream_through_two_slots_and_name_their_sources(bigram_target):
    # Two slots and 16 tokens a step: turns are admitted as slots free up, long prompts prefill
    # in chunks beside others' decodes; a short conversation is written before a long one ends.
    lengths = [40, 2, 25, 3]
    sources = [(i, [{"role": "user", "content": "word " * n}]) for i, n in enumerate(lengths)]
    follow_ups = [{"role": "assistant", "content": "-"}, {"role": "user", "content": "more"}] * 2
    sources[0][1].extend(follow_ups)  # three turns: the others finish first
    llm = LLM(str(bigram_target), draft=None, max_num_seqs=2, max_num_batched_tokens=16)
    most_running = []
    llm.engine.stats_listeners.append(lambda stats: most_running.append(stats.num_running))
    config = DistillConfig(str(bigram_target), "unused", "unused", max_tokens=6, max_num_seqs=2)

    replays = [_Replay(index, messages) for index, messages in sources]
    records = [json.loads(r) for r in _answers(llm, replays, config)]

    assert max(most_running) == 2
    assert records[-1]["source"] == 0  # written last, not holding the others back
    records.sort(key=lambda r: r["source"])
    assert [r["source"] for r in records] == [0, 1, 2, 3]
    reference = LLM(str(bigram_target), draft=None)
    for record, (_, messages) in zip(records, sources):
        assert record["messages"] == replay_by_hand(reference, messages, max_tokens=6)
