"""BlockManager: which KV-cache blocks each sequence owns, with reference counts and prefix caching.

Every check is paired with its action (`can_allocate`/`allocate`). A full block whose K/V has been
computed is registered under a chained hash of its tokens (the hash of the previous block and this
block's token ids), so a later sequence with the same prefix reuses it. Freed blocks keep their hash
until they are evicted, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.core.request import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept with the hash, so a hash collision can never be a hit


@dataclass(frozen=True)
class CachedPrefix:
    """Blocks that already hold the K/V of a sequence's first tokens."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[int, int] = {}  # hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest run of cached full blocks at the start of `seq` (this call changes nothing).

        The last token is never taken from the cache: its logits are needed, so it is recomputed.
        """
        if not self.enable_prefix_caching:
            return CachedPrefix()
        max_blocks = (seq.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for i, block_hash in enumerate(self._full_block_hashes(seq, max_blocks)):
            block_id = self.cached_block_ids.get(block_hash)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block_ids.append(block_id)
        return CachedPrefix(tuple(block_ids), len(block_ids) * self.block_size)

    def can_allocate(self, seq: Sequence, num_tokens: int, cached: CachedPrefix = CachedPrefix()):
        """Whether `seq` can hold `num_tokens` tokens after attaching `cached` (changes nothing)."""
        num_reused_free = sum(self.blocks[b].ref_count == 0 for b in cached.block_ids)
        num_held = len(seq.block_table) + len(cached.block_ids)
        num_needed = max(0, self.num_blocks_for(num_tokens) - num_held)
        num_needed += len(self._shared_blocks_to_write(seq))
        return num_needed + num_reused_free <= self.num_free_blocks

    def allocate(
        self, seq: Sequence, num_tokens: int, cached: CachedPrefix = CachedPrefix()
    ) -> list[tuple[int, int]]:
        """Grow `seq`'s block table to hold `num_tokens` tokens. Returns the (src, dst) block copies
        the cache must make first: a block shared with another sequence is copied before this one
        writes into it (copy-on-write after a fork)."""
        copies = []
        for index in self._shared_blocks_to_write(seq):
            shared = seq.block_table[index]
            seq.block_table[index] = self._allocate_free_block()
            self.blocks[shared].ref_count -= 1
            copies.append((shared, seq.block_table[index]))
        # Cached blocks are attached after the copy-on-write check: they are full and this
        # sequence only reads them, however many others hold them too.
        for block_id in cached.block_ids:
            self._reuse(block_id)
            seq.block_table.append(block_id)
        while len(seq.block_table) < self.num_blocks_for(num_tokens):
            seq.block_table.append(self._allocate_free_block())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (its block table is a copy of the parent's)."""
        assert child.block_table == parent.block_table
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` positions (a step's draft scratch)."""
        keep = self.num_blocks_for(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; the last blocks are evicted first, the shared prefix last."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.num_hashed_blocks = 0

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the full blocks of `seq` whose K/V is now computed, so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_final_kv_tokens // self.block_size
        for i in range(seq.num_hashed_blocks, num_full):
            block_hash = self._full_block_hashes(seq, i + 1)[-1]
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and block_hash not in self.cached_block_ids:
                block.hash = block_hash
                block.token_ids = tuple(
                    seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
                )
                self.cached_block_ids[block_hash] = block.block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def _full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained hashes of the first `num_blocks` full blocks, memoised on the sequence."""
        while len(seq.block_hashes) < num_blocks:
            i = len(seq.block_hashes)
            previous = seq.block_hashes[-1] if i else None
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            seq.block_hashes.append(hash((previous, tokens)))
        return seq.block_hashes[:num_blocks]

    def _shared_blocks_to_write(self, seq: Sequence) -> list[int]:
        """Indices in `seq`'s block table of blocks it will write into that others also hold."""
        first = seq.num_final_kv_tokens // self.block_size
        table = seq.block_table
        return [i for i in range(first, len(table)) if self.blocks[table[i]].ref_count > 1]

    def _allocate_free_block(self) -> int:
        """The first free block, evicted from the prefix cache if it held a prefix, with one
        reference. Free blocks holding no prefix come first, the most recently freed of them
        first (its memory is still warm in the CPU's caches: a speculative engine takes and
        returns draft scratch blocks every step); then those holding one, least recently freed
        first."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.cached_block_ids[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _reuse(self, block_id: int) -> None:
        """Take one more reference to a cached block, reviving it if it was free."""
        self.free_block_ids.pop(block_id, None)
        self.blocks[block_id].ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            if block.hash is None:  # nothing to keep: reuse it first
                self.free_block_ids.move_to_end(block_id, last=False)
