"""Linear-weight formats on CPU: time of whole target passes of the default model, by pass size.

Four formats of the same weights, each a full pass of the engine's model (paged attention, lm_head
on each sequence's first row), swapped in turn within every round so that the machine's drift
hits all four alike: BLAS on row-major weights (PyTorch's default) and on column-major ones
(layers/weight_layout.py, what a compiled model keeps and the eager engine's BLAS passes
read), MKL-packed (`cblas_sgemm_pack` once; up to 16 rows, column-major BLAS above) and oneDNN's
blocked layout, the last two as the eager engine's CpuLinears run them with BLAS serving no pass
(layers/cpu_linear.py). The eager engine chooses one of those two at start-up, and BLAS
for passes of one or a few rows where it measures faster (engine/execution/linear_kernels.py).
Two pass shapes: one sequence verifying N tokens (a draft tree) and N sequences decoding one token
each (a batch). Reports the best of `--rounds` per point. Writes ``weight_layout.json`` and
``.png`` (``weight_layout_TAG.*`` with ``--tag``) to ``--out-dir``. From the repository root:

    .venv/bin/python benchmarks/bench_weight_layout.py    # ~2 minutes
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from engine.execution.layers.cpu_linear import ONEDNN, CpuLinear, LinearKernels, formats_available
from engine.execution.layers.weight_layout import column_major
from engine.execution.model_files import DEFAULT_MODEL
from engine.llm import LLM

from plotting import png_figure

REPO_ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # name: (tokens in the pass, tokens per sequence) for each N
    "one sequence, N tokens": [(n, n) for n in (1, 2, 3, 4, 8, 16, 32)],
    "N sequences, 1 token each": [(n, 1) for n in (2, 4, 8, 16, 32, 64)],
}


def weight_formats(model: nn.Module, kernels: LinearKernels) -> dict[str, tuple[dict, str]]:
    """Per format, the module to set at each (parent, attribute) of the model's CPU linears, and
    the packed format their shared `kernels` name (only the engine's own modules read it; the
    plain nn.Linears of the BLAS formats ignore it)."""
    slots = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, CpuLinear)
    ]
    for _, _, child in slots:
        for packed_format in formats_available():
            child.lay_out(packed_format)
    engine_modules = {(p, n): c for p, n, c in slots}
    formats = {
        "row-major": (
            {(p, n): _linear(c.weight.detach().contiguous(), c.bias) for p, n, c in slots},
            ONEDNN,
        ),
        "column-major": (
            {(p, n): _linear(column_major(c.weight.detach()), c.bias) for p, n, c in slots},
            ONEDNN,
        ),
    }
    for packed_format in formats_available():
        formats[packed_format] = (engine_modules, packed_format)
    return formats


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:  # weight: [out, in]
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = bias  # shared with the engine's module (None: no bias)
    return linear


def time_pass(runner, num_tokens: int, per_sequence: int, repeats: int = 3) -> float:
    """Milliseconds of the fastest of `repeats` synthetic passes (after one warm-up)."""
    runner.synthetic_pass(num_tokens, per_sequence)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        runner.synthetic_pass(num_tokens, per_sequence)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--tag", default="", help="write weight_layout_TAG.json and .png")
    args = parser.parse_args()
    runner = LLM(model=args.model, draft=None, kv_cache_memory_gib=0.25).engine.runner
    kernels = runner.linear_kernels
    formats = weight_formats(runner.model, kernels)
    kernels.blas_max_rows = 0  # the CpuLinears run their packed copy for every pass size
    best = {f: {s: [float("inf")] * len(p) for s, p in SHAPES.items()} for f in formats}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for name, (modules, packed_format) in formats.items():
            for (parent, attribute), module in modules.items():
                setattr(parent, attribute, module)
            kernels.packed_format = packed_format
            for shape, points in SHAPES.items():
                for i, (num_tokens, per_sequence) in enumerate(points):
                    ms = time_pass(runner, num_tokens, per_sequence)
                    best[name][shape][i] = min(best[name][shape][i], ms)
    results = {
        shape: [
            {"tokens": n, **{f"{name}_ms": round(best[name][shape][i], 2) for name in formats}}
            for i, (n, _) in enumerate(points)
        ]
        for shape, points in SHAPES.items()
    }
    for shape, rows in results.items():
        print(shape)
        for row in rows:
            print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"model": args.model, "threads": torch.get_num_threads(), "rounds": args.rounds}
    path = args.out_dir / (f"weight_layout_{args.tag}.json" if args.tag else "weight_layout.json")
    path.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    plot(results, list(formats), path.with_suffix(".png"))


def plot(results: dict, formats: list[str], path: Path) -> None:
    with png_figure(path, ncols=len(results), figsize=(11, 4.2)) as panels:
        for axes, (shape, rows) in zip(panels, results.items()):
            for name in formats:
                axes.plot(
                    [r["tokens"] for r in rows], [r[f"{name}_ms"] for r in rows], "o-", label=name
                )
            axes.set_xscale("log", base=2)
            axes.set_xlabel("N")
            axes.set_ylabel("ms per pass")
            axes.set_title(shape)
            axes.grid(alpha=0.3)
            axes.legend()
        panels[0].figure.suptitle(
            "Target passes of the default model on CPU, by linear-weight format"
        )


if __name__ == "__main__":
    main()
