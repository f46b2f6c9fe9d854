"""The flash-attn backend of paged attention: CUDA, fp16/bf16, only when flash-attn is installed.

flash-attn 2's own paged kernel (`flash_attn_with_kvcache(..., block_table=...)`) needs blocks of a
multiple of 256 entries, and ours are 16 by default. So each step gathers every sequence's keys
from its blocks into one packed tensor and calls `flash_attn_varlen_func` over them:

- prefill chunks and decodes: one causal call. flash-attn (>= 2.1) aligns the causal mask to the
  bottom right, so with n new tokens over c keys, query i sees keys 0 .. c - n + i: the cached
  context plus the new tokens up to itself.
- draft trees: a non-causal call over each tree's cached prefix (every node sees all of it), which
  also returns the softmax's log-sum-exp, and a small masked attention in torch over the tree's own
  entries (a node sees its ancestors), the two merged by their log-sum-exp (`merge_attention`).

The kernel is an argument (`FlashAttentionMetadata.kernel`, flash-attn's `flash_attn_varlen_func`
itself in service), so the tests run this whole path on a CPU with a torch stand-in of the same
signature and semantics (tests/engine/test_flash_attention.py). The real kernel has not run in
this project's CI, which has no GPU: what is tested is everything around it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import AerieError
from engine.execution.layers.paged_attention import (
    SequenceAttention,
    entry_slots,
    store_kv,
    used_block_tables,
)

BACKENDS = ("auto", "torch", "flash")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_FLASH_HEAD_DIM = 256  # flash-attn 2's largest head dimension
NO_WINDOW = (-1, -1)  # flash-attn's window_size for unlimited attention

# flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
# max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), ...,
# return_attn_probs=False); with return_attn_probs=True: (out [total_q, H, D], softmax_lse
# [H, total_q] float32, S_dmask), and S_dmask is only computed when dropout_p > 0.
VarlenAttention = Callable[..., tuple[torch.Tensor, ...]]


# ------------------------------------------------------------------------------ selection
def load_flash_kernel() -> VarlenAttention | None:
    """flash-attn's varlen kernel, or None when flash-attn is not installed (or does not load)."""
    try:
        flash_attn = importlib.import_module("flash_attn")
    except ImportError:
        return None
    return flash_attn.flash_attn_varlen_func


def flash_unavailable_reason(
    device: torch.device, dtype: torch.dtype, head_dim: int, compiled: bool
) -> str | None:
    """Why the flash backend cannot serve this model here, or None when it can."""
    if device.type != "cuda":
        return f"it runs on CUDA only, and the device is {device}"
    if dtype not in FLASH_DTYPES:
        return f"it needs float16 or bfloat16, and the dtype is {dtype}"
    if head_dim > MAX_FLASH_HEAD_DIM:
        return f"flash-attn 2 takes head dimensions up to {MAX_FLASH_HEAD_DIM}, not {head_dim}"
    if compiled:
        return "it is not used with enable_torch_compile (that combination is untested)"
    if load_flash_kernel() is None:
        return "flash-attn is not installed (pip install 'aerie[cuda]')"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "flash-attn 2 needs an Ampere or newer GPU"
    return None


def select_attention_backend(
    requested: str, device: torch.device, dtype: torch.dtype, head_dim: int, compiled: bool
) -> str:
    """ "torch" or "flash". "auto" takes flash-attn where it can run; "flash" insists on it."""
    if requested not in BACKENDS:
        raise AerieError(f"attention_backend must be one of {BACKENDS}, not {requested!r}")
    if requested == "torch":
        return "torch"
    reason = flash_unavailable_reason(device, dtype, head_dim, compiled)
    if reason is None:
        return "flash"
    if requested == "flash":
        raise AerieError(f"attention_backend 'flash' cannot be used: {reason}")
    return "torch"


def flash_supports(sequences: list[SequenceAttention], sliding_window: int | None) -> bool:
    """Whether the flash path computes this step exactly; the torch backend takes the others.

    A draft tree's nodes sit at positions (prefix + depth) that flash-attn's window cannot express,
    so a sliding-window model verifies trees with torch. A tree needs a cached prefix: flash-attn
    gives an empty row a log-sum-exp of +inf, which the merge cannot weigh."""
    for s in sequences:
        if sliding_window is not None and (s.tree_mask is not None or s.positions is not None):
            return False
        if s.tree_mask is not None and s.num_cached + s.num_new - s.tree_mask.shape[1] < 1:
            return False
    return True


