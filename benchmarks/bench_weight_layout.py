"""Row-major against column-major linear weights on CPU: F.linear time per number of rows.

For each linear shape of the default model (fused qkv, o_proj, fused gate/up, down, lm_head) and
each row count, the best of five timed loops of `F.linear(x, W)` with W stored row-major (PyTorch's
default) and column-major (engine/layers/weight_layout.py). Writes ``weight_layout.json`` and
``.png`` to ``--out-dir``. From the repository root:

    .venv/bin/python benchmarks/bench_weight_layout.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.layers.weight_layout import column_major

REPO_ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # name: (out, in) for SmolLM2-135M
    "qkv_proj": (960, 576),
    "o_proj": (576, 576),
    "gate_up_proj": (3072, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}
ROWS = (1, 2, 3, 4, 8, 16, 32, 64)


def best_time_us(fn, budget_s: float = 0.05) -> float:
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < budget_s:
        fn()
        calls += 1
    per_loop = max(1, calls // 4)
    loops = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(per_loop):
            fn()
        loops.append((time.perf_counter() - started) / per_loop * 1e6)
    return min(loops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    for name, (out, inp) in SHAPES.items():
        row_major = torch.randn(out, inp)
        col_major = column_major(row_major)
        results[name] = []
        for rows in ROWS:
            x = torch.randn(rows, inp)
            assert torch.allclose(F.linear(x, row_major), F.linear(x, col_major), atol=1e-4)
            row_us = best_time_us(lambda x=x, w=row_major: F.linear(x, w))
            col_us = best_time_us(lambda x=x, w=col_major: F.linear(x, w))
            results[name].append({"rows": rows, "row_major_us": row_us, "column_major_us": col_us})
            print(
                f"{name:>12} rows {rows:>2}: row-major {row_us:8.0f} us, "
                f"column-major {col_us:8.0f} us"
            )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    path = args.out_dir / "weight_layout.json"
    path.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    plot(results, path.with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for name, rows in results.items():
        axes.plot(
            [r["rows"] for r in rows],
            [r["row_major_us"] / r["column_major_us"] for r in rows],
            "o-",
            label=name,
        )
    axes.axhline(1.0, color="gray", lw=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("rows of x (tokens in the pass)")
    axes.set_ylabel("row-major time / column-major time")
    axes.set_title("F.linear on CPU: speedup of column-major weights")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
