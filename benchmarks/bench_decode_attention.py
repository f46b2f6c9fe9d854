"""Paged attention on CPU, the fused kernel against SDPA, by batch, context and queries each.

One layer's attention of the default model's shape (9 query heads sharing 3 K/V heads of 64,
block size 16, float32) over random K/V, for every (sequences, context entries, new queries per
sequence) point: decodes (one query), draft trees (a few, under an ancestor mask) and short
chunks. Both paths store the new K/V and read the same cache: the fused one is
`CpuKernels.paged_attention` with every group fused, SDPA the torch backend
(layers/paged_attention.py). The two take turns in every round, so the machine's drift
hits both alike; the median of `--rounds` counts. Writes ``decode_attention.json`` and ``.png``
to ``--out-dir``. From the repository root:

    .venv/bin/python benchmarks/bench_decode_attention.py    # ~1 minute
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engine.execution.layers.cpu_kernels import build_cpu_kernels
from engine.execution.layers.paged_attention import SequenceAttention, build_attention_metadata
from engine.execution.layers.paged_attention import paged_attention as sdpa_attention

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M's attention
BATCHES, CONTEXTS, QUERIES = (1, 4, 16, 64), (64, 300, 1000), (1, 2, 4, 8, 16)


def tree_mask(num_queries: int) -> torch.Tensor:  # [Q, Q] bool
    """A draft tree's ancestor mask: node i's parent is (i - 1) // 2, a binary tree."""
    mask = torch.eye(num_queries, dtype=torch.bool)
    for node in range(1, num_queries):
        mask[node] |= mask[(node - 1) // 2]
    return mask


def attention_case(batch: int, context: int, num_queries: int):
    """q, k, v of the new tokens, the two caches and the step's metadata for `batch` sequences of
    `context` cached entries and `num_queries` new tokens each, their blocks interleaved."""
    blocks_each = -(-(context + num_queries) // BLOCK_SIZE)
    tables = [list(range(b, batch * blocks_each, batch)) for b in range(batch)]
    mask = tree_mask(num_queries) if num_queries > 1 else None
    sequences = [SequenceAttention(t, context, num_queries, tree_mask=mask) for t in tables]
    meta = build_attention_metadata(sequences, BLOCK_SIZE, torch.device("cpu"))
    tokens = batch * num_queries
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)  # [T, (H + 2 KV) * D]
    q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
    shape = (batch * blocks_each, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return q, k, v, torch.randn(shape), torch.randn(shape), meta


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def measure(kernels, batch: int, context: int, num_queries: int, rounds: int) -> dict:
    q, k, v, k_cache, v_cache, meta = attention_case(batch, context, num_queries)
    scale = HEAD_DIM**-0.5

    def fused():
        return kernels.paged_attention(q, k, v, k_cache, v_cache, meta, scale, num_queries)

    def sdpa():
        return sdpa_attention(q, k, v, k_cache, v_cache, meta, scale)

    difference = (fused() - sdpa()).abs().max().item()  # also the warm-up
    times = {"fused": [], "sdpa": []}
    with torch.inference_mode():
        for _ in range(rounds):
            times["fused"].append(timed(fused))
            times["sdpa"].append(timed(sdpa))
    fused_us, sdpa_us = (1e6 * statistics.median(times[name]) for name in ("fused", "sdpa"))
    return {
        "batch": batch,
        "context": context,
        "queries": num_queries,
        "fused_us": round(fused_us, 1),
        "sdpa_us": round(sdpa_us, 1),
        "fused_over_sdpa": round(fused_us / sdpa_us, 3),
        "max_abs_difference": difference,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    kernels = build_cpu_kernels()  # raises with the compiler's message where it fails
    points = list(itertools.product(BATCHES, CONTEXTS, QUERIES))
    results = [measure(kernels, *point, args.rounds) for point in tqdm(points, desc="points")]
    settings = {
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "block_size": BLOCK_SIZE,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "decode_attention.json"
    path.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    plot(results, args.out_dir / "decode_attention.png")
    for r in results:
        print(
            f"B{r['batch']:<3} ctx {r['context']:<5} Q{r['queries']}: fused {r['fused_us']:8.1f}"
            f" us, SDPA {r['sdpa_us']:8.1f} us ({r['fused_over_sdpa']:.2f}x)"
        )


def plot(results: list[dict], path: Path) -> None:
    """Fused time over SDPA's against queries per sequence, a line per (batch, context)."""
    with png_figure(path) as axes:
        for batch, context in itertools.product(BATCHES, CONTEXTS):
            rows = [r for r in results if r["batch"] == batch and r["context"] == context]
            axes.plot(
                [r["queries"] for r in rows],
                [r["fused_over_sdpa"] for r in rows],
                marker="o",
                label=f"{batch} seq x {context}",
            )
        axes.axhline(1.0, color="gray", linestyle="--")
        axes.set_xscale("log", base=2)
        axes.set_xlabel("new queries per sequence")
        axes.set_ylabel("fused kernel time / SDPA time")
        axes.set_title("Paged attention, one layer of SmolLM2-135M (lower: fused wins)")
        axes.legend(fontsize=6, ncol=3)


if __name__ == "__main__":
    main()