# ------------------------------------------------------------------------------ metadata
@dataclass(frozen=True)
class VarlenBatch:
    """Some sequences' queries and keys, packed for one varlen kernel call."""

    query_rows: torch.Tensor | None  # [Tq] step token of each packed query; None: all, in order
    key_slots: torch.Tensor  # [Tk] flat cache slot of each packed key, sequence by sequence
    cu_seqlens_q: torch.Tensor  # [B + 1] int32 offsets of each sequence's queries
    cu_seqlens_k: torch.Tensor  # [B + 1] int32 offsets of each sequence's keys
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class TreeBatch:
    """The draft-tree sequences: a non-causal call over their cached prefixes, and their trees'
    own entries padded to [B, Q] queries by [B, W] keys for one masked attention in torch."""

    prefix: VarlenBatch  # queries: the tree nodes; keys: the entries before the tree's window
    window_slots: torch.Tensor  # [B, W] flat cache slot of each tree entry (padding: 0)
    window_mask: torch.Tensor  # [B, 1, Q, W] True where a node may attend (its ancestors)
    query_index: torch.Tensor  # [B, Q] row of each padded query in the packed tree queries
    output_index: torch.Tensor  # [Tt] row of each real query in the [B * Q] padded output


@dataclass(frozen=True)
class FlashAttentionMetadata:
    """One step's attention on the flash backend, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    kernel: VarlenAttention
    causal: VarlenBatch | None  # the sequences without a tree
    trees: TreeBatch | None  # the sequences with one
    window_size: tuple[int, int]  # flash-attn's (left, right) for the causal call
    # [T] row of each token in [causal outputs; tree outputs]; None when that is token order
    token_order: torch.Tensor | None


def build_flash_attention_metadata(
    sequences: list[SequenceAttention],
    block_size: int,
    device: torch.device,
    kernel: VarlenAttention,
    sliding_window: int | None = None,
) -> FlashAttentionMetadata:
    """Metadata for one step whose sequences `flash_supports`."""
    num_cached = torch.tensor([s.num_cached for s in sequences])  # [B]
    num_new = torch.tensor([s.num_new for s in sequences])  # [B]
    first_token = torch.cumsum(num_new, 0) - num_new  # [B] flat index of each one's first token
    tables = torch.from_numpy(used_block_tables(sequences, block_size))  # [B, max_blocks]
    slot_mapping = _entry_slots(tables, num_cached, num_new, first_token, block_size)  # [T]
    window = torch.tensor([0 if s.tree_mask is None else s.tree_mask.shape[1] for s in sequences])
    num_keys = num_cached + num_new - window  # [B] keys of the varlen calls: a tree's prefix
    plain = [i for i, s in enumerate(sequences) if s.tree_mask is None]
    tree = [i for i, s in enumerate(sequences) if s.tree_mask is not None]

    def varlen(rows: list[int]) -> VarlenBatch:
        return _varlen_batch(rows, tables, first_token, num_new, num_keys, block_size, device)

    trees = None
    if tree:
        window_parts = _tree_window([sequences[i] for i in tree], tables[tree], block_size, device)
        trees = TreeBatch(varlen(tree), *window_parts)
    return FlashAttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        kernel=kernel,
        causal=varlen(plain) if plain else None,
        trees=trees,
        window_size=NO_WINDOW if sliding_window is None else (sliding_window - 1, 0),
        token_order=_token_order(plain + tree, first_token, num_new, device),
    )


def _varlen_batch(
    rows: list[int],  # the step's sequences in this call
    tables: torch.Tensor,  # [B, max_blocks] of the whole step
    first_token: torch.Tensor,  # [B] flat index of each sequence's first new token
    num_new: torch.Tensor,  # [B] queries of each sequence
    num_keys: torch.Tensor,  # [B] keys of each sequence: its first num_keys entries
    block_size: int,
    device: torch.device,
) -> VarlenBatch:
    first_token, num_new, num_keys = first_token[rows], num_new[rows], num_keys[rows]  # [B_c]
    first_key = torch.cumsum(num_keys, 0) - num_keys  # [B_c] each one's first packed key
    key_slots = _entry_slots(
        tables[rows], torch.zeros_like(num_keys), num_keys, first_key, block_size
    )
    query_rows = None  # every sequence of the step: the packed queries are q itself
    if len(rows) < len(tables):  # packed query j of sequence b is step token first_token[b] + j
        shift = first_token - (torch.cumsum(num_new, 0) - num_new)  # [B_c] step row - packed row
        packed = torch.arange(int(num_new.sum()))  # [Tq]
        query_rows = (torch.repeat_interleave(shift, num_new) + packed).to(device)  # [Tq]
    return VarlenBatch(
        query_rows=query_rows,
        key_slots=key_slots.to(device),
        cu_seqlens_q=_cumulative(num_new, device),
        cu_seqlens_k=_cumulative(num_keys, device),
        max_seqlen_q=int(num_new.max()),
        max_seqlen_k=int(num_keys.max()),
    )


def _entry_slots(
    tables: torch.Tensor,  # [B, max_blocks]
    first_entry: torch.Tensor,  # [B]
    num_entries: torch.Tensor,  # [B]
    first_row: torch.Tensor,  # [B]
    block_size: int,
) -> torch.Tensor:  # [N]
    """paged_attention.entry_slots (numpy) over CPU torch tensors."""
    arrays = (tables, first_entry, num_entries, first_row)
    return torch.from_numpy(entry_slots(*(a.numpy() for a in arrays), block_size))


def _cumulative(lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[B] lengths -> [B + 1] int32 offsets (flash-attn's cu_seqlens)."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(device, torch.int32)


def _tree_window(
    sequences: list[SequenceAttention],  # every one with a tree_mask
    tables: torch.Tensor,  # [B, max_blocks]
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree's window is its last W entries (W = tree_mask.shape[1] >= its new tokens):
    (window_slots [B, W], window_mask [B, 1, Q, W], query_index [B, Q], output_index [Tt])."""
    num_new = torch.tensor([s.num_new for s in sequences])  # [B]
    width = torch.tensor([s.tree_mask.shape[1] for s in sequences])  # [B]
    window_start = torch.tensor([s.num_cached + s.num_new for s in sequences]) - width  # [B]
    num_queries, num_keys = int(num_new.max()), int(width.max())
    valid_key = torch.arange(num_keys)[None, :] < width[:, None]  # [B, W]
    entry = torch.where(valid_key, window_start[:, None] + torch.arange(num_keys), 0)  # [B, W]
    rows = torch.arange(len(sequences))[:, None]  # [B, 1]
    slots = tables[rows, entry // block_size] * block_size + entry % block_size  # [B, W]
    mask = torch.zeros(len(sequences), num_queries, num_keys, dtype=torch.bool)  # [B, Q, W]
    for row, s in enumerate(sequences):
        mask[row, : s.num_new, : s.tree_mask.shape[1]] = s.tree_mask
    valid_query = torch.arange(num_queries)[None, :] < num_new[:, None]  # [B, Q]
    mask[:, :, 0] |= ~valid_query  # padded queries look at one key, so no row is empty (no NaN)
    first_query = torch.cumsum(num_new, 0) - num_new  # [B] row of each tree's root, packed
    query_index = torch.where(valid_query, first_query[:, None] + torch.arange(num_queries), 0)
    output_index = torch.arange(len(sequences) * num_queries).view(-1, num_queries)[valid_query]
    return (
        torch.where(valid_key, slots, 0).to(device),
        mask.unsqueeze(1).to(device),
        query_index.to(device),
        output_index.to(device),
    )


def _token_order(
    rows: list[int], first_token: torch.Tensor, num_new: torch.Tensor, device: torch.device
) -> torch.Tensor | None:
    """[T] row of each token in the stacked outputs of the sequences `rows`, in that order;
    None when the stacking is already token order."""
    if rows == sorted(rows):
        return None
    stacked = torch.cat([torch.arange(first_token[i], first_token[i] + num_new[i]) for i in rows])
    return stacked.argsort().to(device)


# ------------------------------------------------------------------------------ attention
def flash_paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    meta: FlashAttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    keys = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, KV, D]
    values = v_cache.view(-1, *v_cache.shape[2:])
    outputs = []
    if meta.causal is not None:
        out, _ = _varlen_attention(
            meta.kernel, q, keys, values, meta.causal, scale, causal=True, window=meta.window_size
        )  # [T_c, H, D]
        outputs.append(out)
    if meta.trees is not None:
        outputs.append(_tree_attention(meta.kernel, q, keys, values, meta.trees, scale))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [T, H, D] causal, then trees
    out = out if meta.token_order is None else out[meta.token_order]
    return out.reshape(len(out), -1)


