"""Attention metadata over the paged KV cache: which blocks a step reads."""

from __future__ import annotations

import torch

from engine.execution.layers.paged_attention import (
    SequenceAttention,
    build_attention_metadata,
    paged_attention,
)


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


def _reference_attention(q, keys, values, visible, scale):
    """Softmax attention of q [Q, H, D] over keys/values [C, KV, D] where visible [Q, C]."""
    repeat = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
    scores = torch.einsum("qhd,chd->hqc", q, keys) * scale  # [H, Q, C]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqc,chd->qhd", weights, values).flatten(1)  # [Q, H * D]


def test_attention_sees_what_each_query_may_see_causal_or_not():
    """Fresh prompts (no cached entries, no tree) take SDPA's causal path, which never reads the
    mask; cached prefixes and draft trees take the mask. Every query's output must be its
    softmax over exactly the entries it may see, padded queries and blocks included."""
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    tree = torch.tensor([[True, False], [True, True]])
    cases = {
        "fresh prompts": [SequenceAttention([0, 1], 0, 7), SequenceAttention([2], 0, 3)],
        "a cached prefix": [SequenceAttention([0, 1], 3, 4), SequenceAttention([2], 0, 3)],
        "a draft tree": [SequenceAttention([0, 1], 0, 6), SequenceAttention([2], 1, 2, tree)],
    }
    for name, sequences in cases.items():
        meta = build_attention_metadata(sequences, block_size, torch.device("cpu"))
        assert all(g.causal for g in meta.groups) == (name == "fresh prompts"), name
        num_tokens = sum(s.num_new for s in sequences)
        q = torch.randn(num_tokens, heads, dim)
        k, v = torch.randn(2, num_tokens, kv_heads, dim)
        k_cache, v_cache = torch.randn(2, 3, block_size, kv_heads, dim)  # garbage beyond context
        out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=dim**-0.5)
        first = 0
        for s in sequences:
            end = s.num_cached + s.num_new
            blocks = [s.block_table[e // block_size] for e in range(end)]
            slots = [b * block_size + e % block_size for e, b in enumerate(blocks)]
            keys = k_cache.view(-1, kv_heads, dim)[slots]
            values = v_cache.view(-1, kv_heads, dim)[slots]
            visible = torch.ones(s.num_new, end).tril(s.num_cached).bool()
            if s.tree_mask is not None:
                visible[:, end - s.tree_mask.shape[1] :] = s.tree_mask
            rows = slice(first, first + s.num_new)
            expected = _reference_attention(q[rows], keys, values, visible, dim**-0.5)
            torch.testing.assert_close(out[rows], expected, msg=name)
            first += s.num_new
