"""500 only for a true internal fault, which fails that request alone and never takes the engine
down: faults injected into one method of the real engine of an in-process server, on requests
whose prompt carries a marker. The server runs one sequence at a time (max_num_seqs 1), so a
second request waits in the engine while the first runs."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time

import httpx
import pytest

from tests.server.conftest import BAN_SPECIALS, TINY_NAME, assert_openai_error, sse_events

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
MARKER = "FAULT"
LONG = 2000  # seconds of decoding: the marked request is still running when the fault fires
SHORT = 16


def chat_body(content: str, max_tokens: int, stream: bool = False) -> dict:
    return {
        "model": TINY_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": BAN_SPECIALS,
        "ignore_eos": True,
        "stream": stream,
    }


def is_marked(llm, request) -> bool:
    return MARKER in llm.tokenizer.decode(request.prompt_token_ids)


def marked_request_running(llm) -> bool:
    return any(is_marked(llm, seq.request) for seq in list(llm.scheduler.running))


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def fail_marked_decodes_while_another_waits(llm):
    """ModelRunner.execute that raises for a step decoding a marked request while another
    request waits (so the fault hits a request holding KV blocks, with a bystander queued)."""
    execute = llm.runner.execute

    def faulty(batch, trees=None):
        decoding_marked = any(
            is_marked(llm, item.seq.request) and item.seq.num_output_tokens > 0
            for item in batch.scheduled
        )
        if decoding_marked and llm.scheduler.waiting:
            raise RuntimeError("injected fault in a step")
        return execute(batch, trees)

    return faulty


def fail_adding_marked(llm):
    """Scheduler.add that raises for a marked request: the engine holds it half-added."""
    add = llm.scheduler.add

    def faulty(seq) -> None:
        if is_marked(llm, seq.request):
            raise RuntimeError("injected fault while adding")
        add(seq)

    return faulty


def assert_engine_healthy_and_empty(server) -> None:
    """A later request completes, /health is 200, and every KV block is free again."""
    later = server.post(CHAT, chat_body("And now?", SHORT))
    assert later.status_code == 200, later.text
    assert later.json()["usage"]["completion_tokens"] == SHORT
    assert server.health().status_code == 200
    assert server.state.engine.is_running
    llm = server.llm
    wait_until(lambda: not llm.requests)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert "aerie_kv_cache_usage_ratio" in metrics
    usage_lines = [line for line in metrics.splitlines() if line.startswith("aerie_kv_cache_usage")]
    assert all(float(line.split()[-1]) == 0.0 for line in usage_lines), usage_lines


def test_a_fault_in_a_step_fails_only_the_request_it_scheduled(
    in_process_server, monkeypatch
) -> None:
    server, llm = in_process_server, in_process_server.llm
    monkeypatch.setattr(llm.runner, "execute", fail_marked_decodes_while_another_waits(llm))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        marked = pool.submit(server.post, CHAT, chat_body(f"{MARKER} here", LONG))
        wait_until(lambda: marked_request_running(llm))
        bystander = pool.submit(server.post, CHAT, chat_body("Hello there", SHORT))
        marked_response, bystander_response = marked.result(60), bystander.result(60)

    error = assert_openai_error(marked_response, 500, type_="server_error", code="internal_error")
    assert "injected fault in a step" in error["message"]
    assert bystander_response.status_code == 200, (
        "a request waiting in the engine was failed by another request's fault: "
        + bystander_response.text
    )
    (choice,) = bystander_response.json()["choices"]
    assert choice["finish_reason"] == "length"
    assert bystander_response.json()["usage"]["completion_tokens"] == SHORT
    assert_engine_healthy_and_empty(server)


def test_a_fault_in_a_step_ends_its_stream_with_an_error_event(
    in_process_server, monkeypatch, caplog
) -> None:
    server, llm = in_process_server, in_process_server.llm
    monkeypatch.setattr(llm.runner, "execute", fail_marked_decodes_while_another_waits(llm))
    caplog.set_level(logging.INFO, logger="aerie.server")
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        server.http() as http,
        http.stream("POST", CHAT, json=chat_body(f"{MARKER} here", LONG, stream=True)) as stream,
    ):
        assert stream.status_code == 200
        events = sse_events(stream)
        role = json.loads(next(events))
        assert json.loads(next(events))["choices"][0]["delta"]["content"]  # it is decoding
        bystander = pool.submit(server.post, CHAT, chat_body("Hello there", SHORT))
        rest = list(events)
        bystander_response = bystander.result(60)

    assert rest[-1:] == ["[DONE]"] and rest.count("[DONE]") == 1, rest[-3:]
    error = json.loads(rest[-2])["error"]  # the last event before [DONE], as in vLLM
    assert error["type"] == "server_error" and error["code"] == "internal_error", error
    assert "injected fault in a step" in error["message"]
    assert bystander_response.status_code == 200, bystander_response.text
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith(role["id"])]
    assert len(logged) == 1 and logged[0].endswith("finish=error"), logged
    assert_engine_healthy_and_empty(server)


def test_a_fault_while_adding_fails_that_request_alone(in_process_server, monkeypatch) -> None:
    server, llm = in_process_server, in_process_server.llm
    monkeypatch.setattr(llm.scheduler, "add", fail_adding_marked(llm))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(server.post, CHAT, chat_body("Tell me a story", LONG))
        wait_until(lambda: bool(llm.scheduler.running))
        try:
            marked = server.post(CHAT, chat_body(f"{MARKER} here", SHORT), timeout=20)
        except httpx.ReadTimeout:
            pytest.fail("a request whose add failed got no answer: its stream was never told")
        running_response = running.result(60)

    error = assert_openai_error(marked, 500, type_="server_error", code="internal_error")
    assert "injected fault while adding" in error["message"]
    assert running_response.status_code == 200, (
        "a running request was failed by another request's fault while adding: "
        + running_response.text
    )
    assert running_response.json()["choices"][0]["finish_reason"] == "length"
    assert running_response.json()["usage"]["completion_tokens"] == LONG
    assert_engine_healthy_and_empty(server)


def test_a_fault_while_adding_a_stream_sends_an_error_event(in_process_server, monkeypatch) -> None:
    server, llm = in_process_server, in_process_server.llm
    monkeypatch.setattr(llm.scheduler, "add", fail_adding_marked(llm))
    with (
        server.http(timeout=20) as http,
        http.stream("POST", CHAT, json=chat_body(f"{MARKER} here", SHORT, stream=True)) as stream,
    ):
        assert stream.status_code == 200
        payloads = list(sse_events(stream))
    assert json.loads(payloads[0])["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[-1] == "[DONE]", payloads[-2:]
    error = json.loads(payloads[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error", error
    assert_engine_healthy_and_empty(server)
