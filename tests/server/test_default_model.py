"""End to end on the real default model (SmolLM2-135M-Instruct): `aerie serve` with its default
flags answers a factual question through the official SDK."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.execution.model_files import DEFAULT_MODEL
from tests.server.conftest import LiveServer, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def default_server(server_logs) -> Iterator[LiveServer]:
    server = start_server(DEFAULT_MODEL, server_logs, api_key=None, served_name=None)
    try:
        yield server
    finally:
        server.stop()


def test_capital_of_france(default_server) -> None:
    with default_server.client() as client:
        response = client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=32,
        )
        served = [m.id for m in client.models.list().data]
    (choice,) = response.choices
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 0 < response.usage.completion_tokens <= 32
    assert served == [DEFAULT_MODEL]


def test_the_server_drafts_with_the_shipped_head(default_server) -> None:
    """The default flags load the shipped head (and the adaptive budget), and it drafts:
    /metrics counts drafts and draft tokens of this very request."""
    before = default_server.metrics()
    with default_server.client() as client:
        client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "Count from one to ten."}],
            temperature=0,
            max_tokens=32,
        )
    after = default_server.metrics()
    assert "aerie_spec_decode_num_draft_tokens_total" in after, (
        "no speculation metrics: the server runs without a draft head"
    )
    for counter in (
        "aerie_spec_decode_num_drafts_total",
        "aerie_spec_decode_num_draft_tokens_total",
    ):
        assert after[counter] > before.get(counter, 0.0), (counter, after[counter])


def test_the_shipped_head_speculates_losslessly() -> None:
    """`LLM()` loads the head shipped for the default model; with whole trees verified every
    step, greedy decoding gives plain decoding's tokens and gets drafts accepted."""
    from drafting.shipped_heads import shipped_head
    from engine import LLM, SamplingParams

    assert shipped_head(DEFAULT_MODEL) is not None
    questions = ["Write a haiku about the sea.", "Explain what a CPU cache is."]
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = LLM(DEFAULT_MODEL, draft=None)
    speculative = LLM(DEFAULT_MODEL, adaptive_draft_budget=False)  # draft="auto"
    assert speculative.engine.config.draft == str(shipped_head(DEFAULT_MODEL))
    messages = [[{"role": "user", "content": q}] for q in questions]
    expected = plain.chat(messages, params, use_tqdm=False)
    outputs = speculative.chat(messages, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0
