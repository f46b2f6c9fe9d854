"""Per-sequence evidence: a sequence whose drafts clearly fail to pay pauses, for longer at each
failed retry, and drafts on once its drafts pay again; the others are not affected."""

from __future__ import annotations

import random

from engine.core.request import Sequence
from engine.spec.draft_evidence import DraftEvidence


def bare_sequence(seq_id: int) -> Sequence:
    return Sequence(seq_id, None, 0, [5, 6, 7], 3, None)


def decode_until_it_may_draft(evidence: DraftEvidence, seq: Sequence) -> int:
    """Plain decode steps until `seq` may draft again."""
    steps = 0
    while not evidence.may_draft(seq):
        seq.num_decode_steps += 1
        steps += 1
    return steps


def accepted_drafts(rng: random.Random, none: float, one: float) -> int:
    """A tree's accepted drafts: 0 with probability `none`, 1 with `one`, else 2."""
    u = rng.random()
    return 0 if u < none else 1 if u < none + one else 2


def fail_until_paused(evidence: DraftEvidence, seq: Sequence) -> int:
    """Trees with no draft accepted until `seq` pauses."""
    trees = 0
    while evidence.may_draft(seq):
        evidence.observe(seq, 0)
        trees += 1
    return trees


def test_failing_drafts_pause_a_sequence_with_growing_pauses_and_success_resumes():
    evidence, seq, other = DraftEvidence(), bare_sequence(1), bare_sequence(2)
    evidence.observe(seq, 0)
    assert evidence.may_draft(seq)  # one failure is not a pattern
    assert 2 <= fail_until_paused(evidence, seq) <= 6
    assert evidence.may_draft(other)  # the rest of the batch drafts on
    pauses = []
    for _ in range(6):
        pauses.append(decode_until_it_may_draft(evidence, seq))
        assert fail_until_paused(evidence, seq) == 1  # the retry fails too: the same evidence
    assert pauses == [4, 8, 16, 32, 64, 64]
    decode_until_it_may_draft(evidence, seq)
    evidence.observe(seq, 2)  # a retry whose drafts are accepted
    assert evidence.may_draft(seq)  # lifts the failures' evidence out of clear
    for _ in range(16):
        evidence.observe(seq, 2)  # and more: the mean is back above the break-even
        assert evidence.may_draft(seq)
    fail_until_paused(evidence, seq)
    assert decode_until_it_may_draft(evidence, seq) == 4  # the pauses start over


def test_drafts_that_are_often_accepted_never_pause():
    evidence, seq = DraftEvidence(), bare_sequence(3)
    for accepted in [1, 0, 2, 0, 0, 1, 0, 1] * 10:
        evidence.observe(seq, accepted)
        assert evidence.may_draft(seq)


def test_the_break_even_decides_whether_weak_drafts_pause():
    """One draft accepted in five trees pays where drafting costs little (one request on a CPU)
    and does not where it costs much (a large batch)."""
    cheap, costly = DraftEvidence(), DraftEvidence()
    seq, other = bare_sequence(4), bare_sequence(5)
    paused = {"cheap": 0, "costly": 0}
    for accepted in [1, 0, 0, 0, 0] * 16:
        for name, evidence, s, break_even in [
            ("cheap", cheap, seq, 0.05),
            ("costly", costly, other, 0.5),
        ]:
            if evidence.may_draft(s):
                evidence.observe(s, accepted, break_even)
            else:
                paused[name] += 1
            s.num_decode_steps += 1
    assert paused["cheap"] == 0
    assert paused["costly"] >= 40


def test_chance_runs_of_failed_trees_do_not_pause_a_paying_sequence():
    """Trees of a paying sequence (0, 1 or 2 drafts accepted, mean 0.6) include runs of several
    failures; against a break-even of 0.25 they never pause it."""
    rng = random.Random(0)
    evidence, seq = DraftEvidence(), bare_sequence(6)
    for _ in range(2000):
        evidence.observe(seq, accepted_drafts(rng, 0.55, 0.30), break_even=0.25)
        assert evidence.may_draft(seq)


def test_a_sequence_clearly_below_the_break_even_is_paused_on_most_steps():
    """Drafts worth 0.15 a tree against a break-even of 0.5 (a large batch): once the evidence
    is clear, the sequence drafts on few of its steps."""
    rng = random.Random(1)
    evidence, seq = DraftEvidence(), bare_sequence(7)
    paused = 0
    for _ in range(4000):
        if evidence.may_draft(seq):
            evidence.observe(seq, accepted_drafts(rng, 0.87, 0.11), break_even=0.5)
        else:
            paused += 1
        seq.num_decode_steps += 1
    assert paused > 0.9 * 4000
