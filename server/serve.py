"""`aerie serve`: uvicorn with a graceful SIGTERM (drain, then abort what is left, exit 0)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import uvicorn

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from server.app import create_app
from server.state import ServerSettings

logger = logging.getLogger("aerie.server")


class GracefulServer(uvicorn.Server):
    """On SIGTERM or SIGINT: keep listening, but answer new requests and /health with 503
    (shutting_down), so load balancers see the drain; let the requests in flight finish for up
    to `shutdown_timeout` seconds, end the rest with finish_reason "abort", then shut uvicorn
    down. A second signal skips the wait: uvicorn shuts down as usual (a third SIGINT forces)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        state = getattr(self.config.app.state, "aerie", None)  # type: ignore[union-attr]
        if self._draining or state is None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after shutting down, which would end the
            # process with the signal's status; a drained shutdown is a clean exit (status 0).
            self._captured_signals.clear()
            return
        self._draining = True
        state.draining = True
        logger.info("shutting down: draining requests for up to %.0fs", self.shutdown_timeout)
        threading.Thread(target=self._drain, args=(state,), name="aerie-drain", daemon=True).start()

    def _drain(self, state) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while _has_requests(state) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _has_requests(state):
            logger.info("shutdown timeout reached: aborting the requests still running")
            state.engine.abort_all()
        self.should_exit = True  # uvicorn then waits for the responses to be sent


def _has_requests(state) -> bool:
    return state.engine is not None and state.engine.has_unfinished_requests


def default_served_name(model: str) -> str:
    path = Path(model)
    return path.name if path.exists() else model


def serve(config: EngineConfig, settings: ServerSettings, host: str, port: int) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings, lambda: AsyncLLM.from_config(config))
    uvicorn_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=int(settings.shutdown_timeout) + 5,
    )
    GracefulServer(uvicorn_config, settings.shutdown_timeout).run()
