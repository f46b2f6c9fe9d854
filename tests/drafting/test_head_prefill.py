"""The head is prefilled chunk by chunk, each chunk after the target's, with the features shifted
by one token: however the prompt is cut, a tree drafted from a given position is the one a whole
prefill gives there."""

from __future__ import annotations

import math

import pytest

from engine import LLM, SamplingParams
from engine.core.draft_tree import DraftTree
from tests.drafting.test_speculative_generation import mixed_prompts


def drafted_trees(target, head, prompts, **options) -> dict[tuple[int, int], DraftTree]:
    """Every tree drafted, by (sequence, position of its root)."""
    llm = LLM(
        str(target), draft=str(head), block_size=4, num_kv_blocks=1024,
        adaptive_draft_budget=False, enable_prefix_caching=False, **options,
    )  # fmt: skip
    trees: dict[tuple[int, int], DraftTree] = {}
    propose = llm.engine.drafter.propose

    def recording(batch):
        proposed = propose(batch)
        for item in batch.scheduled:
            if item.seq.seq_id in proposed:
                trees[item.seq.seq_id, item.seq.num_computed_tokens] = proposed[item.seq.seq_id]
        return proposed

    llm.engine.drafter.propose = recording
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    return trees


@pytest.mark.parametrize("chunk", [3, 8, 17])
def test_chunked_prefill_drafts_what_a_whole_prefill_does(bigram_target, trained_head, chunk):
    prompts = [p + p for p in mixed_prompts(4, seed=21) if len(p) > 10]  # cut several times
    assert len(prompts) == 3
    whole = drafted_trees(bigram_target, trained_head, prompts)
    chunked = drafted_trees(
        bigram_target, trained_head, prompts, max_num_batched_tokens=chunk, max_num_seqs=1
    )
    common = set(whole) & set(chunked)
    # a prompt whose last chunk is one token drafts with it, from its last prompt token
    assert {seq for seq, _ in common} == {seq for seq, _ in whole}
    for key in common:  # a small token budget caps a tree's size, so one may hold fewer nodes
        small, large = sorted([node_values(whole[key]), node_values(chunked[key])], key=len)
        assert len(small) > 1 and set(small) <= set(large)
        assert all(math.isclose(small[path], large[path], abs_tol=1e-4) for path in small)


def node_values(tree: DraftTree) -> dict[tuple[int, ...], float]:
    """Each node's path value, by its tokens from the root down."""
    paths: list[tuple[int, ...]] = []
    for node, token in enumerate(tree.tokens):
        parent = tree.parents[node]
        paths.append((token,) if parent < 0 else (*paths[parent], token))
    return dict(zip(paths, tree.values))
