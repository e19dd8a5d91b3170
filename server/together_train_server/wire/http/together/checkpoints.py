"""Checkpoints (``/v1/rl/checkpoints``): listed from the model registry, inference ones downloadable.

Checkpoint ids are ``<session>.<kind>.<name>`` (`ids.uri_of`). Inference checkpoints download as files
behind URLs served here under ``/v1/rl/files/`` with their own short-lived credential (an HMAC over the
checkpoint, the file name and an expiry time), because the SDK fetches them without the Authorization
header. A URL names one file of one checkpoint's manifest, so it cannot read anything else. An inference
checkpoint saved through this API is two checkpoints: the adapter and its merged twin (``<name>.merged``,
its MERGED variant, hidden in listings).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request
from fastapi.responses import FileResponse

from together_train_server.service.interfaces import Checkpoint, ResourceApi, URI_SCHEME
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.wire.http.together.ids import MERGED_SUFFIX, URL_TTL_S, ckpt_id, ckpt_id_of_uri, uri_of
from together_train_server.wire.http.together.parsing import page_limit
from together_train_server.wire.http.together.rendering import rfc3339
from together_train_server.wire.http.together.routing import base_url, ctx, router, routes


def visible(ckpts: list[Any], resource: ResourceApi | None = None) -> list[Any]:
    """Hide the merged sibling of an inference checkpoint saved through this API (it is its MERGED variant).

    The sibling's adapter is looked for in `ckpts`, and in the model registry when `resource` is given (a page
    may hold one of the two).
    """
    names = {(c.session_id, c.kind, c.name) for c in ckpts}

    def twin(c: Checkpoint) -> bool:
        if not c.name.endswith(MERGED_SUFFIX):
            return False
        base = c.name[: -len(MERGED_SUFFIX)]
        return (c.session_id, c.kind, base) in names or (
            resource is not None and resource.checkpoints.checkpoint_registered(f"{URI_SCHEME}{c.session_id}/{c.kind}/{base}"))

    return [c for c in ckpts if not twin(c)]


def checkpoint_json(resource: ResourceApi, c: Checkpoint) -> dict[str, Any]:
    """A Together Checkpoint of ours (with its session's LoRA rank when the session is live)."""
    out = {"id": ckpt_id(c), "base_model": resource.base_model_name(), "created_at": rfc3339(c.created_at),
           "session_id": c.session_id, "step": int(c.step),
           "type": "CHECKPOINT_TYPE_INFERENCE" if c.kind == "weights" else "CHECKPOINT_TYPE_TRAINING"}
    s = next((s for s in resource.session_table.list_sessions_all() if s.session_id == c.session_id), None)
    if s is not None:
        out["lora_rank"] = int(s.lora.rank)
    return out


@router.get("/checkpoints")
@routes
async def list_checkpoints(request: Request) -> Any:
    """The caller's checkpoints, newest first; filters session_id, type, base_model; cursor after, limit."""
    resource, _, owner = ctx(request)
    q = request.query_params
    kind = {"CHECKPOINT_TYPE_TRAINING": "state", "CHECKPOINT_TYPE_INFERENCE": "weights", None: None}
    if q.get("type") not in kind:
        raise invalid(f"type must be CHECKPOINT_TYPE_TRAINING or CHECKPOINT_TYPE_INFERENCE, got {q.get('type')!r}",
                      key="type")
    limit = page_limit(q)
    if q.get("base_model") and q["base_model"] != resource.base_model_name():
        return {"data": [], "meta": {"has_more": False, "limit": limit, "next_cursor": ""}}
    # The model registry's keyset pager (a checkpoint whose files are gone is not listed); the merged twins
    # of inference checkpoints are hidden, so a page may hold fewer than `limit`.
    after = uri_of(q["after"]) if q.get("after") else ""
    ckpts, nxt = await asyncio.to_thread(resource.checkpoints.page_checkpoints, owner, session_id=q.get("session_id") or "",
                                         kind=kind[q.get("type")] or "", limit=limit, after=after)
    rows = [checkpoint_json(resource, c) for c in visible(ckpts, resource)]
    last = resource.checkpoints.cursor_key(nxt) if nxt else ""
    return {"data": rows, "meta": {"has_more": bool(nxt), "limit": limit,
                                   "next_cursor": ckpt_id_of_uri(last) if last else ""}}


@router.get("/checkpoints/{checkpoint_id}")
@routes
async def get_checkpoint(checkpoint_id: str, request: Request) -> Any:
    """One of the caller's checkpoints."""
    resource, _, owner = ctx(request)
    c = await asyncio.to_thread(resource.checkpoints.get_checkpoint, uri_of(checkpoint_id), owner)
    return checkpoint_json(resource, c)


@router.get("/checkpoints/{checkpoint_id}/download")
@routes
async def download_checkpoint(checkpoint_id: str, request: Request) -> Any:
    """Signed URLs (valid URL_TTL_S) for the files of an inference checkpoint's variant (MERGED by default)."""
    resource, ids, owner = ctx(request)
    variant = request.query_params.get("variant") or "CHECKPOINT_VARIANT_MERGED"
    if variant not in ("CHECKPOINT_VARIANT_MERGED", "CHECKPOINT_VARIANT_ADAPTER", "CHECKPOINT_VARIANT_UNSPECIFIED"):
        raise invalid(f"variant {variant!r} is not a CheckpointVariant", key="variant")
    uri = uri_of(checkpoint_id)
    c = await asyncio.to_thread(resource.checkpoints.get_checkpoint, uri, owner)
    if c.kind != "weights":
        raise invalid(f"checkpoint {checkpoint_id} is a training checkpoint; only inference checkpoints download",
                      key="checkpoint_id")
    if variant != "CHECKPOINT_VARIANT_ADAPTER" and not c.merged:
        sibling = f"{uri}{MERGED_SUFFIX}"
        try:
            c = await asyncio.to_thread(resource.checkpoints.get_checkpoint, sibling, owner)
        except ServiceError:
            raise invalid(f"checkpoint {checkpoint_id} has no merged variant (it was saved as an adapter only); "
                          "ask for variant=CHECKPOINT_VARIANT_ADAPTER", key="variant") from None
    elif variant == "CHECKPOINT_VARIANT_ADAPTER" and c.merged:
        raise invalid(f"checkpoint {checkpoint_id} is a merged model with no adapter variant", key="variant")
    ckpt, files = await asyncio.to_thread(resource.checkpoints.checkpoint_files, c.uri, owner)  # verified: DATA_LOSS otherwise
    exp = str(int(time.time() + URL_TTL_S))
    cid = ckpt_id(ckpt)
    base = base_url(request)
    # The SDK saves each file under its base name, so nested paths (none in our checkpoints) are left out.
    return {"data": [{"filename": rel, "size": int(size),
                      "url": f"{base}/v1/rl/files/checkpoints/{cid}/{rel}?expires={exp}"
                             f"&sig={ids.sign('ckpt', cid, rel, exp)}"}
                     for rel, _, size, _ in files if "/" not in rel]}


@router.get("/files/checkpoints/{checkpoint_id}/{filename}")
@routes
async def checkpoint_file(checkpoint_id: str, filename: str, request: Request) -> Any:
    """One file of one checkpoint, for the holder of a signed URL; only names in its manifest are served."""
    resource, ids, _ = ctx(request)
    ids.check_sig(request.query_params.get("sig", ""), request.query_params.get("expires", ""), "ckpt",
                  checkpoint_id, filename)
    path = await asyncio.to_thread(resource.checkpoints.checkpoint_file, uri_of(checkpoint_id), filename)
    return FileResponse(path, filename=filename)
