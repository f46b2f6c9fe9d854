"""VerifyCost: how long one target pass takes against the number of tokens in it.

Measured once at start-up on decode-shaped passes (sequences of `tokens_per_sequence` new tokens
over a short context, logits on each one's root, as a verify pass of draft trees computes), at
powers of two up to the largest pass the scheduler can build, plus the lm_head over one row, which
the acceptance walk spends on each draft node it accepts. The draft budget
(engine/draft_budget.py) weighs extra draft tokens against them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial

import numpy as np


@dataclass(frozen=True)
class VerifyCost:
    num_tokens: tuple[int, ...]  # increasing, the first is 1
    seconds: tuple[float, ...]  # time of a pass with that many tokens
    logits_row_seconds: float = 0.0  # the lm_head over one more row

    def __call__(self, num_tokens):
        """Seconds for a pass of `num_tokens` tokens (a number, or an array of them: then an
        array): piecewise linear between the measured points, the last segment's slope beyond."""
        xs, ys = self.num_tokens, self.seconds
        x = np.maximum(np.asarray(num_tokens, dtype=np.float64), xs[0])
        last_slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        seconds = np.where(x > xs[-1], ys[-1] + (x - xs[-1]) * last_slope, np.interp(x, xs, ys))
        return float(seconds) if seconds.ndim == 0 else seconds


def measure_verify_cost(
    runner, max_tokens: int, tokens_per_sequence: int, repeats: int = 3
) -> VerifyCost:
    """Time passes of 1, 2, 4, ... `max_tokens` tokens with `runner` (the fastest of `repeats`).

    Uses the KV cache as scratch, so call it before any request is scheduled."""
    points = sorted({2**i for i in range(int(math.log2(max(2, max_tokens))) + 1)} | {max_tokens})
    runner.synthetic_pass(points[-1], tokens_per_sequence)  # warm-up: allocations, kernels
    seconds = [
        _fastest(partial(runner.synthetic_pass, n, tokens_per_sequence), repeats) for n in points
    ]
    row = _fastest(runner.logits_row_pass, repeats + 1)  # the first warms up
    return VerifyCost(tuple(points), tuple(_non_decreasing(seconds)), row)


def _fastest(run, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `run`."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def _non_decreasing(values: list[float]) -> list[float]:
    """A bigger pass never costs less: smooth out timing noise that says otherwise."""
    result, highest = [], 0.0
    for value in values:
        highest = max(highest, value)
        result.append(highest)
    return result
