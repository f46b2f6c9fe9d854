"""The flash-attn backend (layers/flash_attention.py) on the CPU, with flash-attn's varlen
kernel replaced by a torch stand-in of the same signature and semantics (`reference_varlen`):
its merge, its metadata and its whole path equal the torch backend, for causal batches and draft
trees, and the backend is chosen only where flash-attn can run. The real kernel needs a GPU and
flash-attn, so it is the one part these tests do not run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import AerieError
from engine.execution.layers.flash_attention import (
    build_flash_attention_metadata,
    flash_paged_attention,
    flash_supports,
    load_flash_kernel,
    merge_attention,
    packed_lse,
    select_attention_backend,
)
from engine.execution.layers.paged_attention import (
    SequenceAttention,
    build_attention_metadata,
    paged_attention,
)
from tests.conftest import save_random_head
from tests.engine.helpers import cpu_options, random_prompt

CPU = torch.device("cpu")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8  # GQA: two query heads per KV head
BLOCK_SIZE = 4  # smaller than every prompt below
NUM_BLOCKS = 64
SCALE = HEAD_DIM**-0.5
TOLERANCE = 1e-5  # fp32


# ------------------------------------------------------------------ the kernel's stand-in
def reference_varlen(
    q: torch.Tensor,  # [total_q, H, D]
    k: torch.Tensor,  # [total_k, KV, D]
    v: torch.Tensor,  # [total_k, KV, D]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """`flash_attn.flash_attn_varlen_func` in torch: per sequence b, queries
    q[cu_q[b]:cu_q[b+1]] over keys k[cu_k[b]:cu_k[b+1]]; causal and window aligned bottom-right
    (query i of sq over sk keys sees key j iff j <= i + sk - sq, and j >= i + sk - sq - left);
    returns out [total_q, H, D] and, with return_attn_probs, (out, lse [H, total_q] float32, None).
    A row with no key gets out 0 and lse +inf, as flash-attn's kernel gives it."""
    assert dropout_p == 0.0 and alibi_slopes is None
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    right = 0 if causal else right
    outs, lses = [], []
    for b in range(len(cu_seqlens_q) - 1):
        qb = q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]].float()  # [sq, H, D]
        kb = k[cu_seqlens_k[b] : cu_seqlens_k[b + 1]].float()  # [sk, KV, D]
        vb = v[cu_seqlens_k[b] : cu_seqlens_k[b + 1]].float()
        assert len(qb) <= max_seqlen_q and len(kb) <= max_seqlen_k
        group = q.shape[1] // k.shape[1]
        kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)  # [sk, H, D]
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * scale  # [H, sq, sk]
        diagonal = torch.arange(len(qb))[:, None] + len(kb) - len(qb)  # [sq, 1]
        key = torch.arange(len(kb))[None, :]  # [1, sk]
        allowed = torch.ones(len(qb), len(kb), dtype=torch.bool)
        if right >= 0:
            allowed &= key <= diagonal + right
        if left >= 0:
            allowed &= key >= diagonal - left
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, -1)  # [H, sq]
        probs = torch.nan_to_num(torch.exp(scores - lse[..., None]))  # [H, sq, sk]
        outs.append(torch.einsum("hqk,khd->qhd", probs, vb))  # [sq, H, D]
        lses.append(torch.where(torch.isneginf(lse), float("inf"), lse))
    out = torch.cat(outs).to(q.dtype)  # [total_q, H, D]
    return (out, torch.cat(lses, dim=1), None) if return_attn_probs else out


class CountingKernel:
    """`reference_varlen`, counting its causal and non-causal calls."""

    def __init__(self) -> None:
        self.calls = {True: 0, False: 0}

    def __call__(self, *args, causal: bool = False, **options):
        self.calls[causal] += 1
        return reference_varlen(*args, causal=causal, **options)


