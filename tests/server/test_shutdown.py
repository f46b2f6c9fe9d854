"""SIGTERM: while requests in flight finish (or end with finish_reason "abort" once they outlive
--shutdown-timeout) the server keeps listening but answers /health and new requests with 503
`shutting_down`; then it closes (connection refused) and exits with status 0."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import pytest

from tests.server.conftest import (
    BAN_SPECIALS,
    TINY_CONTEXT,
    TINY_NAME,
    LiveServer,
    assert_openai_error,
    sse_events,
)

pytestmark = pytest.mark.timeout(150)


def body(max_tokens: int, stream: bool) -> dict:
    return {
        "model": TINY_NAME,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": BAN_SPECIALS,
        "ignore_eos": True,
        "stream": stream,
    }


def wait_for_draining_health(server: LiveServer, timeout: float = 10.0) -> None:
    """Right after SIGTERM /health may still say 200 (the signal not yet handled); then it must
    say 503 shutting_down, from a server still listening, for as long as it drains."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            response = httpx.get(f"{server.base_url}/health", timeout=10)
        except httpx.TransportError as exc:
            pytest.fail(f"/health unreachable while requests drain ({exc!r}): 503 expected")
        if response.status_code != 200:
            break
        assert time.monotonic() < deadline, "/health still 200 long after SIGTERM"
        time.sleep(0.02)
    assert_openai_error(response, 503, type_="service_unavailable_error", code="shutting_down")


def probe_new_requests(server: LiveServer, attempts: int = 10) -> list[str]:
    """Send new requests after SIGTERM: each must get 503 (code shutting_down) while the server
    drains, then connection refused once it closes its listener. A connection that races the
    listener's close is dropped unanswered (disconnected or reset), which a client sees as
    refused too: the request never reached the engine. Returns what each attempt got."""
    outcomes = []
    for _ in range(attempts):
        try:
            with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=10) as h:
                response = h.post("/v1/chat/completions", json=body(2, stream=False))
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            outcomes.append("refused")
            break
        assert_openai_error(response, 503, type_="service_unavailable_error", code="shutting_down")
        outcomes.append("503")
        time.sleep(0.05)
    return outcomes


def read_stream(events) -> tuple[str, str | None, bool]:
    """Text, last finish_reason and whether [DONE] came, from the rest of an SSE stream."""
    text, finish, done = "", None, False
    for payload in events:
        if payload == "[DONE]":
            done = True
            break
        for choice in json.loads(payload)["choices"]:
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    return text, finish, done


def wait_for_exit(server: LiveServer, timeout: float) -> int | None:
    code = server.wait_exit(timeout)
    assert code is not None, f"aerie serve still running {timeout:.0f}s after SIGTERM"
    return code


def exit_message(server: LiveServer, code: int) -> str:
    return (
        f"aerie serve exited with {code} after a graceful SIGTERM, not 0: uvicorn re-raises the "
        "captured signal once shutdown completes (uvicorn.Server.capture_signals), and "
        "server/serve.py GracefulServer does not prevent it.\n" + server.log_tail(8)
    )


def test_sigterm_lets_in_flight_requests_finish(spawn) -> None:
    server = spawn("--shutdown-timeout", "60")
    max_tokens = 1500  # a few seconds of decoding: still running when SIGTERM arrives
    with (
        server.http(timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=body(max_tokens, True)) as response,
    ):
        assert response.status_code == 200
        events = sse_events(response)
        first_text, _, _ = read_stream(_take(events, 3))  # role delta + two content deltas
        server.signal(signal.SIGTERM)
        wait_for_draining_health(server)
        outcomes = probe_new_requests(server)
        rest, finish, done = read_stream(events)

    # the stream may end, and the listener close, before all ten probes
    assert outcomes[0] == "503" and set(outcomes) <= {"503", "refused"}, outcomes
    assert finish == "length", f"the in-flight request ended with {finish!r}"
    assert done
    assert len(first_text + rest) == max_tokens
    code = wait_for_exit(server, 30)
    assert code == 0, exit_message(server, code)


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(spawn) -> None:
    server = spawn("--shutdown-timeout", "2")
    max_tokens = TINY_CONTEXT - 96  # far more than 2 s of decoding

    def non_streaming() -> dict:
        with server.http(timeout=60) as http:
            return http.post("/v1/chat/completions", json=body(max_tokens, False)).json()

    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        server.http(timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=body(max_tokens, True)) as response,
    ):
        assert response.status_code == 200
        events = sse_events(response)
        read_stream(_take(events, 3))
        plain = pool.submit(non_streaming)
        time.sleep(0.3)  # let the non-streaming request reach the engine
        server.signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_for_draining_health(server)
        outcomes = probe_new_requests(server)
        text, finish, done = read_stream(events)
        ended = time.monotonic() - signalled
        plain_result = plain.result(timeout=30)

    assert outcomes[0] == "503" and set(outcomes) <= {"503", "refused"}, outcomes
    assert finish == "abort", f"the streamed request ended with {finish!r}"
    assert done
    assert 1.5 < ended < 15, f"the stream ended {ended:.1f}s after SIGTERM (timeout 2 s)"
    assert len(text) < max_tokens
    (choice,) = plain_result["choices"]
    assert choice["finish_reason"] == "abort", plain_result
    assert 0 < plain_result["usage"]["completion_tokens"] < max_tokens
    code = wait_for_exit(server, 30)
    assert code == 0, exit_message(server, code)


def _take(iterator, count: int):
    for _ in range(count):
        yield next(iterator)
