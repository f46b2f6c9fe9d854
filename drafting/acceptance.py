"""Lossless acceptance of a draft tree against the target's distributions.

At each node, p is the target's distribution for the next token (every sampling setting applied,
penalties conditioned on the node's own path). The node's children are a fixed set of distinct
tokens, tried best draft value first: child x is accepted with probability p(x) / sum(p); if
rejected, p(x) is set to 0 (the residual) and the next child is tried. If every child is rejected,
the bonus token is sampled from the residual; if one is accepted, the walk descends into it. At a
leaf the bonus is sampled from p. Summed over the walk, each token's chance of being emitted is
exactly p(token): the draft changes speed, never the output. For greedy requests p is one-hot, so
this is "accept the child equal to the target's argmax".

The walk visits one node at a time, so the target's distribution is only needed at the nodes it
reaches (drafting/eagle_drafter.py computes those rows of the lm_head as the walk goes).
"""

from __future__ import annotations

import torch

from engine.draft_tree import DraftTree
from engine.logits_processing import sample_from


def accept_at_node(
    tree: DraftTree,
    children: list[int],  # the node's children, best draft value first
    p: torch.Tensor,  # [vocab] the target's distribution at the node
    generator: torch.Generator | None,
) -> tuple[int | None, int | None]:
    """One node of the walk: (the accepted child, None), or (None, the bonus token) when every
    child is rejected (a leaf has none), the bonus sampled from the residual."""
    mass = float(p.sum())  # of the residual: what rejected children have not taken
    rejected: list[int] = []
    for child in children:
        token = tree.tokens[child]
        p_token = float(p[token])
        if _uniform(p.device, generator) * mass < p_token:  # probability p(x) / mass
            return child, None
        rejected.append(token)
        mass -= p_token
    residual = p.clone()
    residual[rejected] = 0.0
    return None, _sample_residual(residual, p, generator)


def accept_at_node_greedy(
    tree: DraftTree, children: list[int], argmax_token: int
) -> tuple[int | None, int | None]:
    """The same rule for one-hot p: accept the child equal to the target's argmax, if any."""
    match = next((c for c in children if tree.tokens[c] == argmax_token), None)
    return (match, None) if match is not None else (None, argmax_token)


def _uniform(device: torch.device, generator: torch.Generator | None) -> float:
    return float(torch.rand((), device=device, generator=generator))


def _sample_residual(
    residual: torch.Tensor, original: torch.Tensor, generator: torch.Generator | None
) -> int:
    # A residual that lost all its mass to rounding (p was ~one-hot on rejected children) falls
    # back to the original distribution; in exact arithmetic this branch has probability 0.
    distribution = residual if float(residual.sum()) > 0 else original
    return int(sample_from(distribution[None, :], [generator])[0])