def test_the_stand_in_agrees_with_sdpa() -> None:
    """The stand-in itself, against SDPA: causal bottom-right over a cached prefix."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(7, NUM_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(7, NUM_HEADS, HEAD_DIM, generator=gen)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    out, lse, _ = reference_varlen(q, k, v, cu_q, cu_k, 3, 7, causal=True, return_attn_probs=True)
    mask = torch.arange(7)[None, :] <= torch.arange(3)[:, None] + 4  # [3, 7]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)  # [3, H, D]
    assert torch.allclose(out, expected, atol=TOLERANCE)
    assert lse.shape == (NUM_HEADS, 3)


# ------------------------------------------------------------------ (a) the merge
def attention_with_lse(q, k, v):  # q [N, H, D], k/v [M, H, D] -> out [N, H, D], lse [N, H]
    scores = torch.einsum("nhd,mhd->nhm", q, k) * SCALE  # [N, H, M]
    return torch.einsum("nhm,mhd->nhd", scores.softmax(-1), v), scores.logsumexp(-1)


def test_merging_two_partial_attentions_equals_attention_over_all_keys() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, NUM_HEADS, HEAD_DIM, generator=gen)  # [N, H, D]
    k = torch.randn(11, NUM_HEADS, HEAD_DIM, generator=gen) * 3  # [M, H, D], peaky softmax
    v = torch.randn(11, NUM_HEADS, HEAD_DIM, generator=gen)
    full, _ = attention_with_lse(q, k, v)
    out_a, lse_a = attention_with_lse(q, k[:7], v[:7])
    out_b, lse_b = attention_with_lse(q, k[7:], v[7:])
    merged = merge_attention(out_a, lse_a, out_b, lse_b)
    assert merged.dtype == torch.float32
    assert torch.allclose(merged, full, atol=TOLERANCE)
    # a part with no keys (lse -inf) contributes nothing
    nothing = torch.full_like(lse_a, float("-inf"))
    assert torch.allclose(merge_attention(torch.zeros_like(out_a), nothing, full, lse_b), full)


def test_padded_lse_is_packed() -> None:
    """flash-attn before 2.6 returned a varlen lse padded to [B, H, max_seqlen_q]."""
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    padded = torch.arange(2 * NUM_HEADS * 3, dtype=torch.float32).view(2, NUM_HEADS, 3)
    packed = packed_lse(padded, cu_q)  # [H, 5]
    expected = torch.cat([padded[0, :, :2], padded[1, :, :3]], dim=1)
    assert torch.equal(packed, expected)
    assert packed_lse(expected, cu_q) is expected


# ------------------------------------------------------------------ (b) the whole path
def random_step(sequences: list[SequenceAttention], seed: int):
    """A filled K/V cache and the step's q, k, v: cache [NUM_BLOCKS, BLOCK_SIZE, KV, D] x 2."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(s.num_new for s in sequences)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return cache, q, k, v


def both_backends(sequences, seed: int = 0, sliding_window: int | None = None):
    """The step's attention [T, H * D] on the torch backend and on the flash path (stand-in
    kernel), each over its own copy of the same cache; and the kernel's call counts."""
    (k_cache, v_cache), q, k, v = random_step(sequences, seed)
    torch_meta = build_attention_metadata(sequences, BLOCK_SIZE, CPU, sliding_window)
    kernel = CountingKernel()
    flash_meta = build_flash_attention_metadata(sequences, BLOCK_SIZE, CPU, kernel, sliding_window)
    expected = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), torch_meta, SCALE)
    ours = flash_paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), flash_meta, SCALE)
    return ours, expected, kernel.calls


def table(first: int, num_blocks: int) -> list[int]:
    """A block table of scattered blocks (every third), never block 0."""
    return [1 + 3 * (first + i) % (NUM_BLOCKS - 1) for i in range(num_blocks)]


