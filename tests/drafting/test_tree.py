"""The EAGLE-2 dynamic tree: expansion, reranking, and the flattened tree's masks and paths."""

from __future__ import annotations

import math

import torch

from drafting.tree import ROOT, Candidates, rerank
from engine.core.draft_tree import DraftTree


def logprobs_from(rows: list[dict[int, float]], vocab: int = 10) -> torch.Tensor:
    """[len(rows), vocab] log-probabilities with the given probabilities (rest spread evenly)."""
    out = torch.empty(len(rows), vocab)
    for i, probs in enumerate(rows):
        rest = (1 - sum(probs.values())) / (vocab - len(probs))
        out[i] = math.log(rest)
        for token, p in probs.items():
            out[i, token] = math.log(p)
    return out


def grow(seed: int, top_k: int, depth: int, vocab: int = 12) -> Candidates:
    """Candidates for one sequence from random draft distributions."""
    generator = torch.Generator().manual_seed(seed)
    candidates = Candidates.first_layer(
        torch.log_softmax(torch.randn(1, vocab, generator=generator) * 2, -1), top_k
    )
    for _ in range(depth - 1):
        chosen = candidates.newest_layer_best(top_k)
        logits = torch.randn(1, top_k, vocab, generator=generator) * 2
        candidates.add_children(chosen, torch.log_softmax(logits, -1), top_k)
    return candidates


def test_worked_example_from_the_module_docstring():
    candidates = Candidates.first_layer(logprobs_from([{1: 0.9, 2: 0.09}]), 2)
    chosen = candidates.newest_layer_best(2)
    children = logprobs_from([{3: 0.9, 4: 0.05}, {5: 0.9, 6: 0.01}])[None]
    candidates.add_children(chosen, children, 2)
    (tree,) = rerank(candidates, roots=[0], num_keep=[3])
    assert tree.tokens == [0, 1, 2, 3]  # a, b (layer 1) then aa: breadth first
    assert tree.parents == [-1, 0, 0, 1]
    assert tree.depths == [0, 1, 1, 2]


def test_kept_set_is_the_best_by_value_and_connected():
    for seed in range(20):
        candidates = grow(seed, top_k=3, depth=4)
        values = candidates.values[0].tolist()
        (tree,) = rerank(candidates, roots=[7], num_keep=[10])
        assert tree.num_draft_tokens == 10
        kept_values = sorted(tree.values[1:], reverse=True)
        assert kept_values == sorted(values, reverse=True)[:10]
        for node in range(1, tree.num_nodes):
            parent = tree.parents[node]
            assert parent < node  # parents come first: the tree is connected and flat
            assert tree.depths[node] == tree.depths[parent] + 1
            assert tree.values[node] <= tree.values[parent]


def test_expansion_uses_only_the_best_nodes_of_the_newest_layer():
    candidates = grow(3, top_k=2, depth=3)
    parents, depths = candidates.parents[0].tolist(), candidates.depths[0].tolist()
    values = candidates.values[0].tolist()
    for layer in (1, 2):
        in_layer = [c for c, d in enumerate(depths) if d == layer]
        best = sorted(in_layer, key=lambda c: -values[c])[:2]
        expanded = {p for c, p in enumerate(parents) if depths[c] == layer + 1}
        assert expanded == set(best)
    assert all(p == ROOT for c, p in enumerate(parents) if depths[c] == 1)


def test_ties_go_to_the_shallower_node():
    # node a (p 1/2) has a child of p 1/2: value log 1/4, exactly node b's (p 1/4)
    candidates = Candidates.first_layer(logprobs_from([{1: 0.5, 2: 0.25}]), 2)
    children = logprobs_from([{3: 0.5}, {4: 0.5}])[None]
    candidates.add_children(candidates.newest_layer_best(2), children, 2)
    (tree,) = rerank(candidates, roots=[0], num_keep=[2])
    assert tree.tokens == [0, 1, 2]  # b, not a's equal-valued child
    # a child whose probability is 1 ties with its parent: the parent is kept first
    certain = Candidates.first_layer(logprobs_from([{1: 0.5, 2: 0.25}]), 2)
    sure_child = torch.full((1, 2, 10), -torch.inf)
    sure_child[0, :, 5] = 0.0
    certain.add_children(certain.newest_layer_best(2), sure_child, 1)
    (tree,) = rerank(certain, roots=[0], num_keep=[1])
    assert tree.tokens == [0, 1]


