"""Every error the server answers: the status code and OpenAI's error object
`{"error": {"message", "type", "param", "code"}}`; and that a bad request never disturbs the
next good one."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time

import httpx
import openai
import pytest

from engine.async_llm import AsyncLLM
from tests.server.conftest import (
    BAN_SPECIALS,
    MAX_REQUEST_BYTES,
    TINY_CONTEXT,
    TINY_NAME,
    LiveServer,
    assert_openai_error,
    sse_events,
    start_server,
    tiny_server_args,
)
from tests.server.in_process import serve_in_process, tiny_engine_config

pytestmark = pytest.mark.timeout(180)

HELLO = [{"role": "user", "content": "Hello there"}]
CHAT = "/v1/chat/completions"


def chat_body(**fields) -> dict:
    return {"model": TINY_NAME, "messages": HELLO, "max_tokens": 4, **fields}


# ------------------------------------------------------------------------- 400: invalid values
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"temperature": "hot"}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"continue_final_message": True}, "continue_final_message"),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",  # the last message is the user's
        ),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ],
)
def test_invalid_values_are_400(tiny_server, fields, param) -> None:
    response = tiny_server.post(CHAT, chat_body(**fields))
    assert_openai_error(response, 400, type_="invalid_request_error", param=param)


def test_missing_messages_is_400(tiny_server) -> None:
    response = tiny_server.post(CHAT, {"model": TINY_NAME, "max_tokens": 4})
    error = assert_openai_error(response, 400, type_="invalid_request_error", param="messages")
    assert "required" in error["message"].lower()


def test_missing_prompt_is_400(tiny_server) -> None:
    response = tiny_server.post("/v1/completions", {"model": TINY_NAME})
    assert_openai_error(response, 400, type_="invalid_request_error", param="prompt")


def test_malformed_json_is_400(tiny_server) -> None:
    with tiny_server.http() as http:
        response = http.post(
            CHAT, content=b'{"messages": [', headers={"Content-Type": "application/json"}
        )
    error = assert_openai_error(response, 400, type_="invalid_request_error")
    assert "json" in error["message"].lower(), error
    # OpenAI answers a body it cannot parse with param null. Aerie reports the character offset
    # of the JSON error as the param (e.g. "14"), which names no request field.
    assert error["param"] is None, (
        f"malformed JSON reported param={error['param']!r}; expected null (server/errors.py "
        "_validation_error turns the json_invalid location ('body', offset) into a param)"
    )


def test_sdk_raises_bad_request_with_the_error_fields(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY_NAME, messages=HELLO, temperature=-1)
    assert caught.value.status_code == 400
    assert caught.value.param == "temperature"
    assert caught.value.type == "invalid_request_error"


# ----------------------------------------------------------------------- 400: context length
def test_prompt_over_the_context_is_context_length_exceeded(tiny_server) -> None:
    long_chat = chat_body(messages=[{"role": "user", "content": "x" * (TINY_CONTEXT + 10)}])
    assert_openai_error(
        tiny_server.post(CHAT, long_chat),
        400,
        type_="invalid_request_error",
        code="context_length_exceeded",
    )
    long_prompt = {"model": TINY_NAME, "prompt": "x" * (TINY_CONTEXT + 10)}
    assert_openai_error(
        tiny_server.post("/v1/completions", long_prompt), 400, code="context_length_exceeded"
    )


def test_prompt_plus_max_tokens_over_the_context(tiny_server) -> None:
    body = {"model": TINY_NAME, "prompt": "x" * 100, "max_tokens": TINY_CONTEXT}
    error = assert_openai_error(
        tiny_server.post("/v1/completions", body), 400, code="context_length_exceeded"
    )
    assert error["param"] == "max_tokens"
    assert str(TINY_CONTEXT) in error["message"]


# ----------------------------------------------------------------- 400: features not supported
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {}}}


@pytest.mark.parametrize(
    ("fields", "param", "problem"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            "response_format",
            "JSON schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
        ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "'x', which is not among the tools (tools: weather)",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools.0.function.name",
            "letters, digits",
        ),
    ],
)
def test_bad_structured_outputs_and_tools_are_400s(tiny_server, fields, param, problem) -> None:
    error = assert_openai_error(tiny_server.post(CHAT, chat_body(**fields)), 400, param=param)
    assert problem in error["message"]


def test_text_response_format_is_free_text(tiny_server) -> None:
    assert tiny_server.post(CHAT, chat_body(response_format={"type": "text"})).status_code == 200


def test_non_text_content_parts_are_rejected(tiny_server) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = chat_body(messages=[{"role": "user", "content": [image]}])
    assert_openai_error(tiny_server.post(CHAT, body), 400, param="messages.0.content")


# ------------------------------------------------------------------------------------- 401
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", CHAT, chat_body()),
        ("POST", "/v1/completions", {"model": TINY_NAME, "prompt": "hi", "max_tokens": 2}),
        ("GET", "/v1/models", None),
        ("GET", f"/v1/models/{TINY_NAME}", None),
    ],
)
@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong-key", "sk-aerie-test", "Basic sk-aerie-test"]
)
def test_v1_requires_the_api_key(tiny_server, method, path, body, authorization) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as http:
        response = http.request(method, path, json=body, headers=headers)
    assert_openai_error(response, 401, type_="invalid_request_error", code="invalid_api_key")


def test_health_and_requests_are_503_while_the_model_loads(tiny_model) -> None:
    """uvicorn serves while the engine loads in its own thread: /health and requests answer 503
    `loading` (with Retry-After) until the load ends, then 200. The load waits on a gate, so
    the loading state is seen for certain, however fast the model loads."""
    gate = threading.Event()

    def load_when_let() -> AsyncLLM:
        gate.wait(60)
        return AsyncLLM.from_config(tiny_engine_config(tiny_model))

    server = serve_in_process(load_when_let)
    try:
        for response in (server.health(), server.post(CHAT, chat_body(), timeout=10)):
            assert_openai_error(
                response, 503, type_="service_unavailable_error", param=None, code="loading"
            )
            assert response.headers.get("retry-after") == "5"
        gate.set()
        server.wait_ready()
        assert server.post(CHAT, chat_body(), timeout=30).status_code == 200
    finally:
        gate.set()
        server.stop()


def test_health_and_requests_are_503_after_the_engine_failed_to_load(server_logs) -> None:
    """A model that cannot load: the server stays up and says why, with 503 `engine_failed`."""
    server = start_server("/nonexistent/path", server_logs, *tiny_server_args(), wait=False)
    try:
        health = wait_for_health(server, lambda r: "engine_failed" in r.text)
        error = assert_openai_error(
            health, 503, type_="service_unavailable_error", code="engine_failed"
        )
        assert "/nonexistent/path" in error["message"]
        chat = server.post(CHAT, chat_body(), timeout=10)
        assert_openai_error(chat, 503, type_="service_unavailable_error", code="engine_failed")
        assert server.process.poll() is None
    finally:
        server.stop()


def wait_for_health(server: LiveServer, done, timeout: float = 60.0) -> httpx.Response:
    """Poll /health until `done(response)`; connection refused until uvicorn listens."""
    deadline = time.monotonic() + timeout
    while True:
        assert server.process.poll() is None, f"aerie serve exited:\n{server.log_tail()}"
        assert time.monotonic() < deadline, f"/health never satisfied:\n{server.log_tail()}"
        try:
            response = httpx.get(f"{server.base_url}/health", timeout=5)
        except httpx.TransportError:
            response = None
        if response is not None and done(response):
            return response
        time.sleep(0.1)


def test_health_and_metrics_need_no_key(tiny_server) -> None:
    with tiny_server.http(auth=False) as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert "aerie_num_requests_running" in metrics.text


def test_sdk_with_a_wrong_key_raises_authentication_error(tiny_server) -> None:
    with (
        tiny_server.client(api_key="sk-wrong") as client,
        pytest.raises(openai.AuthenticationError) as caught,
    ):
        client.models.list()
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"


# ------------------------------------------------------------------------------------- 404
def test_unknown_model_is_404(tiny_server, client) -> None:
    for path, body in [
        (CHAT, chat_body(model="gpt-4o")),
        ("/v1/completions", {"model": "gpt-4o", "prompt": "hi", "max_tokens": 2}),
    ]:
        error = assert_openai_error(
            tiny_server.post(path, body),
            404,
            type_="invalid_request_error",
            param="model",
            code="model_not_found",
        )
        assert "gpt-4o" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as retrieved:
        client.models.retrieve("gpt-4o")
    assert retrieved.value.body["code"] == "model_not_found"


def test_unknown_route_and_method(tiny_server) -> None:
    with tiny_server.http() as http:
        assert_openai_error(http.get("/v1/nothing-here"), 404)
        assert_openai_error(http.get(CHAT), 405)


# ------------------------------------------------------------------------------------- 413
def oversized_body() -> bytes:
    body = chat_body(messages=[{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 1)}])
    return json.dumps(body).encode()


def test_body_over_the_limit_is_413(tiny_server) -> None:
    with tiny_server.http() as http:
        response = http.post(
            CHAT, content=oversized_body(), headers={"Content-Type": "application/json"}
        )
    error = assert_openai_error(response, 413, code="request_too_large")
    assert str(MAX_REQUEST_BYTES) in error["message"]


def test_chunked_body_over_the_limit_is_413(tiny_server) -> None:
    """Without a Content-Length the limit is enforced while the body streams in."""
    data = oversized_body()

    def chunks():
        for start in range(0, len(data), 8192):
            yield data[start : start + 8192]

    with tiny_server.http() as http:
        response = http.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in {k.lower() for k in response.request.headers}
    error = assert_openai_error(response, 413)
    assert error["code"] == "request_too_large", (
        f"a chunked oversized body gets code={error['code']!r}, a declared one "
        "'request_too_large' (server/limits.py BodyTooLarge carries no code)"
    )


def test_body_just_under_the_limit_is_served(tiny_server) -> None:
    # 1024 characters of prompt would overflow the context: stay under both limits.
    body = chat_body(messages=[{"role": "user", "content": "y" * 900}], padding="z" * 60000)
    data = json.dumps(body).encode()
    assert len(data) < MAX_REQUEST_BYTES
    with tiny_server.http() as http:
        response = http.post(CHAT, content=data, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------------- recovery after errors
def test_invalid_requests_leave_the_server_serving(tiny_server, client) -> None:
    def reference() -> str:
        response = client.chat.completions.create(
            model=TINY_NAME,
            messages=HELLO,
            temperature=0,
            max_tokens=12,
            logit_bias=BAN_SPECIALS,
            extra_body={"ignore_eos": True},
        )
        return response.choices[0].message.content

    before = reference()
    bad_bodies = [
        chat_body(temperature=-1),
        chat_body(messages=[{"role": "user", "content": "x" * (TINY_CONTEXT + 10)}]),
        chat_body(model="nope"),
        chat_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "f"}}),
        chat_body(n=1000),
        chat_body(stop_token_ids=[10**6]),
        {"prompt": [[]]},
    ]
    with tiny_server.http() as http:
        for body in bad_bodies:
            path = "/v1/completions" if "prompt" in body else CHAT
            response = http.post(path, json=body)
            assert 400 <= response.status_code < 500, (body, response.text)
        response = http.post(CHAT, content=b"{]", headers={"Content-Type": "application/json"})
        assert response.status_code == 400
    assert reference() == before
    assert httpx.get(f"{tiny_server.base_url}/health", timeout=10).status_code == 200


# ------------------------------------------------------------------------------------- 429
def test_full_waiting_queue_is_429_with_retry_after(spawn) -> None:
    """With --max-num-seqs 1 --max-queued-requests 1, one running and one waiting request fill
    the server: several more concurrent requests all get 429 with a Retry-After header."""
    server = spawn("--max-num-seqs", "1", "--max-queued-requests", "1")
    long_body = chat_body(
        max_tokens=TINY_CONTEXT - 64, ignore_eos=True, stream=True, logit_bias=BAN_SPECIALS
    )
    with server.http(timeout=30) as http, contextlib.ExitStack() as streams:
        running = streams.enter_context(http.stream("POST", CHAT, json=long_body))
        assert running.status_code == 200
        events = sse_events(running)
        next(events)  # the role delta
        next(events)  # a content delta: the request runs and holds the only slot
        waiting = streams.enter_context(http.stream("POST", CHAT, json=long_body))
        assert waiting.status_code == 200  # accepted: it waits for the slot
        # Keep the event iterator referenced: a discarded one closes the connection, and the
        # server then (rightly) aborts the request.
        waiting_events = sse_events(waiting)
        next(waiting_events)

        def attempt(_: int) -> httpx.Response:
            with server.http(timeout=30) as own:
                return own.post(CHAT, json=chat_body())

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(attempt, range(4)))
        for rejected in answers:
            assert_openai_error(rejected, 429, type_="rate_limit_error", code="queue_full")
            assert rejected.headers.get("retry-after") == "1"
        completion = http.post(
            "/v1/completions", json={"model": TINY_NAME, "prompt": "hi", "max_tokens": 2}
        )
        assert_openai_error(completion, 429, code="queue_full")
        with server.client() as client, pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=TINY_NAME, messages=HELLO, max_tokens=2)
    # Both long streams were closed, which aborts them: the server takes requests again.
    started = time.monotonic()
    response = server.post(CHAT, chat_body(max_tokens=2), timeout=30)
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < 10


# --------------------------------------------------------------------- seeds beyond int64
def test_out_of_range_seed_is_400_and_the_engine_survives(spawn) -> None:
    """OpenAI's seed is an int64. Larger seeds must be rejected up front, never reach torch."""
    server = spawn()
    problems = []
    for fields in ({"seed": 2**64}, {"seed": 2**64 - 1, "n": 2}):
        try:
            response = server.post(CHAT, chat_body(**fields), timeout=15)
        except httpx.TimeoutException:
            problems.append(f"{fields}: no answer within 15 s")
            continue
        if response.status_code != 400 or response.json()["error"]["param"] != "seed":
            problems.append(f"{fields}: HTTP {response.status_code} {response.text[:200]}")
    try:
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        after = server.post(CHAT, chat_body(max_tokens=2), timeout=15)
        if health.status_code != 200 or after.status_code != 200:
            problems.append(
                f"afterwards: /health {health.status_code} {health.text[:200]}, "
                f"a valid request {after.status_code} {after.text[:200]}"
            )
    except httpx.TimeoutException:
        problems.append("afterwards: a valid request got no answer within 15 s")
    assert not problems, (
        "out-of-range seeds are not rejected (engine/llm_engine.py _generator: "
        "torch manual_seed(seed + index) raises 'Overflow when unpacking long long'; with n > 1 "
        "it raises inside step(), which fails the request with a 500 instead of a 400):\n"
        + "\n".join(problems)
    )
