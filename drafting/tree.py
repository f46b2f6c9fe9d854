"""The EAGLE-2 dynamic draft tree: candidates grown layer by layer, reranked, then flattened.

A node's value is the sum of draft log-probabilities on its path from the root (the log of the
chance the target accepts the whole path). Each further layer expands only the `top_k` best nodes of
the newest layer. Reranking keeps the `total_tokens - 1` best of all candidates; since a child's
value never exceeds its parent's and ties go to the shallower node, the kept set is a connected
tree. Worked example (top_k 2): root -> layer 1 {a: -0.1, b: -2.3}; expanding a and b gives
{aa: -0.2, ab: -3.0, ba: -2.4, bb: -5.0}; keeping 3 nodes keeps a, aa, b.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.draft_tree import DraftTree

ROOT = -1  # parent index of a layer-1 candidate


@dataclass
class Candidates:
    """Every node generated for a batch of sequences, in generation order (depth-major)."""

    tokens: torch.Tensor  # [B, M] token ids
    values: torch.Tensor  # [B, M] path log-probabilities
    parents: torch.Tensor  # [B, M] candidate index of the parent, ROOT for layer 1
    depths: torch.Tensor  # [B, M] 1 for layer 1

    @classmethod
    def first_layer(
        cls,
        logprobs: torch.Tensor,
        top_k: int,
        vocab: torch.Tensor | None = None,
        forced: torch.Tensor | None = None,
    ) -> Candidates:
        """Layer 1 from the root's draft log-probabilities [B, V]. With a reduced draft
        vocabulary, `vocab` [V] maps draft indices to target token ids. `forced` [B]: the one
        token a grammar allows at the root (-1: none), drafted with certainty, in the draft
        vocabulary or not."""
        values, tokens = logprobs.topk(top_k, dim=-1)  # [B, k]
        tokens = tokens if vocab is None else vocab[tokens]
        tokens, values = _with_forced(tokens, values, forced)
        parents = torch.full_like(tokens, ROOT)
        return cls(tokens, values, parents, torch.ones_like(tokens))

    def path(self, b: int, candidate: int) -> list[int]:
        """Tokens from sequence b's root (excluded) down to `candidate` (included)."""
        tokens = []
        while candidate != ROOT:
            tokens.append(int(self.tokens[b, candidate]))
            candidate = int(self.parents[b, candidate])
        return tokens[::-1]

    def newest_layer_best(self, top_k: int) -> torch.Tensor:
        """Candidate indices [B, top_k] of the best nodes of the deepest layer."""
        depth = int(self.depths.max())
        in_layer = self.depths == depth  # [B, M]
        masked = torch.where(in_layer, self.values, float("-inf"))
        return masked.topk(top_k, dim=-1).indices.sort(dim=-1).values  # generation order

    def add_children(
        self,
        parents: torch.Tensor,
        logprobs: torch.Tensor,
        top_k: int,
        vocab: torch.Tensor | None = None,
        forced: torch.Tensor | None = None,
    ) -> None:
        """Score the `top_k` children of each expanded node. parents: [B, k] candidate indices;
        logprobs: [B, k, V], the draft distributions at those nodes; vocab as in first_layer;
        forced: [B, k] as in first_layer, for each expanded node."""
        batch, width = parents.shape
        child_lp, child_tokens = logprobs.topk(top_k, dim=-1)  # [B, k, top_k]
        child_tokens = child_tokens if vocab is None else vocab[child_tokens]
        child_tokens, child_lp = _with_forced(child_tokens, child_lp, forced)
        parent_values = self.values.gather(1, parents)  # [B, k]
        values = (parent_values[:, :, None] + child_lp).reshape(batch, width * top_k)
        parent_idx = parents[:, :, None].expand(-1, -1, top_k).reshape(batch, width * top_k)
        depth = self.depths.gather(1, parents)[:, :, None].expand(-1, -1, top_k) + 1
        self.tokens = torch.cat([self.tokens, child_tokens.reshape(batch, -1)], dim=1)
        self.values = torch.cat([self.values, values], dim=1)
        self.parents = torch.cat([self.parents, parent_idx], dim=1)
        self.depths = torch.cat([self.depths, depth.reshape(batch, -1)], dim=1)


def _with_forced(
    tokens: torch.Tensor, logprobs: torch.Tensor, forced: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where `forced` [...] names a token (>= 0), it becomes the only child: the first of the
    top-k [..., k] with log-probability 0, the others -inf."""
    if forced is None:
        return tokens, logprobs
    is_forced = forced >= 0  # [...]
    tokens, logprobs = tokens.clone(), logprobs.clone()
    tokens[..., 0] = torch.where(is_forced, forced, tokens[..., 0])
    logprobs[..., 0] = torch.where(is_forced, 0.0, logprobs[..., 0])
    logprobs[..., 1:] = logprobs[..., 1:].masked_fill(is_forced[..., None], float("-inf"))
    return tokens, logprobs


def rerank(candidates: Candidates, roots: list[int], num_keep: list[int]) -> list[DraftTree]:
    """Keep each sequence's `num_keep` best candidates (ties to the shallower) as a DraftTree."""
    trees = []
    tokens, values = candidates.tokens.tolist(), candidates.values.tolist()
    parents, depths = candidates.parents.tolist(), candidates.depths.tolist()
    # Candidates are in depth-major order, so a stable sort breaks ties toward shallower nodes.
    order = candidates.values.sort(dim=-1, descending=True, stable=True).indices.tolist()
    for b, root in enumerate(roots):
        kept = sorted(order[b][: num_keep[b]], key=lambda c: (depths[b][c], c))
        flat_index = {c: i + 1 for i, c in enumerate(kept)}  # candidate -> node (root is 0)
        trees.append(
            DraftTree(
                tokens=[root] + [tokens[b][c] for c in kept],
                parents=[-1]
                + [0 if parents[b][c] == ROOT else flat_index[parents[b][c]] for c in kept],
                depths=[0] + [depths[b][c] for c in kept],
                values=[0.0] + [values[b][c] for c in kept],
            )
        )
    return trees
