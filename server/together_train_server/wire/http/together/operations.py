"""Operations (``/v1/rl/training-sessions/{id}/operations/{kind}``): submit in arrival order, then poll.

Operations carry no seq_id: a session's operations take the next seq_id of its queue in arrival order
(under a per-session lock), so they run in arrival order, ``sample`` included
(`session_sampling.submit_sample`). The ``Idempotency-Key`` header maps to the queue's idempotency key:
a retried POST returns the original operation and the work is applied once. An inference checkpoint is
two queued operations (adapter, then merged model, same step), reported as one.

A POST refused by validation is a 400 (the JSON body names the sample index and key, and the operation
ran nothing); a stopped session is 400 with code SESSION_NOT_ACTIVE; the session cap is 429 with
``x-should-retry: false``. The POST waits up to `POST_HOLD_S` for the operation to finish and the GET up
to `GET_HOLD_S`, so a short operation costs no 0.5 s poll.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import Request

from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.interfaces import CANCELLED, FAILED, QUEUED, RUNNING, ResourceApi, SUCCEEDED
from together_train_server.wire.http.together import sampling, training
from together_train_server.wire.http.together.ids import OPS_KEPT, OpEntry, Prepared, TogetherIds
from together_train_server.wire.http.together.payloads import operation_body
from together_train_server.wire.http.together.routing import ctx, error_response, router, routes

POST_HOLD_S = 2.0
GET_HOLD_S = 10.0

OP_STATUS = {QUEUED: "TRAINING_OPERATION_STATUS_PENDING", RUNNING: "TRAINING_OPERATION_STATUS_RUNNING",
             SUCCEEDED: "TRAINING_OPERATION_STATUS_COMPLETED", FAILED: "TRAINING_OPERATION_STATUS_FAILED",
             CANCELLED: "TRAINING_OPERATION_STATUS_FAILED"}


@dataclass(frozen=True)
class Kind:
    """An operation kind: parse its body into a submission, and render its COMPLETED output."""

    prepare: Callable[[ResourceApi, dict[str, Any], str, str, str], Prepared]
    output: Callable[[OpEntry, list[Any]], dict[str, Any]]


KINDS: dict[str, Kind] = {
    "forward-backward": Kind(training.prepare_forward_backward, training.output_forward_backward),
    "custom-forward-backward": Kind(training.prepare_custom_forward_backward,
                                    training.output_custom_forward_backward),
    "optim-step": Kind(training.prepare_optim_step, training.output_optim_step),
    "weights-sync": Kind(training.prepare_weights_sync, training.output_weights_sync),
    "sample": Kind(sampling.prepare_sample, sampling.output_sample),
    "inference-checkpoint": Kind(training.prepare_inference_checkpoint, training.output_checkpoint),
    "training-checkpoint": Kind(training.prepare_training_checkpoint, training.output_checkpoint),
}


def op_error(err: ServiceError | None, ran: bool) -> dict[str, Any]:
    """A failed operation's OperationError; `ran`: it failed while running (not refused at submission)."""
    if err is None:
        return {"code": "TRAINING_OPERATION_ERROR_CODE_UNSPECIFIED", "message": "failed"}
    msg = str(err)
    if err.code == "INVALID_ARGUMENT":
        # The trainer refuses a batch whose loss or gradient is not finite while running it (nothing accumulated).
        code = "NON_FINITE_LOSS" if ran and "finite" in msg else "INVALID_INPUT"
    elif err.code in ("CANCELLED",) or (err.code == "FAILED_PRECONDITION" and err.key == "session_id"):
        code = "SESSION_NOT_ACTIVE"
    elif err.code == "RESOURCE_EXHAUSTED":
        code = "RESOURCE_EXHAUSTED"
    elif err.code == "DEADLINE_EXCEEDED":
        code = "TIMEOUT"
    elif err.code in ("FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS", "OUT_OF_RANGE", "UNIMPLEMENTED"):
        code = "INVALID_INPUT"
    else:
        code = "INTERNAL_ERROR"
    return {"code": f"TRAINING_OPERATION_ERROR_CODE_{code}", "message": msg}


def op_json(resource: ResourceApi, ids: TogetherIds, op_id: str) -> dict[str, Any]:
    """A Together Operation: its status, and its output (COMPLETED) or error (FAILED)."""
    entry = ids.ops[op_id]
    recs = [resource.submissions.get_operation(r, entry.owner) for r in entry.records]
    failed = next((r for r in recs if r.status in (FAILED, CANCELLED)), None)
    out: dict[str, Any] = {"id": op_id}
    if failed is not None:
        out.update(status=OP_STATUS[FAILED], error=op_error(failed.error, failed.started_at > 0))
    elif all(r.status == SUCCEEDED for r in recs):
        out.update(status=OP_STATUS[SUCCEEDED], output=KINDS[entry.kind].output(entry, recs))
    else:
        out["status"] = OP_STATUS[RUNNING if any(r.status != QUEUED for r in recs) else QUEUED]
        places = [r.queue_position for r in recs if r.queue_position > 0]
        if places:  # the trainer's run order (service/core/scheduler.py): 1 = next
            out["queue_position"] = min(places)
    return out


