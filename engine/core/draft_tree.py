"""DraftTree: the flattened tree of draft tokens one sequence proposes for verification.

It is the currency between a drafter and the engine: the engine verifies its nodes in one target
pass (each node attending to its ancestors), and the drafter's acceptance walks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """One sequence's tree, flattened breadth first. Node 0 is the root (the last sampled token,
    not a draft); nodes 1..N are drafts. Every parent comes before its children."""

    tokens: list[int]  # [1 + N], tokens[0] is the root
    parents: list[int]  # [1 + N], parents[0] == -1
    depths: list[int]  # [1 + N], depths[0] == 0
    values: list[float]  # [1 + N] path log-probabilities, 0 for the root

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.tokens) - 1

    def children(self) -> list[list[int]]:
        """Children of every node, best draft value first."""
        result: list[list[int]] = [[] for _ in self.tokens]
        for node in range(1, self.num_nodes):
            result[self.parents[node]].append(node)
        for kids in result:
            kids.sort(key=lambda n: -self.values[n])
        return result

    def positions(self, start: int) -> list[int]:
        """[1 + N] position ids of the nodes, the root at `start`: a node sits one past its
        parent, so each root-to-leaf path reads as consecutive tokens."""
        return [start + depth for depth in self.depths]

    def ancestor_mask(self) -> torch.Tensor:
        """[1 + N, 1 + N] bool: node i may attend to node j (j is i or one of its ancestors)."""
        mask = torch.eye(self.num_nodes, dtype=torch.bool)
        for node in range(1, self.num_nodes):
            mask[node] |= mask[self.parents[node]]
        return mask
