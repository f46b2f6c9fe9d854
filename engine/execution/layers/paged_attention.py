"""Attention over a paged KV cache: the per-step metadata and the torch (SDPA) backend.

Every sequence in a step brings `num_new` query tokens and attends to its whole context (the tokens
already cached plus the new ones). The metadata says where each new token's K/V is written
(`slot_mapping`) and which blocks each sequence reads (`block_tables`), built once per step
and shared by every layer. Keys are gathered block by block (whole blocks are contiguous in the
cache, so the copy runs at memory speed), which pads each sequence's keys to whole blocks; the
mask hides the padding. Sequences with similar numbers of new tokens form a group whose queries
are padded to [B, Q] for one SDPA call (see `build_attention_metadata`). This is the "torch"
backend, on every device; flash_attention.py holds the optional flash-attn one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SequenceAttention:
    """What one sequence contributes to a step: its block table and how many tokens are new.

    Keys are the sequence's first `num_cached + num_new` cache entries in block-table order; the
    new tokens' K/V is written to the last `num_new` of them. Queries see every earlier entry
    (causal), except that `tree_mask` decides for the last `tree_mask.shape[1]` entries: a draft
    tree's node sees only its ancestors.
    """

    block_table: list[int]
    num_cached: int  # entries whose K/V is already in the cache
    num_new: int  # tokens computed in this step (queries)
    tree_mask: torch.Tensor | None = None  # [num_new, W] bool over the last W entries; W >= num_new
    positions: list[int] | None = None  # positions of the new tokens; None: the entry indices


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences whose queries are padded together to [B, Q] for one SDPA call."""

    block_tables: torch.Tensor  # [B, max_blocks] each sequence's blocks (padding: block 0)
    mask: torch.Tensor  # [B, 1, Q, C] True where a query may attend
    # every sequence's queries are its first entries, with no tree mask or window: the mask is
    # plain causal (query i sees entries 0..i), which SDPA computes without reading it, skipping
    # the blocks above the diagonal
    causal: bool
    # [B, Q] flat token of each padded query; None when the group is the whole step and every
    # sequence brings Q tokens, so the queries are a view of the step's tokens
    query_index: torch.Tensor | None
    output_index: torch.Tensor | None  # [T_g] row of each real query in the [B * Q] output
    # on the CPU, for the fused kernels (layers/cpu_kernels.py): sequence b's queries are
    # the step's tokens first_token[b] + i for i < num_new[b]; `tokens` lists them all
    first_token: torch.Tensor  # [B] int64
    num_new: torch.Tensor  # [B] int64
    tokens: torch.Tensor  # [T_g] int64, sequence by sequence


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    groups: tuple[AttentionGroup, ...]
    # [T] row of each token in the groups' outputs stacked; None when they are in token order
    token_order: torch.Tensor | None


def build_attention_metadata(
    sequences: list[SequenceAttention],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    group_queries: bool = True,
) -> AttentionMetadata:
    """Metadata for one step, shared by every layer.

    Padding every sequence's queries to the longest one's would make a prefill chunk of 300 tokens
    cost 300 query rows for each of the decodes beside it (benchmarks/bench_mixed_step.py). With
    `group_queries`, sequences are grouped by their number of new tokens (power-of-two buckets: 1,
    2, 3-4, 5-8, ...), one SDPA call per group, so padding at most doubles a group's queries.
    Without it (torch.compile, whose graphs must not change with the number of groups), one group
    holds them all.

    The index arithmetic runs in numpy: it is a few dozen operations on arrays of a few to a few
    thousand entries, where a torch operation's dispatch costs more than its work
    (benchmarks/bench_attention_metadata.py).
    """
    new = _NewTokens.of(sequences, block_size)
    members = (
        _query_groups(new.num_new.tolist()) if group_queries else [list(range(len(sequences)))]
    )
    # The queries are a view of the step's tokens when one group holds sequences of equal query
    # counts. A compiled model takes that path for a single sequence only, so that one graph
    # serves every batch of several (equal counts or not).
    dense = len(members) == 1 and int(new.num_new.min()) == int(new.num_new.max())
    dense &= group_queries or len(sequences) == 1
    groups = tuple(
        _group(
            [sequences[i] for i in rows],
            new.tables[rows],
            new.num_cached[rows],
            new.num_new[rows],
            new.first_token[rows],
            block_size,
            device,
            sliding_window,
            dense,
        )
        for rows in members
    )
    return AttentionMetadata(
        slot_mapping=_tensor(new.slots, device),
        groups=groups,
        token_order=_token_order(members, new.first_token, new.num_new, device),
    )


