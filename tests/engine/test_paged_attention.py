"""Attention metadata over the paged KV cache: which blocks a step reads."""

from __future__ import annotations

import torch

from engine.execution.layers.paged_attention import SequenceAttention, build_attention_metadata


def test_keys_are_gathered_from_the_blocks_in_use_only():
    """A speculative engine's block tables run past the context (scratch room for draft trees);
    those blocks hold no key a query may see, so a plain step does not gather them."""
    sequences = [
        SequenceAttention([7, 3, 9, 4], num_cached=5, num_new=1),  # entries 0-5: blocks 7, 3
        SequenceAttention([2, 8], num_cached=2, num_new=1),  # entries 0-2: block 2
    ]
    meta = build_attention_metadata(sequences, block_size=4, device=torch.device("cpu"))
    (group,) = meta.groups
    assert group.block_tables.tolist() == [[7, 3], [2, 0]]
    assert group.mask.shape[-1] == 8  # keys: two blocks of 4
    assert meta.slot_mapping.tolist() == [3 * 4 + 1, 2 * 4 + 2]
