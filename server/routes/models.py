"""GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter

from server.auth import require_api_key
from server.protocol import ModelCard, ModelList
from server.state import StateDep

router = APIRouter(dependencies=[require_api_key])


@router.get("/v1/models")
async def list_models(state: StateDep) -> ModelList:
    return ModelList(data=[ModelCard(id=state.settings.served_model_name, created=state.created)])