@dataclass(frozen=True)
class _NewTokens:
    """A step's sequences as arrays, and the cache slot of each new token."""

    num_cached: np.ndarray  # [B]
    num_new: np.ndarray  # [B]
    first_token: np.ndarray  # [B] flat index of each sequence's first new token
    tables: np.ndarray  # [B, max_blocks] the blocks each sequence reads
    slots: np.ndarray  # [T] flat cache slot of each new token, sequence by sequence

    @classmethod
    def of(cls, sequences: list[SequenceAttention], block_size: int) -> _NewTokens:
        num_cached = np.array([s.num_cached for s in sequences], dtype=np.int64)
        num_new = np.array([s.num_new for s in sequences], dtype=np.int64)
        first_token = np.cumsum(num_new) - num_new
        tables = used_block_tables(sequences, block_size)
        slots = entry_slots(tables, num_cached, num_new, first_token, block_size)
        return cls(num_cached, num_new, first_token, tables, slots)


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A contiguous torch tensor of `array` on `device` (no copy on the CPU)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _token_order(
    members: list[list[int]], first_token: np.ndarray, num_new: np.ndarray, device
) -> torch.Tensor | None:
    """[T] row of each token in the groups' stacked outputs; None when that is token order."""
    if len(members) == 1:  # one group holds every sequence, in step order
        return None
    stacked = np.concatenate(
        [np.arange(first_token[i], first_token[i] + num_new[i]) for rows in members for i in rows]
    )  # [T] token behind each row of the stacked outputs
    if bool((stacked[1:] > stacked[:-1]).all()):  # the groups happen to run in step order
        return None
    return _tensor(np.argsort(stacked, kind="stable"), device)


def _query_groups(num_new: list[int]) -> list[list[int]]:
    """Sequence indices per group, by power-of-two bucket of their new tokens, fewest first."""
    buckets: dict[int, list[int]] = {}
    for index, count in enumerate(num_new):
        buckets.setdefault((count - 1).bit_length(), []).append(index)
    return [buckets[b] for b in sorted(buckets)]


