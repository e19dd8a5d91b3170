"""Checkpoint search, edits and storage usage over HTTP (``/v1/checkpoints/...``; neither the Tinker 0.38 client
nor the Together SDK has a route for these, so the shape is ours and mirrors the gRPC messages).

- ``POST /v1/checkpoints/search``: JSON ``{user_metadata, type, base_model, session_id, owner, limit, cursor}``
  -> ``{checkpoints: [...], next_cursor}`` (newest first; each with size_bytes, user_metadata, expires_at, pinned);
- ``PATCH /v1/checkpoints``: ``{uri, user_metadata?, ttl_seconds?, pinned?}`` (a key left out stays as is;
  ``ttl_seconds`` null/0 = never expires) -> the checkpoint;
- ``GET /v1/checkpoints/usage``: ``{usage: {owner tag: bytes}}`` (the caller's; an admin key: every key's).

``uri`` is ours (``together-train://``) or a ``tinker://`` path. Errors: the service's, as JSON (400 naming
the field, 403 for another key's checkpoints without an admin key, 404).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from together_train_server.service.interfaces import CheckpointRow, checkpoint_type
from together_train_server.wire.http.deps import OwnerDep, ResourceDep
from together_train_server.service.errors import invalid

router = APIRouter(prefix="/v1/checkpoints")


def row_json(row: CheckpointRow) -> dict[str, Any]:
    """A registry row as JSON (times in Unix seconds; expires_at null = never)."""
    return {"uri": row.uri, "session_id": row.session_id, "name": row.name, "type": checkpoint_type(row),
            "base_model": row.base_model, "step": int(row.step), "size_bytes": int(row.size_bytes),
            "created_at": float(row.created_at), "user_metadata": dict(row.metadata),
            "expires_at": row.expires_at, "pinned": bool(row.pinned), "owner": row.owner}


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise invalid("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


def _uri(value: Any) -> str:
    from together_train_server.wire.http.tinker.ids import to_our_uri

    if not isinstance(value, str) or not value:
        raise invalid("uri is required: a together-train:// or tinker:// checkpoint path", key="uri")
    return to_our_uri(value, "uri")


@router.post("/search")
async def search(request: Request, resource: ResourceDep, owner: OwnerDep) -> dict[str, Any]:
    b = await _body(request)
    rows, nxt = await asyncio.to_thread(
        resource.lifecycle.search, owner, user_metadata=b.get("user_metadata"), type=b.get("type") or "",
        base_model=b.get("base_model") or "", session_id=b.get("session_id") or "", of_owner=b.get("owner") or "",
        limit=b.get("limit", 50), cursor=b.get("cursor") or "")
    return {"checkpoints": [row_json(r) for r in rows], "next_cursor": nxt}


@router.patch("")
async def update(request: Request, resource: ResourceDep, owner: OwnerDep) -> dict[str, Any]:
    b = await _body(request)
    row = await asyncio.to_thread(
        resource.lifecycle.update, _uri(b.get("uri")), owner,
        user_metadata=b["user_metadata"] if "user_metadata" in b else None,
        ttl_seconds=b["ttl_seconds"] if "ttl_seconds" in b else False,
        pinned=bool(b["pinned"]) if "pinned" in b else None)
    return row_json(row)


@router.get("/usage")
def usage(resource: ResourceDep, owner: OwnerDep) -> dict[str, Any]:
    return {"usage": resource.lifecycle.usage(owner)}
