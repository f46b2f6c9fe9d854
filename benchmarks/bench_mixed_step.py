"""A continuous-batching step that mixes decodes with a prefill chunk: attention groups on and off.

Under load, a new request's prompt is prefilled in chunks inside the steps that decode everyone
else. If every sequence's queries are padded to the longest (one SDPA call for the batch), each
decode pays for as many query rows as the chunk has tokens. Attention groups (sequences grouped by
their number of new tokens, one SDPA call per group; layers/paged_attention.py) avoid that.

For B decoding sequences (context 300 tokens) beside one 256-token prefill chunk, this times the
default model's forward pass with groups (the engine's default), with one group (what a compiled
model uses), and the decodes and the chunk as two separate passes (the floor), interleaved, best
of five. Writes ``mixed_step.json`` and ``.png`` to ``--out-dir``. From the repository root:

    .venv/bin/python benchmarks/bench_mixed_step.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engine.execution.layers.paged_attention import SequenceAttention, build_attention_metadata
from engine.execution.model_files import DEFAULT_MODEL
from engine.llm import LLM

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
CONTEXT = 300  # cached tokens of each decoding sequence
CHUNK = 256  # prefill chunk tokens
BATCHES = (1, 4, 16, 64)
REPEATS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    llm = LLM(DEFAULT_MODEL, draft=None, num_kv_blocks=4096, block_size=BLOCK_SIZE)
    runner = llm.engine.runner
    results = []
    for batch in tqdm(BATCHES, desc="batch sizes"):
        decodes, chunk = step_sequences(batch)
        timings = {"grouped": [], "one_group": [], "apart": []}
        for _ in range(REPEATS):
            timings["grouped"].append(timed_pass(runner, decodes + chunk, group_queries=True))
            timings["one_group"].append(timed_pass(runner, decodes + chunk, group_queries=False))
            timings["apart"].append(
                timed_pass(runner, decodes, group_queries=True)
                + timed_pass(runner, chunk, group_queries=True)
            )
        row = {"decoding_sequences": batch, **{k: min(v) * 1000 for k, v in timings.items()}}
        results.append(row)
        tqdm.write(
            f"{batch:>3} decodes + {CHUNK}-token chunk: grouped {row['grouped']:.0f} ms, "
            f"one group {row['one_group']:.0f} ms, apart {row['apart']:.0f} ms"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "model": DEFAULT_MODEL,
        "context": CONTEXT,
        "chunk": CHUNK,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    path = args.out_dir / "mixed_step.json"
    path.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    plot(results, path.with_suffix(".png"))


def step_sequences(batch: int) -> tuple[list[SequenceAttention], list[SequenceAttention]]:
    """`batch` decoding sequences and one prefill chunk, on disjoint blocks."""
    blocks = -(-(CONTEXT + 1) // BLOCK_SIZE)
    decodes = [
        SequenceAttention(list(range(i * blocks, (i + 1) * blocks)), CONTEXT, 1)
        for i in range(batch)
    ]
    first = batch * blocks
    chunk = [SequenceAttention(list(range(first, first + CHUNK // BLOCK_SIZE)), 0, CHUNK)]
    return decodes, chunk


@torch.inference_mode()
def timed_pass(runner, sequences: list[SequenceAttention], group_queries: bool) -> float:
    started = time.perf_counter()
    meta = build_attention_metadata(
        sequences, BLOCK_SIZE, runner.device, group_queries=group_queries
    )
    positions = torch.cat([torch.arange(s.num_cached, s.num_cached + s.num_new) for s in sequences])
    ids = torch.zeros(len(positions), dtype=torch.long)  # [T]
    runner.forward(ids, positions, runner.kv_cache.layers, meta)
    return time.perf_counter() - started


def plot(results: list[dict], path: Path) -> None:
    with png_figure(path) as axes:
        batches = [r["decoding_sequences"] for r in results]
        for key, label in (
            ("one_group", "one SDPA call (queries padded to the chunk)"),
            ("grouped", "attention groups (default)"),
            ("apart", "decodes and chunk in separate passes"),
        ):
            axes.plot(batches, [r[key] for r in results], "o-", label=label)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("decoding sequences beside one 256-token prefill chunk")
        axes.set_ylabel("forward pass (ms, best of 5)")
        axes.set_title("A mixed continuous-batching step, SmolLM2-135M fp32 on CPU")
        axes.grid(alpha=0.3)
        axes.legend()


if __name__ == "__main__":
    main()
