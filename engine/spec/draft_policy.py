"""DraftPolicy: the engine's speculation decisions, made as each step is planned and drafted.

Three parts, each with one job: DraftEvidence says which sequences' own drafts have been paying
(engine/spec/draft_evidence.py); DraftController says whether the step drafts for them, from
measured whole steps (engine/spec/draft_controller.py), before the step is scheduled; DraftBudget
says which of the drafted nodes are worth verifying (engine/spec/draft_budget.py). The engine
reports each finished step back through `observe_step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Sequence
from engine.spec.draft_budget import DraftBudget
from engine.spec.draft_controller import DraftController
from engine.spec.draft_evidence import DraftEvidence


@dataclass(frozen=True)
class StepReport:
    """A finished step, for `DraftPolicy.observe_step`."""

    seconds: float  # the whole step
    pass_seconds: float  # its target pass
    num_pass_tokens: int  # tokens of that pass (scheduled tokens and verified draft nodes)
    num_decoding: int  # decoding sequences (prefill chunks aside)
    prefilled: bool  # it also computed prompt tokens
    num_tokens: int  # tokens the step gave the decoding sequences (accepted drafts + bonus)
    trees: list[tuple[Sequence, float, int]]  # per verified tree: seq, expected, accepted drafts


@dataclass
class DraftPolicy:
    budget: DraftBudget
    controller: DraftController = field(default_factory=DraftController)
    evidence: DraftEvidence = field(default_factory=DraftEvidence)
    drafted: bool = False  # whether the current step drafts (set by `plan`)

    def plan(self, decoding: list[Sequence], prompts_pending: bool) -> set[int]:
        """The ids of the `decoding` sequences the next step drafts for, decided before it is
        scheduled (a plain step then reserves no draft scratch): none if no sequence's evidence
        allows it or the controller chooses a plain step. A step that is likely to compute
        prompt tokens as well drafts only on a clear verdict (such steps are not measured)."""
        eligible = {seq.seq_id for seq in decoding if self.evidence.may_draft(seq)}
        self.drafted = bool(eligible) and (
            self.controller.drafting_clearly_wins(len(decoding))
            if prompts_pending
            else self.controller.choose(len(decoding))
        )
        return eligible if self.drafted else set()

    def observe_step(self, step: StepReport) -> None:
        """What the step took and gave: every part learns its share. Steps that also computed
        prompt tokens are not weighed by the controller (their time is mostly the prompt's)."""
        self.budget.observe_verify(step.num_pass_tokens, step.pass_seconds)
        if step.trees:
            self.budget.observe_acceptance(
                sum(expected for _, expected, _ in step.trees),
                sum(accepted for _, _, accepted in step.trees),
            )
            break_even = self.controller.break_even_drafts(step.num_decoding)
            for seq, _, accepted in step.trees:
                self.evidence.observe(seq, accepted, break_even)
        elif self.drafted:
            self.budget.observe_nothing_verified()
        if step.num_decoding and not step.prefilled:
            self.controller.observe(step.num_decoding, self.drafted, step.num_tokens, step.seconds)
        self.drafted = False
