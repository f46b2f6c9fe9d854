"""Clients that go away: 50 streams closed after a few chunks, and a non-streaming request whose
client times out, are aborted in the engine and leave every KV block free."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import BAN_SPECIALS, TINY_CONTEXT, TINY_NAME, LiveServer

pytestmark = pytest.mark.timeout(180)

NUM_STREAMS = 50
CHUNKS_BEFORE_CLOSE = 3
LONG = TINY_CONTEXT - 96  # thousands of tokens: seconds of work each, if nothing aborted them
GAUGES = ("aerie_num_requests_running", "aerie_kv_cache_usage_ratio")


def long_request(index: int) -> dict:
    return {
        "model": TINY_NAME,
        "messages": [{"role": "user", "content": f"Tell me story number {index}"}],
        "max_tokens": LONG,
        "logit_bias": BAN_SPECIALS,
        "extra_body": {"ignore_eos": True},
    }


def raw_body(index: int) -> dict:
    """The same request as a plain HTTP body (the SDK's extra_body fields at the top level)."""
    body = long_request(index)
    return {**body.pop("extra_body"), **body}


async def cancel_streams(server: LiveServer, count: int, concurrency: int = 10) -> list[int]:
    """Open `count` long streams, `concurrency` at a time; close each after a few content
    chunks. Returns the number of chunks each received (all must still be unfinished)."""
    gate = asyncio.Semaphore(concurrency)
    async with server.async_client() as client:

        async def one(index: int) -> int:
            async with gate:
                stream = await client.chat.completions.create(**long_request(index), stream=True)
                received = 0
                try:
                    async for chunk in stream:
                        assert chunk.choices and chunk.choices[0].finish_reason is None, chunk
                        if chunk.choices[0].delta.content:
                            received += 1
                        if received >= CHUNKS_BEFORE_CLOSE:
                            break
                finally:
                    await stream.close()
                return received

        return await asyncio.gather(*(one(i) for i in range(count)))


def wait_for_gauges_at_zero(server: LiveServer, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = {name: server.metrics().get(name, float("nan")) for name in GAUGES}
        if all(v == 0 for v in values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def settled_generation_tokens(server: LiveServer, timeout: float = 20.0) -> float:
    """The generated-token counter once it stops moving (no step for a full second)."""
    deadline = time.monotonic() + timeout
    last = server.metrics().get("aerie_generation_tokens_total", 0.0)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = server.metrics().get("aerie_generation_tokens_total", 0.0)
        if now == last:
            return now
        last = now
    return last


@pytest.fixture(scope="module")
def after_cancelling(tiny_server) -> dict:
    """Cancel 50 streams once; record what the server looks like afterwards."""
    # The server may still be finishing another module's requests: start from a quiet engine.
    before_tokens = settled_generation_tokens(tiny_server)
    received = asyncio.run(cancel_streams(tiny_server, NUM_STREAMS))
    idle_gauges = wait_for_gauges_at_zero(tiny_server, timeout=5.0)

    started = time.monotonic()
    with tiny_server.client() as client:
        fresh = client.chat.completions.create(
            model=TINY_NAME,
            messages=[{"role": "user", "content": "Are you still there?"}],
            temperature=0,
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
    fresh_seconds = time.monotonic() - started
    gauges_after_fresh = {name: tiny_server.metrics()[name] for name in GAUGES}
    generated = settled_generation_tokens(tiny_server) - before_tokens
    return {
        "received": received,
        "idle_gauges": idle_gauges,
        "fresh": fresh,
        "fresh_seconds": fresh_seconds,
        "gauges_after_fresh": gauges_after_fresh,
        "generated": generated,
    }


def test_cancelled_streams_were_cut_mid_way(after_cancelling) -> None:
    assert after_cancelling["received"] == [CHUNKS_BEFORE_CLOSE] * NUM_STREAMS
    # Had the engine kept generating for the closed streams, it would have produced
    # NUM_STREAMS * LONG tokens; aborted ones stop a few chunks in.
    assert after_cancelling["generated"] < NUM_STREAMS * LONG / 10, after_cancelling["generated"]


def test_a_fresh_request_then_completes_promptly(after_cancelling) -> None:
    fresh = after_cancelling["fresh"]
    assert fresh.choices[0].finish_reason == "length"
    assert fresh.usage.completion_tokens == 8
    assert after_cancelling["fresh_seconds"] < 10


def test_every_kv_block_is_free_after_the_next_step(after_cancelling) -> None:
    """The fresh request's final step reports the engine state after it: nothing running, no KV
    block in use, so none of the 50 cancelled requests kept blocks."""
    assert after_cancelling["gauges_after_fresh"] == dict.fromkeys(GAUGES, 0.0)


def test_gauges_return_to_zero_without_further_traffic(after_cancelling) -> None:
    gauges = after_cancelling["idle_gauges"]
    assert gauges == dict.fromkeys(GAUGES, 0.0), (
        f"5 s after the last stream was cancelled /metrics still reports {gauges}. The engine "
        "publishes StepStats only from LLMEngine.step(); an abort (AsyncLLM._handle_inbox -> "
        "LLMEngine.abort_request) frees the blocks but leaves the gauges at the last step's "
        "values while the engine idles."
    )


def test_non_streaming_client_disconnect_aborts_the_request(tiny_server) -> None:
    before = settled_generation_tokens(tiny_server)
    with (
        tiny_server.http(timeout=httpx.Timeout(10.0, read=0.5)) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        http.post("/v1/chat/completions", json=raw_body(0))
    generated = settled_generation_tokens(tiny_server) - before
    assert 0 < generated < LONG, (
        f"the request generated {generated} of its {LONG} tokens after its client left"
    )
    with tiny_server.client() as client:
        again = client.chat.completions.create(
            model=TINY_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert again.choices[0].finish_reason in ("length", "stop")


def test_client_disconnect_is_not_logged_as_a_server_error(tiny_server) -> None:
    log_before = len(tiny_server.log())
    with (
        tiny_server.http(timeout=httpx.Timeout(10.0, read=0.3)) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        http.post("/v1/chat/completions", json=raw_body(1))
    time.sleep(1.0)
    new_log = tiny_server.log()[log_before:]
    flagged = [
        line
        for line in new_log.splitlines()
        if "ERROR" in line or "Traceback" in line or line.startswith("server.")
    ]
    assert not flagged, (
        "a client that disconnects is logged as an internal server error with a traceback "
        "(server.generation.ClientDisconnected reaches the catch-all handler in "
        "server/errors.py):\n" + "\n".join(flagged[:10])
    )
