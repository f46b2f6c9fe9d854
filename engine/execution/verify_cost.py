"""VerifyCost: how long one target pass takes against the number of tokens in it.

Measured once at start-up on decode-shaped passes (sequences of `tokens_per_sequence` new tokens
over a short context, logits on each one's root, as a verify pass of draft trees computes), at
powers of two up to the largest pass the scheduler can build; and the lm_head alone over 1, 2,
4, ... rows, which the acceptance walk spends on the draft nodes it accepts (on a CPU with packed
weights a few rows cost about what one does). The draft budget (engine/spec/draft_budget.py) weighs
extra draft tokens against them. A busy machine can fool a start-up measurement, so LiveVerifyCost
prefers what the engine's own passes take: per measured point, the median of its recent live
passes once there are a few, the start-up value scaled by the median live ratio until then. A
point's live passes expire after `_LIVE_HORIZON` passes of any size: a pass size the budget stopped
choosing because a noisy stretch made it look dear is otherwise never measured again, and the
budget never chooses it again.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from functools import partial

import numpy as np

_MAX_LOGITS_ROWS = 64  # the lm_head is timed up to this many rows; the last slope goes beyond
# Rows of logits the lm_head computes for about the price of one (layers/cpu_linear.py):
# a verify pass whose sampled rows and draft nodes are no more computes all their logits at once.
FREE_LOGITS_ROWS = 8


@dataclass(frozen=True)
class VerifyCost:
    num_tokens: tuple[int, ...]  # increasing, the first is 1
    seconds: tuple[float, ...]  # time of a pass with that many tokens
    logits_rows: tuple[int, ...] = (1,)  # increasing, the first is 1
    logits_seconds: tuple[float, ...] = (0.0,)  # time of the lm_head over that many rows

    def __call__(self, num_tokens):
        """Seconds for a pass of `num_tokens` tokens (a number, or an array of them: then an
        array): piecewise linear between the measured points, the last segment's slope beyond."""
        return _piecewise_linear(self.num_tokens, self.seconds, num_tokens)

    def logits(self, num_rows):
        """Seconds of the lm_head over `num_rows` rows (a number or an array; an expected number
        may be fractional): from nothing at 0 rows, piecewise linear through the measurements."""
        return _piecewise_linear((0, *self.logits_rows), (0.0, *self.logits_seconds), num_rows)


_LIVE_WINDOW = 16  # live passes kept per measured point
_MIN_LIVE = 3  # live passes a point needs before they replace its start-up value
_LIVE_HORIZON = 256  # passes of any size after which a point's live pass no longer counts


