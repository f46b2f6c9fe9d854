"""GET /health and GET /metrics: open without an API key, for load balancers and Prometheus."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from server.errors import APIError, error_response
from server.state import StateDep

router = APIRouter()


@router.get("/health")
async def health(state: StateDep) -> Response:
    try:
        state.ready_engine()
    except APIError as exc:
        return error_response(exc)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)
