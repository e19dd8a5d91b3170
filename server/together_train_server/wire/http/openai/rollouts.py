"""``GET`` / ``DELETE /v1/rollouts/{rollout_id}``: the calls recorded under a rollout URL (`service.rollouts`).

The calls themselves (``/v1/rollouts/{rollout_id}/chat/completions``, ``.../completions``,
``.../models``) are the other modules' routes under a second path. A rollout is its key's only:
another key's is 404, as a missing one.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from together_train_server.service.errors import ServiceError
from together_train_server.wire.http.openai.routing import handled, router, service


def _store(request: Request) -> tuple[Any, str]:
    svc, owner = service(request)
    if svc.rollouts is None:
        raise ServiceError("NOT_FOUND", "this server records no rollouts", key="rollout_id")
    return svc.rollouts, owner


@router.get("/v1/rollouts/{rollout_id}")
@handled
async def get_rollout(rollout_id: str, request: Request) -> Any:
    """``{"rollout_id", "calls": [{"model", "prompt_tokens", "choices": [{"tokens", "logprobs",
    "policy_versions", "finish_reason", "text"}], "messages", "created"}]}``."""
    store, owner = _store(request)
    return store.get(owner, rollout_id).to_json()


@router.delete("/v1/rollouts/{rollout_id}")
@handled
async def delete_rollout(rollout_id: str, request: Request) -> Any:
    """Free a rollout."""
    store, owner = _store(request)
    store.delete(owner, rollout_id)
    return {"rollout_id": rollout_id, "object": "rollout.deleted", "deleted": True}
