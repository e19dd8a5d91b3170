"""Large request bodies (``/v1/rl/training-sessions/{id}/payloads``, ``/v1/rl/files/payloads``).

Request bodies over 0.5 MiB arrive through ``payloads/upload-url``: the SDK PUTs the JSON body to a
signed URL here (stored under ``<storage>/.payloads/``, at most `TogetherIds.max_payload_bytes`) and then
POSTs the operation with ``payload_id`` and a truncated copy of the body, which is ignored in favour of
the uploaded one (`operation_body`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, Response

from together_train_server.service.errors import ServiceError, invalid
from together_train_server.wire.http.app import error_body
from together_train_server.wire.http.together.ids import PAYLOAD_TTL_S, URL_TTL_S, Payload, TogetherIds
from together_train_server.wire.http.together.parsing import json_body
from together_train_server.wire.http.together.rendering import rfc3339
from together_train_server.wire.http.together.routing import base_url, ctx, router, routes


async def operation_body(request: Request, ids: TogetherIds, session_id: str, owner: str) -> dict[str, Any]:
    """The operation's body; with ``payload_id`` the uploaded full body (the inline one is truncated).

    The payload rides along as ``body["__payload__"]``, to be removed once the operation is queued.
    """
    body = await json_body(request)
    pid = body.get("payload_id")
    if pid is None:
        return body
    with ids.lock:
        p = ids.payloads.get(str(pid))
    if p is None or p.owner != owner or p.session_id != session_id or not p.complete:
        raise invalid(f"unknown payload_id {pid!r} (upload the body to the URL from payloads/upload-url first)",
                      key="payload_id")
    try:
        full = json.loads(await asyncio.to_thread(p.path.read_bytes))
    except (OSError, ValueError) as e:
        raise invalid(f"payload {pid} is not a readable JSON body: {e}", key="payload_id") from None
    if not isinstance(full, dict):
        raise invalid(f"payload {pid} must hold a JSON object", key="payload_id")
    full["__payload__"] = p  # removed once the operation is queued (a retry finds it by Idempotency-Key)
    return full


@router.post("/training-sessions/{session_id}/payloads/upload-url")
@routes
async def payload_upload_url(session_id: str, request: Request) -> Any:
    """A payload id and a signed URL (valid URL_TTL_S) to PUT an operation's JSON body to."""
    resource, ids, owner = ctx(request)
    resource.session_table.active_session(session_id, owner)
    now = time.time()
    with ids.lock:
        stale = [p for p in ids.payloads.values() if p.expires_at < now]
        for p in stale:
            del ids.payloads[p.payload_id]
        pid = f"pl-{uuid.uuid4().hex}"
        ids.payloads[pid] = Payload(pid, session_id, owner, ids.payload_dir / pid, now + PAYLOAD_TTL_S)
    for p in stale:
        p.path.unlink(missing_ok=True)
    exp = str(int(now + URL_TTL_S))
    url = f"{base_url(request)}/v1/rl/files/payloads/{pid}?expires={exp}&sig={ids.sign('put', pid, exp)}"
    return {"payload_id": pid, "upload_url": url, "expires_at": rfc3339(float(exp))}


@router.post("/training-sessions/{session_id}/payloads/{payload_id}/download-url")
@routes
async def payload_download_url(session_id: str, payload_id: str, request: Request) -> Any:
    """A signed URL (valid URL_TTL_S) to read back an uploaded payload."""
    resource, ids, owner = ctx(request)
    resource.session_table.get_session(session_id, owner)
    with ids.lock:
        p = ids.payloads.get(payload_id)
    if p is None or p.owner != owner or p.session_id != session_id or not p.complete:
        raise ServiceError("NOT_FOUND", f"unknown payload {payload_id!r}", key="payload_id")
    exp = str(int(time.time() + URL_TTL_S))
    url = f"{base_url(request)}/v1/rl/files/payloads/{payload_id}?expires={exp}&sig={ids.sign('get', payload_id, exp)}"
    return {"payload_id": payload_id, "download_url": url, "expires_at": rfc3339(float(exp))}


@router.put("/files/payloads/{payload_id}")
@routes
async def put_payload(payload_id: str, request: Request) -> Any:
    """The signed upload: the body is streamed to disk, at most max_payload_bytes (413 beyond)."""
    _, ids, _ = ctx(request)
    ids.check_sig(request.query_params.get("sig", ""), request.query_params.get("expires", ""), "put", payload_id)
    with ids.lock:
        p = ids.payloads.get(payload_id)
    if p is None:
        raise ServiceError("NOT_FOUND", f"unknown payload {payload_id!r}", key="payload_id")
    ids.payload_dir.mkdir(parents=True, exist_ok=True)
    tmp = p.path.with_name(f".{payload_id}.{os.getpid()}.part")
    size = 0
    try:
        with open(tmp, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > ids.max_payload_bytes:
                    raise ServiceError("OUT_OF_RANGE", f"payload over {ids.max_payload_bytes} bytes", key="payload")
                f.write(chunk)
        os.replace(tmp, p.path)
    except ServiceError as err:
        tmp.unlink(missing_ok=True)
        return JSONResponse(error_body(err), status_code=413, headers={"x-should-retry": "false"})
    p.complete = True
    return Response(status_code=200)


@router.get("/files/payloads/{payload_id}")
@routes
async def get_payload(payload_id: str, request: Request) -> Any:
    """The signed download of an uploaded payload."""
    _, ids, _ = ctx(request)
    ids.check_sig(request.query_params.get("sig", ""), request.query_params.get("expires", ""), "get", payload_id)
    with ids.lock:
        p = ids.payloads.get(payload_id)
    if p is None or not p.complete:
        raise ServiceError("NOT_FOUND", f"unknown payload {payload_id!r}", key="payload_id")
    return FileResponse(p.path, media_type="application/json")