def _varlen_attention(
    kernel: VarlenAttention,
    q: torch.Tensor,  # [T, H, D]
    keys: torch.Tensor,  # [num_slots, KV, D]
    values: torch.Tensor,  # [num_slots, KV, D]
    batch: VarlenBatch,
    scale: float,
    causal: bool,
    window: tuple[int, int] = NO_WINDOW,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [Tq, H, D], lse [Tq, H] float32
    queries = q if batch.query_rows is None else q[batch.query_rows]  # [Tq, H, D]
    out, lse, _ = kernel(
        queries,
        keys[batch.key_slots],  # [Tk, KV, D]: flash-attn handles GQA (KV dividing H) itself
        values[batch.key_slots],
        batch.cu_seqlens_q,
        batch.cu_seqlens_k,
        batch.max_seqlen_q,
        batch.max_seqlen_k,
        softmax_scale=scale,
        causal=causal,
        window_size=window,
        return_attn_probs=True,  # for the log-sum-exp; no probabilities without dropout
    )
    return out, packed_lse(lse, batch.cu_seqlens_q).T


def packed_lse(
    lse: torch.Tensor,  # [H, Tq], or flash-attn < 2.6's padded [B, H, max_seqlen_q]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
) -> torch.Tensor:  # [H, Tq]
    """The varlen log-sum-exp in its packed layout, whichever layout the kernel returned."""
    if lse.dim() == 2:
        return lse
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # [B]
    total = int(cu_seqlens_q[-1])
    row = torch.repeat_interleave(
        torch.arange(len(lengths), device=lse.device), lengths, output_size=total
    )
    index = torch.arange(total, device=lse.device) - cu_seqlens_q[row].long()  # [Tq]
    return lse[row, :, index].T  # [H, Tq]


def _tree_attention(
    kernel: VarlenAttention,
    q: torch.Tensor,  # [T, H, D]
    keys: torch.Tensor,  # [num_slots, KV, D]
    values: torch.Tensor,
    trees: TreeBatch,
    scale: float,
) -> torch.Tensor:  # [Tt, H, D] every tree node's attention over its prefix and its ancestors
    prefix_out, prefix_lse = _varlen_attention(
        kernel, q, keys, values, trees.prefix, scale, causal=False
    )  # [Tt, H, D], [Tt, H]
    nodes = q if trees.prefix.query_rows is None else q[trees.prefix.query_rows]  # [Tt, H, D]
    window_out, window_lse = masked_attention_with_lse(
        nodes[trees.query_index],  # [B, Q, H, D]
        keys[trees.window_slots],  # [B, W, KV, D]
        values[trees.window_slots],
        trees.window_mask,
        scale,
    )  # [B, Q, H, D], [B, Q, H]
    window_out = window_out.flatten(0, 1)[trees.output_index]  # [Tt, H, D]
    window_lse = window_lse.flatten(0, 1)[trees.output_index]  # [Tt, H]
    return merge_attention(prefix_out, prefix_lse, window_out, window_lse)


def masked_attention_with_lse(
    queries: torch.Tensor,  # [B, Q, H, D]
    keys: torch.Tensor,  # [B, W, KV, D]
    values: torch.Tensor,  # [B, W, KV, D]
    mask: torch.Tensor,  # [B, 1, Q, W] True where a query may attend; no row all False
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Q, H, D] (queries' dtype), lse [B, Q, H] fp32
    """Attention and its log-sum-exp, in float32: for the few keys of draft trees."""
    group = queries.shape[2] // keys.shape[2]  # query heads per KV head
    keys = keys.repeat_interleave(group, dim=2).float()  # [B, W, H, D]
    values = values.repeat_interleave(group, dim=2).float()
    scores = torch.einsum("bqhd,bkhd->bhqk", queries.float(), keys) * scale  # [B, H, Q, W]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Q]
    probs = torch.exp(scores - lse[..., None])  # [B, H, Q, W]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values)  # [B, Q, H, D]
    return out.to(queries.dtype), lse.transpose(1, 2)


def merge_attention(
    out_a: torch.Tensor,  # [N, H, D] attention over key set A
    lse_a: torch.Tensor,  # [N, H] log-sum-exp of the scaled scores over A
    out_b: torch.Tensor,  # [N, H, D] attention over key set B (disjoint from A)
    lse_b: torch.Tensor,  # [N, H]
) -> torch.Tensor:  # [N, H, D] attention over A and B together, in out_a's dtype
    """Softmax over A and B together weighs each part's output by its share of the whole
    exp-sum: exp(lse_part - lse_all), where lse_all = log(exp(lse_a) + exp(lse_b)). A part with no
    keys (lse -inf) gets weight 0."""
    lse = torch.logaddexp(lse_a.float(), lse_b.float())  # [N, H]
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)  # [N, H, 1]
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return (weight_a * out_a.float() + weight_b * out_b.float()).to(out_a.dtype)
