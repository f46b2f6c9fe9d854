"""DraftEvidence: per sequence, whether its own drafts have been paying, so that a request whose
drafts keep failing (code, another language, an unusual style) stops drafting while the rest
of its batch goes on, and tries again later.

The break-even is what the draft controller measures for the batch size: the accepted drafts
per tree that pay for a sequence's share of a drafting step's extra time (`_DEFAULT_BREAK_EVEN`
until it knows). Each sequence keeps discounted sums over its verified trees (the past weighing
half as much every `_HALF_LIFE` trees). It pauses only when failing is clear: its mean accepted
drafts per tree, plus `_CLEAR` standard errors, below the break-even (a tree's variance taken as
at least `_VARIANCE_FLOOR`, so that a few alike trees prove little). A pause lasts 4 of its
decode steps, doubling at each consecutive pause up to 64; the tree it then drafts joins the
same evidence, so good trees soon lift it out, and a mean back at the break-even resets the
doubling. A paused sequence decodes plainly, which is always lossless: this changes only which
steps draft, never what the target emits.

Simulated (tests/engine/test_draft_evidence.py), a sequence whose mean is above the break-even
is almost never paused, chance runs of failed trees included, and one clearly below it is paused
on nine steps in ten and more; one that never gets a draft accepted pauses after
`_CLEAR ** 2 * _VARIANCE_FLOOR / break_even ** 2` trees: the more drafting costs, the sooner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from engine.core.request import Sequence

_DEFAULT_BREAK_EVEN = 0.3  # accepted drafts per verified tree, before the controller knows
_HALF_LIFE = 32  # trees: the evidence follows a sequence whose text changes
_DECAY = 0.5 ** (1.0 / _HALF_LIFE)  # per tree
_VARIANCE_FLOOR = 0.1  # of a tree's accepted drafts
_CLEAR = 2.0  # standard errors under the break-even that make failing clear
_FIRST_PAUSE, _MAX_PAUSE = 4, 64  # decode steps


@dataclass
class _Record:
    """Discounted sums over the sequence's verified trees, and its pause."""

    trees: float = 0.0
    accepted: float = 0.0  # accepted drafts
    accepted2: float = 0.0  # their squares
    pause: int = 0  # the latest pause's length (0: none since its drafts last paid)
    resume_at: int = 0  # the sequence's decode step from which it may draft again

    def add(self, num_accepted: int) -> None:
        self.trees = self.trees * _DECAY + 1.0
        self.accepted = self.accepted * _DECAY + num_accepted
        self.accepted2 = self.accepted2 * _DECAY + num_accepted * num_accepted

    @property
    def mean(self) -> float:
        return self.accepted / self.trees

    def clearly_below(self, break_even: float) -> bool:
        variance = max(_VARIANCE_FLOOR, self.accepted2 / self.trees - self.mean**2)
        return self.mean + _CLEAR * math.sqrt(variance / self.trees) < break_even


class DraftEvidence:
    def __init__(self) -> None:
        self.records: WeakKeyDictionary[Sequence, _Record] = WeakKeyDictionary()

    def may_draft(self, seq: Sequence) -> bool:
        record = self.records.get(seq)
        return record is None or seq.num_decode_steps >= record.resume_at

    def observe(self, seq: Sequence, num_accepted: int, break_even: float | None = None) -> None:
        """`seq`'s verified tree had `num_accepted` of its drafts accepted; below `break_even`
        accepted drafts per tree (None: `_DEFAULT_BREAK_EVEN`) its drafting does not pay."""
        threshold = _DEFAULT_BREAK_EVEN if break_even is None else break_even
        record = self.records.setdefault(seq, _Record())
        record.add(num_accepted)
        if record.clearly_below(threshold):
            record.pause = min(_MAX_PAUSE, max(_FIRST_PAUSE, 2 * record.pause))
            record.resume_at = seq.num_decode_steps + record.pause
        elif record.mean >= threshold:
            record.pause = 0