def _group(
    sequences: list[SequenceAttention],
    tables: np.ndarray,  # [B, max_blocks of the step]
    num_cached: np.ndarray,  # [B]
    num_new: np.ndarray,  # [B]
    first_token: np.ndarray,  # [B] flat index of each sequence's first new token
    block_size: int,
    device: torch.device,
    sliding_window: int | None,
    dense: bool,
) -> AttentionGroup:
    context_len = num_cached + num_new  # [B]
    tables = tables[:, : -(-int(context_len.max()) // block_size)]  # [B, the group's max_blocks]
    num_queries, num_keys = int(num_new.max()), tables.shape[1] * block_size

    queries = np.arange(num_queries)  # [Q]
    query_entry = num_cached[:, None] + queries[None, :]  # [B, Q]
    key_entry = np.arange(num_keys)[None, None, :]  # [1, 1, C]
    mask = (key_entry <= query_entry[:, :, None]) & (key_entry < context_len[:, None, None])
    _apply_tree_masks(mask, sequences)  # [B, Q, C]
    if sliding_window is not None:
        query_pos, key_pos = _positions(sequences, num_queries, num_keys)
        mask &= query_pos[:, :, None] - key_pos[:, None, :] < sliding_window
    valid_query = queries[None, :] < num_new[:, None]  # [B, Q]
    mask &= valid_query[:, :, None]
    mask[:, :, 0] |= ~valid_query  # padded queries look at one key, so no row is empty (no NaN)

    query_index = output_index = None
    query_token = first_token[:, None] + queries[None, :]  # [B, Q] flat token of each query
    if not dense:
        query_index = _tensor(np.where(valid_query, query_token, 0), device)
        flat_rows = np.arange(len(sequences) * num_queries).reshape(-1, num_queries)  # [B, Q]
        output_index = _tensor(flat_rows[valid_query], device)  # [T_g]
    causal = not num_cached.any() and sliding_window is None
    causal &= all(s.tree_mask is None for s in sequences)
    return AttentionGroup(
        block_tables=_tensor(tables, device),
        mask=_tensor(mask[:, None], device),  # [B, 1, Q, C]
        causal=bool(causal),
        query_index=query_index,
        output_index=output_index,
        first_token=torch.from_numpy(first_token),
        num_new=torch.from_numpy(num_new),
        tokens=torch.from_numpy(query_token[valid_query]),
    )


def entry_slots(
    tables: np.ndarray,  # [B, max_blocks]
    first_entry: np.ndarray,  # [B] each sequence's first entry wanted (new tokens: num_cached)
    num_entries: np.ndarray,  # [B] how many entries from there (new tokens: num_new)
    first_row: np.ndarray,  # [B] cumsum(num_entries) - num_entries: each one's first row
    block_size: int,
) -> np.ndarray:  # [N] flat cache slot of each wanted entry, sequence by sequence
    row = np.repeat(np.arange(len(tables)), num_entries)  # [N] its sequence
    entry = first_entry[row] + np.arange(len(row)) - first_row[row]  # [N] its cache entry
    return tables[row, entry // block_size] * block_size + entry % block_size


def _positions(sequences: list[SequenceAttention], num_queries: int, num_keys: int):
    """Positions of queries [B, Q] and keys [B, C]: entry indices unless a sequence says."""
    key_pos = np.tile(np.arange(num_keys), (len(sequences), 1))  # [B, C]
    query_pos = np.zeros((len(sequences), num_queries), dtype=np.int64)  # [B, Q]
    for row, s in enumerate(sequences):
        new = slice(s.num_cached, s.num_cached + s.num_new)
        if s.positions is not None:
            key_pos[row, new] = s.positions
        query_pos[row, : s.num_new] = key_pos[row, new]
    return query_pos, key_pos


def used_block_tables(
    sequences: list[SequenceAttention], block_size: int
) -> np.ndarray:  # [B, max_blocks] int64
    """The blocks each sequence reads: those holding its context and new tokens. A block table
    may run further (a speculative engine keeps scratch room for draft trees after the context),
    and gathering those blocks would only add masked keys."""
    used = [s.block_table[: -(-(s.num_cached + s.num_new) // block_size)] for s in sequences]
    width = max(map(len, used))
    return np.array([blocks + [0] * (width - len(blocks)) for blocks in used], dtype=np.int64)


def _apply_tree_masks(mask: np.ndarray, sequences: list[SequenceAttention]) -> None:
    """Replace the causal mask over each tree's entries by its ancestor mask."""
    for row, s in enumerate(sequences):
        if s.tree_mask is not None:
            end = s.num_cached + s.num_new
            mask[row, : s.num_new, end - s.tree_mask.shape[1] : end] = s.tree_mask.cpu().numpy()


def new_token_slots(
    sequences: list[SequenceAttention], block_size: int, device: torch.device
) -> torch.Tensor:  # [T] flat cache slot of each new token, sequence by sequence
    """Where the new tokens' K/V goes, for a pass that only stores it (no attention)."""
    return _tensor(_NewTokens.of(sequences, block_size).slots, device)


def store_kv(
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)  # [num_slots, KV, D]
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    outputs = [group_attention(q, k, k_cache, v_cache, group, scale) for group in meta.groups]
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [T, H * D] group by group
    return out if meta.token_order is None else out[meta.token_order]


def group_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:  # [T_g, H * D] the group's real queries, sequence by sequence
    num_heads, head_dim = q.shape[1:]
    tables = group.block_tables  # [B, max_blocks]
    # [B, Q, H, D]
    queries = (
        q.view(len(tables), -1, *q.shape[1:]) if group.query_index is None else q[group.query_index]
    )
    blocks = tables.view(-1)  # [B * max_blocks]
    keys = k_cache.index_select(0, blocks).view(len(tables), -1, *k.shape[1:])  # [B, C, KV, D]
    values = v_cache.index_select(0, blocks).view(len(tables), -1, *k.shape[1:])
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # [B, H, Q, D]
        keys.transpose(1, 2),  # [B, KV, C, D]
        values.transpose(1, 2),
        attn_mask=None if group.causal else group.mask,  # [B, 1, Q, C]
        is_causal=group.causal,  # query i sees keys 0..i (top-left aligned): the same mask
        scale=scale,
        enable_gqa=num_heads != k.shape[1],  # k's head count is static when compiled
    )  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)  # [B * Q, H * D]
    return out if group.output_index is None else out[group.output_index]
