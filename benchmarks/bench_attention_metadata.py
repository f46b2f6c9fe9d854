"""What building a step's attention metadata costs on the CPU, per call, for the shapes it runs at.

Every pass (the target's, and the head's two per drafting step) first builds its metadata
(engine/execution/layers/paged_attention.py: slots, block tables, masks, query groups). It is index
arithmetic on small arrays, so what it costs is dispatch, not work; at one sequence it is paid
three times per drafting step. The shapes, each timed in turn in every round so that the
machine's drift hits all alike (block size 16, 300 cached entries): a decode of 1, 16 and 64
sequences; one sequence's head pass over a layer of 4 tree nodes; a catch-up of 3 rows; and 16
sequences verifying 4-node trees. Reports the median and the fastest microseconds per call.
Results merge into ``attention_metadata.json`` in ``--out-dir`` under ``--label``, with a plot
(``.png``) of every label's medians. From the repository root:

    .venv/bin/python benchmarks/bench_attention_metadata.py --label numpy    # ~30 seconds

An earlier version of the builder is measured by putting its checkout first on the path:
``git worktree add /tmp/before COMMIT`` and ``PYTHONPATH=/tmp/before .venv/bin/python
benchmarks/bench_attention_metadata.py --label before``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engine.execution.layers.paged_attention import SequenceAttention, build_attention_metadata

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
CONTEXT = 300  # cached entries of each sequence
CPU = torch.device("cpu")


def shapes() -> dict[str, list[SequenceAttention]]:
    blocks = list(range(-(-(CONTEXT + 64 + 4) // BLOCK_SIZE)))  # room for every shape below
    tree = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )  # [4, 4] a 4-node tree's ancestor mask
    layer = torch.eye(4, dtype=torch.bool)  # [4, 4] a head pass over one layer of 4 nodes

    def decode(batch: int) -> list[SequenceAttention]:
        return [SequenceAttention(blocks, CONTEXT + i, 1) for i in range(batch)]

    return {
        "decode, 1 sequence": decode(1),
        "decode, 16 sequences": decode(16),
        "decode, 64 sequences": decode(64),
        "head pass, a layer of 4 nodes": [SequenceAttention(blocks, CONTEXT, 4, tree_mask=layer)],
        "head catch-up, 3 rows": [SequenceAttention(blocks, CONTEXT, 3)],
        "verify, 16 sequences x 4-node trees": [
            SequenceAttention(blocks, CONTEXT + i, 4, tree_mask=tree, positions=[0, 1, 1, 2])
            for i in range(16)
        ],
    }


def time_call(sequences: list[SequenceAttention], calls: int) -> float:
    """Microseconds per call, over `calls` calls."""
    started = time.perf_counter()
    for _ in range(calls):
        build_attention_metadata(sequences, BLOCK_SIZE, CPU)
    return 1e6 * (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=50, help="calls per shape and round")
    parser.add_argument("--label", default="current", help="this run's name in the results")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    cases = shapes()
    for sequences in cases.values():  # warm-up
        time_call(sequences, 10)
    timings: dict[str, list[float]] = {name: [] for name in cases}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for name, sequences in cases.items():
            timings[name].append(time_call(sequences, args.calls))
    results = [
        {"shape": name, "median_us": statistics.median(t), "fastest_us": min(t)}
        for name, t in timings.items()
    ]
    for row in results:
        print(f"{row['shape']:40s} {row['median_us']:8.1f} us (fastest {row['fastest_us']:.1f})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "attention_metadata.json"
    runs = json.loads(out.read_text())["runs"] if out.exists() else {}
    settings = {"block_size": BLOCK_SIZE, "context": CONTEXT, "rounds": args.rounds}
    runs[args.label] = {"settings": {**settings, "calls": args.calls}, "results": results}
    out.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    plot(runs, out.with_suffix(".png"))
    print(f"wrote {out}")


def plot(runs: dict[str, dict], path: Path) -> None:
    with png_figure(path) as axes:
        names = [row["shape"] for row in next(iter(runs.values()))["results"]]
        width = 0.8 / len(runs)
        for i, (label, run) in enumerate(runs.items()):
            medians = [row["median_us"] for row in run["results"]]
            axes.barh([y + i * width for y in range(len(names))], medians, width, label=label)
        axes.set_yticks([y + 0.4 - width / 2 for y in range(len(names))], names)
        axes.invert_yaxis()
        axes.set_xlabel("microseconds per call (median)")
        axes.set_title("Attention metadata per pass, CPU")
        axes.grid(alpha=0.3, axis="x")
        axes.legend()


if __name__ == "__main__":
    main()
