"""The drafter protocol through which the engine step speculates.

A drafter proposes draft tokens for the scheduled sequences before the target's verify pass. Plain
autoregressive decoding is the drafter that proposes nothing: the verify pass then samples exactly
one token per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class DraftProposals:
    """Draft tokens per sequence id (empty: no speculation this step)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


class Drafter(Protocol):
    def propose(self, batch: SchedulerOutput) -> DraftProposals:
        """Draft tokens for the sequences of `batch` that sample this step (changes no sequence)."""
        ...


class AutoregressiveDrafter:
    """Proposes nothing: every step yields one token per sampling sequence."""

    def propose(self, batch: SchedulerOutput) -> DraftProposals:
        return DraftProposals()
