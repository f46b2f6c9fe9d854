"""Which kernels run the linears on this machine: the format of each weight's second copy, and up to
how many rows BLAS's GEMV on the plain weight serves a pass instead.

The kernels rank differently from one CPU to another (layers/cpu_linear.py;
benchmarks/bench_weight_layout.py), so at start-up the engine times whole passes of one-token
sequences, the candidates taking turns in every round:

1. the format: oneDNN against MKL-packed (where PyTorch has MKL) on passes of 4, 8, 16 and 64
   sequences, BLAS serving none; MKL-packed is kept when its times average under 95% of oneDNN's,
   and the other copies are freed;
2. BLAS's share: passes of 1, 2, 4 and 8 sequences through BLAS against the chosen format; BLAS
   serves passes of up to the largest of those sizes at which it, and every smaller one, is
   clearly faster;
3. padding: passes of 1 to 8 sequences, the sizes taking turns; a pass of m rows (beyond BLAS's)
   is computed as the fastest pass of m to 8 rows (zero rows added) when that is clearly faster
   than m rows (some kernels are slower for one or two rows than for four).

The kernels sum in different orders, so they agree to float rounding, as any two BLAS kernels do.
A model whose weights fit in a CPU's caches is not timed (its passes do not stream weights, so the
choice hardly matters there) and keeps oneDNN throughout: tests' tiny models run the same kernels
on every start.
"""

from __future__ import annotations

import logging
import statistics
import time

from engine.execution.layers.cpu_linear import ONEDNN, LinearKernels, cpu_linears, formats_available

logger = logging.getLogger(__name__)

_FORMAT_ROWS = (4, 8, 16, 64)  # pass sizes the formats are compared on
_BLAS_ROWS = (1, 2, 4, 8)  # pass sizes tried for BLAS, in order; it must win at each one
_PAD_ROWS = 8  # passes of fewer rows may be padded, up to this many
_ROUNDS = 5  # timed passes per candidate and size, the candidates taking turns; the fastest counts
_PAD_ROUNDS = 8  # the same for the padding's 8 sizes (their differences are small against noise)
_MARGIN = 0.95  # a candidate replaces the default only under this share of its time
_MIN_WEIGHT_BYTES = 64 << 20  # smaller models are not timed: oneDNN serves every pass


def choose_linear_kernels(runner, kernels: LinearKernels, padding: bool = True) -> None:
    """Time `runner`'s passes and set `kernels` (shared by every CpuLinear of its model) to the
    fastest choice (padding no pass unless `padding`). Uses the KV cache as scratch, so call it
    before any request is scheduled."""
    linears = cpu_linears(runner.model)
    weight_bytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in linears)
    if weight_bytes < _MIN_WEIGHT_BYTES:
        return
    format_timings = _choose_format(runner, kernels, formats_available())
    for layer in linears:
        layer.keep_only(kernels.packed_format)
    blas_timings = _choose_blas_rows(runner, kernels)
    padding_timings = _choose_padding(runner, kernels) if padding else "no padding"
    logger.info(
        "linear kernels: BLAS up to %d rows, then %s (%s; %s; %s)",
        kernels.blas_max_rows,
        kernels.packed_format,
        format_timings,
        blas_timings,
        padding_timings,
    )


def _choose_format(runner, kernels: LinearKernels, formats: tuple[str, ...]) -> str:
    """Set `kernels.packed_format` to the fastest of `formats` (oneDNN unless another is clearly
    faster), with BLAS serving no pass; return the timings, for the log."""
    kernels.blas_max_rows = 0
    if formats == (ONEDNN,):
        kernels.packed_format = ONEDNN
        return "oneDNN the only format"
    candidates = [LinearKernels(packed_format=f) for f in formats]
    for layer in cpu_linears(runner.model):
        for packed_format in formats:
            layer.lay_out(packed_format)
    per_size = [_fastest_passes(runner, kernels, candidates, rows) for rows in _FORMAT_ROWS]
    ratios = {  # format -> its mean time relative to oneDNN's (the first)
        c.packed_format: statistics.fmean(s[i] / s[0] for s in per_size)
        for i, c in enumerate(candidates)
    }
    best = min(ratios, key=ratios.get)
    kernels.packed_format = best if ratios[best] < _MARGIN else ONEDNN
    times = ", ".join(
        f"{rows} rows " + "/".join(f"{1000 * t:.1f}" for t in seconds) + " ms"
        for rows, seconds in zip(_FORMAT_ROWS, per_size)
    )
    return f"{'/'.join(formats)}: {times}"


