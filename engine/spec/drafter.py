"""The drafter protocol through which each engine step speculates: propose, accept, commit.

A drafter proposes a draft tree for each decoding sequence before the target's verify pass, then
turns the verified logits into the tokens each sequence keeps, and finally learns the target's
features of the positions that became final. Plain autoregressive decoding is the drafter that
proposes nothing: its acceptance samples one token per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.core.draft_tree import DraftTree
from engine.core.request import Sequence
from engine.core.scheduler import SchedulerOutput
from engine.execution.model_runner import ForwardOutput
from engine.outputs import TokenLogprob
from engine.sampling.grammar import all_allowed
from engine.sampling.logits_processing import LogitsContext
from engine.sampling.sampler import sample


@dataclass(frozen=True)
class Accepted:
    """What one sequence keeps from a verify pass."""

    token_ids: list[int]  # accepted draft tokens, then the bonus token sampled by the target
    logprobs: list[TokenLogprob | None]  # one per token
    accepted_nodes: list[int]  # tree nodes of the accepted drafts (empty without a tree)


class Drafter(Protocol):
    num_lookahead_tokens: int  # scratch positions a drafting sequence needs beyond its root

    def propose(self, batch: SchedulerOutput) -> dict[int, DraftTree]:
        """Draft trees by sequence id, for the scheduled sequences that decode this step."""
        ...

    def accept(
        self,
        seqs: list[Sequence],
        trees: list[DraftTree | None],
        verified: ForwardOutput,
        logits_rows: list[int],
        token_rows: list[range],
    ) -> list[Accepted]:
        """Tokens each sequence keeps. seqs[i]'s raw target logits are row logits_rows[i] of
        `verified.logits` (its last token's, or its tree's root's); node n of its tree is row
        token_rows[i][n] of `verified.hidden`. Changes no sequence."""
        ...

    def commit(self, seq: Sequence, features: torch.Tensor) -> None:
        """Target features [k, hidden] of the k positions that just became final for `seq`."""
        ...

    def settle(self, seqs: list[Sequence]) -> None:
        """End of a step, its tokens appended: `seqs` are the live sequences that did not draft.
        What the drafter keeps for them is done here, while the step's outputs have not yet
        left, so that a step that drafts nothing has no drafter work left for the next one."""
        ...


class AutoregressiveDrafter:
    """Proposes nothing, so every step yields one sampled token per sequence."""

    num_lookahead_tokens = 0

    def propose(self, batch: SchedulerOutput) -> dict[int, DraftTree]:
        return {}

    def accept(
        self,
        seqs: list[Sequence],
        trees: list[DraftTree | None],
        verified: ForwardOutput,
        logits_rows: list[int],
        token_rows: list[range],
    ) -> list[Accepted]:
        return sample_one_each(seqs, verified.logits, logits_rows)

    def commit(self, seq: Sequence, features: torch.Tensor) -> None:
        pass

    def settle(self, seqs: list[Sequence]) -> None:
        pass


def sample_one_each(seqs: list[Sequence], logits: torch.Tensor, rows: list[int]) -> list[Accepted]:
    """Plain sampling: one token per sequence from its row of `logits`."""
    if not seqs:
        return []
    picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
    contexts = [logits_context(s) for s in seqs]
    result = sample(picked, contexts, [s.generator for s in seqs], grammar_bitmasks(seqs))
    return [Accepted([t], [lp], []) for t, lp in zip(result.token_ids, result.logprobs)]


def grammar_bitmasks(seqs: list[Sequence], paths: list[list[int]] | None = None):
    """[N, words] int32: the tokens each sequence's grammar allows after its tokens plus its
    draft path (paths[i], default none); None when no sequence is constrained."""
    if all(s.grammar is None for s in seqs):
        return None
    vocab_size = next(s.grammar.vocab_size for s in seqs if s.grammar is not None)
    masks = all_allowed(len(seqs), vocab_size)
    for row, seq in enumerate(seqs):
        if seq.grammar is not None:
            masks[row] = seq.grammar.bitmasks_along([paths[row] if paths else []])[0]
    return masks


def logits_context(seq: Sequence, path: list[int] = ()) -> LogitsContext:
    """What the logits after `seq`'s tokens plus the draft `path` are conditioned on."""
    tokens = seq.token_ids + list(path) if path else seq.token_ids
    request = seq.request
    return LogitsContext(request.params, tokens, seq.prompt_len, request.eos_token_ids)
