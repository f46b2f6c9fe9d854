"""The fused CPU kernels compute what the PyTorch formulations they replace compute, on the
layouts the engine hands them, and the engine runs without them where they cannot be built.

These tests skip only on a machine without a C compiler: a compiler that fails on the source fails
them, with its message (`built_or_skipped`)."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.execution.layers import cpu_kernels
from engine.execution.layers.cpu_kernels import (
    FUSED_MAX_QUERIES,
    CpuKernels,
    KernelBuildError,
    NoCompilerError,
    build_cpu_kernels,
    load_cpu_kernels,
)
from engine.execution.layers.paged_attention import (
    SequenceAttention,
    build_attention_metadata,
    paged_attention,
)
from engine.execution.layers.rotary import RotaryEmbedding, apply_rotary
from tests.engine.helpers import FIRST_TEXT_TOKEN, tiny_llm

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def built_or_skipped() -> CpuKernels:
    """The kernels; a skip where the machine has no C compiler, and where it has one that fails,
    the compiler's error (never a skip)."""
    try:
        return build_cpu_kernels()
    except NoCompilerError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def kernels():
    return built_or_skipped()


@pytest.fixture
def compiler() -> str:
    name = os.environ.get("CC", "cc")
    if shutil.which(name) is None:
        pytest.skip(f"no C compiler '{name}'")
    return name


@pytest.fixture
def source(tmp_path, monkeypatch):
    """Point the build at a C file of the test's own (and at a cache of the test's own)."""
    monkeypatch.setenv("AERIE_CACHE", str(tmp_path / "cache"))

    def _source(text: str) -> None:
        path = tmp_path / "cpu_kernels.c"
        path.write_text(text)
        monkeypatch.setattr(cpu_kernels, "SOURCE", path)

    return _source


def test_a_source_that_does_not_compile_fails_the_tests_with_the_compilers_message(
    compiler, source
):
    source("void rms_norm(float *x) { return x + ; }\n")
    with pytest.raises(KernelBuildError, match=r"cpu_kernels\.c:1:.*error") as failure:
        built_or_skipped()  # what the `kernels` fixture runs: an error, not a skip
    assert compiler in str(failure.value)


def test_a_library_without_every_kernel_fails_to_load(compiler, source):
    source("void rms_norm(void) {}\n")  # compiles, but add_rms_norm and the rest are missing
    with pytest.raises(KernelBuildError, match="add_rms_norm"):
        built_or_skipped()


def test_only_a_missing_compiler_skips(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(NoCompilerError):
        build_cpu_kernels()
    with pytest.raises(pytest.skip.Exception, match="no C compiler"):
        built_or_skipped()


def test_a_failed_build_leaves_the_engine_on_pytorchs_kernels_with_a_warning(
    compiler, source, caplog
):
    source("this is not C\n")
    with caplog.at_level(logging.WARNING, logger="engine.execution.layers.cpu_kernels"):
        assert load_cpu_kernels() is None
    assert "fused CPU kernels unavailable" in caplog.text and "error" in caplog.text


def test_rms_norm_matches_torch_on_contiguous_and_strided_rows(kernels):
    torch.manual_seed(0)
    weight = torch.randn(40)
    for x in (torch.randn(5, 40), torch.randn(3, 7, 100)[:, 2:6, 20:60], torch.randn(0, 40)):
        expected = F.rms_norm(x, (40,), weight, 1e-6)
        torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), expected, **TOLERANCE)


def test_add_rms_norm_updates_the_residual_and_norms_the_sum(kernels):
    torch.manual_seed(1)
    x, residual, weight = torch.randn(6, 48), torch.randn(6, 48), torch.randn(48)
    expected_sum = residual + x
    normed = kernels.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(normed, F.rms_norm(expected_sum, (48,), weight, 1e-5), **TOLERANCE)


def test_silu_and_mul_matches_torch(kernels):
    torch.manual_seed(2)
    gate_up = torch.randn(4, 2 * 36) * 4  # wide inputs reach silu's saturated tails
    gate, up = gate_up.split(36, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), F.silu(gate) * up, **TOLERANCE)