def _choose_blas_rows(runner, kernels: LinearKernels) -> str:
    """Set `kernels.blas_max_rows` to the most rows at which BLAS, and at every smaller size, beat
    the chosen format; return the timings, for the log."""
    packed_format, timings = kernels.packed_format, []
    chosen = 0
    for rows in _BLAS_ROWS:
        candidates = [LinearKernels(packed_format, rows), LinearKernels(packed_format, 0)]
        blas, packed = _fastest_passes(runner, kernels, candidates, rows)
        timings.append(
            f"{rows} rows: BLAS {1000 * blas:.1f} ms, {packed_format} {1000 * packed:.1f}"
        )
        if blas > _MARGIN * packed:
            break
        chosen = rows
    kernels.blas_max_rows = chosen
    return "; ".join(timings)


def _choose_padding(runner, kernels: LinearKernels) -> str:
    """Set `kernels.pad_to` from unpadded passes of 1 to `_PAD_ROWS` sequences; return the
    timings, for the log."""
    pass_times = _fastest_by_size(runner, range(1, _PAD_ROWS + 1))
    kernels.pad_to = padded_rows(pass_times, kernels.blas_max_rows)
    times = "/".join(f"{1000 * t:.1f}" for t in pass_times)
    return f"passes of 1-{_PAD_ROWS} rows {times} ms, computed as {kernels.pad_to} rows"


def padded_rows(pass_times: list[float], blas_max_rows: int) -> tuple[int, ...]:
    """Rows to compute for a pass of 1, 2, ... len(pass_times) rows, given the seconds of an
    unpadded pass of each size: the fastest size from m up where it takes under `_MARGIN` of m's
    time, else m (and m itself where BLAS serves m rows: it takes no padded pass)."""
    sizes = range(1, len(pass_times) + 1)
    chosen = []
    for m in sizes:
        best = min(sizes[m - 1 :], key=lambda size: pass_times[size - 1])
        faster = pass_times[best - 1] < _MARGIN * pass_times[m - 1]
        chosen.append(best if faster and m > blas_max_rows else m)
    return tuple(chosen)


def _fastest_by_size(runner, sizes) -> list[float]:
    """Seconds of the fastest pass of each size of one-token sequences, the sizes taking turns."""
    fastest = [float("inf")] * len(sizes)
    for round_ in range(_PAD_ROUNDS + 1):  # the first round only warms every size up
        for i, rows in enumerate(sizes):
            started = time.perf_counter()
            runner.synthetic_pass(rows, 1)
            if round_:
                fastest[i] = min(fastest[i], time.perf_counter() - started)
    return fastest


def _fastest_passes(
    runner, kernels: LinearKernels, candidates: list[LinearKernels], rows: int
) -> list[float]:
    """Seconds of the fastest pass of `rows` one-token sequences with `kernels` set to each
    candidate in turn (and left at the last one)."""
    fastest = [float("inf")] * len(candidates)
    for round_ in range(_ROUNDS + 1):  # the first round only warms every candidate up
        for i, candidate in enumerate(candidates):
            kernels.packed_format, kernels.blas_max_rows = (
                candidate.packed_format,
                candidate.blas_max_rows,
            )
            started = time.perf_counter()
            runner.synthetic_pass(rows, 1)
            if round_:
                fastest[i] = min(fastest[i], time.perf_counter() - started)
    return fastest
