"""`aerie serve`: uvicorn with a graceful SIGTERM (drain, then abort what is left, exit 0)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import uvicorn

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from server.app import create_app
from server.state import ServerSettings

logger = logging.getLogger("aerie.server")


class GracefulServer(uvicorn.Server):
    """On SIGTERM or SIGINT: refuse new requests (503), let those in flight finish for up to
    `shutdown_timeout` seconds, then end the rest with finish_reason "abort"."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if not self._draining:
            self._draining = True
            state = getattr(self.config.app.state, "aerie", None)  # type: ignore[union-attr]
            if state is not None:
                state.draining = True
                timer = threading.Timer(self.shutdown_timeout, _abort_all, args=(state,))
                timer.daemon = True
                timer.start()
            logger.info("shutting down: draining requests for up to %.0fs", self.shutdown_timeout)
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutting down, which would end the process
        # with the signal's status; a drained shutdown is a clean exit (status 0).
        self._captured_signals.clear()


def _abort_all(state) -> None:
    if state.engine is not None:
        logger.info("shutdown timeout reached: aborting the requests still running")
        state.engine.abort_all()


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
