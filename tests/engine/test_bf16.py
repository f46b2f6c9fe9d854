"""The engine's exactness in bfloat16: on the CPU, and on a CUDA GPU (marker `cuda`: skipped where
torch sees none) through torch's attention and, where it is installed, flash-attn's.

Our logits stay within bf16's rounding of transformers' fp32 logits, in prefill and in decoding
through the paged KV cache, for every family; greedy output is transformers' greedy path, every
token of it within a near-tie, however the engine batches, chunks or preempts.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.conftest import save_tiny_model
from tests.engine.helpers import (
    BF16_CPU,
    BF16_GPU,
    BF16_RTOL,
    FAMILIES,
    assert_near_greedy,
    bf16_options,
    hf_logits,
    load_hf_model,
    random_prompt,
)
from tests.engine.test_model_equivalence import forward, new_sequence, release

MAX_TOKENS = 24
PROMPT_LENGTHS = [1, 4, 13, 22, 31, 40]
SETUPS = {  # as tests/engine/test_generation.py's
    "plain": {},
    "chunked-prefill": {"max_num_batched_tokens": 8},
    "chunked-prefill-and-preemption": {
        "max_num_batched_tokens": 8,
        "block_size": 4,
        "num_kv_blocks": 20,
    },
}


def assert_rows_close(ours: torch.Tensor, theirs: torch.Tensor, label: str) -> None:
    """Each row of our logits within BF16_RTOL of the row's largest |logit| of transformers'."""
    ours = ours.float().cpu()
    assert ours.shape == theirs.shape
    errors = (ours - theirs).abs().max(dim=-1).values / theirs.abs().max(dim=-1).values
    assert float(errors.max()) <= BF16_RTOL, f"{label}: relative error per row {errors.tolist()}"


@pytest.fixture(scope="module")
def bf16_generation_model(tmp_path_factory) -> Path:
    """A tiny Llama with weights large enough for greedy text to wander (initializer_range
    0.15), not so large that bf16 rounding swamps its logits (generation_model's 0.3 does)."""
    root = tmp_path_factory.mktemp("bf16-generation")
    return save_tiny_model(root / "llama", "llama", seed=3, initializer_range=0.15)


@pytest.mark.parametrize(("device", "backend"), [BF16_CPU, *BF16_GPU])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_track_transformers_in_prefill_and_paged_decode(
    model_paths, family, device, backend
):
    """Every prefix of a 13-token prompt prefilled in one batch, then 12 tokens decoded one at a
    time through 4-token blocks: each row within bf16's rounding of transformers' fp32 logits."""
    path = model_paths[family]
    engine = LLMEngine(EngineConfig(model=str(path), **bf16_options(device, backend, block_size=4)))
    hf = load_hf_model(path)
    tokens = random_prompt(random.Random(1), 25)
    expected = hf_logits(hf, tokens)  # [25, vocab]
    prefixes = [new_sequence(tokens[:n]) for n in range(1, 14)]
    ours = forward(engine, [(seq, seq.num_tokens) for seq in prefixes])  # [13, vocab]
    release(engine, prefixes)
    assert_rows_close(ours, expected[:13], f"{family}, prefill")
    seq = new_sequence(tokens[:13])
    rows = [forward(engine, [(seq, 13)])[0]]
    for position in range(13, len(tokens)):
        seq.token_ids.append(tokens[position])
        rows.append(forward(engine, [(seq, 1)])[0])
    release(engine, [seq])
    assert_rows_close(torch.stack(rows), expected[12:], f"{family}, decode")


@pytest.mark.parametrize(("device", "backend"), [BF16_CPU, *BF16_GPU])
@pytest.mark.parametrize("setup", SETUPS)
def test_greedy_is_transformers_greedy_path(bf16_generation_model, setup, device, backend):
    options = bf16_options(device, backend, **SETUPS[setup])
    llm = LLM(str(bf16_generation_model), draft=None, **options)
    rng = random.Random(0)
    prompts = [random_prompt(rng, length) for length in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf_model(bf16_generation_model)
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        assert len(tokens) == MAX_TOKENS
        assert_near_greedy(hf, prompt, tokens, BF16_RTOL, f"{setup}, prompt of {len(prompt)}")
    if "num_kv_blocks" in SETUPS[setup]:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
