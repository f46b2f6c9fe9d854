"""Training recipes side by side: heads trained on the same data, measured on the dev set.

Each `LABEL=HEAD` is measured as the campaign measures a round's head (whole trees, greedy, 128
tokens, per category, at the default and a 32-node tree); results go to
benchmarks/results/head_recipes.json with a bar chart beside it, one entry per label, the
recorded ones kept. From the repository root (the heads' `train-head` commands are in
docs/benchmarks.md, "Training recipes on the same data"):

    .venv/bin/python benchmarks/head_recipes.py b1024-e2=runs/recipe/b1024e2/head
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from head_training import machine_name

from drafting.training.dev_set import read_dev_set
from drafting.training.evaluation import acceptance_lengths
from engine.execution.model_files import DEFAULT_MODEL

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", nargs="+", help="LABEL=HEAD_FOLDER")
    parser.add_argument("--dev-set", type=Path, default=REPO_ROOT / "benchmarks/data/dev_set.jsonl")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks/results/head_recipes.json"
    )
    args = parser.parse_args()
    dev_set = read_dev_set(args.dev_set)
    results = json.loads(args.out.read_text()) if args.out.exists() else {"recipes": {}}
    results["machine"] = machine_name()
    for item in args.heads:
        label, head = item.split("=", 1)
        lengths = acceptance_lengths(DEFAULT_MODEL, head, dev_set, max_tokens=128)
        results["recipes"][label] = {"head": head, "acceptance_length": lengths}
        print(label, json.dumps(lengths))
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results["recipes"], args.out.with_suffix(".png"))


def plot(recipes: dict, path: Path) -> None:
    """Acceptance length over every dev-set prompt, one bar per recipe, a panel per tree."""
    shapes = list(next(iter(recipes.values()))["acceptance_length"])
    labels = list(recipes)
    with png_figure(path, ncols=len(shapes), figsize=(5 * len(shapes), 4)) as axes:
        for ax, shape in zip(axes if len(shapes) > 1 else [axes], shapes):
            values = [recipes[label]["acceptance_length"][shape]["all"] for label in labels]
            ax.bar(range(len(labels)), values)
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
            ax.set(title=f"tree {shape}", ylabel="acceptance length (dev set)")
            ax.set_ylim(1.0, max(values) * 1.1)


if __name__ == "__main__":
    main()
