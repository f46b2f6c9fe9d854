"""Lossless acceptance of a draft tree against the target's distributions.

At each node, p is the target's distribution for the next token (every sampling setting applied,
penalties conditioned on the node's own path). The walk draws the token the target emits at that
position exactly as plain decoding draws it: one uniform draw from the request's own generator,
inverted through p's cumulative distribution (`sample_from` in sampling/logits_processing.py). If
a child of the node carries that token, the child is accepted and the walk descends into it;
otherwise that token is the bonus and the walk ends (at a leaf, always).

Every emitted token is therefore a draw from p, whatever the drafts: the draft changes speed,
never the output. A child is accepted with probability p(child), and one of a node's children
with probability sum(p(children)), exactly as with the rule of accepting each child in turn with
probability p(x) / (mass left) and sampling the bonus from the residual; so acceptance is as high
as it can be. Because the walk consumes one uniform draw per emitted token, in order, as plain
decoding does, a seeded request gives the same tokens with speculation as without, whatever the
trees' shapes (which the draft budget sizes from timings) and whatever else shares the batch. For
greedy requests p is one-hot: "accept the child equal to the target's argmax".

The walk visits one node at a time, so the target's distribution is only needed at the nodes it
reaches (drafting/eagle_drafter.py computes those rows of the lm_head as the walk goes).
"""

from __future__ import annotations

import torch

from engine.core.draft_tree import DraftTree
from engine.sampling.logits_processing import sample_from


def accept_at_node(
    tree: DraftTree,
    children: list[int],  # the node's children
    p: torch.Tensor,  # [vocab] the target's distribution at the node
    generator: torch.Generator | None,
) -> tuple[int | None, int | None]:
    """One node of the walk: (the accepted child, None), or (None, the bonus token) when no child
    carries the token the target draws here (a leaf has none)."""
    token = int(sample_from(p[None, :], [generator])[0])
    return accept_target_token(tree, children, token)


def accept_target_token(
    tree: DraftTree, children: list[int], target_token: int
) -> tuple[int | None, int | None]:
    """Accept the child carrying the target's token (its argmax, for one-hot p), if any."""
    match = next((c for c in children if tree.tokens[c] == target_token), None)
    return (match, None) if match is not None else (None, target_token)
