"""``retrieve_future``: long-poll an operation and answer its result in the SDK's shape."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from together_train_server.service.interfaces import CANCELLED, FAILED, SUCCEEDED
from together_train_server.wire.http.tinker.base import PROTO, _ctx, router
from together_train_server.wire.http.tinker.parsing import _get, _json
from together_train_server.wire.http.tinker.results import _category, _result


LONG_POLL_S = 40.0

_WAIT_POOL: Any = None

_WAIT_POOL_LOCK = threading.Lock()


def _wait_pool() -> Any:
    """Threads for long-polls (sized like the gRPC server's pool; the default executor has a handful)."""
    global _WAIT_POOL
    with _WAIT_POOL_LOCK:
        if _WAIT_POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _WAIT_POOL = ThreadPoolExecutor(max_workers=256, thread_name_prefix="http-wait")
        return _WAIT_POOL


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    """Long-poll an operation: its result, 200 {error, category} when it failed, or 408 after ~40 s."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    op_id = _get(body, "request_id", str)
    rec = await asyncio.to_thread(resource.submissions.get_operation, op_id, owner)
    if not rec.terminal:
        # Blocked on the operation book's condition in a thread of its own (no polling: the trainer keeps
        # the CPU); one thread per waiting request, as gRPC's WaitOperation.
        await asyncio.get_running_loop().run_in_executor(_wait_pool(), resource.submissions.wait_operation, op_id, LONG_POLL_S, owner)
    if not rec.terminal:
        again = {"type": "try_again", "request_id": op_id, "queue_state": "active"}
        if rec.queue_position:  # its place in the trainer's run order (1 = next)
            again["queue_position"] = rec.queue_position
        return JSONResponse(again, status_code=408)
    if rec.status in (FAILED, CANCELLED):
        return JSONResponse({"error": str(rec.error), "category": _category(rec.error)})
    assert rec.status == SUCCEEDED
    return _result(rec, ids, PROTO in request.headers.get("accept", ""))
