"""RealizedRates: how fast drafting steps and plain steps have really decoded, by batch size.

The draft budget (engine/spec/draft_budget.py) predicts whether drafting pays from a cost model and
the drafts' values. Its estimates are right on average but can be off for a batch size, and a
prediction that is a little optimistic there drafts on every step and loses to plain decoding
(at 4 sequences: drafting steps at 0.86x plain steps' tokens per second while the model said
1.1x). So the budget also keeps what each choice has actually delivered: per batch-size bucket
(1, 2-3, 4-7, 8-15, ...), the tokens per sequence and seconds of its recent drafting steps and
of its recent plain steps, whole steps both (the head, the pass, the acceptance and the commit).
Once both have been seen often enough and differ by more than their noise, the realized rates
decide, whatever the model predicts; while they are closer than that, the faster of the two by
its recent rate is chosen, and the probes go on. "Often enough" is fewer steps for more
sequences: a step's tokens per sequence average over all of them, so at 16 sequences four
drafting steps say more than sixteen at one.

A bucket that keeps drafting still needs a fresh plain step now and then to compare against: one
every `plain_probe_interval` drafting decisions once drafting has clearly won there; while both
kinds have been seen and there is no verdict (drafting then goes by its lead over a plain window
of eight steps), one every `unsure_probe_interval` where the lead is small, further apart the
larger it is. The machine drifts (AR's speed at 8 requests went from 141 to 185 tokens/s between
runs of benchmarks/bench_load_overhead.py within an hour), and a plain window refreshed once in
32 drafting steps kept a slow spell's plain rate long after it: drafting led it at a loss.
Refreshed every 4, the lead goes when the slow spell does (bench_load_overhead.py --batches 1,8
--rounds 4, with and without: at 8 requests 31 drafting steps of 506 and 0.963x AR, against 136
of 491 and 0.944x). A plain step there gives up little, the two kinds being close; where drafting
leads by a fifth but its steps' luck still leaves it short of a verdict (one sequence: a drafting
step emits 1 to 3 tokens), a plain step every 4 gives up a sixth of a step's tokens one step in
five, 3% of the time, and a drift that could
overturn a lead that large is slow. So the plain steps come as far apart as keeps what they give
up under `_PLAIN_PROBE_SHARE` of the time (every 4 at a lead of 5%, every 16 at a fifth). (The
other way round, the budget's own probes keep the drafting side fresh.)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

_DRAFTED_WINDOW = 32  # drafting steps per bucket: their tokens vary from step to step
_PLAIN_WINDOW = 8  # plain steps per bucket: they always emit one token a sequence
_CONFIDENCE = 2.0  # standard errors apart before the realized rates decide
_MIN_DRAFTED_STEPS = 4  # drafting steps before a verdict, however many sequences each had
# Without a verdict, drafting must lead plain steps by this share to be chosen: a lead smaller than
# the noise gains little when right, and at 4 sequences (drafting and plain steps within a few
# percent of each other) a bare lean flipped between them and drafted at 0.93x overall.
_LEAD_MARGIN = 0.05
# Of the time, what plain steps taken to refresh the plain rate may give up while drafting leads
# without a verdict (the draft budget's probes are held to the same share).
_PLAIN_PROBE_SHARE = 0.01


@dataclass
class _Bucket:
    drafted: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=_DRAFTED_WINDOW)
    )  # (tokens per sequence, seconds)
    plain: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=_PLAIN_WINDOW))
    drafts_since_plain: int = 0  # drafting decisions since the last plain one


class RealizedRates:
    def __init__(
        self,
        plain_probe_interval: int = 32,
        unsure_probe_interval: int = 4,
        min_drafted: int = 16,
        min_plain: int = 4,
    ) -> None:
        self.plain_probe_interval = plain_probe_interval
        self.unsure_probe_interval = unsure_probe_interval
        # steps of each kind before the realized rates decide: a drafting step's tokens vary
        # (1 to 4 at one sequence), a plain step's do not; min_drafted is for one sequence
        self.min_drafted, self.min_plain = min_drafted, min_plain
        self.buckets: dict[int, _Bucket] = {}

    def record(self, drafted: bool, num_sequences: int, num_tokens: int, seconds: float) -> None:
        """A finished decode step that drafted (or not) for `num_sequences` sequences, emitted
        `num_tokens` tokens for them and took `seconds` in all."""
        samples = self._bucket(num_sequences)
        (samples.drafted if drafted else samples.plain).append(
            (num_tokens / num_sequences, seconds)
        )

    def drafting_wins(self, num_sequences: int) -> bool | None:
        """Whether drafting steps have decoded faster than plain ones at this batch size; None
        until both kinds have been seen often enough and their rates differ by more than
        `_CONFIDENCE` standard errors. A verdict that drafting loses backs the probes off, and
        then few drafting steps come to revise it, so a lucky or unlucky streak must not give
        one: with 4 drafting steps and one standard error, a head worth 1.2x at one sequence
        was judged losing within a few hundred steps and stayed plain."""
        samples = self._bucket(num_sequences)
        if not self._seen_enough(samples, num_sequences):
            return None
        drafted, plain = _rate(samples.drafted), _rate(samples.plain)
        error = math.hypot(_standard_error(samples.drafted), _standard_error(samples.plain))
        return None if abs(drafted - plain) <= _CONFIDENCE * error else drafted > plain

    def drafting_leads(self, num_sequences: int) -> bool | None:
        """Whether drafting steps have decoded faster than plain ones at this batch size by
        `_LEAD_MARGIN` at least, by the rates alone, once both kinds have been seen often enough
        (None before): what the budget goes by when the two are too close for `drafting_wins`
        to decide. Where they are that close, drafting gains or loses little either way; what
        matters is not to keep drafting on the cost model's word when the clock says plain
        steps are ahead or even (at 4 sequences the model kept drafting at 0.93x plain
        decoding's speed, the rates a standard error or two apart)."""
        samples = self._bucket(num_sequences)
        if not self._seen_enough(samples, num_sequences):
            return None
        return _rate(samples.drafted) > (1 + _LEAD_MARGIN) * _rate(samples.plain)

    def plain_probe_due(self, num_sequences: int) -> bool:
        """Whether a step about to draft should decode plainly instead, to refresh the plain
        rate it is compared against: more often while both kinds have been seen and there is no
        verdict (drafting then goes by its lead over a plain window that must stay fresh)."""
        samples = self._bucket(num_sequences)
        unsure = (
            self._seen_enough(samples, num_sequences) and self.drafting_wins(num_sequences) is None
        )
        interval = self._unsure_interval(samples) if unsure else self.plain_probe_interval
        return samples.drafts_since_plain >= interval or (
            len(samples.plain) < self.min_plain
            and len(samples.drafted) >= self._min_drafted(num_sequences)
        )

    def _unsure_interval(self, samples: _Bucket) -> int:
        """Drafting decisions between plain steps in a bucket that drafts without a verdict: a
        plain step there gives up `1 - plain rate / drafting rate` of a step's tokens, so one
        in `interval + 1` steps gives up that over `interval + 1` of the time, kept under
        `_PLAIN_PROBE_SHARE`; `unsure_probe_interval` at least, `plain_probe_interval` at most."""
        given_up = max(0.0, 1 - _rate(samples.plain) / max(_rate(samples.drafted), 1e-9))
        steps = math.ceil(given_up / _PLAIN_PROBE_SHARE) - 1
        return min(self.plain_probe_interval, max(self.unsure_probe_interval, steps))

    def extra_seconds(self, num_sequences: int) -> float | None:
        """How much longer a drafting step has recently taken than a plain one at this batch
        size (its drafting, its larger pass and its acceptance walk); None before both."""
        samples = self._bucket(num_sequences)
        if not samples.drafted or not samples.plain:
            return None
        return max(0.0, _mean_seconds(samples.drafted) - _mean_seconds(samples.plain))

    def lost_seconds(self, num_sequences: int) -> float | None:
        """How much longer a drafting step has recently taken at this batch size than plain
        steps would for the tokens it emitted (0 where it gains); None before both kinds."""
        samples = self._bucket(num_sequences)
        if not samples.drafted or not samples.plain:
            return None
        tokens = sum(tokens for tokens, _ in samples.drafted) / len(samples.drafted)
        return max(0.0, _mean_seconds(samples.drafted) - tokens / _rate(samples.plain))

    def decided(self, num_sequences: int, drafts: bool) -> None:
        samples = self._bucket(num_sequences)
        samples.drafts_since_plain = samples.drafts_since_plain + 1 if drafts else 0

    def _seen_enough(self, samples: _Bucket, num_sequences: int) -> bool:
        return (
            len(samples.drafted) >= self._min_drafted(num_sequences)
            and len(samples.plain) >= self.min_plain
        )

    def _min_drafted(self, num_sequences: int) -> int:
        """Drafting steps this batch size's bucket needs for a verdict: `min_drafted` at one
        sequence, proportionally fewer for the bucket's fewest sequences, and at least 4."""
        fewest = 1 << (num_sequences.bit_length() - 1)  # buckets: 1, 2-3, 4-7, 8-15, ...
        floor = min(_MIN_DRAFTED_STEPS, self.min_drafted)
        return max(floor, math.ceil(self.min_drafted / fewest))

    def _bucket(self, num_sequences: int) -> _Bucket:
        return self.buckets.setdefault(num_sequences.bit_length(), _Bucket())


def _mean_seconds(samples: deque[tuple[float, float]]) -> float:
    return sum(seconds for _, seconds in samples) / len(samples)


def _rate(samples: deque[tuple[float, float]]) -> float:
    """Tokens per sequence per second over the steps in `samples`."""
    return sum(tokens for tokens, _ in samples) / max(sum(s for _, s in samples), 1e-9)


def _standard_error(samples: deque[tuple[float, float]]) -> float:
    """Of the mean of the steps' own rates (tokens per sequence per second)."""
    rates = [tokens / max(seconds, 1e-9) for tokens, seconds in samples]
    mean = sum(rates) / len(rates)
    variance = sum((r - mean) ** 2 for r in rates) / max(len(rates) - 1, 1)
    return math.sqrt(variance / len(rates))
