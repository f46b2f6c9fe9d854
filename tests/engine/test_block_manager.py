"""Unit tests of BlockManager: allocation, reference counts, prefix caching, eviction and
copy-on-write."""

from __future__ import annotations

import itertools

from engine.core.block_manager import BlockManager
from engine.core.request import Sequence

BLOCK_SIZE = 4
_seq_ids = itertools.count()


def make_seq(token_ids: list[int]) -> Sequence:
    """A bare sequence: the block manager reads only its tokens, progress and block table."""
    return Sequence(next(_seq_ids), None, 0, list(token_ids), len(token_ids), None)


def computed(manager: BlockManager, token_ids: list[int]) -> Sequence:
    """A sequence whose tokens all have K/V in its blocks, offered to the prefix cache."""
    seq = make_seq(token_ids)
    assert manager.allocate(seq, seq.num_tokens) == []
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_computed_blocks(seq)
    return seq


def ref_counts(manager: BlockManager) -> list[int]:
    return [block.ref_count for block in manager.blocks]


def test_allocate_and_free() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(list(range(10)))
    assert manager.can_allocate(seq, 10)
    assert manager.allocate(seq, 10) == []
    assert len(seq.block_table) == 3  # ceil(10 / 4)
    assert len(set(seq.block_table)) == 3
    assert manager.num_free_blocks == 5
    assert sorted(ref_counts(manager)) == [0] * 5 + [1] * 3
    manager.allocate(seq, 12)  # still fits in 3 blocks
    assert len(seq.block_table) == 3
    manager.allocate(seq, 13)
    assert len(seq.block_table) == 4
    manager.free(seq)
    assert seq.block_table == []
    assert manager.num_free_blocks == 8
    assert ref_counts(manager) == [0] * 8
    assert manager.usage == 0.0


def test_can_allocate_counts_free_blocks_exactly() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    first = make_seq(list(range(8)))
    manager.allocate(first, 8)
    second = make_seq(list(range(20, 28)))
    assert manager.can_allocate(second, 8)
    assert not manager.can_allocate(second, 9)  # 3 blocks, only 2 free
    manager.allocate(second, 8)
    assert manager.num_free_blocks == 0
    assert manager.usage == 1.0
    assert not manager.can_allocate(first, 9)
    assert manager.can_allocate(first, 8)  # nothing new needed


def test_prefix_cache_hit_after_free() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    tokens = list(range(100, 111))  # 11 tokens: two full blocks and a partial one
    first = computed(manager, tokens)
    full_blocks = first.block_table[:2]
    manager.free(first)
    assert manager.num_free_blocks == 8

    again = make_seq(tokens)
    cached = manager.find_cached_prefix(again)
    assert cached.block_ids == tuple(full_blocks)
    assert cached.num_tokens == 8
    # Attaching the cached blocks takes them off the free list, with one reference each.
    assert manager.can_allocate(again, 11, cached)
    manager.allocate(again, 11, cached)
    assert again.block_table[:2] == full_blocks
    assert [manager.blocks[b].ref_count for b in full_blocks] == [1, 1]
    assert manager.num_free_blocks == 8 - 3


def test_cached_blocks_are_shared_while_in_use() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    tokens = list(range(9))
    first = computed(manager, tokens)
    second = make_seq(tokens)
    cached = manager.find_cached_prefix(second)
    assert cached.num_tokens == 8
    manager.allocate(second, 9, cached)
    assert second.block_table[:2] == first.block_table[:2]
    assert [manager.blocks[b].ref_count for b in first.block_table[:2]] == [2, 2]
    manager.free(first)
    assert [manager.blocks[b].ref_count for b in second.block_table[:2]] == [1, 1]
    assert manager.num_free_blocks == 8 - 3
    manager.free(second)
    assert manager.num_free_blocks == 8


def test_the_last_token_is_never_served_from_the_cache() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    computed(manager, list(range(8)))
    # Same 8 tokens: only the first block is reused; the last token needs its logits.
    assert manager.find_cached_prefix(make_seq(list(range(8)))).num_tokens == 4
    assert manager.find_cached_prefix(make_seq(list(range(9)))).num_tokens == 8


