"""Our decoder's logits equal transformers' for every supported family, in prefill and in decoding
through the paged KV cache (block size 4, smaller than the 13-token prompt).

The engine's own forward (`ModelRunner.execute` on a hand-built schedule) is compared with the
transformers model loaded from the same folder, both in fp32 on the CPU.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine.core.request import Sequence
from engine.core.scheduler import ScheduledSequence, SchedulerOutput
from engine.llm_engine import LLMEngine
from tests.engine.helpers import FAMILIES, hf_logits, load_hf_model, random_prompt, tiny_engine

TOLERANCE = 1e-4  # max abs logit difference
BLOCK_SIZE = 4
PROMPT_LEN = 13
NUM_DECODE = 12

_seq_ids = itertools.count()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, model_paths):
    """(engine, transformers model) for one family."""
    path = model_paths[request.param]
    engine = tiny_engine(path, block_size=BLOCK_SIZE, num_kv_blocks=64)
    return engine, load_hf_model(path)


def new_sequence(token_ids: list[int]) -> Sequence:
    """A bare sequence: the runner reads only its tokens, progress and block table."""
    return Sequence(next(_seq_ids), None, 0, list(token_ids), len(token_ids), None)


def forward(engine: LLMEngine, chunks: list[tuple[Sequence, int]]) -> torch.Tensor:
    """One batched pass computing `num_new` more tokens of each sequence, as the scheduler would
    lay it out. Returns the logits of the sequences whose chunk reaches their last token."""
    for seq, num_new in chunks:
        engine.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
    batch = SchedulerOutput([ScheduledSequence(seq, num_new) for seq, num_new in chunks])
    logits = engine.runner.execute(batch, {}).logits  # no draft trees: plain forward
    for seq, num_new in chunks:
        seq.num_computed_tokens += num_new
    return logits


def release(engine: LLMEngine, seqs: list[Sequence]) -> None:
    for seq in seqs:
        engine.block_manager.free(seq)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape
    return float((ours - theirs).abs().max())


# Longest first, the attention groups (by number of new tokens) run in another order than the
# sequences, and their outputs are put back in token order.
@pytest.mark.parametrize("longest_first", [False, True])
def test_prefill_logits(family, longest_first) -> None:
    """Every prefix of the prompt (1..13 tokens) prefilled in one batch: the last row of each
    equals transformers' logits at that position."""
    engine, hf = family
    prompt = random_prompt(random.Random(0), PROMPT_LEN)
    expected = hf_logits(hf, prompt)  # [13, vocab]
    lengths = range(1, PROMPT_LEN + 1)
    seqs = [new_sequence(prompt[:n]) for n in (reversed(lengths) if longest_first else lengths)]
    ours = forward(engine, [(seq, seq.num_tokens) for seq in seqs])  # [13, vocab]
    release(engine, seqs)
    assert max_diff(ours, expected.flip(0) if longest_first else expected) <= TOLERANCE


def test_decode_logits_through_paged_cache(family) -> None:
    """Prefill 13 tokens into 4-token blocks, then decode 12 tokens one at a time: each step's
    logits equal transformers' at that position of the whole sequence."""
    engine, hf = family
    tokens = random_prompt(random.Random(1), PROMPT_LEN + NUM_DECODE)
    expected = hf_logits(hf, tokens)  # [25, vocab]
    seq = new_sequence(tokens[:PROMPT_LEN])
    diffs = [max_diff(forward(engine, [(seq, PROMPT_LEN)])[0], expected[PROMPT_LEN - 1])]
    for position in range(PROMPT_LEN, len(tokens)):
        seq.token_ids.append(tokens[position])
        diffs.append(max_diff(forward(engine, [(seq, 1)])[0], expected[position]))
    assert len(seq.block_table) == -(-len(tokens) // BLOCK_SIZE)
    release(engine, [seq])
    assert max(diffs) <= TOLERANCE, f"max abs logit diff per step: {diffs}"


def test_chunked_prefill_beside_batched_decode(family) -> None:
    """A prompt prefilled in chunks of 5, 5 and 3 in the same passes as another sequence decodes,
    then both decode together: every sampled row matches transformers."""
    engine, hf = family
    rng = random.Random(2)
    first = random_prompt(rng, 7 + 6)  # 7 prompt tokens then 6 decoded
    second = random_prompt(rng, PROMPT_LEN + 3)  # 13 prompt tokens then 3 decoded
    expected_first, expected_second = hf_logits(hf, first), hf_logits(hf, second)
    a, b = new_sequence(first[:7]), new_sequence(second[:PROMPT_LEN])
    diffs = [max_diff(forward(engine, [(a, 7)])[0], expected_first[6])]
    for chunk in (5, 5, 3):
        a.token_ids.append(first[a.num_tokens])
        logits = forward(engine, [(a, 1), (b, chunk)])
        diffs.append(max_diff(logits[0], expected_first[a.num_tokens - 1]))
        if b.num_computed_tokens == b.num_tokens:  # only the last chunk samples
            assert logits.shape[0] == 2
            diffs.append(max_diff(logits[1], expected_second[PROMPT_LEN - 1]))
        else:
            assert logits.shape[0] == 1
    for _ in range(2):
        a.token_ids.append(first[a.num_tokens])
        b.token_ids.append(second[b.num_tokens])
        logits = forward(engine, [(a, 1), (b, 1)])
        diffs.append(max_diff(logits[0], expected_first[a.num_tokens - 1]))
        diffs.append(max_diff(logits[1], expected_second[b.num_tokens - 1]))
    release(engine, [a, b])
    assert max(diffs) <= TOLERANCE, f"max abs logit diff per row: {diffs}"
