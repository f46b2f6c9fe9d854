"""32 concurrent greedy streams (asyncio + AsyncOpenAI) all complete, and each is identical to the
same request run alone: batching with other requests changes nothing."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.conftest import BAN_SPECIALS, TINY_NAME, LiveServer

pytestmark = pytest.mark.timeout(180)

NUM_STREAMS = 32
MAX_TOKENS = 24


def request(index: int) -> dict:
    # Prompts of different lengths, so prefills and decodes of different sizes share steps.
    words = " ".join(["word"] * (index % 7))
    return {
        "model": TINY_NAME,
        "messages": [{"role": "user", "content": f"Request {index}: {words} please continue"}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "logit_bias": BAN_SPECIALS,
        "extra_body": {"ignore_eos": True},
    }


async def stream_text(client, index: int) -> tuple[str, str | None, int]:
    stream = await client.chat.completions.create(
        **request(index), stream=True, stream_options={"include_usage": True}
    )
    text, finish, completion_tokens = "", None, -1
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    return text, finish, completion_tokens


async def run_alone(server: LiveServer) -> list[tuple[str, str | None, int]]:
    async with server.async_client() as client:
        return [await stream_text(client, i) for i in range(NUM_STREAMS)]


async def run_together(server: LiveServer) -> list[tuple[str, str | None, int]]:
    async with server.async_client() as client:
        return await asyncio.wait_for(
            asyncio.gather(*(stream_text(client, i) for i in range(NUM_STREAMS))), timeout=120
        )


def test_concurrent_greedy_streams_match_their_solo_runs(tiny_server) -> None:
    alone = asyncio.run(run_alone(tiny_server))
    together = asyncio.run(run_together(tiny_server))
    assert all(r == (r[0], "length", MAX_TOKENS) and len(r[0]) == MAX_TOKENS for r in together)
    mismatched = [i for i in range(NUM_STREAMS) if together[i] != alone[i]]
    assert not mismatched, [(i, alone[i][0], together[i][0]) for i in mismatched]
    assert len({text for text, _, _ in alone}) > NUM_STREAMS // 2, "prompts barely matter?"
