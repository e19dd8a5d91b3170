"""Tinker client sessions: create, heartbeat (keeps their training models alive), finish (stops them)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from together_train_server.service.errors import ServiceError
from together_train_server.wire.http.tinker.base import _ctx, router
from together_train_server.wire.http.tinker.ids import finish
from together_train_server.wire.http.tinker.parsing import _get, _json


@router.post("/create_session")
async def create_session(request: Request) -> dict[str, Any]:
    _, ids, owner = _ctx(request)
    body = await _json(request) if await request.body() else {}
    meta = _get(body, "user_metadata", dict, None)
    name = _get(body, "display_name", str, None)
    cs = ids.new_session(owner)
    cs.user_metadata, cs.display_name = meta, name
    return {"type": "create_session", "session_id": cs.session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request) -> Any:
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    cs = ids.session(_get(body, "session_id", str), owner)
    if cs.finished:
        # 410 ends the SDK's heartbeat loop.
        return JSONResponse({"detail": f"session {cs.session_id} has finished"}, status_code=410)
    cs.last_heartbeat = time.time()
    for ours in list(cs.models.values()):
        try:
            resource.session_table.keep_alive(ours, owner)
        except ServiceError:
            pass  # a stopped model stays stopped; its calls say so
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, request: Request) -> dict[str, Any]:
    """End a client session: its training models are stopped (their checkpoints stay)."""
    resource, ids, owner = _ctx(request)
    finish(resource, ids, ids.session(session_id, owner))
    return {}
