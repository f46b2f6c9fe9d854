"""The benchmarks' plots: matplotlib without a display, one PNG per figure (`pip install
'aerie[bench]'`). Imported by the scripts beside it, which run from the repository root as
`python benchmarks/bench_*.py`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def png_figure(path: Path, ncols: int = 1, figsize: tuple[float, float] = (7, 4.2)) -> Iterator:
    """Axes to draw on (one, or an array of `ncols` side by side; `.figure` is their figure),
    laid out and written to `path` at 120 dpi when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, ncols, figsize=figsize)
    try:
        yield axes
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)
