"""Tinker RestClient session listings: ``GET /api/v1/sessions`` and ``GET /api/v1/sessions/{id}``.

Over the client sessions of this API (`ids.TinkerIds`): ``list_sessions`` pages the caller's
client session ids (newest first, ``limit`` / ``offset``); ``get_session`` names a client session's
training runs (model ids), its samplers, and the ``user_metadata`` / ``display_name`` sent when it
was created. Another API key's session is NOT_FOUND, as an unknown one. ``access_scope=accessible``
is answered as ``owned`` (no sharing between keys here).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from together_train_server.service.errors import invalid
from together_train_server.wire.http.tinker.base import _ctx, router


@router.get("/sessions")
def list_sessions(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    """RestClient.list_sessions: ``{"sessions": [client session ids]}``."""
    _, ids, owner = _ctx(request)
    if limit < 1 or offset < 0:
        raise invalid(f"limit must be >= 1 and offset >= 0, got limit={limit}, offset={offset}", key="limit")
    with ids._lock:
        mine = [cs for cs in ids.sessions.values() if cs.owner == owner]
    mine.sort(key=lambda cs: cs.created_at, reverse=True)
    return {"sessions": [cs.session_id for cs in mine[offset:offset + limit]]}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, request: Request) -> dict[str, Any]:
    """RestClient.get_session: the client session's training runs, samplers and metadata."""
    _, ids, owner = _ctx(request)
    cs = ids.session(session_id, owner)  # NOT_FOUND for an unknown id or another key's
    with ids._lock:
        samplers = [sid for sid, s in ids.samplers.items() if s.owner == owner and sid.startswith(cs.session_id + ":")]
        runs = list(cs.models)
    return {"training_run_ids": runs, "sampler_ids": samplers, "user_metadata": cs.user_metadata,
            "display_name": cs.display_name}