class LiveVerifyCost:
    """Pass seconds by number of tokens, from live passes where seen, else `startup`'s shape."""

    def __init__(self, startup: VerifyCost, learn: bool = True) -> None:
        self.startup = startup
        self.learn = learn  # False: `startup` as given (to fix the costs a test or benchmark sets)
        # per point: (the pass's number, its seconds moved to the point)
        self.windows = [deque(maxlen=_LIVE_WINDOW) for _ in startup.num_tokens]
        self.num_passes = 0
        self.ratios: deque[float] = deque(maxlen=2 * _LIVE_WINDOW)  # live / start-up, any size
        self._points: np.ndarray | None = None  # corrected seconds at startup.num_tokens
        self._log_points = [math.log2(n) for n in startup.num_tokens]

    @property
    def scale(self) -> float:
        """Median of recent live passes' seconds over the start-up measurement's (1 before)."""
        return statistics.median(self.ratios) if self.ratios else 1.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A live pass of `num_tokens` tokens took `seconds`: kept at the nearest point (in
        log scale), moved there along the start-up curve."""
        if not self.learn:
            return
        self.num_passes += 1
        predicted = max(self.startup(num_tokens), 1e-9)
        self.ratios.append(seconds / predicted)
        log = math.log2(max(num_tokens, 1))
        nearest = min(range(len(self._log_points)), key=lambda i: abs(self._log_points[i] - log))
        point = self.startup.num_tokens[nearest]
        self.windows[nearest].append((self.num_passes, seconds * self.startup(point) / predicted))
        self._points = None

    def __call__(self, num_tokens):
        """Seconds for a pass of `num_tokens` tokens (a number or an array), piecewise linear
        through the corrected points, never less for more tokens."""
        if self._points is None:
            scale, oldest = self.scale, self.num_passes - _LIVE_HORIZON
            points = []
            for window, startup in zip(self.windows, self.startup.seconds):
                recent = [seconds for number, seconds in window if number > oldest]
                points.append(
                    statistics.median(recent) if len(recent) >= _MIN_LIVE else startup * scale
                )
            self._points = np.maximum.accumulate(points)
        return _piecewise_linear(self.startup.num_tokens, tuple(self._points), num_tokens)


def node_logits_with_pass(cost: VerifyCost | None, num_sampled: int, num_nodes, num_trees: int):
    """Whether a verify pass computes its draft nodes' logits with those of its `num_sampled`
    sampled rows (`num_nodes` a number, or an array of them: then an array): always when all
    of them are at most `FREE_LOGITS_ROWS`; beyond that, once the lm_head is measured, when the
    extra rows cost less than one call over a row per tree, the least the acceptance walks spend
    without them (a walk that accepts a node needs its logits). On a CPU with packed weights a
    few more rows cost far less than another call."""
    total = num_sampled + np.asarray(num_nodes)
    free = total <= FREE_LOGITS_ROWS
    if cost is None:
        return free
    extra = cost.logits(total) - cost.logits(num_sampled)
    return free | (extra < cost.logits(num_trees))


def _piecewise_linear(xs: tuple, ys: tuple, x):
    """y at `x` (a number, or an array: then an array) through the points (xs, ys): ys[0] below
    the first point, the last segment's slope beyond the last. A number takes a plain-Python
    path: the engine prices one pass a step, where numpy's per-call overhead would cost more
    than the arithmetic."""
    if isinstance(x, (int, float)):
        if len(xs) == 1 or x <= xs[0]:
            return float(ys[0])
        i = min(bisect.bisect_left(xs, x), len(xs) - 1)  # x in (xs[i-1], xs[i]], or beyond
        return float(ys[i - 1] + (x - xs[i - 1]) * (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1]))
    x = np.asarray(x, dtype=np.float64)
    last_slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    y = np.where(x > xs[-1], ys[-1] + (x - xs[-1]) * last_slope, np.interp(x, xs, ys))
    return float(y) if y.ndim == 0 else y


def measure_verify_cost(
    runner, max_tokens: int, tokens_per_sequence: int, repeats: int = 3
) -> VerifyCost:
    """Time passes of 1, 2, 4, ... `max_tokens` tokens with `runner` (the fastest of `repeats`),
    and the lm_head over 1, 2, 4, ... rows.

    Uses the KV cache as scratch, so call it before any request is scheduled."""
    points = _powers_of_two_to(max_tokens)
    runner.synthetic_pass(points[-1], tokens_per_sequence)  # warm-up: allocations, kernels
    seconds = [
        _fastest(partial(runner.synthetic_pass, n, tokens_per_sequence), repeats) for n in points
    ]
    rows = _powers_of_two_to(min(max_tokens, _MAX_LOGITS_ROWS))
    runner.logits_pass(rows[-1])  # warm-up
    logits_seconds = [_fastest(partial(runner.logits_pass, n), repeats) for n in rows]
    return VerifyCost(
        tuple(points),
        tuple(_non_decreasing(seconds)),
        tuple(rows),
        tuple(_non_decreasing(logits_seconds)),
    )


def _powers_of_two_to(largest: int) -> list[int]:
    """1, 2, 4, ... up to `largest`, and `largest` itself."""
    return sorted({2**i for i in range(int(math.log2(max(2, largest))) + 1)} | {largest})


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
