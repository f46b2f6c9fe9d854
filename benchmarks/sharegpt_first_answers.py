"""ShareGPT's own first answers to the prompts of a distilled first-turn file, cut as the target's.

For the matched-data comparison in docs/benchmarks.md ("Training recipes on the same data"): each
record of a `distill-data --max-turns 1` file names its source conversation; this writes the same
prompt with ChatGPT's answer from ShareGPT instead of the target's, cut at `--max-tokens` tokens,
so the two files differ only in who wrote the answers. From the repository root:

    .venv/bin/python benchmarks/sharegpt_first_answers.py distilled.jsonl sharegpt.jsonl
"""

from __future__ import annotations

import argparse
import json
from itertools import islice
from pathlib import Path

from drafting.training.data import Message, load_conversations
from engine.execution.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("distilled", type=Path, help="a distill-data --max-turns 1 JSONL")
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-tokens", type=int, default=160, help="as distill-data's")
    args = parser.parse_args()
    records = [json.loads(line) for line in args.distilled.read_text().splitlines() if line]
    sources = _source_conversations({r["source"] for r in records})
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    with args.out.open("w") as out:
        for record in records:
            prompt = record["messages"][:-1]
            answer = _first_answer(sources[record["source"]], prompt[-1])
            ids = tokenizer(answer, add_special_tokens=False)["input_ids"][: args.max_tokens]
            reply = {"role": "assistant", "content": tokenizer.decode(ids)}
            out.write(json.dumps({"messages": [*prompt, reply], "source": record["source"]}))
            out.write("\n")


def _source_conversations(indices: set[int]) -> dict[int, list[Message]]:
    conversations = islice(load_conversations("sharegpt"), max(indices) + 1)
    return {i: c for i, c in enumerate(conversations) if i in indices}


def _first_answer(conversation: list[Message], question: Message) -> str:
    """The assistant message after the conversation's first user turn (which must be `question`)."""
    start = next(i for i, m in enumerate(conversation) if m["role"] == "user")
    if conversation[start]["content"] != question["content"]:
        raise ValueError("the distilled prompt is not its source's first user turn")
    return next(m["content"] for m in conversation[start + 1 :] if m["role"] == "assistant")


if __name__ == "__main__":
    main()