def ancestor_mask(parents: list[int]) -> torch.Tensor:  # [N, N] node i sees its ancestors and i
    mask = torch.eye(len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
    return mask


def test_causal_batch_equals_the_torch_backend() -> None:
    """A prefill from scratch, a chunk after a cached prefix, decodes, and a table that runs past
    the context (a speculative engine's scratch room)."""
    sequences = [
        SequenceAttention(table(0, 3), num_cached=0, num_new=11),
        SequenceAttention(table(3, 4), num_cached=6, num_new=7),
        SequenceAttention(table(7, 3), num_cached=9, num_new=1),
        SequenceAttention(table(10, 6), num_cached=13, num_new=1),
    ]
    ours, expected, calls = both_backends(sequences)
    assert ours.shape == (11 + 7 + 1 + 1, NUM_HEADS * HEAD_DIM)
    assert torch.allclose(ours, expected, atol=TOLERANCE)
    assert calls == {True: 1, False: 0}


def test_sliding_window_equals_the_torch_backend() -> None:
    sequences = [
        SequenceAttention(table(0, 4), num_cached=5, num_new=9),
        SequenceAttention(table(4, 3), num_cached=10, num_new=1),
    ]
    ours, expected, _ = both_backends(sequences, seed=1, sliding_window=3)
    assert torch.allclose(ours, expected, atol=TOLERANCE)


def test_tree_verification_equals_the_torch_backend() -> None:
    """Draft trees (prefixes longer than a block) beside a prefill chunk and a decode, the tree
    sequences first, so the outputs are put back in token order."""
    sequences = [
        SequenceAttention(
            table(0, 4),
            num_cached=9,
            num_new=5,
            tree_mask=ancestor_mask([-1, 0, 0, 1, 2]),
            positions=[9, 10, 10, 11, 11],
        ),
        SequenceAttention(table(4, 2), num_cached=2, num_new=6),  # a chunk
        SequenceAttention(
            table(6, 3),
            num_cached=5,
            num_new=3,
            tree_mask=ancestor_mask([-1, 0, 1]),
            positions=[5, 6, 7],
        ),
        SequenceAttention(table(9, 3), num_cached=10, num_new=1),  # a decode
    ]
    ours, expected, calls = both_backends(sequences, seed=2)
    assert torch.allclose(ours, expected, atol=TOLERANCE)
    assert calls == {True: 1, False: 1}  # one causal call, one over the trees' prefixes


def test_a_window_wider_than_the_new_tokens_equals_the_torch_backend() -> None:
    """A tree mask may cover entries already cached (a draft head's earlier layers)."""
    mask = ancestor_mask([-1, 0, 0, 1, 2])[2:]  # nodes 2-4 new; 0 and 1 cached before them
    sequences = [SequenceAttention(table(0, 4), num_cached=8, num_new=3, tree_mask=mask)]
    ours, expected, _ = both_backends(sequences, seed=3)
    assert torch.allclose(ours, expected, atol=TOLERANCE)


def test_steps_flash_cannot_express_go_to_torch() -> None:
    tree = ancestor_mask([-1, 0])
    with_tree = SequenceAttention([1, 2], num_cached=5, num_new=2, tree_mask=tree)
    no_prefix = SequenceAttention([1], num_cached=0, num_new=2, tree_mask=tree)
    plain = SequenceAttention([1, 2], num_cached=5, num_new=2)
    assert flash_supports([with_tree, plain], sliding_window=None)
    assert flash_supports([plain], sliding_window=4)
    assert not flash_supports([with_tree, plain], sliding_window=4)
    assert not flash_supports([no_prefix], sliding_window=None)


# ------------------------------------------------------------------ through the engine
@pytest.fixture(scope="module")
def head(generation_model: Path, tmp_path_factory) -> Path:
    return save_random_head(tmp_path_factory.mktemp("flash-head") / "head", generation_model)


def speculative_llm(generation_model: Path, head: Path) -> LLM:
    """Whole trees every step (no adaptive budget), blocks smaller than the prompts."""
    return LLM(
        str(generation_model),
        draft=str(head),
        draft_top_k=2,
        draft_depth=3,
        draft_total_tokens=6,
        adaptive_draft_budget=False,
        **cpu_options(block_size=BLOCK_SIZE),
    )


def test_engine_output_is_the_same_on_the_flash_path(generation_model, head) -> None:
    """Greedy speculative decoding of prompts prefilled beside other requests' tree verifications:
    the same tokens with the target's attention on the flash path as on the torch backend."""
    rng = random.Random(0)
    prompts = [random_prompt(rng, n) for n in (5, 9, 14)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = speculative_llm(generation_model, head).generate(prompts, params, use_tqdm=False)

    llm = speculative_llm(generation_model, head)
    assert llm.engine.runner.flash_kernel is None  # the CPU chooses the torch backend
    kernel = CountingKernel()
    llm.engine.runner.flash_kernel = kernel
    ours = llm.generate(prompts, params, use_tqdm=False)

    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in expected]
    assert kernel.calls[True] > 0 and kernel.calls[False] > 0  # prefills and trees both ran
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


# ------------------------------------------------------------------ (c) selection
def test_the_cpu_uses_the_torch_backend() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert select_attention_backend("auto", CPU, dtype, HEAD_DIM, compiled=False) == "torch"
    with pytest.raises(ValueError, match=r"flash.*CUDA"):
        select_attention_backend("flash", CPU, torch.bfloat16, HEAD_DIM, compiled=False)


def test_flash_needs_half_precision_and_no_compile() -> None:
    cuda = torch.device("cuda")  # a device object needs no GPU
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        select_attention_backend("flash", cuda, torch.float32, HEAD_DIM, compiled=False)
    with pytest.raises(ValueError, match="enable_torch_compile"):
        select_attention_backend("flash", cuda, torch.bfloat16, HEAD_DIM, compiled=True)
    assert select_attention_backend("auto", cuda, torch.float32, HEAD_DIM, False) == "torch"
    assert select_attention_backend("torch", cuda, torch.bfloat16, HEAD_DIM, False) == "torch"


@pytest.mark.skipif(load_flash_kernel() is not None, reason="flash-attn is installed here")
def test_without_flash_attn_cuda_uses_torch_and_forcing_flash_says_why() -> None:
    cuda = torch.device("cuda")
    assert select_attention_backend("auto", cuda, torch.bfloat16, HEAD_DIM, False) == "torch"
    with pytest.raises(ValueError, match="flash-attn is not installed"):
        select_attention_backend("flash", cuda, torch.bfloat16, HEAD_DIM, compiled=False)


def test_the_option_is_validated() -> None:
    assert EngineConfig().attention_backend == "auto"
    with pytest.raises(AerieError, match="attention_backend"):
        EngineConfig(attention_backend="xformers")
