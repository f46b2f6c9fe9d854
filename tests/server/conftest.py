"""Live `aerie serve` processes for the server tests, and small helpers to talk to them.

Every server listens on 127.0.0.1 only, on a free port, and is terminated at fixture teardown.
The shared tiny-model server is session-scoped; tests that must disturb a server (a full queue,
SIGTERM, a request that may stop the engine) start their own through `start_server`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.conftest import save_random_head, save_tiny_model

API_KEY = "sk-aerie-test"
TINY_NAME = "tiny-llama"
TINY_CONTEXT = 4096  # the tiny model's max_position_embeddings, and the server's --max-model-len
MAX_REQUEST_BYTES = 65536
READY_TIMEOUT_S = 240.0  # the default model times its kernels at start-up: slow on a busy machine
STOP_TIMEOUT_S = 20.0
# Tokens 0-2 are <pad>, <s> and </s>, which decode to no text: banning them makes every generated
# token exactly one character, so tests can reason about text and token counts interchangeably.
BAN_SPECIALS = {"0": -100, "1": -100, "2": -100}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    """One `aerie serve` subprocess on 127.0.0.1."""

    process: subprocess.Popen
    port: int
    log_path: Path
    model: str
    api_key: str | None
    _log_file: object = field(repr=False, default=None)
    # /health answers other than 200 seen while waiting for readiness: (status, headers, body)
    startup_answers: list = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **options) -> OpenAI:
        # max_retries=0: the SDK would otherwise retry 429s and 5xx behind the test's back.
        options = {"max_retries": 0, "timeout": 60.0, "api_key": self.api_key or "none", **options}
        return OpenAI(base_url=f"{self.base_url}/v1", **options)

    def async_client(self, **options) -> AsyncOpenAI:
        options = {"max_retries": 0, "timeout": 60.0, "api_key": self.api_key or "none", **options}
        return AsyncOpenAI(base_url=f"{self.base_url}/v1", **options)

    def http(self, timeout: float = 60.0, auth: bool = True) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers=self.headers if auth else {}, timeout=timeout
        )

    def post(self, path: str, body: dict, timeout: float = 60.0) -> httpx.Response:
        with self.http(timeout) as http:
            return http.post(path, json=body)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, summed over labels, by sample name."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return parse_metrics(text)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                pytest.fail(
                    f"aerie serve exited with code {self.process.returncode} before it was "
                    f"ready:\n{self.log_tail()}"
                )
            try:
                response = httpx.get(f"{self.base_url}/health", timeout=2)
            except httpx.TransportError as exc:
                last = repr(exc)
            else:
                if response.status_code == 200:
                    return
                last = response.text
                self.startup_answers.append(
                    (response.status_code, dict(response.headers), response.text)
                )
                if "engine_failed" in response.text:
                    self.stop()
                    pytest.fail(f"the engine failed to load: {last}\n{self.log_tail()}")
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"aerie serve not ready after {timeout:.0f}s ({last}):\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def wait_exit(self, timeout: float) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(timeout)
        return None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time; always reaps the process."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            if self.wait_exit(STOP_TIMEOUT_S) is None:
                self.process.kill()
                self.process.wait(10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def start_server(
    model: str | Path,
    log_dir: Path,
    *args: str,
    api_key: str | None = API_KEY,
    served_name: str | None = TINY_NAME,
    wait: bool = True,
) -> LiveServer:
    """Start `aerie serve` on a free loopback port; wait until /health says 200 (unless not
    `wait`: then the caller polls, e.g. for a server whose engine cannot load)."""
    port = free_port()
    command = [
        sys.executable,
        "-c",
        "from server.cli import main; main()",
        "serve",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(["--api-key", api_key] if api_key else []),
        *(["--served-model-name", served_name] if served_name else []),
        *args,
    ]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"aerie-serve-{port}.log"
    log_file = log_path.open("w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(
        command,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parents[2],
        env=env,
    )
    server = LiveServer(
        process, port, log_path, served_name or str(model), api_key, _log_file=log_file
    )
    if wait:
        server.wait_ready()
    return server


SPEC_NAME = "tiny-eagle"
SPEC_DEPTH = 4  # the draft tree of the speculating server: depth, top-k, nodes (root included)
SPEC_TOP_K = 4
SPEC_TOTAL_TOKENS = 16


def tiny_server_args(*extra: str) -> list[str]:
    """Flags shared by every tiny-model server: CPU, plain decoding, a small KV cache."""
    return [
        "--draft",
        "none",
        "--device",
        "cpu",
        "--num-threads",
        "1",
        "--max-model-len",
        str(TINY_CONTEXT),
        "--num-kv-blocks",
        "2048",
        *extra,
    ]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            name = match.group(1)
            totals[name] = totals.get(name, 0.0) + float(match.group(3))
    return totals


def sse_events(response: httpx.Response) -> Iterator[str]:
    """The `data:` payloads of a server-sent-event response, as they arrive ("[DONE]" included).

    Lines end at LF only, as the SSE format says: not `iter_lines()`, which also splits at
    U+0085 or U+2028, characters the tiny model emits and JSON carries unescaped."""
    buffer = ""
    for text in response.iter_text():
        buffer += text.replace("\r\n", "\n")
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            for line in event.split("\n"):
                if line.startswith("data:"):
                    value = line[len("data:") :]
                    yield value[1:] if value.startswith(" ") else value


def sse_json(payloads: list[str]) -> list[dict]:
    assert payloads and payloads[-1] == "[DONE]", f"the stream must end with [DONE]: {payloads}"
    assert payloads.count("[DONE]") == 1
    return [json.loads(p) for p in payloads[:-1]]


def assert_openai_error(
    response: httpx.Response,
    status: int,
    *,
    type_: str | None = None,
    param: object = ...,
    code: object = ...,
) -> dict:
    """The response has `status` and OpenAI's error object; return the `error` member."""
    assert response.status_code == status, (
        f"expected HTTP {status}, got {response.status_code}: {response.text[:500]}"
    )
    assert response.headers.get("content-type", "").startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    if type_ is not None:
        assert error["type"] == type_, error
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


