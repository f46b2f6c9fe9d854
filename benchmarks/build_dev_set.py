"""Write benchmarks/data/dev_set.jsonl: the categorised prompts heads are judged on
(drafting/training/dev_set.py). From the repository root:

    .venv/bin/python benchmarks/build_dev_set.py
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from drafting.training.dev_set import build_dev_set

REPO_ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-category", type=int, default=16, help="per category and source")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/data/dev_set.jsonl")
    args = parser.parse_args()
    mt_bench = REPO_ROOT / "benchmarks" / "data" / "mt_bench_questions.jsonl"
    records = build_dev_set(mt_bench, "sharegpt", args.per_category)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(Counter((r["source"], r["category"]) for r in records))


if __name__ == "__main__":
    main()
