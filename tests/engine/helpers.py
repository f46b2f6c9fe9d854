"""Helpers shared by the engine tests: engines on tiny models, transformers references, outputs."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM
from engine.config import EngineConfig
from engine.execution.layers.flash_attention import flash_unavailable_reason
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

# fp32 on the CPU: our logits and transformers' differ by ~1e-6; a greedy choice may differ only
# where transformers' two best logits are closer than this (a near-tie).
NEAR_TIE = 1e-4
# bf16 (8 significant bits): our logits differ from transformers' fp32 ones by a share of the row's
# largest |logit|. CPU bf16 runs (fp32 accumulation, as on a GPU) of the tiny families measured up
# to half this, and greedy tokens of bf16_generation_model trailing the best by under a third of
# it; an error of context (one token changed, positions off by one) moves logits by 2-40 times it.
BF16_RTOL = 2**-5
# Where the bf16 tests run (device, attention backend): the CPU always, a GPU marked `cuda`.
BF16_CPU = pytest.param("cpu", "torch", id="cpu")
BF16_GPU = [
    pytest.param("cuda", backend, id=f"cuda-{backend}", marks=pytest.mark.cuda)
    for backend in ("torch", "flash")
]
HEAD_DIM = 16  # the tiny models' (hidden 64, 4 heads)
VOCAB = 256  # the tiny models' vocabulary (tests/conftest.py)
FIRST_TEXT_TOKEN = 3  # ids 0-2 are <pad>, <s>, </s>
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "mistral-sliding-window"]  # of model_paths


def cpu_options(**options) -> dict:
    """Engine options for exact comparisons: CPU and fp32 whatever the machine has, and a KV pool
    sized for tiny models (the default 2 GiB would take seconds to allocate)."""
    return {"device": "cpu", "dtype": "float32", "num_kv_blocks": 256, **options}


def bf16_options(device: str, backend: str, **options) -> dict:
    """Engine options in bf16 on `device` with `backend`'s attention (a skip where flash-attn
    cannot run: not installed, or an older GPU)."""
    if backend == "flash":
        reason = flash_unavailable_reason(
            torch.device(device), torch.bfloat16, HEAD_DIM, compiled=False
        )
        if reason is not None:
            pytest.skip(f"flash backend: {reason}")
    return {
        "device": device,
        "dtype": "bfloat16",
        "attention_backend": backend,
        "num_kv_blocks": 256,
        **options,
    }


def tiny_engine(path: Path, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), **cpu_options(**options)))


def tiny_llm(path: Path, **options) -> LLM:
    """The facade on a model folder, decoding plainly (no draft head)."""
    return LLM(str(path), draft=None, **cpu_options(**options))


def random_prompt(rng: random.Random, length: int) -> list[int]:
    """Token ids of ordinary characters (never <pad>, <s> or </s>)."""
    return [rng.randrange(FIRST_TEXT_TOKEN, VOCAB) for _ in range(length)]


def load_hf_model(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@dataclass(frozen=True)
class Reference:
    """transformers' greedy continuation of a prompt and its logits at each generated position."""

    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), vocab] float32


@torch.inference_mode()
def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], num_tokens: int) -> Reference:
    """transformers' own greedy `generate`, never stopping at EOS."""
    config = transformers.GenerationConfig(
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    out = model.generate(
        torch.tensor([prompt]),
        generation_config=config,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        return_dict_in_generate=True,
        output_logits=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == num_tokens, "transformers stopped early"
    return Reference(tokens, torch.cat(out.logits).float())


@torch.inference_mode()
def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `token_ids`: [len, vocab] float32."""
    return model(torch.tensor([token_ids])).logits[0].float()


def assert_greedy_matches(ours: list[int], reference: Reference, label: str = "") -> None:
    """Our greedy tokens equal transformers' token for token. Floating point may break a near-tie
    the other way; then the rest cannot be compared, but the divergence must be such a tie."""
    assert len(ours) == len(reference.tokens), (
        f"{label}: {len(ours)} tokens, expected {len(reference.tokens)}"
    )
    for step, (mine, theirs) in enumerate(zip(ours, reference.tokens)):
        if mine != theirs:
            gap = float(reference.logits[step, theirs] - reference.logits[step, mine])
            assert gap <= NEAR_TIE, (
                f"{label}: token {step} is {mine}, transformers chose {theirs} by a logit margin "
                f"of {gap:.2e} (not a near-tie); ours {ours}, theirs {reference.tokens}"
            )
            return


def assert_near_greedy(
    hf: transformers.PreTrainedModel, prompt: list[int], tokens: list[int], rtol: float, label=""
) -> None:
    """Each token is transformers' greedy choice after the prompt and the tokens before it, or
    trails that choice's logit by at most `rtol` of the row's largest |logit| (a near-tie, which
    lower precision may break either way). Every token is checked, not only up to a divergence."""
    logits = hf_logits(hf, prompt + tokens)[len(prompt) - 1 : -1]  # [len(tokens), vocab]
    chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]  # [len(tokens)]
    trails = logits.max(dim=-1).values - chosen  # [len(tokens)], >= 0
    bounds = rtol * logits.abs().max(dim=-1).values  # [len(tokens)]
    worst = int((trails - bounds).argmax())
    assert trails[worst] <= bounds[worst], (
        f"{label}: token {worst} ({tokens[worst]}) trails transformers' best by "
        f"{float(trails[worst]):.3g}, more than a near-tie ({float(bounds[worst]):.3g}); {tokens}"
    )


def collect(outputs: dict[str, RequestOutput], deltas: Iterable[RequestOutput]) -> None:
    """Merge streamed deltas into one cumulative output per request."""
    for delta in deltas:
        if delta.request_id in outputs:
            outputs[delta.request_id].merge(delta)
        else:
            outputs[delta.request_id] = delta


def run_engine(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Step until every request has finished; return the merged outputs by request id."""
    outputs: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        collect(outputs, engine.step())
    raise AssertionError(f"requests still unfinished after {max_steps} steps (engine stalled?)")


def assert_block_invariants(engine: LLMEngine) -> None:
    """Each block's reference count equals the number of live block tables holding it; a block
    is on the free list exactly when nobody holds it; the prefix cache index is consistent."""
    manager, scheduler = engine.block_manager, engine.scheduler
    held = Counter(b for seq in [*scheduler.running, *scheduler.waiting] for b in seq.block_table)
    for block in manager.blocks:
        assert block.ref_count == held[block.block_id], f"block {block.block_id}"
        assert (block.block_id in manager.free_block_ids) == (block.ref_count == 0)
    for block_hash, block_id in manager.cached_block_ids.items():
        assert manager.blocks[block_id].hash == block_hash
    for seq in scheduler.waiting:
        assert seq.block_table == [] or seq.num_computed_tokens == 0
