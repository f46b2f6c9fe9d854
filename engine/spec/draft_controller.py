"""DraftController: whether a decode step drafts, a two-armed bandit per batch-size bucket.

The arms are "draft" and "plain"; a step's payoff is what the engine measures of the whole step:
tokens per sequence over its seconds (drafting, the larger pass, the acceptance walk, the head's
catch-up, all of it). Each bucket (1, 2-3, 4-7, ... decoding sequences) keeps, per arm, sums of
tokens and seconds discounted by half every `half_life` of its steps: an arm's rate is its
recent throughput, with the ratio estimator's standard error. A step's seconds are first scaled
to the bucket's smallest batch size by a fit of its plain steps' seconds on batch size: where a
step's time grows with the batch, steps of different sizes would otherwise measure different
things, and an arm played more while the load ramps would look better or worse for it. The
choice is discounted Thompson sampling: draw each arm's rate from a normal that wide around its
estimate, play the higher.
Each arm is played twice first, and again whenever its discounted steps fall under one half.
Steps that also compute prompt tokens are not measured (their time is mostly the prompt's) and
draft only on a clear verdict: drafting's rate two standard errors ahead.

Guarantee (tests/engine/test_draft_controller.py simulates it at one sequence's noise):
- Loss against the better arm = the worse arm's share of steps x the gap; the share falls as
  gap^2 / noise^2 grows. At the default half-life of 128: at most 2.5% of throughput on average
  at the hardest gap (drafting ~10% slower, trees' tokens spreading 46% a step), 1.5% where
  drafting is 20% faster, 1% for a useless head (never accepted; it drafts on under 5% of
  steps); arms within the noise of each other cost at most that noise.
- It follows a change within a few half-lives of the bucket's steps: the past weighs half as
  much per half-life, an unplayed arm's estimate widens as it ages, and is retried by force
  once its discounted steps fall under one half.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

_PRIOR_SPREAD, _PRIOR_STEPS = 0.3, 2.0  # a step's relative spread before many are seen
_MIN_PLAYS = 2  # steps an arm is played first, before its estimate is drawn from
_MIN_WEIGHT = 0.5  # an arm whose discounted steps fall under this is played again
_CLEAR = 2.0  # standard errors of lead that make a verdict clear


def batch_bucket(num_decoding: int) -> tuple[int, int]:
    """The smallest and largest batch size of `num_decoding`'s bucket: 1, 2-3, 4-7, 8-15, ..."""
    low = 1 << (max(num_decoding, 1).bit_length() - 1)
    return low, 2 * low - 1


@dataclass
class _Arm:
    """Discounted sums over an arm's steps: w = decay ** age, per step k tokens in s seconds."""

    plays: int = 0  # steps it has been played
    weight: float = 0.0  # sum w: the steps it has been played, recent ones counting most
    tokens: float = 0.0  # sum w k
    seconds: float = 0.0  # sum w s
    tokens2: float = 0.0  # sum w k^2 (these three give the spread of a step about the rate)
    cross: float = 0.0  # sum w k s
    seconds2: float = 0.0  # sum w s^2

    def decay(self, factor: float) -> None:
        self.weight *= factor
        self.tokens *= factor
        self.seconds *= factor
        self.tokens2 *= factor
        self.cross *= factor
        self.seconds2 *= factor

    def add(self, tokens: float, seconds: float) -> None:
        self.plays += 1
        self.weight += 1.0
        self.tokens += tokens
        self.seconds += seconds
        self.tokens2 += tokens * tokens
        self.cross += tokens * seconds
        self.seconds2 += seconds * seconds

    @property
    def known(self) -> bool:
        return self.plays >= _MIN_PLAYS and self.weight >= _MIN_WEIGHT

    @property
    def mean_seconds(self) -> float:
        """Of one of the arm's steps, over its discounted steps."""
        return self.seconds / self.weight

    @property
    def rate(self) -> float:
        """Tokens per second over the arm's discounted steps."""
        return self.tokens / self.seconds

    @property
    def standard_error(self) -> float:
        """Of `rate` (the ratio estimator's linearisation): a step's spread about the rate over
        the square root of the arm's weight, so it widens as the arm's steps age unplayed. The
        spread is shrunk toward a prior (`_PRIOR_SPREAD` over `_PRIOR_STEPS` steps), so that a
        few alike steps cannot make an estimate look sure."""
        rate = self.rate
        residual = self.tokens2 - 2 * rate * self.cross + rate * rate * self.seconds2  # sum w e^2
        prior = _PRIOR_STEPS * (_PRIOR_SPREAD * rate * self.mean_seconds) ** 2
        step_variance = (max(0.0, residual) + prior) / (self.weight + _PRIOR_STEPS)  # tokens^2
        return math.sqrt(step_variance / self.weight) / self.mean_seconds


