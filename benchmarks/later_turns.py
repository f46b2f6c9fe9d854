"""How many first-turn records a second turn continues: the data of the campaign's later rounds.

For each committed distilled first turn (`distill-data --max-turns 1`), its source conversation is
checked for a second user turn, and that turn's prompt (the first turn, the target's answer, the
second question, through the chat template) plus the longest answer (160 tokens) for the tokens
training reads (1,024): what `distill-data --continue-from` answers. Results go to
benchmarks/results/later_turns.json. From the repository root (about a minute):

    .venv/bin/python benchmarks/later_turns.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from head_training import machine_name
from tqdm import tqdm

from drafting.training.data import load_conversations, open_text
from engine.execution.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model_path

REPO_ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", type=Path, default=REPO_ROOT / "benchmarks/data/distilled_first_turns.jsonl.gz"
    )
    parser.add_argument("--train-tokens", type=int, default=1024, help="train-head --max-tokens")
    parser.add_argument("--answer-tokens", type=int, default=160, help="the longest answer")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks/results/later_turns.json"
    )
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    sources = list(load_conversations("sharegpt"))
    with open_text(args.data) as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    prompts = [second_prompt(r["messages"], sources[r["source"]]) for r in records]
    with_second = [p for p in prompts if p is not None]
    fitting = sum(
        prompt_tokens(tokenizer, p) + args.answer_tokens <= args.train_tokens
        for p in tqdm(with_second, desc="second turns", unit="record")
    )
    result = {
        "machine": machine_name(),
        "data": str(args.data.relative_to(REPO_ROOT)),
        "records": len(records),
        "with_a_second_user_turn": len(with_second),
        "second_turn_fits": fitting,
        "train_tokens": args.train_tokens,
        "answer_tokens": args.answer_tokens,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


def prompt_tokens(tokenizer, messages: list[dict]) -> int:
    """Tokens of the prompt that asks for the next answer, as distillation renders it."""
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return len(rendered["input_ids"])


def second_prompt(first_turn: list[dict], source: list[dict]) -> list[dict] | None:
    """The record's messages and its source's second user turn, or None when it has none."""
    users = [m for m in source if m["role"] == "user"]
    return [*first_turn, users[1]] if len(users) > 1 else None


if __name__ == "__main__":
    sys.exit(main())
