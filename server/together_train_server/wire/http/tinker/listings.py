"""The Tinker RestClient's listings: training runs and checkpoints, paged by offset from the model registry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request

from together_train_server.service.interfaces import Checkpoint, SessionRow
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.wire.http.tinker.base import _ctx, router
from together_train_server.wire.http.tinker.ids import _run_id, to_tinker_path

if TYPE_CHECKING:
    from together_train_server.service.interfaces import ResourceApi


def _iso(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


def _checkpoint_json(c: Checkpoint, resource: ResourceApi | None = None) -> dict[str, Any]:
    """A Tinker Checkpoint; with `resource`, its user_metadata and expires_at from the model registry."""
    path = to_tinker_path(c.uri)
    out = {"checkpoint_id": path.split("/", 3)[3], "checkpoint_type": "training" if c.kind == "state" else "sampler",
           "time": _iso(c.created_at), "tinker_path": path, "size_bytes": int(c.size_bytes), "public": False}
    row = resource.registry.checkpoint(c.uri) if resource is not None else None
    if row is not None:
        out["user_metadata"] = {str(k): str(v) for k, v in row.metadata.items()} or None
        out["expires_at"] = _iso(row.expires_at) if row.expires_at else None
    return out


def _training_run(resource: ResourceApi, row: SessionRow, owner: str) -> dict[str, Any]:
    """A Tinker TrainingRun of a session's model-registry `row` (a live session adds its last request time)."""
    try:
        live = resource.session_table.get_session(row.session_id, owner)
    except ServiceError:
        live = None  # a session of an earlier run of this server
    ckpts = resource.checkpoints.list_checkpoints(row.session_id, owner)
    last = {kind: next((c for c in reversed(ckpts) if c.kind == kind), None) for kind in ("state", "weights")}
    meta = {k: str(v) for k, v in row.metadata.items()}  # Tinker's user_metadata is str -> str
    return {
        "training_run_id": row.session_id,
        "base_model": resource.base_model_name(),
        "model_owner": "",
        "is_lora": True,
        "lora_rank": int(row.lora.get("rank") or 0) or None,
        "last_request_time": _iso(live.last_active_at if live is not None else (row.stopped_at or row.created_at)),
        "last_checkpoint": _checkpoint_json(last["state"], resource) if last["state"] else None,
        "last_sampler_checkpoint": _checkpoint_json(last["weights"], resource) if last["weights"] else None,
        "user_metadata": meta or None,
    }


def _offset_page(limit: int, offset: int) -> None:
    if limit < 1 or offset < 0:
        raise invalid(f"limit must be >= 1 and offset >= 0, got limit={limit} offset={offset}", key="limit")


@router.get("/training_runs")
def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    """Every session this storage holds (earlier runs' too), newest first, paged by offset from the model registry."""
    resource, _, owner = _ctx(request)
    _offset_page(limit, offset)
    rows, _ = resource.session_rows.page_session_rows(owner, limit=limit, offset=offset)
    return {"training_runs": [_training_run(resource, r, owner) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": resource.session_rows.count_session_rows(owner)}}


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, request: Request) -> dict[str, Any]:
    resource, ids, owner = _ctx(request)
    sid = _run_id(ids, run_id, owner)
    try:
        row = resource.session_rows.session_row(sid, owner)
    except ServiceError:
        raise ServiceError("NOT_FOUND", f"unknown training run {run_id!r}", key="run_id") from None
    return _training_run(resource, row, owner)


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
    resource, ids, owner = _ctx(request)
    ckpts = [_checkpoint_json(c, resource) for c in resource.checkpoints.list_checkpoints(_run_id(ids, run_id, owner), owner)]
    return {"checkpoints": ckpts}


@router.get("/checkpoints")
def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict[str, Any]:
    """The caller's checkpoints, newest first, paged by offset from the model registry."""
    resource, _, owner = _ctx(request)
    _offset_page(limit, offset)
    ckpts, _ = resource.checkpoints.page_checkpoints(owner, limit=limit, offset=offset)  # files gone: not listed
    return {"checkpoints": [_checkpoint_json(c, resource) for c in ckpts],
            "cursor": {"offset": offset, "limit": limit, "total_count": resource.checkpoints.count_checkpoints(owner)}}
