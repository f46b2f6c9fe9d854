"""An Aerie app served by uvicorn in a thread of the test process, so a test can reach into its
real engine (inject a fault into one method, count free KV blocks) while talking HTTP to it, or
drive the ASGI app by hand."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from server.app import create_app
from server.state import ServerSettings, ServerState
from tests.server.conftest import TINY_CONTEXT, TINY_NAME, free_port

START_TIMEOUT_S = 30.0


def tiny_engine_config(model: Path, **options) -> EngineConfig:
    """The tiny-model engine of tiny_server_args(), as a config object."""
    options = {
        "device": "cpu",
        "max_model_len": TINY_CONTEXT,
        "num_kv_blocks": 2048,
        **options,
    }
    return EngineConfig(model=str(model), draft=None, **options)


@dataclass
class InProcessServer:
    app: FastAPI
    port: int
    _server: uvicorn.Server
    _thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> ServerState:
        return self.app.state.aerie

    @property
    def llm(self) -> LLMEngine:
        """The real engine behind the app (once loaded)."""
        return self.state.engine.engine

    def http(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float = 60.0) -> httpx.Response:
        with self.http(timeout) as http:
            return http.post(path, json=body)

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.base_url}/health", timeout=10)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.health().status_code != 200:
            assert time.monotonic() < deadline, f"not ready: {self.health().text}"
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(START_TIMEOUT_S)


def serve_in_process(
    load_engine: Callable[[], AsyncLLM], served_name: str = TINY_NAME
) -> InProcessServer:
    """Start uvicorn (no API key) once it listens; the engine loads in the app's own thread."""
    app = create_app(ServerSettings(served_model_name=served_name), load_engine)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, log_level="warning")
    server = uvicorn.Server(config)  # outside the main thread it installs no signal handlers
    thread = threading.Thread(target=server.run, name="uvicorn-in-process", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return InProcessServer(app, port, server, thread)
