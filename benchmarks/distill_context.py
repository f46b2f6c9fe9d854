"""What a context limit on distillation keeps: prefill spent against answer tokens training reads.

`train-head` reads a conversation's first `--max-tokens` tokens (the campaign's: 1,024), so an
answer after a long prompt is cut there. The campaign distils only first turns whose prompt plus
the longest answer (160 tokens) fit that limit. For the committed distilled first turns and a few
limits, this counts the records kept, the prompt tokens their prefill costs, and the answer tokens
training then reads (an answer's tokens before the training limit). Results go to
benchmarks/results/distill_context.json. From the repository root (about a minute):

    .venv/bin/python benchmarks/distill_context.py [--max-records 7000]
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import islice
from pathlib import Path
from typing import NamedTuple

from head_training import machine_name
from tqdm import tqdm

from drafting.training.data import open_text, tokenize_conversation
from engine.execution.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model_path

REPO_ROOT = Path(__file__).resolve().parent.parent
LIMITS = (512, 768, 1024, 1536, 2048)


class Counts(NamedTuple):
    prompt: int  # tokens before the answer, the generation prompt included
    answer: int  # the answer's tokens, its end-of-turn included
    answer_read: int  # of those, within the tokens training reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", type=Path, default=REPO_ROOT / "benchmarks/data/distilled_first_turns.jsonl.gz"
    )
    parser.add_argument("--max-records", type=int, help="read only the file's first N records")
    parser.add_argument("--train-tokens", type=int, default=1024, help="train-head --max-tokens")
    parser.add_argument("--answer-tokens", type=int, default=160, help="the longest answer")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks/results/distill_context.json"
    )
    args = parser.parse_args()
    counts = token_counts(args.data, args.max_records, args.train_tokens)
    rows = {limit: kept(counts, limit - args.answer_tokens) for limit in LIMITS}
    args.out.write_text(
        json.dumps(
            {
                "machine": machine_name(),
                "data": str(args.data.relative_to(REPO_ROOT)),
                "records": len(counts),
                "train_tokens": args.train_tokens,
                "answer_tokens": args.answer_tokens,
                "by_distill_limit": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"{'limit':>6} {'records':>8} {'prefill':>8} {'answers read':>13} {'read/prefill':>13}")
    for limit, row in rows.items():
        print(
            f"{limit:>6} {row['records']:>8.1%} {row['prompt_tokens']:>8.1%} "
            f"{row['answer_tokens_read']:>13.1%} {row['answers_read_per_prompt_token']:>13.3f}"
        )


def token_counts(path: Path, max_records: int | None, train_tokens: int) -> list[Counts]:
    """Each record's prompt and answer tokens, and the answer tokens training reads: its loss
    mask within the first `train_tokens` (`tokenize_conversation`, as training tokenizes)."""
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    counts = []
    with open_text(path) as file:
        records = islice(file, max_records)
        for line in tqdm(records, desc="records", unit="record", mininterval=5):
            whole = tokenize_conversation(tokenizer, json.loads(line)["messages"], sys.maxsize)
            mask = whole.loss_mask
            counts.append(Counts(mask.index(True), sum(mask), sum(mask[:train_tokens])))
    return counts


def kept(counts: list[Counts], max_prompt: int) -> dict:
    """Shares of the records, of their prompt tokens and of the answer tokens training reads,
    when only prompts of at most `max_prompt` tokens are answered."""
    chosen = [c for c in counts if c.prompt <= max_prompt]
    prompt_tokens = sum(c.prompt for c in chosen)
    answers_read = sum(c.answer_read for c in chosen)
    return {
        "records": len(chosen) / len(counts),
        "prompt_tokens": prompt_tokens / sum(c.prompt for c in counts),
        "answer_tokens_read": answers_read / sum(c.answer for c in counts),
        "answers_read_per_prompt_token": answers_read / prompt_tokens,
    }


if __name__ == "__main__":
    main()