def prompt_tokens_of(rendered: str) -> int:
    """Prompt length under the tiny character-level tokenizer: one token per character, except
    the special `<s>`, which is one token for three characters."""
    return len(rendered) - 2 * rendered.count("<s>")


def render_chat(messages: list[tuple[str, str]]) -> str:
    """The tiny model's chat template (tests/conftest.py), with the generation prompt."""
    turns = "".join(f"<s>{role}: {content}\n" for role, content in messages)
    return turns + "<s>assistant: "


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama (as in tests/engine: large weights, so greedy text varies) with a
    4096-token context: it decodes a token in about a millisecond, so only requests thousands of
    tokens long stay in flight long enough to cancel, queue behind, or outlive a SIGTERM."""
    return save_tiny_model(
        tmp_path_factory.mktemp("server-model") / "llama",
        "llama",
        seed=3,
        initializer_range=0.3,
        max_position_embeddings=TINY_CONTEXT,
    )


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def tiny_server(tiny_model, server_logs) -> Iterator[LiveServer]:
    """The shared server: API key, a 64 KiB body limit, at most 8 running sequences."""
    server = start_server(
        tiny_model,
        server_logs,
        *tiny_server_args("--max-num-seqs", "8", "--max-request-bytes", str(MAX_REQUEST_BYTES)),
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(tiny_server) -> Iterator[OpenAI]:
    with tiny_server.client() as client:
        yield client


@pytest.fixture
def spawn(tiny_model, server_logs) -> Iterator:
    """Start throw-away tiny-model servers; every one is stopped at teardown."""
    started: list[LiveServer] = []

    def _spawn(*extra: str, **options) -> LiveServer:
        server = start_server(tiny_model, server_logs, *tiny_server_args(*extra), **options)
        started.append(server)
        return server

    yield _spawn
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def in_process_server(tiny_model) -> Iterator:
    """The tiny model served in this process (no API key), one running sequence at a time, so a
    second request waits while the first runs; tests may patch one method of its engine."""
    from engine.async_llm import AsyncLLM
    from tests.server.in_process import serve_in_process, tiny_engine_config

    config = tiny_engine_config(tiny_model, max_num_seqs=1)
    server = serve_in_process(lambda: AsyncLLM.from_config(config))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def spec_model(tmp_path_factory) -> tuple[Path, Path]:
    """A nearly-bigram tiny target and an EAGLE head trained on it for a few seconds (as in
    tests/drafting), so the speculating server accepts a good share of its drafts."""
    from tests.drafting.conftest import train_head_quickly

    root = tmp_path_factory.mktemp("spec-model")
    target = save_tiny_model(
        root / "llama",
        "llama",
        residual_scale=0.1,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    head = train_head_quickly(target, save_random_head(root / "random-head", target), root / "head")
    return target, head


def spec_server_args(head: Path) -> list[str]:
    return [
        *tiny_server_args("--max-num-seqs", "8", "--max-model-len", "512"),  # later flags win
        "--draft", str(head),
        "--draft-depth", str(SPEC_DEPTH),
        "--draft-top-k", str(SPEC_TOP_K),
        "--draft-total-tokens", str(SPEC_TOTAL_TOKENS),
    ]  # fmt: skip


@pytest.fixture(scope="session")
def spec_server(spec_model, server_logs) -> Iterator[LiveServer]:
    """A server that speculates with the trained head (no API key: /metrics needs none), on
    whole trees every decode step (no adaptive budget), so the speculation counters are exact."""
    target, head = spec_model
    args = [*spec_server_args(head), "--no-adaptive-draft-budget"]
    server = start_server(target, server_logs, *args, api_key=None, served_name=SPEC_NAME)
    try:
        yield server
    finally:
        server.stop()