def test_rotary_rotates_q_and_k_in_place_inside_the_qkv_buffer(kernels):
    torch.manual_seed(3)
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 5
    rotary = RotaryEmbedding(1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim), 1.0, 64)
    cos_sin = rotary.cos_sin(torch.tensor([0, 3, 9, 10, 63]), torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    values_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    expected = apply_rotary(qk.clone(), *cos_sin)
    kernels.rotary_(qk, *cos_sin)
    torch.testing.assert_close(qk, expected, rtol=0, atol=0)  # same products and sums, unfused
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim :], values_before)


def _attention_case(sliding_window: int | None, head_dim: int):
    """A step of four sequences as an EAGLE engine lays one out: a decode, a short chunk, a draft
    tree of 4 nodes (branching after the root) and a decode, the last two over contexts of a few
    of the kernel's tiles (64 entries), so its softmax rescales; K/V heads shared by groups of
    three query heads, block size 4. The queries are scaled up so that scores spread widely."""
    torch.manual_seed(4)
    block_size, heads, kv_heads, num_blocks = 4, 6, 2, 100
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    sequences = [
        SequenceAttention([3, 7], num_cached=5, num_new=1),
        SequenceAttention([1, 2, 4], num_cached=4, num_new=3),
        SequenceAttention(list(range(60, 95)), num_cached=130, num_new=4, tree_mask=tree),
        SequenceAttention(list(range(10, 60)), num_cached=190, num_new=1),
    ]
    meta = build_attention_metadata(sequences, block_size, torch.device("cpu"), sliding_window)
    tokens = sum(s.num_new for s in sequences)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    qkv[:, : heads * head_dim] *= 3
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim) for _ in range(2)]
    return q, k, v, caches, meta


# fused_max_queries 1: the decode's group fused, the others through SDPA into the same output;
# the engine's: every group fused, the draft tree's mask included. Head size 64 runs the kernel's
# code compiled for it, 16 the general one.
@pytest.mark.parametrize("fused_max_queries", [1, FUSED_MAX_QUERIES])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_paged_attention_matches_sdpa_with_tree_masks_and_gqa(
    kernels, sliding_window, fused_max_queries, head_dim
):
    assert FUSED_MAX_QUERIES >= 4
    q, k, v, (k_cache, v_cache), meta = _attention_case(sliding_window, head_dim)
    # two groups (1 query; 3-4 queries), whose outputs SDPA stacks out of token order
    assert len(meta.groups) == 2 and meta.token_order is not None
    theirs_k, theirs_v = k_cache.clone(), v_cache.clone()
    scale = head_dim**-0.5
    expected = paged_attention(q, k, v, theirs_k, theirs_v, meta, scale)
    ours = kernels.paged_attention(q, k, v, k_cache, v_cache, meta, scale, fused_max_queries)
    torch.testing.assert_close(ours, expected, **TOLERANCE)
    torch.testing.assert_close(k_cache, theirs_k, rtol=0, atol=0)  # the same K/V stored
    torch.testing.assert_close(v_cache, theirs_v, rtol=0, atol=0)


def test_greedy_text_is_the_same_with_and_without_the_kernels(kernels, generation_model):
    prompts = [[FIRST_TEXT_TOKEN + i for i in range(n)] for n in (3, 11, 30)]
    fused, plain = (tiny_llm(generation_model, fused_cpu_kernels=on) for on in (True, False))
    assert fused.engine.runner.cpu_kernels is not None
    assert plain.engine.runner.cpu_kernels is None
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in fused.generate(prompts, params)]
    assert ours == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]


def test_without_a_compiler_the_engine_runs_pytorch_kernels(generation_model, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="engine.execution.layers.cpu_kernels"):
        llm = tiny_llm(generation_model)
    assert llm.engine.runner.cpu_kernels is None
    assert "fused CPU kernels unavailable" in caplog.text
    output = llm.generate([[FIRST_TEXT_TOKEN] * 4], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(output[0].outputs[0].token_ids) == 5
