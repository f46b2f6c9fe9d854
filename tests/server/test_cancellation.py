"""Clients that go away: 50 streams closed after a few chunks, a stream left during its first
chunk, and a non-streaming request whose client times out, are aborted in the engine, leave every
KV block free, and are logged in one line each."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from tests.server.conftest import (
    BAN_SPECIALS,
    TINY_CONTEXT,
    TINY_NAME,
    LiveServer,
    prompt_tokens_of,
    render_chat,
    sse_events,
)

pytestmark = pytest.mark.timeout(180)

NUM_STREAMS = 50
CHUNKS_BEFORE_CLOSE = 3
LONG = TINY_CONTEXT - 96  # thousands of tokens: seconds of work each, if nothing aborted them
GAUGES = ("aerie_num_requests_running", "aerie_kv_cache_usage_ratio")
# server/generation.py log_request: one line per HTTP call
REQUEST_LINE = re.compile(
    r"(?P<id>\S+) prompt=(?P<prompt>\d+) completion=(?P<completion>\d+) "
    r"latency=(?P<latency>[\d.]+)s finish=(?P<finish>\S+)$"
)


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


def request_lines(log: str) -> list[re.Match]:
    lines = (REQUEST_LINE.search(line) for line in log.splitlines())
    return [match for match in lines if match]


def logged_line(server: LiveServer, request_id: str, timeout: float = 10.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        found = [m for m in request_lines(server.log()) if m["id"] == request_id]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, f"{len(found)} log lines for {request_id}"
            return found[0]
        time.sleep(0.1)


def test_a_completed_request_is_logged_in_one_line(tiny_server, client) -> None:
    response = client.chat.completions.create(
        model=TINY_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        logit_bias=BAN_SPECIALS,
        extra_body={"ignore_eos": True},
    )
    line = logged_line(tiny_server, response.id)
    assert int(line["prompt"]) == response.usage.prompt_tokens
    assert int(line["completion"]) == 8
    assert line["finish"] == "length"
    assert float(line["latency"]) > 0


def test_a_cancelled_stream_is_logged_with_its_tokens_so_far(tiny_server) -> None:
    with (
        tiny_server.http() as http,
        http.stream("POST", "/v1/chat/completions", json={**raw_body(7), "stream": True}) as r,
    ):
        events = sse_events(r)
        request_id = json.loads(next(events))["id"]  # the role delta
        for _ in range(CHUNKS_BEFORE_CLOSE):
            next(events)
    line = logged_line(tiny_server, request_id)
    assert line["finish"] == "abort"
    prompt = render_chat([("user", "Tell me story number 7")])
    assert int(line["prompt"]) == prompt_tokens_of(prompt)
    assert CHUNKS_BEFORE_CLOSE <= int(line["completion"]) < LONG


def test_non_streaming_client_disconnect_aborts_the_request(tiny_server) -> None:
    before = settled_generation_tokens(tiny_server)
    log_before = len(tiny_server.log())
    with (
        tiny_server.http(timeout=httpx.Timeout(10.0, read=0.5)) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        http.post("/v1/chat/completions", json=raw_body(0))
    generated = settled_generation_tokens(tiny_server) - before
    assert 0 < generated < LONG, (
        f"the request generated {generated} of its {LONG} tokens after its client left"
    )
    (line,) = request_lines(tiny_server.log()[log_before:])
    assert line["id"].startswith("chatcmpl-") and line["finish"] == "abort", line[0]
    assert 0 < int(line["completion"]) < LONG
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


async def leave_during_the_first_chunk(app, body: dict) -> None:
    """Drive the ASGI app as a client that disconnects while the first body chunk (the role
    delta) is being sent: the send never completes, and the disconnect arrives meanwhile."""
    data = json.dumps(body).encode()
    first_chunk_sending = asyncio.Event()
    requested = False

    async def receive() -> dict:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": data, "more_body": False}
        await first_chunk_sending.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            first_chunk_sending.set()
            await asyncio.Event().wait()  # the client never reads it

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=30)


def test_a_stream_left_during_its_first_chunk_is_aborted(in_process_server) -> None:
    """The role delta is sent before the engine's deltas are first awaited: a client gone by
    then must still abort the request, not leave it running to max_tokens."""
    llm = in_process_server.llm
    finished = []
    llm.stats_listeners.append(lambda stats: finished.extend(stats.finished))
    try:
        body = {**raw_body(3), "stream": True}
        asyncio.run(leave_during_the_first_chunk(in_process_server.app, body))
        deadline = time.monotonic() + 60
        while not finished and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        llm.stats_listeners.pop()
    (stats,) = finished
    assert stats.finish_reason == "abort", (
        f"the request ran on after its client left: finished {stats.finish_reason!r} with "
        f"{stats.num_generation_tokens} tokens"
    )
    assert stats.num_generation_tokens < LONG
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
