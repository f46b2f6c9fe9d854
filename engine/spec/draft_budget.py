"""DraftBudget: how many draft tokens a step verifies, across the whole batch, so that speculation
never makes decoding slower.

A draft node's value v is the draft's log-estimate that the target accepts its whole path, so
c * exp(v) is the number of tokens the node is expected to add; the calibration c (tokens accepted
over tokens expected, measured as the engine runs) corrects a head that is over- or
under-confident. A step with B decoding sequences and T0 scheduled tokens (their roots, plus any
prefill chunks) that verifies N draft nodes emits B + E(N) tokens, E(N) the sum of the N values
kept, in cost(T0 + N) + L(E(N)) seconds: the verify cost measured at start-up
(execution/verify_cost.py), scaled by how long the real passes take against it, plus L, what the
lm_head spends on the nodes: the extra rows in the pass's own lm_head call where that is cheaper
than a call of the acceptance walks (`node_logits_with_pass`, the runner's rule too), else the
walks' calls over the rows of the nodes they accept (the lm_head's cost by rows is measured too).
The budget keeps the N nodes of highest value across all sequences, with N maximising that rate;
N = 0 is plain decoding. A child's value never exceeds its parent's, so each sequence's kept nodes
form a tree.

Drafting costs time too, spent before the values are known. So before drafting, the budget decides
whether the step drafts at all. A step that also computes prompt tokens (prefill chunks beside
the decodes) drafts only where the realized rates say clearly that drafting wins at its batch
size: such steps are left out of those rates (their time is mostly the prompt's), so a loss
there would go unseen, and a probe there verifies trees beside the chunk in a pass no longer
bound by reading weights (16 requests started at once, benchmarks/bench_engine.py: 14 probes
at 317.5 ms of verify each against a plain step's 72.2 before this rule, 6 at 49.7 ms after).
Otherwise, what it goes by, first to last:
- a probe: after `probe_interval` plain steps it drafts anyway, so the estimates follow the traffic
  and the realized rates soon have the drafting steps they need for a verdict. (16 apart, at one
  sequence the cost model's early estimates, pessimistic from probes that paid for a plain
  stretch's catch-up, kept the engine plain for some 270 steps where drafting won 1.4x);
- the realized rates (engine/spec/realized_rates.py): per batch-size bucket, the tokens per sequence
  per second that recent drafting steps and recent plain steps have actually delivered, whole
  steps both; once 4 plain steps and 16 drafting steps have been seen (at one sequence; from 4
  sequences up 4 drafting steps, as each averages over its sequences) and their rates stand two
  standard errors apart, the faster kind is chosen (a bucket that drafts takes a plain step
  every 32 drafting decisions once drafting has won there, every 4 to 32 while it drafts on a
  lead alone, the larger the lead the further apart, to keep its comparison fresh); while they
  stand closer than that,
  drafting only where its recent rate leads by 5% (probes going on as before: only a clear loss
  backs them off);
- until then, the cost model's prediction of both rates for the step's batch, from the recent
  value curve (the mean calibrated value of each sequence's m-th best node, averaged over recent
  steps) and the drafting cost fitted against the number of sequences. That cost is measured on
  whole steps: the time a drafting step spends outside its target pass, less what a plain step
  of as many sequences spends there (fitted the same way; until a plain step is seen, nothing is
  subtracted). So it holds everything speculation adds around the pass (the head's catch-up and
  drafting, the trees' attention masks, the acceptance walk, moving accepted K/V).
The model alone was right on average but not at every batch size, and a small error decided every
step: optimistic at 4 sequences, it drafted on 158 of 190 steps at 0.83x plain decoding's speed;
pessimistic after a few early probes at 1, it backed its probes off and never drafted again.
Probes stay `probe_interval` apart until the realized rates show drafting behind at the batch
size. Behind within the noise, they come 4 times as far apart, or further where the time its
steps lose (their seconds less what plain steps would take for their tokens) is over 1% of that
many plain steps'. Clearly behind, they back off so that
they cost at most 1% of decoding time (what a drafting step has recently taken beyond a plain one
there, its drafting, larger pass and acceptance walk, over 1% of a plain step; at least
`probe_interval` and at most 256 steps). On plain steps the head
catches up on the decoding sequences' new tokens only every 32nd step, in one batch, so that a
mostly plain engine costs next to nothing over plain decoding.

Which nodes are verified depends only on the drafts, never on the target's answer, so the
acceptance rule stays lossless.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from engine.execution.verify_cost import VerifyCost, node_logits_with_pass
from engine.spec.realized_rates import RealizedRates

_DECAY = 0.95  # weight of the past in the running estimates, per observation (the values: per step)
_MAX_SCALE = 4.0  # the start-up measurement is trusted to within this factor
_MAX_PROBE_INTERVAL = 256  # plain steps
_PROBE_SHARE = 0.01  # of decoding time, spent on probes whose drafts do not pay
_TRAILING_PROBE_FACTOR = 4  # probes this many times further apart while drafting trails
# Plain steps between the head's catch-ups: each costs a few milliseconds, mostly fixed overhead,
# so rarer and larger ones cost less (every 8th step, they were two thirds of a plain step's
# drafting overhead at batch 1).
_CATCH_UP_EVERY = 32


@dataclass(frozen=True)
class StepOutcome:
    """What a finished step took and gave, for `DraftBudget.observe_step`."""

    seconds: float  # the whole step
    pass_seconds: float  # its target pass
    num_decoding: int  # decoding sequences (prefill chunks aside)
    prefilled: bool  # whether it also computed prompt tokens
    num_tokens: int = 0  # tokens the pass gave the decoding sequences (accepted drafts + bonus)


class DraftBudget:
    def __init__(self, verify_cost: VerifyCost, probe_interval: int = 4) -> None:
        self.verify_cost = verify_cost
        self.probe_interval = probe_interval
        self.interval = probe_interval  # the current wait between probes
        self.probing = False  # this step drafts to refresh the estimates, not by prediction
        self.verify_scale = 1.0  # real passes' time over the start-up measurement's
        # decayed sums behind the calibration, from a prior of 4 tokens accepted as expected,
        # so that one unlucky early probe cannot halve it
        self.expected, self.accepted = 4.0, 4.0
        self.value_curve: np.ndarray | None = None  # [M] mean exp(value) of the m-th best node
        self.draft_fit = (0.0, 0.0)  # seconds of drafting = a + b * sequences
        self.draft_times: deque[tuple[int, float]] = deque(maxlen=64)  # (sequences, seconds)
        # plain steps' seconds outside their pass: (sequences, seconds)
        self.plain_times: deque[tuple[int, float]] = deque(maxlen=64)
        self.drafted_sequences = 0  # sequences this step drafted for (set by `allocate`)
        self.plain_steps = 0  # steps decoded plainly since the last draft
        self.skipped_steps = 0  # plain steps between the last two drafts
        self.realized = RealizedRates()  # what drafting and plain steps have really delivered
        self.decision: bool | None = None  # this step's choice (None: nobody could draft)

    @property
    def plain_fit(self) -> tuple[float, float]:
        """A plain step's seconds outside its pass = a + b * sequences ((0, 0) before any):
        fitted only when a drafting step is weighed against it, not on every plain step."""
        return _fit_line(self.plain_times) if self.plain_times else (0.0, 0.0)

    @property
    def calibration(self) -> float:
        return min(2.0, max(0.05, self.accepted / self.expected))

    # ------------------------------------------------------------------ decisions
    def should_draft(self, num_decoding: int, num_pass_tokens: int) -> bool:
        """Whether this step drafts for its `num_decoding` sequences (of `num_pass_tokens`
        scheduled tokens): a probe when one is due; else what the realized rates of both kinds
        of step say at this batch size, once known; else what the cost model predicts."""
        if num_decoding == 0:
            return False
        drafts = self._choose(num_decoding, num_pass_tokens)
        if drafts and not self.probing:  # if plain steps follow, probe soon
            self.interval = self.probe_interval
        self.realized.decided(num_decoding, drafts)
        self.decision = drafts
        if drafts:
            self.skipped_steps, self.plain_steps = self.plain_steps, 0
        else:
            self.plain_steps += 1
        return drafts

    def _choose(self, num_decoding: int, num_pass_tokens: int) -> bool:
        if num_pass_tokens > num_decoding:  # prompt tokens ride along (more than the roots)
            return self.realized.drafting_wins(num_decoding) is True
        if self.value_curve is None or self.plain_steps >= self.interval:
            self.probing = True
            return True
        wins = self.realized.drafting_wins(num_decoding)
        if wins is None:  # too close to call, or too few steps seen
            wins = self.realized.drafting_leads(num_decoding)
        if wins is None:
            wins = self._predicted_to_win(num_decoding, num_pass_tokens)
        return wins and not self.realized.plain_probe_due(num_decoding)

    def _predicted_to_win(self, num_decoding: int, num_pass_tokens: int) -> bool:
        """The cost model's view: trees of the same size for every sequence (1, 2, ... M nodes)
        against plain decoding."""
        gain = self.value_curve.cumsum()  # [M] expected tokens of a sequence's m best nodes
        nodes = np.arange(1, len(gain) + 1)  # [M]
        accepted = num_decoding * self.calibration * gain  # [M] expected accepted drafts
        drafted_rate = self._drafted_rate(
            num_decoding, accepted, num_decoding * nodes, num_pass_tokens
        ).max(initial=0.0)
        return drafted_rate > self._plain_rate(num_decoding, num_pass_tokens)

    def allocate(self, values: torch.Tensor, num_pass_tokens: int) -> list[int]:
        """Draft nodes to verify per sequence. values: [B, M] path log-probabilities of each
        sequence's candidates, best first (-inf where a sequence may not keep more)."""
        probs = values.exp()  # [B, M]
        self._observe_values(probs)
        batch, width = probs.shape
        self.drafted_sequences = batch
        flat = probs.flatten() * self.calibration  # [B * M]
        order = flat.argsort(descending=True, stable=True)  # a row's nodes stay in rank order
        order = order[flat[order] > 0]  # [K] the nodes that may be kept
        expected = np.concatenate([[0.0], flat[order].cumsum(0).numpy()])  # [K + 1] E(N)
        num_nodes = np.arange(len(expected))  # [K + 1] N
        rate = (batch + expected) / (
            self._seconds(num_pass_tokens + num_nodes)
            + self._walk_seconds(expected, batch, num_nodes)
        )
        best = int(rate.argmax())  # the first maximum: ties go to fewer nodes
        counts = torch.bincount(order[:best] // width, minlength=batch)
        if self.probing:
            self.probing = False
            self.interval = self._next_probe_interval(batch, num_pass_tokens)
        return counts.tolist()

    def _next_probe_interval(self, num_sequences: int, num_pass_tokens: int) -> int:
        """Plain steps until the next probe at this batch size: backed off all the way once
        drafting is known to lose here; while it merely trails, `_TRAILING_PROBE_FACTOR` times
        as far apart (within the noise, probes every few steps would draft a fifth of the time
        at a loss), or further where what its steps lose would cost more than `_PROBE_SHARE`
        of the time; else `probe_interval`."""
        if self.realized.drafting_wins(num_sequences) is False:
            # a probe's cost: its drafting, or all that drafting steps have really taken beyond
            # a plain step here (their larger pass and walk too), their tokens not counted, so
            # that the probes of a batch size where drafting is clearly dear stay rare
            realized = self.realized.extra_seconds(num_sequences) or 0.0
            extra = max(self._draft_seconds(num_sequences), realized)
            return self._probe_wait(extra, num_pass_tokens)
        if self.realized.drafting_leads(num_sequences) is False:
            lost = self.realized.lost_seconds(num_sequences) or 0.0
            trailing = _TRAILING_PROBE_FACTOR * self.probe_interval
            return max(trailing, self._probe_wait(lost, num_pass_tokens))
        return self.probe_interval

    def _probe_wait(self, probe_cost: float, num_pass_tokens: int) -> int:
        """Plain steps between probes that cost `probe_cost` seconds each beyond what they
        deliver, so that they take `_PROBE_SHARE` of the time (a plain step: its pass)."""
        steps = probe_cost / (_PROBE_SHARE * self._seconds(num_pass_tokens))
        return int(min(_MAX_PROBE_INTERVAL, max(self.probe_interval, math.ceil(steps))))

    def head_catch_up_due(self) -> bool:
        """Whether this plain step should run the head over the decoding sequences' new tokens
        (it keeps their K/V complete for the prefix cache and for the next draft)."""
        return self.plain_steps % _CATCH_UP_EVERY == 0

    # ------------------------------------------------------------------ observations
    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        ratio = seconds / max(self.verify_cost(num_tokens), 1e-9)
        scale = _DECAY * self.verify_scale + (1 - _DECAY) * ratio
        self.verify_scale = min(_MAX_SCALE, max(1 / _MAX_SCALE, scale))

    def observe_step(self, step: StepOutcome) -> None:
        """A finished step. Its tokens and seconds go to the realized rates of its kind. A
        drafting step's seconds outside its pass, less what a plain step of as many sequences
        spends there on average (its share of the head's catch-ups included), are its drafting
        cost. Steps that also prefilled are left out: the head's prefill of the prompt would
        count as drafting."""
        decision, self.decision = self.decision, None
        drafted, self.drafted_sequences = self.drafted_sequences, 0
        if step.prefilled or not step.num_decoding:
            return
        if decision is not None:
            self.realized.record(decision, step.num_decoding, step.num_tokens, step.seconds)
        outside_pass = step.seconds - step.pass_seconds
        if not drafted:
            self.plain_times.append((step.num_decoding, outside_pass))
            return
        # Before any plain step nothing is subtracted (plain steps follow if that is too dear).
        plain = _line(self.plain_fit, step.num_decoding)
        self.observe_draft(drafted, max(0.0, outside_pass - plain))

    def observe_draft(self, num_sequences: int, seconds: float) -> None:
        self.draft_times.append((num_sequences, seconds))
        self.draft_fit = _fit_line(self.draft_times)

    def observe_acceptance(self, expected: float, accepted: int) -> None:
        """Tokens the verified drafts were expected to add (sum of exp(value)), and added."""
        self.expected = _DECAY * self.expected + expected
        self.accepted = _DECAY * self.accepted + accepted

    # ------------------------------------------------------------------ estimates
    def _observe_values(self, probs: torch.Tensor) -> None:
        """The curve ages by step, not by draft: after a plain stretch its old part has aged by
        every step skipped, so a probe weighs as much as the drafts those steps would have been.
        (Aged by draft, one probe moved it by 5%, and an engine that had turned plain after a
        bad stretch stayed plain long after the drafts had turned good.)"""
        mean = probs.mean(0).numpy()  # [M]
        if self.value_curve is None or len(self.value_curve) != len(mean):
            self.value_curve = mean
        else:
            kept = _DECAY ** (1 + self.skipped_steps)
            self.value_curve = kept * self.value_curve + (1 - kept) * mean

    def _drafted_rate(self, num_sequences: int, accepted, num_nodes, num_pass_tokens: int):
        """Tokens per second of a step that drafts for `num_sequences`, verifies `num_nodes`
        nodes and accepts `accepted` of them (numbers, or arrays of the same shape). The measured
        drafting cost includes the acceptance walk."""
        seconds = self._seconds(num_pass_tokens + num_nodes) + self._draft_seconds(num_sequences)
        return (num_sequences + accepted) / seconds

    def _plain_rate(self, num_sequences: int, num_pass_tokens: int) -> float:
        return num_sequences / self._seconds(num_pass_tokens)

    def _seconds(self, num_tokens):
        """Seconds of a pass of `num_tokens` tokens (a number or an array) on this machine now."""
        return np.maximum(self.verify_cost(num_tokens) * self.verify_scale, 1e-9)

    def _walk_seconds(self, num_accepted, num_sampled: int, num_nodes):
        """Seconds the lm_head spends on draft nodes beyond the pass's sampled rows: their rows
        in the pass's own call where it brings them (`node_logits_with_pass`: a few rows cost
        about what one does), else the acceptance walk's calls over the `num_accepted` nodes it
        accepts (numbers or arrays), as if one: a batch's walks share one call per level."""
        logits = self.verify_cost.logits
        in_pass = logits(num_sampled + np.asarray(num_nodes)) - logits(num_sampled)
        walk = logits(num_accepted)
        with_pass = node_logits_with_pass(self.verify_cost, num_sampled, num_nodes, num_sampled)
        return np.where(with_pass, in_pass, walk) * self.verify_scale

    def _draft_seconds(self, num_sequences: int) -> float:
        return _line(self.draft_fit, num_sequences)


def _line(fit: tuple[float, float], num_sequences: int) -> float:
    intercept, slope = fit
    return intercept + slope * num_sequences


def _fit_line(samples: deque[tuple[int, float]]) -> tuple[float, float]:
    """Seconds against sequences, by least squares over recent steps (a + b * sequences)."""
    sizes = [b for b, _ in samples]
    times = [t for _, t in samples]
    mean_size, mean_time = sum(sizes) / len(sizes), sum(times) / len(times)
    spread = sum((b - mean_size) ** 2 for b in sizes)
    if spread < 1e-9:
        return mean_time, 0.0
    covariance = sum((b - mean_size) * (t - mean_time) for b, t in zip(sizes, times))
    slope = max(0.0, covariance / spread)
    return max(0.0, mean_time - slope * mean_size), slope


def expected_tokens(values: list[float]) -> float:
    """Tokens a tree's draft nodes are expected to add: the sum of exp(path value)."""
    return sum(math.exp(v) for v in values)