def test_ancestor_masks_and_children():
    tree = DraftTree(
        tokens=[9, 1, 2, 3, 4, 5],
        parents=[-1, 0, 0, 1, 1, 3],
        depths=[0, 1, 1, 2, 2, 3],
        values=[0, -1, -2, -1.5, -3, -2],
    )
    mask = tree.ancestor_mask()
    expected_ancestors = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 1, 3, 5}}
    for node, ancestors in expected_ancestors.items():
        assert set(torch.nonzero(mask[node]).flatten().tolist()) == ancestors
    assert tree.children() == [[1, 2], [3, 4], [], [5], [], []]  # best value first


def root_path(tree: DraftTree, node: int) -> list[int]:
    """The nodes from the root down to `node`, by following parents."""
    path = [node]
    while tree.parents[path[-1]] != -1:
        path.append(tree.parents[path[-1]])
    return path[::-1]


def test_masks_positions_and_paths_of_reranked_trees():
    """Each node attends to exactly its root-to-node path, and sits at the prefix length plus its
    depth, so every path is verified as a run of consecutive positions."""
    for seed in range(20):
        (tree,) = rerank(grow(seed, top_k=3, depth=4), roots=[7], num_keep=[10])
        mask, positions = tree.ancestor_mask(), tree.positions(start=40)
        leaves = [n for n, kids in enumerate(tree.children()) if not kids]
        assert leaves and tree.tokens[0] == 7
        for node in range(tree.num_nodes):
            path = root_path(tree, node)
            assert path[0] == 0 and tree.depths[node] == len(path) - 1
            assert torch.nonzero(mask[node]).flatten().tolist() == path  # parents come first
            assert [positions[n] for n in path] == list(range(40, 40 + len(path)))
        # the leaves' paths cover the tree
        assert {n for leaf in leaves for n in root_path(tree, leaf)} == set(range(tree.num_nodes))


def test_batched_rerank_matches_one_at_a_time():
    batch = Candidates.first_layer(torch.log_softmax(torch.randn(3, 12), -1), 3)
    for _ in range(2):
        chosen = batch.newest_layer_best(3)
        batch.add_children(chosen, torch.log_softmax(torch.randn(3, 3, 12), -1), 3)
    together = rerank(batch, roots=[1, 2, 3], num_keep=[5, 8, 1])
    for b in range(3):
        single = Candidates(
            batch.tokens[b : b + 1],
            batch.values[b : b + 1],
            batch.parents[b : b + 1],
            batch.depths[b : b + 1],
        )
        (alone,) = rerank(single, roots=[b + 1], num_keep=[[5, 8, 1][b]])
        assert alone == together[b]


def test_a_token_the_grammar_forces_is_the_only_child_even_outside_the_draft_vocabulary():
    vocab = torch.tensor([10, 11, 12, 13])  # draft index -> target id; 99 is not drafted
    root = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]]), -1)
    candidates = Candidates.first_layer(root, 2, vocab, forced=torch.tensor([99, -1]))
    assert candidates.tokens.tolist() == [[99, 11], [10, 11]]
    assert candidates.values[0].tolist() == [0.0, float("-inf")]  # certain, and alone
    assert torch.equal(candidates.values[1], root[1].topk(2).values)  # unconstrained: as drafted
    chosen = candidates.newest_layer_best(2)
    children = torch.log_softmax(torch.randn(2, 2, 4), -1)
    candidates.add_children(chosen, children, 2, vocab, forced=torch.tensor([[98, -1], [-1, -1]]))
    (tree, _) = rerank(candidates, roots=[0, 0], num_keep=[2, 2])
    assert tree.tokens == [0, 99, 98]  # the forced chain, each node certain
    assert tree.values == [0.0, 0.0, 0.0]