def test_prefix_hash_is_chained() -> None:
    """A block matches only if every block before it matches too."""
    manager = BlockManager(8, BLOCK_SIZE)
    computed(manager, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    other_start = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9])  # same second block, different first
    assert manager.find_cached_prefix(other_start).num_tokens == 0
    other_second = make_seq([1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert manager.find_cached_prefix(other_second).num_tokens == 4


def test_a_hash_collision_is_never_a_hit() -> None:
    """In CPython hash(-1) == hash(-2), so these two blocks' chained hashes collide."""
    manager = BlockManager(8, BLOCK_SIZE)
    computed(manager, [-1, 5, 6, 7, 8])
    assert manager.find_cached_prefix(make_seq([-1, 5, 6, 7, 8])).num_tokens == 4
    colliding = make_seq([-2, 5, 6, 7, 8])
    assert hash((None, (-1, 5, 6, 7))) == hash((None, (-2, 5, 6, 7)))
    assert manager.find_cached_prefix(colliding).num_tokens == 0


def test_partial_and_uncomputed_blocks_are_not_cached() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(list(range(10)))
    manager.allocate(seq, 10)
    seq.num_computed_tokens = 6  # the first block is computed, the second only half
    manager.cache_computed_blocks(seq)
    assert manager.find_cached_prefix(make_seq(list(range(10)))).num_tokens == 4


def test_prefix_caching_disabled() -> None:
    manager = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    manager.free(computed(manager, list(range(9))))
    assert manager.find_cached_prefix(make_seq(list(range(9)))).num_tokens == 0


def test_eviction_order_uncached_first_then_least_recently_freed_and_prefix_last() -> None:
    manager = BlockManager(5, BLOCK_SIZE)
    tokens = list(range(13))
    seq = computed(manager, tokens)  # blocks 0, 1, 2 full and cached, block 3 partial
    assert seq.block_table == [0, 1, 2, 3]
    manager.free(seq)
    probe = make_seq(tokens)
    assert manager.find_cached_prefix(probe).num_tokens == 12

    def allocate_blocks(count: int) -> list[int]:
        filler = make_seq(list(range(1000, 1000 + count * BLOCK_SIZE)))
        manager.allocate(filler, filler.num_tokens)
        return filler.block_table

    # Blocks holding no prefix go first, the most recently freed first (the partial block 3,
    # then never-used block 4); then the cached blocks, from the sequence's end backwards.
    assert allocate_blocks(1) == [3]
    assert manager.find_cached_prefix(probe).num_tokens == 12
    assert allocate_blocks(2) == [4, 2]  # the never-used block, then the third cached block
    assert manager.find_cached_prefix(probe).num_tokens == 8
    assert allocate_blocks(1) == [1]
    assert manager.find_cached_prefix(probe).num_tokens == 4
    assert allocate_blocks(1) == [0]
    assert manager.find_cached_prefix(probe).num_tokens == 0


def test_blocks_holding_no_prefix_are_reused_before_cached_ones() -> None:
    """Scratch blocks (a speculative engine's draft room, a sequence's partial last block) have
    nothing to keep: taking them again first keeps cached prefixes alive longer."""
    manager = BlockManager(4, BLOCK_SIZE)
    manager.free(computed(manager, list(range(8))))  # blocks 0 and 1 cached, all 4 free
    scratch = make_seq(list(range(100, 108)))
    manager.allocate(scratch, 8)  # blocks 2 and 3
    manager.free(scratch)  # never computed: they hold no prefix
    again = make_seq(list(range(200, 208)))
    manager.allocate(again, 8)
    assert sorted(again.block_table) == [2, 3]
    assert manager.find_cached_prefix(make_seq([*range(8), 99])).num_tokens == 8


def test_reviving_a_free_cached_block_counts_against_free_blocks() -> None:
    manager = BlockManager(3, BLOCK_SIZE)
    tokens = list(range(9))
    manager.free(computed(manager, tokens))  # blocks 0, 1 cached; all 3 free
    seq = make_seq(tokens)
    cached = manager.find_cached_prefix(seq)
    assert cached.num_tokens == 8
    assert manager.can_allocate(seq, 9, cached)  # 2 revived + 1 new = 3 free blocks
    assert not manager.can_allocate(seq, 13, cached)  # would need a 4th
    blocker = make_seq([7] * 4)
    manager.allocate(blocker, 4)  # takes the uncached block 2
    assert manager.can_allocate(seq, 8, cached)
    assert not manager.can_allocate(seq, 9, cached)


def test_fork_shares_blocks_and_copy_on_write_returns_a_copy_pair() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    parent = computed(manager, list(range(6)))  # one full block and a partial one
    child = make_seq(parent.token_ids)
    child.block_table = list(parent.block_table)
    child.num_computed_tokens = parent.num_computed_tokens
    manager.fork(parent, child)
    assert [manager.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    full, partial = parent.block_table

    # Both append a token: the first to write the shared partial block gets a copy of it.
    parent.token_ids.append(6)
    child.token_ids.append(9)
    assert manager.can_allocate(parent, 7)
    copies = manager.allocate(parent, 7)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == partial and dst not in (full, partial)
    assert parent.block_table == [full, dst]
    assert manager.blocks[partial].ref_count == 1
    assert manager.allocate(child, 7) == []  # now the only holder: writes in place
    assert child.block_table == [full, partial]
    assert manager.blocks[full].ref_count == 2

    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 8
    assert ref_counts(manager) == [0] * 8


def test_copy_on_write_needs_a_free_block() -> None:
    manager = BlockManager(2, BLOCK_SIZE)
    parent = computed(manager, list(range(2)))  # one partial block
    child = make_seq(parent.token_ids)
    child.block_table = list(parent.block_table)
    child.num_computed_tokens = 2
    manager.fork(parent, child)
    filler = make_seq([5] * 4)
    manager.allocate(filler, 4)
    assert manager.num_free_blocks == 0
    parent.token_ids.append(2)
    assert not manager.can_allocate(parent, 3)  # the shared block must be copied first
    manager.free(filler)
    assert manager.can_allocate(parent, 3)


def test_full_shared_block_needs_no_copy() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    parent = computed(manager, list(range(4)))  # exactly one full block
    child = make_seq(parent.token_ids)
    child.block_table = list(parent.block_table)
    child.num_computed_tokens = 4
    manager.fork(parent, child)
    parent.token_ids.append(4)
    assert manager.allocate(parent, 5) == []
    assert parent.block_table[0] == child.block_table[0]
    assert len(parent.block_table) == 2
