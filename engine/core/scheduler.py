"""Scheduler: continuous batching over a waiting queue and a running list, within a token budget.

Prefill and decode are one thing here: each step a sequence computes the tokens that still lack K/V
(its whole prompt chunk by chunk, or its one newest token). Running sequences go first, in arrival
order; when blocks run out the newest running sequence is preempted (its blocks freed, to be
recomputed later). New sequences are admitted only in a step that preempted nobody.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager, CachedPrefix
from engine.core.request import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes, from seq.num_computed_tokens on
    num_lookahead: int = 0  # scratch positions reserved after them for a draft tree
    decoding: bool = False  # one new token after a computed context: a tree could grow from it

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits yield a new token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the pass
    num_cache_queried_tokens: int = 0
    num_cache_hit_tokens: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_lookahead for s in self.scheduled)

    @property
    def num_new_tokens(self) -> int:
        """Tokens the pass computes before any draft tree is added."""
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, num_lookahead_tokens: int = 0
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.num_lookahead_tokens = num_lookahead_tokens  # what a drafter needs per decode step
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """Insert a forked sibling right after its parent, keeping arrival order."""
        self.running.insert(self.running.index(after) + 1, seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End `seq` (stopped, length or aborted) and free its blocks at once."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def decoding_sequences(self) -> list[Sequence]:
        """The running sequences whose next step decodes one token after a computed context."""
        return [seq for seq in self.running if _decodes(seq)]

    def prompts_pending(self) -> bool:
        """Whether the next step is likely to compute prompt tokens: a running sequence's prompt
        is not all computed, or the first waiting one has a free slot (its blocks unchecked)."""
        if any(seq.num_tokens - seq.num_computed_tokens > 1 for seq in self.running):
            return True
        if not self.waiting:
            return False
        num_seqs = sum(self._num_seqs(seq) for seq in self.running)
        return num_seqs + self._num_seqs(self.waiting[0]) <= self.max_num_seqs

    def schedule(self, drafts: Container[int] | None = None) -> SchedulerOutput:
        """The step's sequences and chunks. Decoding sequences whose id is in `drafts` (every one,
        if None) get draft scratch, within the budget; the others are scheduled as plain decoding
        schedules them, so a step that does not draft leaves that budget to prompt chunks."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        for seq in list(self.running):
            if budget == 0 or seq in preempted:
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            decoding = _decodes(seq)
            drafts_here = decoding and (drafts is None or seq.seq_id in drafts)
            lookahead = self._lookahead(seq, budget) if drafts_here else 0
            num_tokens = seq.num_computed_tokens + num_new + lookahead
            if not self._make_room(seq, num_tokens, preempted):
                break
            copies += self.block_manager.allocate(seq, num_tokens)
            scheduled.append(ScheduledSequence(seq, num_new, lookahead, decoding))
            budget -= num_new + lookahead
        queried = hits = 0
        num_seqs = sum(self._num_seqs(seq) for seq in self.running)
        while not preempted and self.waiting and budget:
            seq = self.waiting[0]
            if num_seqs + self._num_seqs(seq) > self.max_num_seqs:
                break
            cached = self._cached_prefix(seq)
            num_new = min(seq.num_tokens - cached.num_tokens, budget)
            if num_new < seq.num_tokens - cached.num_tokens and not self.enable_chunked_prefill:
                break
            if not self.block_manager.can_allocate(seq, cached.num_tokens + num_new, cached):
                break
            self.waiting.popleft()
            copies += self.block_manager.allocate(seq, cached.num_tokens + num_new, cached)
            seq.reset_computed(cached.num_tokens)
            if seq.num_output_tokens == 0:  # a first admission, not a recompute
                seq.request.metrics.num_cached_tokens = cached.num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            queried, hits = queried + seq.num_tokens, hits + cached.num_tokens
            num_seqs += self._num_seqs(seq)
        return SchedulerOutput(scheduled, preempted, copies, queried, hits)

    def _lookahead(self, seq: Sequence, budget: int) -> int:
        """Draft scratch for a decoding sequence, within its token cap and the step's budget."""
        room = seq.request.max_total_tokens - seq.num_tokens
        return max(0, min(self.num_lookahead_tokens, room, budget - 1))

    @staticmethod
    def _num_seqs(seq: Sequence) -> int:
        """`seq` and the choices of its request that will fork from it after its prefill."""
        return 1 + seq.request.num_pending_choices

    def _cached_prefix(self, seq: Sequence) -> CachedPrefix:
        if seq.num_computed_tokens:  # a sequence keeps its own blocks; only fresh ones look up
            return CachedPrefix()
        return self.block_manager.find_cached_prefix(seq)

    def _make_room(self, seq: Sequence, num_tokens: int, preempted: list[Sequence]) -> bool:
        """Preempt the newest running sequences until `seq` fits; False if `seq` itself went."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it first in line; it will recompute its tokens."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_computed()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _decodes(seq: Sequence) -> bool:
    """Its next step computes one token after a computed context: it decodes (and may draft)."""
    return seq.num_tokens - seq.num_computed_tokens == 1
