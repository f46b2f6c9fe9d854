"""DraftBudget: once a step drafts, which draft nodes it verifies, across the whole batch.

A node's value v is the draft's log-estimate that the target accepts its whole path, so
c * exp(v) is the number of tokens it is expected to add; the calibration c (tokens accepted over
tokens expected, measured as the engine runs) corrects an over- or under-confident head; while
drafting steps verify nothing it drifts back toward its prior, so a head that recovers after a bad
stretch is verified again (the calibration only learns from verified trees). A step
of B decoding sequences and T0 scheduled tokens that verifies N nodes emits B + E(N) tokens,
E(N) the sum of the N best values, in cost(T0 + N) + L(E(N)) seconds: the pass's cost
(execution/verify_cost.py, start-up timings corrected by live passes) plus what the lm_head spends
on the nodes (the extra rows of the pass's own call where that is cheaper than the acceptance
walks' calls, `node_logits_with_pass`, else the walks' calls). The budget keeps the N nodes of
highest value with N maximising that rate; N = 0 verifies nothing. A child's value never exceeds
its parent's, so each sequence's kept nodes form a tree.

Whether a step drafts at all is the DraftController's choice (engine/spec/draft_controller.py),
made on measured whole steps; the budget's model only sizes the trees. Which nodes are verified
depends only on the drafts, never on the target's answer, so acceptance stays lossless.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.execution.verify_cost import LiveVerifyCost, VerifyCost, node_logits_with_pass

_DECAY = 0.95  # weight of the past in the calibration's sums, per observation
_PRIOR = 4.0  # tokens accepted as expected that the calibration starts from and drifts back to


class DraftBudget:
    def __init__(self, verify_cost: VerifyCost, learn: bool = True) -> None:
        self.verify_cost = verify_cost  # the start-up measurement (its lm_head part is used as is)
        # pass seconds, live passes preferred (learn=False: the start-up measurement as given)
        self.pass_cost = LiveVerifyCost(verify_cost, learn)
        # decayed sums behind the calibration, from a prior of tokens accepted as expected,
        # so that one unlucky early step cannot halve it
        self.expected, self.accepted = _PRIOR, _PRIOR

    @property
    def calibration(self) -> float:
        return min(2.0, max(0.05, self.accepted / self.expected))

    def allocate(self, values: torch.Tensor, num_pass_tokens: int) -> list[int]:
        """Draft nodes to verify per sequence. values: [B, M] path log-probabilities of each
        sequence's candidates, best first (-inf where a sequence may not keep more)."""
        probs = values.exp()  # [B, M]
        batch, width = probs.shape
        flat = probs.flatten() * self.calibration  # [B * M]
        order = flat.argsort(descending=True, stable=True)  # a row's nodes stay in rank order
        order = order[flat[order] > 0]  # [K] the nodes that may be kept
        expected = np.concatenate([[0.0], flat[order].cumsum(0).numpy()])  # [K + 1] E(N)
        num_nodes = np.arange(len(expected))  # [K + 1] N
        seconds = self.pass_cost(num_pass_tokens + num_nodes) + self._walk_seconds(
            expected, batch, num_nodes
        )
        rate = (batch + expected) / np.maximum(seconds, 1e-9)
        best = int(rate.argmax())  # the first maximum: ties go to fewer nodes
        counts = torch.bincount(order[:best] // width, minlength=batch)
        return counts.tolist()

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        """A live pass of `num_tokens` tokens took `seconds`."""
        self.pass_cost.observe(num_tokens, seconds)

    def observe_acceptance(self, expected: float, accepted: float) -> None:
        """Tokens the verified drafts were expected to add (sum of exp(value)), and added."""
        self.expected = _DECAY * self.expected + expected
        self.accepted = _DECAY * self.accepted + accepted

    def observe_nothing_verified(self) -> None:
        """A drafting step verified no node: no evidence on the head, so the calibration moves
        one observation's weight back toward its prior. Without this a collapsed calibration
        would keep every draft out and never learn again."""
        self.observe_acceptance((1 - _DECAY) * _PRIOR, (1 - _DECAY) * _PRIOR)

    def _walk_seconds(self, num_accepted, num_sampled: int, num_nodes):
        """Seconds the lm_head spends on draft nodes beyond the pass's sampled rows: their rows
        in the pass's own call where it brings them (`node_logits_with_pass`), else the
        acceptance walks' calls over the `num_accepted` nodes they accept (numbers or arrays),
        as if one: a batch's walks share one call per level. Scaled as live passes scale."""
        logits = self.verify_cost.logits
        in_pass = logits(num_sampled + np.asarray(num_nodes)) - logits(num_sampled)
        walk = logits(num_accepted)
        with_pass = node_logits_with_pass(self.verify_cost, num_sampled, num_nodes, num_sampled)
        return np.where(with_pass, in_pass, walk) * self.pass_cost.scale


def expected_tokens(values: list[float]) -> float:
    """Tokens a tree's draft nodes are expected to add: the sum of exp(path value)."""
    return sum(math.exp(v) for v in values)
