"""Attention over a paged KV cache: the per-step metadata and the torch (SDPA) backend.

Every sequence in a step brings `num_new` query tokens and attends to its whole context (the tokens
already cached plus the new ones). The metadata says where each new token's K/V is written
(`slot_mapping`) and which blocks each sequence reads (`block_tables`), built once per step
and shared by every layer. Keys are gathered block by block (whole blocks are contiguous in the
cache, so the copy runs at memory speed), which pads each sequence's keys to whole blocks; the
mask hides the padding. Queries are padded per sequence to [B, Q] so that one SDPA call
serves the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

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
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] each sequence's blocks (padding: block 0)
    mask: torch.Tensor  # [B, 1, Q, C] True where a query may attend
    query_index: torch.Tensor | None  # [B, Q] flat token of each padded query; None when B == 1
    output_index: torch.Tensor | None  # [T] row of each token in the flattened [B * Q] output


def build_attention_metadata(
    sequences: list[SequenceAttention],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Metadata for one step, shared by every layer."""
    num_cached = torch.tensor([s.num_cached for s in sequences])  # [B]
    num_new = torch.tensor([s.num_new for s in sequences])  # [B]
    context_len = num_cached + num_new  # [B]
    tables = _block_tables(sequences)  # [B, max_blocks]
    num_queries, num_keys = int(num_new.max()), tables.shape[1] * block_size

    query_entry = num_cached[:, None] + torch.arange(num_queries)[None, :]  # [B, Q]
    key_entry = torch.arange(num_keys)[None, None, :]  # [1, 1, C]
    mask = (key_entry <= query_entry[:, :, None]) & (key_entry < context_len[:, None, None])
    _apply_tree_masks(mask, sequences)  # [B, Q, C]
    if sliding_window is not None:
        query_pos, key_pos = _positions(sequences, num_queries, num_keys)
        mask &= query_pos[:, :, None] - key_pos[:, None, :] < sliding_window
    valid_query = torch.arange(num_queries)[None, :] < num_new[:, None]  # [B, Q]
    mask &= valid_query[:, :, None]
    mask[:, :, 0] |= ~valid_query  # padded queries look at one key, so no row is empty (no NaN)

    first_token = torch.cumsum(num_new, 0) - num_new  # [B] flat index of each one's first token
    slot_mapping = _new_token_slots(tables, num_cached, num_new, first_token, block_size)  # [T]
    query_index = output_index = None
    if len(sequences) > 1:
        query_index = torch.where(valid_query, first_token[:, None] + torch.arange(num_queries), 0)
        flat_rows = torch.arange(len(sequences) * num_queries).view(-1, num_queries)  # [B, Q]
        output_index = flat_rows[valid_query]  # [T]
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=tables.to(device),
        mask=mask.unsqueeze(1).to(device),
        query_index=None if query_index is None else query_index.to(device),
        output_index=None if output_index is None else output_index.to(device),
    )


def _new_token_slots(
    tables: torch.Tensor,  # [B, max_blocks]
    num_cached: torch.Tensor,  # [B]
    num_new: torch.Tensor,  # [B]
    first_token: torch.Tensor,  # [B] flat index of each sequence's first new token
    block_size: int,
) -> torch.Tensor:  # [T] flat cache slot of each new token, sequence by sequence
    row = torch.repeat_interleave(torch.arange(len(tables)), num_new)  # [T] its sequence
    entry = num_cached[row] + torch.arange(len(row)) - first_token[row]  # [T] its key entry
    return tables[row, entry // block_size] * block_size + entry % block_size


def _positions(sequences: list[SequenceAttention], num_queries: int, num_keys: int):
    """Positions of queries [B, Q] and keys [B, C]: entry indices unless a sequence says."""
    key_pos = torch.arange(num_keys).repeat(len(sequences), 1)  # [B, C]
    query_pos = torch.zeros(len(sequences), num_queries, dtype=torch.long)  # [B, Q]
    for row, s in enumerate(sequences):
        new = range(s.num_cached, s.num_cached + s.num_new)
        if s.positions is not None:
            key_pos[row, new.start : new.stop] = torch.tensor(s.positions)
        query_pos[row, : s.num_new] = key_pos[row, new.start : new.stop]
    return query_pos, key_pos


def _block_tables(sequences: list[SequenceAttention]) -> torch.Tensor:  # [B, max_blocks]
    max_blocks = max(len(s.block_table) for s in sequences)
    tables = torch.zeros(len(sequences), max_blocks, dtype=torch.long)
    for row, s in enumerate(sequences):
        tables[row, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
    return tables


def _apply_tree_masks(mask: torch.Tensor, sequences: list[SequenceAttention]) -> None:
    """Replace the causal mask over each tree's entries by its ancestor mask."""
    for row, s in enumerate(sequences):
        if s.tree_mask is not None:
            end = s.num_cached + s.num_new
            mask[row, : s.num_new, end - s.tree_mask.shape[1] : end] = s.tree_mask


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    num_heads, head_dim = q.shape[1:]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, KV, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)

    # [B, Q, H, D]; a single sequence needs no padding
    queries = q.unsqueeze(0) if meta.query_index is None else q[meta.query_index]
    tables = meta.block_tables  # [B, max_blocks]
    blocks = tables.view(-1)  # [B * max_blocks]
    keys = k_cache.index_select(0, blocks).view(len(tables), -1, *k.shape[1:])  # [B, C, KV, D]
    values = v_cache.index_select(0, blocks).view(len(tables), -1, *v.shape[1:])
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # [B, H, Q, D]
        keys.transpose(1, 2),  # [B, KV, C, D]
        values.transpose(1, 2),
        attn_mask=meta.mask,  # [B, 1, Q, C]
        scale=scale,
        enable_gqa=num_heads != k.shape[1],
    )  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)  # [B * Q, H * D]
    return out if meta.output_index is None else out[meta.output_index]  # [T, H * D]
