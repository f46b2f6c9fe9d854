"""`aerie distill-data`: the target's own greedy answers, written resumably as train-head data."""

from __future__ import annotations

import json

from drafting.data import HOLDOUT_EVERY, load_conversations
from drafting.distill import DistillConfig, _answers, distill
from engine import LLM, SamplingParams
from tests.drafting.test_training import write_jsonl


def test_answers_are_the_targets_own_and_skip_the_held_out_slice(bigram_target, tmp_path):
    source = write_jsonl(tmp_path / "source.jsonl", 12)
    out = tmp_path / "answers.jsonl"
    config = DistillConfig(str(bigram_target), str(source), out, max_prompts=6, max_tokens=10)
    distill(config)

    records = [json.loads(line)["messages"] for line in out.open()]
    sources = list(load_conversations(str(source)))
    kept = [c for i, c in enumerate(sources) if i % HOLDOUT_EVERY != 0][:6]
    assert [r[:-1] for r in records] == [c[:1] for c in kept]
    llm = LLM(str(bigram_target), draft=None)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    expected = llm.chat([c[:1] for c in kept], greedy, use_tqdm=False)
    assert [r[-1] for r in records] == [
        {"role": "assistant", "content": o.outputs[0].text} for o in expected
    ]


def test_a_rerun_repairs_a_cut_line_and_continues(bigram_target, tmp_path):
    source = write_jsonl(tmp_path / "source.jsonl", 12)
    out = tmp_path / "answers.jsonl"
    config = DistillConfig(str(bigram_target), str(source), out, max_prompts=6, max_tokens=6)
    distill(config)
    whole = out.read_text()

    lines = whole.splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][:10])  # interrupted while writing record 4
    distill(config)
    assert out.read_text() == whole


def test_prompts_stream_through_two_slots_and_answers_keep_prompt_order(bigram_target, tmp_path):
    # Two slots and 16 tokens a step: prompts are admitted as slots free up, long prompts prefill
    # in chunks beside others' decodes, and each answer is written under its own prompt.
    lengths = [90, 5, 7, 60, 6, 8, 33]
    prompts = [([{"role": "user", "content": str(n)}], list(range(3, 3 + n))) for n in lengths]
    llm = LLM(str(bigram_target), draft=None, max_num_seqs=2, max_num_batched_tokens=16)
    most_running = []
    llm.engine.stats_listeners.append(lambda stats: most_running.append(stats.num_running))
    config = DistillConfig(str(bigram_target), "unused", tmp_path / "unused", max_tokens=6)

    records = [json.loads(r)["messages"] for r in _answers(llm.engine, prompts, config, 0)]

    assert max(most_running) == 2
    greedy = SamplingParams(temperature=0, max_tokens=6)
    expected = LLM(str(bigram_target), draft=None).generate(
        [ids for _, ids in prompts], greedy, use_tqdm=False
    )
    assert records == [
        [*turn, {"role": "assistant", "content": out.outputs[0].text}]
        for (turn, _), out in zip(prompts, expected)
    ]
