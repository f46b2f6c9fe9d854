"""Padded linear passes: what computing a pass of a few rows as a few more (zero) rows buys.

On some CPUs a linear kernel is slower for one or two rows than for four (oneDNN on the AMD EPYC
with AVX-512), so the engine times unpadded passes of 1-8 sequences at start-up and computes each
small pass as the fastest size at least as large (`pad_linear_passes`, execution/linear_kernels.py).
AR and EAGLE, each with and without the padding, on the same requests, stepped in turns
(engine_variants.py): per batch size, tokens/s and its ratio to padded AR's, the decode step, and
whether the outputs equal padded AR's (each row's result does not depend on the others, so they
must). Writes ``padded_passes.json`` and ``padded_passes.png`` to ``--out-dir``. From the
repository root:

    .venv/bin/python benchmarks/bench_padded_passes.py    # ~5 minutes
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine_variants import compare_variants

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINES = {  # name -> options beside the model's; the first is the reference
    "ar": dict(draft=None),
    "ar, unpadded": dict(draft=None, pad_linear_passes=False),
    "eagle": dict(draft="auto"),
    "eagle, unpadded": dict(draft="auto", pad_linear_passes=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2,4", help="comma-separated batch sizes")
    parser.add_argument("--rounds", default="6,3,2", help="rounds per batch size")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    results = compare_variants(
        ENGINES,
        [int(b) for b in args.batches.split(",")],
        [int(r) for r in args.rounds.split(",")],
        args.max_tokens,
        args.out_dir / "padded_passes.json",
        "Linear passes padded to the fastest size (SmolLM2-135M, CPU)",
    )
    for row in results:
        padded = row["eagle"]["tok_s"] / row["ar"]["tok_s"]
        unpadded = row["eagle, unpadded"]["tok_s"] / row["ar, unpadded"]["tok_s"]
        print(f"batch {row['batch']}: EAGLE / AR {padded:.3f}x padded, {unpadded:.3f}x unpadded")


if __name__ == "__main__":
    main()
