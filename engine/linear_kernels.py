"""Which kernel runs the linears of a pass of few rows on this machine: oneDNN's or BLAS's.

oneDNN's blocked weights (engine/layers/onednn_linear.py) read each weight once however few the
rows. On the AMD EPYC (AVX2) of this project's first machines they beat MKL at every pass size;
on an Intel Xeon with AVX-512, MKL's GEMV on the plain weight is faster for one to three rows
(benchmarks/results/weight_layout_xeon.json: a one-token pass of the default model took 32.5 ms
row-major, 39.5 through oneDNN), and oneDNN wins from 4 or 8 rows. So at start-up the engine times
whole passes of 1, 2, 4 and 8 sequences of one token each with both kernels, in turns, and lets BLAS
serve passes of up to the largest of those sizes at which it, and every smaller one, is clearly
faster.

The two kernels sum in different orders, so they agree to float rounding, as any two BLAS
kernels do. A model whose weights fit in a CPU's caches is not timed (its passes do not stream
weights, so the choice hardly matters there) and keeps oneDNN throughout: tests' tiny models run
the same kernels on every start.
"""

from __future__ import annotations

import logging
import time

from engine.layers.onednn_linear import onednn_linears, use_blas_up_to

logger = logging.getLogger(__name__)

_ROW_COUNTS = (1, 2, 4, 8)  # pass sizes tried, in order; BLAS must win at each one up to its choice
_ROUNDS = 5  # timed passes per kernel and size, the kernels taking turns; the fastest counts
_MARGIN = 0.95  # BLAS is chosen for a size only when its pass takes under this share of oneDNN's
_MIN_WEIGHT_BYTES = 64 << 20  # smaller models are not timed: oneDNN serves every pass


def choose_blas_rows(runner) -> int:
    """Time `runner`'s passes with both kernels; set and return the chosen `blas_max_rows` of
    every OneDnnLinear of its model (0: oneDNN for all). Uses the KV cache as scratch, so call it
    before any request is scheduled."""
    linears = onednn_linears(runner.model)
    weight_bytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in linears)
    if weight_bytes < _MIN_WEIGHT_BYTES:
        return 0
    chosen, timings = 0, []
    for rows in _ROW_COUNTS:
        blas, onednn = _fastest_passes(runner, rows)
        timings.append(f"{rows} rows: BLAS {1000 * blas:.1f} ms, oneDNN {1000 * onednn:.1f} ms")
        if blas > _MARGIN * onednn:
            break
        chosen = rows
    use_blas_up_to(runner.model, chosen)
    logger.info("linear kernels: BLAS up to %d rows, then oneDNN (%s)", chosen, "; ".join(timings))
    return chosen


def _fastest_passes(runner, rows: int) -> tuple[float, float]:
    """Seconds of the fastest pass of `rows` one-token sequences with BLAS, and with oneDNN."""
    fastest = {rows: float("inf"), 0: float("inf")}  # blas_max_rows -> seconds
    for round_ in range(_ROUNDS + 1):  # the first round only warms both up
        for max_rows in fastest:
            use_blas_up_to(runner.model, max_rows)
            started = time.perf_counter()
            runner.synthetic_pass(rows, 1)
            if round_:
                fastest[max_rows] = min(fastest[max_rows], time.perf_counter() - started)
    return fastest[rows], fastest[0]