def refused(resource: ResourceApi, ids: TogetherIds, op_id: str) -> ServiceError | None:
    """The validation error of an operation refused at submission (FAILED without having started), if any."""
    entry = ids.ops[op_id]
    for r in entry.records:
        rec = resource.submissions.get_operation(r, entry.owner)
        if rec.status == FAILED and rec.started_at == 0.0 and rec.error is not None and rec.error.code != "INTERNAL":
            return rec.error
    return None


async def hold(resource: ResourceApi, ids: TogetherIds, op_id: str, seconds: float) -> None:
    """Wait (without a thread) until the operation is terminal or `seconds` pass."""
    deadline = time.monotonic() + seconds
    entry = ids.ops[op_id]
    recs = [resource.submissions.get_operation(r, entry.owner) for r in entry.records]
    delay = 0.002
    while not all(r.terminal for r in recs) and not any(r.status in (FAILED, CANCELLED) for r in recs):
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


def _unknown_kind(kind: str) -> ServiceError:
    return ServiceError("NOT_FOUND", f"unknown operation kind {kind!r}; one of {list(KINDS)}", key="kind")


@router.post("/training-sessions/{session_id}/operations/{kind}")
@routes
async def submit_operation(session_id: str, kind: str, request: Request) -> Any:
    """Queue an operation in arrival order; a retried Idempotency-Key returns the original operation."""
    resource, ids, owner = ctx(request)
    if kind not in KINDS:
        raise _unknown_kind(kind)
    s = resource.session_table.get_session(session_id, owner)
    key = request.headers.get("idempotency-key") or ""
    if not key:
        raise invalid("the Idempotency-Key header is required", key="Idempotency-Key")
    with ids.lock:
        known = ids.by_key.get((session_id, key))
    if known is not None:
        if ids.ops[known].kind != kind:
            raise ServiceError("ABORTED", f"Idempotency-Key {key!r} was used for a {ids.ops[known].kind} operation",
                               key="Idempotency-Key")
        err = refused(resource, ids, known)
        if err is not None:
            return error_response(err)
        await hold(resource, ids, known, POST_HOLD_S)
        return op_json(resource, ids, known)
    resource.session_table.active_session(session_id, owner)  # a stopped session: 400 before any parsing
    body = await operation_body(request, ids, session_id, owner)
    payload = body.pop("__payload__", None)
    submit, extra = await asyncio.to_thread(KINDS[kind].prepare, resource, body, session_id, f"together:{key}", owner)
    ex = ids.extras(session_id)

    def queue() -> str:
        with ex.lock:  # arrival order: the next seq_ids of the session's queue
            with ids.lock:
                known = ids.by_key.get((session_id, key))
            if known is not None:
                return known
            recs = submit(s.next_seq_id)
            op_id = recs[-1].operation_id
            with ids.lock:
                ids.ops[op_id] = OpEntry(kind, session_id, owner, [r.operation_id for r in recs], extra)
                ids.by_key[(session_id, key)] = op_id
                if len(ids.ops) > 2 * OPS_KEPT:
                    ids.prune(resource)
            return op_id

    op_id = await asyncio.to_thread(queue)
    if payload is not None:
        with ids.lock:
            ids.payloads.pop(payload.payload_id, None)
        payload.path.unlink(missing_ok=True)
    err = refused(resource, ids, op_id)
    if err is not None:
        return error_response(err)  # refused by validation at submission: nothing ran
    await hold(resource, ids, op_id, POST_HOLD_S)
    return op_json(resource, ids, op_id)


@router.get("/training-sessions/{session_id}/operations/{kind}/{op_id}")
@routes
async def get_operation(session_id: str, kind: str, op_id: str, request: Request) -> Any:
    """The operation's state; held up to GET_HOLD_S while it runs, so the SDK's 0.5 s poll rarely waits."""
    resource, ids, owner = ctx(request)
    resource.session_table.get_session(session_id, owner)
    with ids.lock:
        entry = ids.ops.get(op_id)
    if entry is None or entry.session_id != session_id or entry.kind != kind:
        raise ServiceError("NOT_FOUND", f"unknown {kind} operation {op_id!r} in session {session_id}",
                           key="operation_id")
    await hold(resource, ids, op_id, GET_HOLD_S)
    return op_json(resource, ids, op_id)
