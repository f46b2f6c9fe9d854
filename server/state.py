"""ServerState: the engine behind the app, its readiness, and the server's settings."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from engine.async_llm import AsyncLLM
from server.errors import APIError
from server.metrics import Metrics

logger = logging.getLogger("aerie.server")


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_queued_requests: int = 256
    max_request_bytes: int = 8 << 20
    shutdown_timeout: float = 30.0


class ServerState:
    """Loads the engine in a background thread so /health can answer 503 while it loads."""

    def __init__(
        self, settings: ServerSettings, load_engine: Callable[[], AsyncLLM], metrics: Metrics
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.created = int(time.time())
        self.engine: AsyncLLM | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self._loader = threading.Thread(
            target=self._load, args=(load_engine,), daemon=True, name="aerie-loader"
        )
        self._loader.start()

    def _load(self, load_engine: Callable[[], AsyncLLM]) -> None:
        try:
            self.engine = load_engine()
            logger.info("engine ready: %s", self.settings.served_model_name)
        except BaseException as exc:  # reported by /health and every request
            logger.exception("engine failed to load")
            self.load_error = exc

    def ready_engine(self) -> AsyncLLM:
        """The engine, or a 503 that says why it cannot take requests now."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.load_error is not None:
            raise APIError(
                503, f"the engine failed to load: {self.load_error}", code="engine_failed"
            )
        if self.engine is None:
            raise APIError(
                503, "the model is still loading", code="loading", headers={"Retry-After": "5"}
            )
        if not self.engine.is_running:
            raise APIError(503, "the engine has stopped", code="engine_failed")
        return self.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )

    def check_queue(self, engine: AsyncLLM) -> None:
        if engine.num_waiting_requests >= self.settings.max_queued_requests:
            raise APIError(
                429,
                "too many requests are waiting; retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown(timeout=5)


def get_state(request: Request) -> ServerState:
    return request.app.state.aerie


StateDep = Annotated[ServerState, Depends(get_state)]
