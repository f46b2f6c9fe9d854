"""The FastAPI application: routers, error handlers, body limit, and the engine's lifecycle."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine.async_llm import AsyncLLM
from server.errors import install_error_handlers
from server.limits import BodySizeLimit
from server.metrics import Metrics
from server.routes import chat, completions, health, models
from server.state import ServerSettings, ServerState


def create_app(settings: ServerSettings, load_engine: Callable[[], AsyncLLM]) -> FastAPI:
    """An app that starts loading the engine at startup and serves 503 until it is ready."""
    metrics = Metrics(settings.served_model_name)

    def load_and_watch() -> AsyncLLM:
        engine = load_engine()
        metrics.attach(engine.engine)
        return engine

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state = ServerState(settings, load_and_watch, metrics)
        app.state.aerie = state
        yield
        state.shutdown()

    app = FastAPI(title="Aerie", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    install_error_handlers(app)
    for module in (chat, completions, models, health):
        app.include_router(module.router)
    return app
