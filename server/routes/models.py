"""GET /v1/models and GET /v1/models/{model}."""

from __future__ import annotations

from fastapi import APIRouter

from server.auth import require_api_key
from server.protocol import ModelCard, ModelList
from server.state import ServerState, StateDep

router = APIRouter(dependencies=[require_api_key])


@router.get("/v1/models")
async def list_models(state: StateDep) -> ModelList:
    return ModelList(data=[_served_model(state)])


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, state: StateDep) -> ModelCard:
    state.check_model(model)
    return _served_model(state)


def _served_model(state: ServerState) -> ModelCard:
    return ModelCard(id=state.settings.served_model_name, created=state.created)
