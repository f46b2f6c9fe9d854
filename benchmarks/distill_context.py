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
from itertools import islice
from pathlib import Path

from head_training import machine_name
from tqdm import tqdm

from drafting.training.data import open_text
from engine.execution.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model_path

REPO_ROOT = Path(__file__).resolve().parent.parent
LIMITS = (512, 768, 1024, 1536, 2048)


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
    lengths = prompt_and_answer_lengths(args.data, args.max_records)
    rows = {limit: kept(lengths, limit - args.answer_tokens, args.train_tokens) for limit in LIMITS}
    args.out.write_text(
        json.dumps(
            {
                "machine": machine_name(),
                "data": str(args.data.relative_to(REPO_ROOT)),
                "records": len(lengths),
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


def prompt_and_answer_lengths(path: Path, max_records: int | None) -> list[tuple[int, int]]:
    """(prompt tokens with the generation prompt, answer tokens) of each record's first turn."""
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    lengths = []
    with open_text(path) as file:
        records = islice(file, max_records)
        for line in tqdm(records, desc="records", unit="record", mininterval=5):
            messages = json.loads(line)["messages"]
            answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompt = tokenizer.apply_chat_template(
                messages[:answer], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            answer_ids = tokenizer(messages[answer]["content"], add_special_tokens=False)
            lengths.append((len(prompt), len(answer_ids["input_ids"])))
    return lengths


def kept(lengths: list[tuple[int, int]], max_prompt: int, train_tokens: int) -> dict:
    """Shares of the records, of their prompt tokens and of the answer tokens training reads,
    when only prompts of at most `max_prompt` tokens are answered."""
    read = [max(0, min(a, train_tokens - p)) for p, a in lengths]
    chosen = [i for i, (p, _) in enumerate(lengths) if p <= max_prompt]
    prompt_tokens = sum(lengths[i][0] for i in chosen)
    return {
        "records": len(chosen) / len(lengths),
        "prompt_tokens": prompt_tokens / sum(p for p, _ in lengths),
        "answer_tokens_read": sum(read[i] for i in chosen) / sum(a for _, a in lengths),
        "answers_read_per_prompt_token": sum(read[i] for i in chosen) / prompt_tokens,
    }


if __name__ == "__main__":
    main()
