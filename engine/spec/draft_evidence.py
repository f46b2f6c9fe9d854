"""DraftEvidence: per sequence, whether its own drafts have been paying, so that a request whose
drafts keep failing (code, another language, an unusual style) stops drafting while the rest
of its batch goes on, and tries again later.

Each sequence keeps a running mean of the drafts the target accepted per verified tree (the
newest tree weighing `_WEIGHT`). Below `_THRESHOLD` the sequence pauses for a number of its
decode steps, 4 at first, doubling at each failed retry up to 64; a retry that is accepted
resumes drafting and resets the pause. A paused sequence decodes plainly, which is always
lossless: this changes only which steps draft, never what the target emits.
"""

from __future__ import annotations

from dataclasses import dataclass
from weakref import WeakKeyDictionary

from engine.core.request import Sequence

_THRESHOLD = 0.3  # accepted drafts per verified tree below which a sequence pauses
_WEIGHT = 0.25  # of the newest tree in the running mean
_PRIOR = 0.5  # a new sequence's mean: two trees with nothing accepted pause it
_FIRST_PAUSE, _MAX_PAUSE = 4, 64  # decode steps


@dataclass
class _Record:
    accepted: float = _PRIOR  # running mean of accepted drafts per verified tree
    pause: int = 0  # the latest pause's length (0: not paused since its last success)
    resume_at: int = 0  # the sequence's decode step from which it may draft again


class DraftEvidence:
    def __init__(self) -> None:
        self.records: WeakKeyDictionary[Sequence, _Record] = WeakKeyDictionary()

    def may_draft(self, seq: Sequence) -> bool:
        record = self.records.get(seq)
        return record is None or seq.num_decode_steps >= record.resume_at

    def observe(self, seq: Sequence, num_accepted: int) -> None:
        """`seq`'s verified tree had `num_accepted` of its drafts accepted."""
        record = self.records.setdefault(seq, _Record())
        if record.pause:  # a retry after a pause: its own outcome decides
            record.accepted = max(record.accepted, _THRESHOLD)
        record.accepted += _WEIGHT * (num_accepted - record.accepted)
        if record.accepted >= _THRESHOLD:
            record.pause = 0
            return
        record.pause = min(_MAX_PAUSE, max(_FIRST_PAUSE, 2 * record.pause))
        record.resume_at = seq.num_decode_steps + record.pause
