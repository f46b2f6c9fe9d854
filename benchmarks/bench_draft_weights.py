"""Draft weights in fp16 or fp32: what FBGEMM's fp16 GEMM for the head and the draft lm_head buys.

AR, EAGLE with fp16 draft weights (`fp16_draft_weights`, the default on CPU) and EAGLE with fp32
ones, on the same requests, stepped in turns (engine_variants.py): per batch size, tokens/s and
its ratio to AR's, the decode step and its propose phase, acceptance, and whether the outputs
equal AR's. Writes ``draft_weights.json`` and ``draft_weights.png`` to ``--out-dir``. From the
repository root:

    .venv/bin/python benchmarks/bench_draft_weights.py    # ~4 minutes
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine_variants import compare_variants

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINES = {  # name -> options beside the model's; the first is the reference
    "ar": dict(draft=None),
    "fp16 drafts": dict(draft="auto", fp16_draft_weights=True),
    "fp32 drafts": dict(draft="auto", fp16_draft_weights=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    parser.add_argument("--rounds", default="10,3,1", help="rounds per batch size")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    compare_variants(
        ENGINES,
        [int(b) for b in args.batches.split(",")],
        [int(r) for r in args.rounds.split(",")],
        args.max_tokens,
        args.out_dir / "draft_weights.json",
        "Draft weights in fp16 (FBGEMM) or fp32 (SmolLM2-135M, CPU)",
    )


if __name__ == "__main__":
    main()
