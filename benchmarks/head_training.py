"""The head campaign's learning curve, copied into benchmarks/results with its plot: acceptance
length on the dev set, per category and tree shape, against training tokens seen. Its last
round's head is copied beside it (head_training_head/), and its distilled answers, in the order
the rounds read them, over benchmarks/data/distilled_first_turns.jsonl.gz (later turns:
distilled_later_turns.jsonl.gz): `make head-campaign` on a new machine resumes from those copies
(`--seed`, `--distilled-seed`, `--later-seed`) instead of distilling and training every round
again.

    make head-campaign                                       # runs (or resumes) in the background
    .venv/bin/python benchmarks/head_training.py             # results/head_training.json + .png
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
from pathlib import Path

from drafting.training.campaign import commit_distilled

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
CAMPAIGN = Path.home() / ".cache" / "aerie" / "runs" / "campaign-first-turns"
LAST_HEAD = "head_training_head"  # beside the results file
ANSWERS = REPO_ROOT / "benchmarks" / "data" / "distilled_first_turns.jsonl.gz"
LATER_ANSWERS = REPO_ROOT / "benchmarks" / "data" / "distilled_later_turns.jsonl.gz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--campaign", type=Path, default=CAMPAIGN, help="its --out folder")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--answers", type=Path, default=ANSWERS, help="the committed answers")
    parser.add_argument("--later-answers", type=Path, default=LATER_ANSWERS)
    args = parser.parse_args()
    commit_distilled(args.campaign / "distilled.jsonl", args.answers)
    commit_distilled(args.campaign / "later_turns.jsonl", args.later_answers)
    curve = json.loads((args.campaign / "head_training.json").read_text())
    shipped_path = args.campaign / "shipped_head.json"
    shipped = json.loads(shipped_path.read_text()) if shipped_path.exists() else None
    result = {
        "machine": machine_name(),
        "command": f"make head-campaign CAMPAIGN={args.campaign}",
        "shipped_head": shipped,
        "rounds": [{k: v for k, v in r.items() if k != "head"} for r in curve],
        "last_head": LAST_HEAD,
    }
    shutil.rmtree(args.out_dir / LAST_HEAD, ignore_errors=True)
    shutil.copytree(curve[-1]["head"], args.out_dir / LAST_HEAD)
    (args.out_dir / "head_training.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(curve, shipped, args.out_dir / "head_training.png")


def plot(curve: list[dict], shipped: dict | None, path: Path) -> None:
    """Acceptance length per category against tokens seen, one panel per tree shape; the head
    shipped when the campaign began (its `shipped_head.json`), over every prompt, as a dashed
    line."""
    shapes = list(curve[0]["acceptance_length"])
    with png_figure(path, ncols=len(shapes), figsize=(6 * len(shapes), 4.2)) as axes:
        for ax, shape in zip(axes if len(shapes) > 1 else [axes], shapes):
            tokens = [r["training_tokens_seen"] / 1e6 for r in curve]
            for category in curve[0]["acceptance_length"][shape]:
                lengths = [r["acceptance_length"][shape][category] for r in curve]
                ax.plot(tokens, lengths, marker="o", label=category)
            if shipped is not None and shape in shipped["acceptance_length"]:
                reference = shipped["acceptance_length"][shape]["all"]
                ax.axhline(
                    reference, color="gray", linestyle="--", label="head shipped at the start, all"
                )
            ax.set(
                title=f"tree {shape}", xlabel="training tokens seen (M)", ylabel="acceptance length"
            )
            ax.grid(alpha=0.3)
            ax.legend()


def machine_name() -> str:
    """The architecture and the CPU's model name, as results files record the machine."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{platform.machine()}, {line.split(':', 1)[1].strip()}"
    return f"{platform.machine()}, {platform.processor()}"


if __name__ == "__main__":
    main()
