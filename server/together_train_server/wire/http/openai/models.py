"""``GET /v1/models`` and ``GET /v1/models/{model}``: the base model, then the caller's inference checkpoints."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from together_train_server.service.errors import ServiceError
from together_train_server.wire.http.openai.rendering import model_json
from together_train_server.wire.http.openai.routing import handled, router, service


@router.get("/v1/models")
@router.get("/v1/rollouts/{rollout_id}/models")
@handled
async def list_models(request: Request) -> Any:
    """The base model, then the caller's inference checkpoints (newest first)."""
    svc, owner = service(request)
    models = await asyncio.to_thread(svc.models, owner)
    return {"object": "list", "data": [model_json(m) for m in models]}


@router.get("/v1/models/{model:path}")
@handled
async def retrieve_model(model: str, request: Request) -> Any:
    """One model by id (a checkpoint URI contains slashes); 404 ``model_not_found`` otherwise."""
    svc, owner = service(request)
    for m in await asyncio.to_thread(svc.models, owner):
        if m.id == model:
            return model_json(m)
    raise ServiceError("NOT_FOUND", f"model {model!r} does not exist (see GET /v1/models)", key="model")