@dataclass
class _PlainTimes:
    """Discounted least squares of a bucket's plain steps' seconds on their batch size."""

    weight: float = 0.0  # sum w
    size: float = 0.0  # sum w b
    size2: float = 0.0  # sum w b^2
    seconds: float = 0.0  # sum w s
    cross: float = 0.0  # sum w b s

    def decay(self, factor: float) -> None:
        self.weight *= factor
        self.size *= factor
        self.size2 *= factor
        self.seconds *= factor
        self.cross *= factor

    def add(self, size: int, seconds: float) -> None:
        self.weight += 1.0
        self.size += size
        self.size2 += size * size
        self.seconds += seconds
        self.cross += size * seconds

    def scale(self, size: int, reference: int) -> float:
        """T(reference) / T(size) by the fit: what a step of `size` sequences' seconds are worth
        at `reference` (<= size). Kept within [reference / size, 1] (a step takes no less time
        with more sequences, nor more than in proportion); 1 until the fit has sizes to go by."""
        if self.weight < _MIN_PLAYS:
            return 1.0
        mean_size = self.size / self.weight
        spread = self.size2 / self.weight - mean_size * mean_size
        if spread < 0.25:  # sizes (nearly) all alike: no slope to read
            return 1.0
        mean_seconds = self.seconds / self.weight
        slope = (self.cross / self.weight - mean_size * mean_seconds) / spread
        at_size = mean_seconds + slope * (size - mean_size)
        at_reference = mean_seconds + slope * (reference - mean_size)
        if at_size <= 0.0:
            return 1.0
        return min(1.0, max(reference / size, at_reference / at_size))


@dataclass
class _Bucket:
    reference: int  # its smallest batch size: seconds are scaled to it
    draft: _Arm
    plain: _Arm
    plain_times: _PlainTimes


class DraftController:
    def __init__(self, half_life: float = 128.0, seed: int = 0) -> None:
        if half_life < 1:
            raise ValueError("half_life must be >= 1")
        self.decay = 0.5 ** (1.0 / half_life)  # per step of a bucket
        self.random = random.Random(seed)  # the controller's own: requests' streams stay theirs
        self.buckets: dict[int, _Bucket] = {}

    def choose(self, num_decoding: int) -> bool:
        """Whether a decode-only step of `num_decoding` sequences drafts: an arm not yet known
        is played first (drafting first), then the higher of two Thompson draws."""
        bucket = self._bucket(num_decoding)
        if not bucket.draft.known:
            return True
        if not bucket.plain.known:
            return False
        return self._draw(bucket.draft) > self._draw(bucket.plain)

    def drafting_clearly_wins(self, num_decoding: int) -> bool:
        """Whether drafting's rate leads plain steps' by `_CLEAR` standard errors: what a step
        that also computes prompt tokens goes by (it is not measured, so it does not explore)."""
        bucket = self._bucket(num_decoding)
        if not (bucket.draft.known and bucket.plain.known):
            return False
        error = math.hypot(bucket.draft.standard_error, bucket.plain.standard_error)
        return bucket.draft.rate - bucket.plain.rate > _CLEAR * error

    def observe(self, num_decoding: int, drafted: bool, num_tokens: int, seconds: float) -> None:
        """A finished decode-only step: it drafted or not, gave its `num_decoding` sequences
        `num_tokens` tokens and took `seconds` in all. Ages the bucket's past by one step."""
        if num_decoding <= 0 or seconds <= 0:
            return
        bucket = self._bucket(num_decoding)
        for stats in (bucket.draft, bucket.plain, bucket.plain_times):
            stats.decay(self.decay)
        if not drafted:
            bucket.plain_times.add(num_decoding, seconds)
        scaled = seconds * bucket.plain_times.scale(num_decoding, bucket.reference)
        (bucket.draft if drafted else bucket.plain).add(num_tokens / num_decoding, scaled)

    def break_even_drafts(self, num_decoding: int) -> float | None:
        """Accepted drafts per tree at which one sequence's drafting pays at this batch size, or
        None until both arms are known. Its share of a drafting step's extra time, (T_draft -
        T_plain) / B, must buy tokens at the drafting step's own rate, (1 + a) B / T_draft
        (a: accepted drafts per sequence): (1 - T_plain / T_draft)(1 + a). The bucket's measured
        a stands in for the batch's; alone in its batch, where drafting pays on average, the
        price is thus a little above the exact T_draft / T_plain - 1."""
        bucket = self._bucket(num_decoding)
        draft, plain = bucket.draft, bucket.plain
        if not (draft.known and plain.known):
            return None
        extra_time = 1.0 - plain.mean_seconds / draft.mean_seconds
        return max(0.0, extra_time) * draft.tokens / draft.weight

    def rates(self, num_decoding: int) -> tuple[float | None, float | None]:
        """(drafting, plain) tokens per sequence per second, at the smallest batch size of this
        one's bucket; None if unknown."""
        bucket = self._bucket(num_decoding)
        return tuple(arm.rate if arm.known else None for arm in (bucket.draft, bucket.plain))

    def _draw(self, arm: _Arm) -> float:
        return self.random.gauss(arm.rate, arm.standard_error)

    def _bucket(self, num_decoding: int) -> _Bucket:
        low, _ = batch_bucket(num_decoding)
        if low not in self.buckets:
            self.buckets[low] = _Bucket(low, _Arm(), _Arm(), _PlainTimes())
        return self.buckets[low]
