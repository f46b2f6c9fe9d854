"""The dev set heads are judged on: prompts by category, never trained on.

Sources: the 80 MT-bench first turns (their own categories, folded into three) and first user
turns of ShareGPT's held-out slice (every `HOLDOUT_EVERY`th conversation, which neither
`distill-data` nor `train-head` reads), sorted into the same three by what they ask for. A
head's acceptance is reported per category, so a gain on chat cannot hide a loss on code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from drafting.training.data import is_held_out, load_conversations

CATEGORIES = ("writing", "code", "reasoning")
_MT_BENCH_CATEGORIES = {
    "writing": "writing",
    "roleplay": "writing",
    "extraction": "writing",
    "stem": "writing",
    "humanities": "writing",
    "coding": "code",
    "math": "reasoning",
    "reasoning": "reasoning",
}
_CODE = re.compile(
    r"```|\b(def|class|function|import|python|javascript|typescript|java|sql|html|css|c\+\+|"
    r"golang|rust|bash|regex|api|code|script|compile|bug|error)\b",
    re.IGNORECASE,
)
_REASONING = re.compile(
    r"\b(calculate|solve|equation|probability|prove|how many|integral|derivative|percent|"
    r"puzzle|riddle|logic)\b|\d+\s*[-+*^=]\s*\d+",
    re.IGNORECASE,
)


def category_of(prompt: str) -> str:
    """Code if it shows or asks for code, reasoning if it asks to compute or deduce; else
    writing."""
    if _CODE.search(prompt):
        return "code"
    if _REASONING.search(prompt):
        return "reasoning"
    return "writing"


def build_dev_set(mt_bench: Path, sharegpt: str, per_category: int) -> list[dict]:
    """Up to `per_category` records {"source", "category", "prompt"} per category from each
    source, in source order."""
    records = []
    for source, items in (("mt-bench", _mt_bench(mt_bench)), ("sharegpt", _held_out(sharegpt))):
        counts = dict.fromkeys(CATEGORIES, 0)
        for category, prompt in items:
            if counts[category] < per_category:
                counts[category] += 1
                records.append({"source": source, "category": category, "prompt": prompt})
    return records


def _mt_bench(path: Path) -> Iterator[tuple[str, str]]:
    for line in path.read_text().splitlines():
        if line.strip():
            question = json.loads(line)
            yield _MT_BENCH_CATEGORIES[question["category"]], question["turns"][0]


def _held_out(sharegpt: str) -> Iterator[tuple[str, str]]:
    for index, messages in enumerate(load_conversations(sharegpt)):
        if is_held_out(index) and messages[0]["role"] == "user":
            prompt = messages[0]["content"]
            if 8 <= len(prompt) <= 2000:
                yield category_of(prompt), prompt


def read_dev_set(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
