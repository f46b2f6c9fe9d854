"""The real default model (SmolLM2-135M-Instruct) answers a simple question through `LLM().chat`."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()  # loads once for this module (~5 s after the first conversion)


def test_capital_of_france(llm) -> None:
    (output,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
        use_tqdm=False,
    )
    choice = output.outputs[0]
    assert "Paris" in choice.text, choice.text
    assert choice.finish_reason in ("stop", "length")
    assert 0 < len(choice.token_ids) <= 32
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
