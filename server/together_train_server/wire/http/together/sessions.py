"""Training sessions (``/v1/rl/training-sessions``): one of our sessions each (same id, ``s-...``).

A session is created within the POST, so it is RUNNING at the SDK's first GET. Listings and GETs also
show the sessions of earlier runs of this server (from the model registry); display name and metadata
live in the registry, so they outlive a restart.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request

from together_train_server.service.interfaces import ResourceApi, SessionRecord, SessionRow, owner_tag
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.wire.http.together.checkpoints import visible
from together_train_server.wire.http.together.ids import TogetherIds, uri_of
from together_train_server.wire.http.together.parsing import json_body, lora_config, page_limit
from together_train_server.wire.http.together.rendering import ckpt_short, rfc3339
from together_train_server.wire.http.together.resources import check_resource
from together_train_server.wire.http.together.routing import ctx, router, routes

SESSION_STATUS = {"ACTIVE": "TRAINING_SESSION_STATUS_RUNNING", "STOPPED": "TRAINING_SESSION_STATUS_STOPPED",
                  "EXPIRED": "TRAINING_SESSION_STATUS_EXPIRED",
                  "ENDED_BY_RESTART": "TRAINING_SESSION_STATUS_STOPPED"}  # the server stopped under it


def live(resource: ResourceApi, session_id: str, owner: str) -> SessionRecord | None:
    """The running server's SessionRecord, None for one of an earlier run (only in the registry)."""
    try:
        return resource.session_table.get_session(session_id, owner)
    except ServiceError:
        return None


def session_json(resource: ResourceApi, ids: TogetherIds, owner: str, s: SessionRecord | None,
                 row: SessionRow | None = None) -> dict[str, Any]:
    """A Together Session of the caller's live session `s` (None: one of an earlier run) and its registry `row`.

    Display name and metadata come from the registry row (None: read here); status, step and
    versions from the live session when there is one.
    """
    if s is not None:
        sid = s.session_id
    elif row is not None:
        sid = row.session_id
    else:
        raise ValueError("session_json needs the live session or its registry row")
    if row is None:
        try:
            row = resource.session_rows.session_row(sid, owner)
        except ServiceError:
            row = None  # a registry failure at creation is logged, never fails the session
    ex = ids.extras(sid)
    name = row.display_name if row is not None else s.name if s is not None else ""
    meta = dict(row.metadata) if row is not None else {}
    lora: dict[str, Any]
    if s is not None:
        ckpts = visible(resource.checkpoints.page_checkpoints(owner, session_id=sid)[0])  # the model registry
        lora = {"rank": s.lora.rank, "alpha": s.lora.alpha, "dropout": s.lora.dropout, "seed": s.lora.seed,
                "train_unembed": s.lora.train_unembed}
        pending = s.publish_pending
        synced, step, state, owner = int(s.synced_version), int(s.step), s.state, owner_tag(s.owner)
        created, updated = s.created_at, max(ex.updated_at, s.last_active_at)
    else:
        assert row is not None  # s None: the caller passed the row (checked above)
        ckpts = visible(resource.checkpoints.page_checkpoints(owner, session_id=sid)[0])
        lora = {k: row.lora.get(k) for k in ("rank", "alpha", "dropout", "seed", "train_unembed")}
        pending, synced, step, state, owner = False, int(row.step), int(row.step), row.status, row.owner
        created, updated = row.created_at, max(ex.updated_at, row.stopped_at or row.created_at)
    return {
        "id": sid,
        "base_model": resource.base_model_name(),
        "model_resources_id": ids.resource_id,
        "created_at": rfc3339(created),
        "updated_at": rfc3339(updated),
        "created_by": owner or "local",
        "status": SESSION_STATUS.get(state, "TRAINING_SESSION_STATUS_UNSPECIFIED"),
        "step": step,
        "policy_state": {"applied_weights_version": synced, "pending_publish": pending,
                         "target_weights_version": synced, "trainer_step": step},
        "display_name": name or None,
        "metadata": meta,
        "lora_config": lora,
        "resume_from_checkpoint_id": ex.resume_from_checkpoint_id,
        "training_checkpoints": [ckpt_short(c) for c in ckpts if c.kind == "state"],
        "inference_checkpoints": [ckpt_short(c) for c in ckpts if c.kind == "weights"],
    }


