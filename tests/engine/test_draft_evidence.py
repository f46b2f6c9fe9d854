"""Per-sequence evidence: a sequence whose drafts keep failing pauses, for longer at each failed
retry, and drafts again once a retry is accepted; the others are not affected."""

from __future__ import annotations

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


def test_failing_drafts_pause_a_sequence_with_growing_pauses_and_success_resumes():
    evidence, seq, other = DraftEvidence(), bare_sequence(1), bare_sequence(2)
    assert evidence.may_draft(seq)
    evidence.observe(seq, 0)
    assert evidence.may_draft(seq)  # one failure is not a pattern
    evidence.observe(seq, 0)
    assert not evidence.may_draft(seq)
    assert evidence.may_draft(other)  # the rest of the batch drafts on
    pauses = []
    for _ in range(6):
        pauses.append(decode_until_it_may_draft(evidence, seq))
        evidence.observe(seq, 0)  # the retry fails too
    assert pauses == [4, 8, 16, 32, 64, 64]
    decode_until_it_may_draft(evidence, seq)
    evidence.observe(seq, 2)  # a retry whose drafts are accepted
    assert evidence.may_draft(seq)
    failures = 0
    while evidence.may_draft(seq):
        evidence.observe(seq, 0)
        failures += 1
    assert failures <= 4  # a success weighs for a few trees, no more
    assert decode_until_it_may_draft(evidence, seq) == 4  # the pauses start over


def test_drafts_that_are_often_accepted_never_pause():
    evidence, seq = DraftEvidence(), bare_sequence(3)
    for accepted in [1, 0, 2, 0, 0, 1, 0, 1] * 10:
        evidence.observe(seq, accepted)
        assert evidence.may_draft(seq)
