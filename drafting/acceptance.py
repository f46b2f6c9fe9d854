"""Lossless acceptance of a draft tree against the target's distributions.

At each node, p is the target's distribution for the next token (every sampling setting applied,
penalties conditioned on the node's own path). The node's children are a fixed set of distinct
tokens, tried best draft value first: child x is accepted with probability p(x) / sum(p); if
rejected, p(x) is set to 0 (the residual) and the next child is tried. If every child is rejected,
the bonus token is sampled from the residual; if one is accepted, the walk descends into it. At a
leaf the bonus is sampled from p. Summed over the walk, each token's chance of being emitted is
exactly p(token): the draft changes speed, never the output. For greedy requests p is one-hot, so
this is "accept the child equal to the target's argmax".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.draft_tree import DraftTree
from engine.logits_processing import sample_from


@dataclass(frozen=True)
class Acceptance:
    accepted_nodes: list[int]  # draft nodes on the accepted path, root excluded, in order
    bonus_token: int  # sampled from the target at the last accepted node (or the root)
    last_node: int  # the node the bonus was sampled at (0: the root)


def accept_tree(
    tree: DraftTree,
    probs: torch.Tensor,  # [1 + N, vocab] target distribution at each node of `tree`
    generator: torch.Generator | None,
) -> Acceptance:
    children = tree.children()
    accepted: list[int] = []
    node = 0
    while True:
        p = probs[node]  # [vocab]
        mass = float(p.sum())  # of the residual: what rejected children have not taken
        rejected: list[int] = []
        for child in children[node]:
            token = tree.tokens[child]
            p_token = float(p[token])
            if _uniform(p.device, generator) * mass < p_token:  # probability p(x) / mass
                accepted.append(child)
                node = child
                break
            rejected.append(token)
            mass -= p_token
        else:
            residual = p.clone()
            residual[rejected] = 0.0
            return Acceptance(accepted, _sample_residual(residual, p, generator), node)


def accept_greedy(tree: DraftTree, argmax_tokens: list[int]) -> Acceptance:
    """The same rule for one-hot p: descend while a child equals the target's argmax."""
    children = tree.children()
    accepted: list[int] = []
    node = 0
    while True:
        target = argmax_tokens[node]
        match = next((c for c in children[node] if tree.tokens[c] == target), None)
        if match is None:
            return Acceptance(accepted, target, node)
        accepted.append(match)
        node = match


def _uniform(device: torch.device, generator: torch.Generator | None) -> float:
    return float(torch.rand((), device=device, generator=generator))


def _sample_residual(
    residual: torch.Tensor, original: torch.Tensor, generator: torch.Generator | None
) -> int:
    # A residual that lost all its mass to rounding (p was ~one-hot on rejected children) falls
    # back to the original distribution; in exact arithmetic this branch has probability 0.
    distribution = residual if float(residual.sum()) > 0 else original
    return int(sample_from(distribution[None, :], [generator])[0])