@router.post("/training-sessions")
@routes
async def create_session(request: Request) -> Any:
    """A RUNNING session (created within the request); 429 (not retried) at the session cap."""
    resource, ids, owner = ctx(request)
    body = await json_body(request)
    check_resource(ids, str(body.get("model_resources_id", "")))
    if ids.status != "MODEL_RESOURCES_STATUS_READY":
        raise ServiceError("FAILED_PRECONDITION", f"model resource {ids.resource_id} is stopped; create it again",
                           key="model_resources_id")
    ckpt_id = body.get("resume_from_checkpoint_id")
    uri = uri_of(ckpt_id) if ckpt_id else ""
    load_optimizer = body.get("load_optimizer")
    if load_optimizer is not None and not isinstance(load_optimizer, bool):
        raise invalid(f"load_optimizer must be a boolean, got {load_optimizer!r}", key="load_optimizer")
    with_optimizer = bool(uri) and load_optimizer is not False  # Together: omitted or true restores it
    lora = lora_config(body.get("lora_config"))
    s = await asyncio.to_thread(resource.sessions.create_session, lora, name=str(body.get("display_name") or ""),
                                owner=owner, checkpoint_uri=uri, with_optimizer=with_optimizer)
    meta = body.get("metadata")
    if meta:
        if not isinstance(meta, dict):
            raise invalid("metadata must be an object", key="metadata")
        await asyncio.to_thread(resource.session_rows.update_session_info, s.session_id, owner, metadata=dict(meta))
    ids.extras(s.session_id).resume_from_checkpoint_id = ckpt_id or None
    return session_json(resource, ids, owner, s)


@router.get("/training-sessions")
@routes
async def list_sessions(request: Request) -> Any:
    """Every session this storage holds (earlier runs' too), newest first, from the model registry's keyset
    pager; filters status / model_resources_id; cursor ``after`` (the last session id of the previous page)."""
    resource, ids, owner = ctx(request)
    q = request.query_params
    limit = page_limit(q)
    status = q.getlist("status")
    ours = [k for k, v in SESSION_STATUS.items() if v in status]
    mr = q.get("model_resources_id")
    if (status and not ours) or (mr and mr != ids.resource_id):
        return {"data": [], "meta": {"has_more": False, "limit": limit, "next_cursor": ""}}
    rows, nxt = await asyncio.to_thread(resource.session_rows.page_session_rows, owner, status=ours, limit=limit,
                                        after=q.get("after") or "")
    data = [session_json(resource, ids, owner, live(resource, r.session_id, owner), r) for r in rows]
    return {"data": data, "meta": {"has_more": bool(nxt), "limit": limit,
                                   "next_cursor": rows[-1].session_id if nxt else ""}}


@router.get("/training-sessions/{session_id}")
@routes
async def get_session(session_id: str, request: Request) -> Any:
    """A live session, or one of an earlier run of this server (from the model registry)."""
    resource, ids, owner = ctx(request)
    row = await asyncio.to_thread(resource.session_rows.session_row, session_id, owner)
    return session_json(resource, ids, owner, live(resource, session_id, owner), row)


@router.patch("/training-sessions/{session_id}")
@routes
async def update_session(session_id: str, request: Request) -> Any:
    """display_name ("" clears it) and metadata (given fields replace, "" clears one), kept in the model
    registry (they show after a restart too); sessions of earlier runs can be renamed as well."""
    resource, ids, owner = ctx(request)
    resource.session_rows.session_row(session_id, owner)
    body = await json_body(request)
    name, meta = body.get("display_name"), body.get("metadata")
    if "display_name" in body and not isinstance(name, str):
        raise invalid("display_name must be a string", key="display_name")
    if meta is not None and not isinstance(meta, dict):
        raise invalid("metadata must be an object", key="metadata")
    ex = ids.extras(session_id)
    with ex.lock:  # read-modify-write of the metadata
        row = resource.session_rows.session_row(session_id, owner)
        merged = dict(row.metadata)
        for k, v in (meta or {}).items():
            if isinstance(v, dict):
                cur = {**merged.get(k, {}), **v}
                merged[k] = {kk: vv for kk, vv in cur.items() if vv != ""}
            elif v == "":
                merged.pop(k, None)
            else:
                merged[k] = v
        resource.session_rows.update_session_info(session_id, owner, display_name=name if "display_name" in body else None,
                                     metadata=merged if meta is not None else None)
        ex.updated_at = time.time()
    return session_json(resource, ids, owner, live(resource, session_id, owner), resource.session_rows.session_row(session_id, owner))


@router.post("/training-sessions/{session_id}/stop")
@routes
async def stop_session(session_id: str, request: Request) -> Any:
    """Stops at once (queued operations are cancelled): the answer is already STOPPED."""
    resource, ids, owner = ctx(request)
    s = await asyncio.to_thread(resource.sessions.stop_session, session_id, owner)
    ids.extras(session_id).updated_at = time.time()
    return session_json(resource, ids, owner, s)
