"""The Together RL REST API (``/v1/rl/...``) over the resource's service layer.

The official ``together`` SDK (3.1.1, ``together.post_training``) runs
unchanged against these routes: a user points ``base_url`` at this server
and passes one of its API keys (``Authorization: Bearer <key>``). The
contract is the SDK's sources (``together/resources/post_training/*``,
``together/post_training/*``); how it maps onto ours:

- a running server is ONE model resource (``mr-...``), READY from the
  start: ``create`` with the base model this server holds returns it (another
  base model is a 400 naming ours); ``stop`` without ``force`` is refused while
  sessions are active, with ``force`` it stops every session of the caller's
  key; the next ``create`` makes it READY again (the server keeps running).
- a training session is one of our sessions (same id, ``s-...``), created
  within the POST, so it is RUNNING at the SDK's first GET.
- operations carry no seq_id: a session's operations take the next seq_id
  of its queue in arrival order (under a per-session lock), so they run in
  arrival order, ``sample`` included (`session_sampling.submit_sample`). The
  ``Idempotency-Key`` header maps to the queue's idempotency key: a retried
  POST returns the original operation and the work is applied once. An
  operation id is our operation id; an inference checkpoint is two queued
  operations (adapter, then merged model, same step), reported as one.
- a POST refused by validation is a 400 (the JSON body names the sample
  index and key, and the operation ran nothing); a stopped session is 400 with
  code SESSION_NOT_ACTIVE; the session cap is 429 with ``x-should-retry:
  false`` (the SDK would retry it 7 times otherwise). The POST waits up to
  `POST_HOLD_S` for the operation to finish and the GET up to `GET_HOLD_S`,
  so a short operation costs no 0.5 s poll.
- checkpoints are listed from the model registry (`Resource.page_checkpoints`);
  checkpoint ids are ``<session>.<kind>.<name>`` (our URI
  ``together-train://<session>/<kind>/<name>``, reversible without a table).
  Inference checkpoints download as files behind URLs served here under
  ``/v1/rl/files/`` with their own short-lived credential (an HMAC over
  the checkpoint, the file name and an expiry time), because the SDK fetches
  them without the Authorization header. A URL names one file of one
  checkpoint's manifest, so it cannot read anything else.
- request bodies over 0.5 MiB arrive through ``payloads/upload-url``: the SDK
  PUTs the JSON body to a signed URL here (stored under
  ``<storage>/.payloads/``, at most `max_payload_bytes`) and then POSTs the
  operation with ``payload_id`` and a truncated copy of the body, which is
  ignored in favour of the uploaded one.

Not served (a clear 400): Muon (``muon_params``), LOSS_TYPE_DPPO, full-weight
resources (``lora_enabled=false``), ``base_weights_ref``, ``return_routed_experts``
(no mixture-of-experts here), non-encoded-text prompt chunks.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from together_train_server.engines.types import LoraConfig
from together_train_server.service.checkpoints import URI_SCHEME, owner_tag
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.operations import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED
from together_train_server.service.sampling import DEFAULT_MAX_TOKENS
from together_train_server.service.session_sampling import submit_sample
from together_train_server.wire.http import together_wire as tw
from together_train_server.wire.http.app import HTTP_STATUS, error_body

router = APIRouter(prefix="/v1/rl")
# Signed download/upload URLs: the SDK fetches them without the Authorization header.
OPEN_PREFIXES = ("/v1/rl/files/",)

POST_HOLD_S = 2.0
GET_HOLD_S = 10.0
URL_TTL_S = 900.0
PAYLOAD_TTL_S = 3600.0
# Operation entries kept at least (the operation book keeps 10,000 records for an hour); older ones whose
# records the book evicted are forgotten.
OPS_KEPT = 10_000
MERGED_SUFFIX = ".merged"
# Together's documented default when AdamParams.grad_clip_norm is unset (ours is 0 = off).
TOGETHER_GRAD_CLIP_NORM = 1.0

_OP_KINDS = ("forward-backward", "custom-forward-backward", "optim-step", "weights-sync", "sample",
             "inference-checkpoint", "training-checkpoint")
_OP_STATUS = {QUEUED: "TRAINING_OPERATION_STATUS_PENDING", RUNNING: "TRAINING_OPERATION_STATUS_RUNNING",
              SUCCEEDED: "TRAINING_OPERATION_STATUS_COMPLETED", FAILED: "TRAINING_OPERATION_STATUS_FAILED",
              CANCELLED: "TRAINING_OPERATION_STATUS_FAILED"}
_SESSION_STATUS = {"ACTIVE": "TRAINING_SESSION_STATUS_RUNNING", "STOPPED": "TRAINING_SESSION_STATUS_STOPPED",
                   "EXPIRED": "TRAINING_SESSION_STATUS_EXPIRED",
                   "ENDED_BY_RESTART": "TRAINING_SESSION_STATUS_STOPPED"}  # the server stopped under it


# ----- id translation ------------------------------------------------------------------------
@dataclass
class SessionExtras:
    """What the Together API keeps about a session that our SessionRecord has no field for (display name and
    metadata live in the model registry, so they outlive a restart)."""

    resume_from_checkpoint_id: str | None = None
    updated_at: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class OpEntry:
    """A Together operation: its kind, our operation ids (one, or two for an inference
    checkpoint) and what its output needs that the result lacks (request inputs, flags)."""

    kind: str
    session_id: str
    records: list[str]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Payload:
    payload_id: str
    session_id: str
    owner: str
    path: Path
    expires_at: float
    complete: bool = False


class TogetherIds:
    """The model resource's state, session extras, operation entries, payloads and the URL-signing key."""

    def __init__(self, resource: Any) -> None:
        self.lock = threading.Lock()
        self.resource_id = f"mr-{uuid.uuid4().hex[:16]}"
        self.status = "MODEL_RESOURCES_STATUS_READY"
        self.created_at = self.updated_at = time.time()
        self.expires_at = 0.0  # extend_expiry's promise (our sessions expire by their own idle timer)
        self.sessions: dict[str, SessionExtras] = {}
        self.ops: dict[str, OpEntry] = {}
        self.by_key: dict[tuple[str, str], str] = {}  # (session id, Idempotency-Key) -> operation id
        self.payloads: dict[str, Payload] = {}
        self.secret = secrets.token_bytes(32)
        self.payload_dir = Path(resource.store.root) / ".payloads"
        # A JSON body is ~3x its binary tensors; beyond this an upload is refused (413).
        self.max_payload_bytes = max(64 << 20, 8 * int(resource.max_request_bytes()))

    def prune(self, book: Any) -> None:
        """Forget the oldest operations beyond OPS_KEPT whose records the operation book has evicted
        (caller holds `lock`); their ids then answer 404, as the book's own evicted ids do."""
        gone = set()
        for op_id in list(self.ops)[: len(self.ops) - OPS_KEPT]:
            try:
                book.get(self.ops[op_id].records[0])
            except ServiceError:
                del self.ops[op_id]
                gone.add(op_id)
        if gone:
            self.by_key = {k: v for k, v in self.by_key.items() if v not in gone}

    def extras(self, session_id: str) -> SessionExtras:
        with self.lock:
            return self.sessions.setdefault(session_id, SessionExtras())

    def sign(self, *parts: str) -> str:
        return hmac.new(self.secret, "|".join(parts).encode(), hashlib.sha256).hexdigest()

    def check_sig(self, sig: str, expires: str, *parts: str) -> None:
        """Raises ServiceError PERMISSION_DENIED for a wrong or expired signature."""
        try:
            exp = float(expires)
        except ValueError:
            exp = 0.0
        if exp < time.time() or not hmac.compare_digest(self.sign(*parts, expires), sig or ""):
            raise ServiceError("PERMISSION_DENIED", "this URL's signature is wrong or has expired; request a new one",
                               key="sig")


def install(app: FastAPI, resource: Any) -> None:
    """Attach this API's tables to the app."""
    app.state.together = TogetherIds(resource)


def _ctx(request: Request) -> tuple[Any, TogetherIds, str]:
    return request.app.state.resource, request.app.state.together, request.state.owner


# ----- errors ---------------------------------------------------------------------------------
def _error(err: ServiceError) -> JSONResponse:
    """The HTTP error of a refused request: 4xx that the SDK does not retry (429 included), 5xx that it does."""
    status = HTTP_STATUS.get(err.code, 500)
    body = error_body(err)  # detail (the message naming sample and key), code, sample_index, key
    body["message"] = body.pop("detail")
    if err.code == "FAILED_PRECONDITION" and err.key == "session_id":
        body["code"] = "SESSION_NOT_ACTIVE"
    retry = status >= 500 and err.retryable
    return JSONResponse({"error": body}, status_code=status, headers={"x-should-retry": "true" if retry else "false"})


# The app answers errors under these paths (auth failures, unknown bodies) with `error_response`.
ERROR_PREFIXES = ("/v1/rl",)


def error_response(err: ServiceError) -> JSONResponse:
    """This API's error shape for the app's handlers (see app.create_app's ERROR_PREFIXES)."""
    return _error(err)


def _routes(fn: Callable) -> Callable:
    """Service errors raised by a route become `_error` responses (not the app's generic mapping)."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except ServiceError as err:
            return _error(err)

    return wrapper


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():  # empty-body POSTs arrive with Content-Length: 0
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise invalid(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


# ----- model resources -------------------------------------------------------------------------
def _model_name(resource: Any) -> str:
    return str(getattr(resource.engine, "model_dir", None) or resource.engine.model_id)


def _resource_json(resource: Any, ids: TogetherIds, owner: str) -> dict[str, Any]:
    ready = ids.status == "MODEL_RESOURCES_STATUS_READY"
    last = max([s.last_active_at for s in resource.list_sessions(owner)] + [ids.created_at])
    return {
        "id": ids.resource_id,
        "base_model": _model_name(resource),
        "compute_config": {"num_generator_replicas": len(resource.pool)},
        "created_at": tw.rfc3339(ids.created_at),
        "updated_at": tw.rfc3339(ids.updated_at),
        "created_by": owner_tag(owner) or "local",
        "inactive_timeout": int(resource.idle_timeout_s),
        "lora_enabled": getattr(resource.engine, "mode", "lora") == "lora",
        "optimizer_config": {"adam": {}},
        "status": ids.status,
        "status_details": {},
        "expires_at": tw.rfc3339(max(last + resource.idle_timeout_s, ids.expires_at)) if ready else None,
    }


def _check_resource(ids: TogetherIds, resource_id: str) -> None:
    if resource_id != ids.resource_id:
        raise ServiceError("NOT_FOUND", f"unknown model resource {resource_id!r}; this server is model resource "
                                        f"{ids.resource_id!r}", key="model_resources_id")


@router.post("/model-resources")
@_routes
async def create_model_resource(request: Request) -> Any:
    """This server's resource, READY, when `base_model` is the model it holds (400 naming it otherwise)."""
    from together_train_server.wire.http.tinker.parsing import _check_base_model

    resource, ids, owner = _ctx(request)
    body = await _json(request)
    base_model = body.get("base_model")
    if not isinstance(base_model, str) or not base_model:
        raise invalid("base_model is required", key="base_model")
    _check_base_model(resource, base_model)
    if body.get("lora_enabled") is False and getattr(resource.engine, "mode", "lora") == "lora":
        raise invalid("this server hosts LoRA sessions (started without --full-weights); lora_enabled=false is not "
                      "available here", key="lora_enabled")
    if body.get("base_weights_ref"):
        raise invalid("base_weights_ref is not supported: this server trains the weights it was started with",
                      key="base_weights_ref")
    want = (body.get("compute_config") or {}).get("num_generator_replicas")
    if want is not None and tw.int64(want, "num_generator_replicas") != len(resource.pool):
        raise invalid(f"this server runs {len(resource.pool)} generator replicas (serve --generators N); "
                      f"compute_config.num_generator_replicas={want} cannot be provisioned",
                      key="num_generator_replicas")
    if (body.get("optimizer_config") or {}).get("muon") is not None:
        raise invalid("the Muon optimizer is not supported here (Adam only)", key="optimizer_config.muon")
    with ids.lock:
        ids.status, ids.updated_at = "MODEL_RESOURCES_STATUS_READY", time.time()
    return _resource_json(resource, ids, owner)


@router.get("/model-resources")
@_routes
async def list_model_resources(request: Request) -> Any:
    resource, ids, owner = _ctx(request)
    status = request.query_params.getlist("status")
    data = [_resource_json(resource, ids, owner)]
    data = [d for d in data if not status or d["status"] in status]
    return {"data": data, "meta": {"has_more": False, "limit": 100, "next_cursor": ""}}


@router.get("/model-resources/{resource_id}")
@_routes
async def get_model_resource(resource_id: str, request: Request) -> Any:
    resource, ids, owner = _ctx(request)
    _check_resource(ids, resource_id)
    return _resource_json(resource, ids, owner)


@router.post("/model-resources/{resource_id}/extend-expiry")
@_routes
async def extend_expiry(resource_id: str, request: Request) -> Any:
    """Keep the caller's sessions from expiring for at least `seconds` (60-86400): their idle timers restart."""
    resource, ids, owner = _ctx(request)
    _check_resource(ids, resource_id)
    seconds = tw.int64((await _json(request)).get("seconds"), "seconds")
    if not 60 <= seconds <= 86400:
        raise invalid(f"seconds must be in [60, 86400], got {seconds}", key="seconds")
    if ids.status != "MODEL_RESOURCES_STATUS_READY":
        raise ServiceError("FAILED_PRECONDITION", f"model resource {resource_id} is not READY", key="status")
    for s in resource.list_sessions(owner):
        if s.state == "ACTIVE":
            resource.keep_alive(s.session_id, owner)
    with ids.lock:
        ids.expires_at = max(ids.expires_at, time.time() + seconds)
    return _resource_json(resource, ids, owner)


@router.post("/model-resources/{resource_id}/stop")
@_routes
async def stop_model_resource(resource_id: str, request: Request) -> Any:
    """Refused (400) while the caller has active sessions, unless ?force=true stops them."""
    resource, ids, owner = _ctx(request)
    _check_resource(ids, resource_id)
    force = request.query_params.get("force", "false").lower() in ("true", "1")
    active = [s.session_id for s in resource.list_sessions(owner) if s.state == "ACTIVE"]
    if ids.status != "MODEL_RESOURCES_STATUS_READY":
        raise ServiceError("FAILED_PRECONDITION", f"model resource {resource_id} is already stopped", key="status")
    if active and not force:
        raise ServiceError("FAILED_PRECONDITION", f"model resource {resource_id} has {len(active)} active training "
                           f"sessions ({', '.join(active)}); stop them first or pass force=true", key="force")
    for sid in active:
        await asyncio.to_thread(resource.stop_session, sid, owner)
    with ids.lock:
        ids.status, ids.updated_at = "MODEL_RESOURCES_STATUS_STOPPED", time.time()
    return _resource_json(resource, ids, owner)


@router.get("/supported-models")
@_routes
async def supported_models(request: Request) -> Any:
    resource, _, _ = _ctx(request)
    caps = resource.capabilities()
    lim = caps["limits"]
    return {"data": [{
        "base_model": _model_name(resource),
        "default_gpu_type": "B200-SXM",  # the SDK's only enum value; this server runs on what it was started on
        "compute_configs": [{
            "gpu_type": "B200-SXM",
            "trainer_config": {"lora": {"max_batch_size": int(getattr(lim, "max_samples_per_batch", 0) or 0),
                                        "max_rank": int(caps["max_lora_rank"]),
                                        "max_seq_length": int(caps["max_seq_len"])}},
            "generator_config": {"context_length": int(caps["max_seq_len"]),
                                 "sampling_defaults": {"logprobs": 1, "max_tokens": DEFAULT_MAX_TOKENS, "n": 1,
                                                       "temperature": 1.0}}
            if caps["num_replicas"] else None,
        }],
    }]}


# ----- sessions ----------------------------------------------------------------------------------
def _ckpt_id(c: Any) -> str:
    return f"{c.session_id}.{c.kind}.{c.name}"


def _uri_of(checkpoint_id: str) -> str:
    parts = checkpoint_id.split(".", 2)
    if len(parts) != 3 or parts[1] not in ("weights", "state"):
        raise ServiceError("NOT_FOUND", f"unknown checkpoint {checkpoint_id!r}", key="checkpoint_id")
    return f"{URI_SCHEME}{parts[0]}/{parts[1]}/{parts[2]}"


def _visible(ckpts: list[Any], registry: Any = None) -> list[Any]:
    """Hide the merged sibling of an inference checkpoint saved through this API (it is its MERGED variant).

    The sibling's adapter is looked for in `ckpts`, and in `registry` when given (a page may hold one of the two).
    """
    names = {(c.session_id, c.kind, c.name) for c in ckpts}

    def twin(c: Any) -> bool:
        if not c.name.endswith(MERGED_SUFFIX):
            return False
        base = c.name[: -len(MERGED_SUFFIX)]
        return (c.session_id, c.kind, base) in names or (
            registry is not None and registry.checkpoint(f"{URI_SCHEME}{c.session_id}/{c.kind}/{base}") is not None)

    return [c for c in ckpts if not twin(c)]


def _ckpt_short(c: Any) -> dict[str, Any]:
    return {"id": _ckpt_id(c), "created_at": tw.rfc3339(c.created_at), "step": int(c.step)}


def _session_row(resource: Any, session_id: str, owner: str) -> Any:
    """The session's model-registry row (any session this storage ever held), NOT_FOUND for another key's."""
    row = resource.registry.session(session_id)
    if row is None or row.owner != owner_tag(owner):
        raise ServiceError("NOT_FOUND", f"unknown session {session_id!r}", key="session_id")
    return row


def _live(resource: Any, session_id: str, owner: str) -> Any:
    """The running server's SessionRecord, None for one of an earlier run (only in the registry)."""
    try:
        return resource.get_session(session_id, owner)
    except ServiceError:
        return None


def _session_json(resource: Any, ids: TogetherIds, s: Any, row: Any = None) -> dict[str, Any]:
    """A Together Session of our live session `s` (None: one of an earlier run) and its registry `row`.

    Display name and metadata come from the registry row (None: read here); status, step and
    versions from the live session when there is one.
    """
    sid = s.session_id if s is not None else row.session_id
    row = row or resource.registry.session(sid)
    ex = ids.extras(sid)
    name = row.display_name if row is not None else s.name
    meta = dict(row.metadata) if row is not None else {}
    if s is not None:
        ckpts = _visible(resource.page_checkpoints(s.owner, session_id=sid)[0])  # the model registry
        lora = {"rank": s.lora.rank, "alpha": s.lora.alpha, "dropout": s.lora.dropout, "seed": s.lora.seed,
                "train_unembed": s.lora.train_unembed}
        pending = bool(s.publish_tail is not None and not s.publish_tail.done())
        synced, step, state, owner = int(s.synced_version), int(s.step), s.state, owner_tag(s.owner)
        created, updated = s.created_at, max(ex.updated_at, s.last_active_at)
    else:
        ckpts = _visible(_owned_checkpoints(resource, row))
        lora = {k: row.lora.get(k) for k in ("rank", "alpha", "dropout", "seed", "train_unembed")}
        pending, synced, step, state, owner = False, int(row.step), int(row.step), row.status, row.owner
        created, updated = row.created_at, max(ex.updated_at, row.stopped_at or row.created_at)
    return {
        "id": sid,
        "base_model": _model_name(resource),
        "model_resources_id": ids.resource_id,
        "created_at": tw.rfc3339(created),
        "updated_at": tw.rfc3339(updated),
        "created_by": owner or "local",
        "status": _SESSION_STATUS.get(state, "TRAINING_SESSION_STATUS_UNSPECIFIED"),
        "step": step,
        "policy_state": {"applied_weights_version": synced, "pending_publish": pending,
                         "target_weights_version": synced, "trainer_step": step},
        "display_name": name or None,
        "metadata": meta,
        "lora_config": lora,
        "resume_from_checkpoint_id": ex.resume_from_checkpoint_id,
        "training_checkpoints": [_ckpt_short(c) for c in ckpts if c.kind == "state"],
        "inference_checkpoints": [_ckpt_short(c) for c in ckpts if c.kind == "weights"],
    }


def _owned_checkpoints(resource: Any, row: Any) -> list[Any]:
    """The checkpoints of a session of an earlier run (its owner tag is all the registry knows)."""
    rows, _ = resource.registry.list_checkpoints(row.owner, session_id=row.session_id)
    out = []
    for r in rows[::-1]:
        try:
            out.append(resource.store.get(r.uri, verify=False))
        except ServiceError:
            pass  # files gone: reported by the registry, not listed
    return out


def _lora(cfg: Any) -> LoraConfig | None:
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        raise invalid("lora_config must be an object", key="lora_config")
    d = LoraConfig()
    return LoraConfig(
        rank=tw.int64(cfg.get("rank", d.rank), "rank", where="lora_config."),
        alpha=tw.number(cfg.get("alpha", d.alpha), "alpha", "lora_config."),
        dropout=tw.number(cfg.get("dropout", d.dropout), "dropout", "lora_config."),
        seed=tw.int64(cfg.get("seed", d.seed), "seed", where="lora_config."),
        train_unembed=bool(cfg.get("train_unembed", False)),
    )


@router.post("/training-sessions")
@_routes
async def create_session(request: Request) -> Any:
    """A RUNNING session (created within the request); 429 (not retried) at the session cap."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    _check_resource(ids, str(body.get("model_resources_id", "")))
    if ids.status != "MODEL_RESOURCES_STATUS_READY":
        raise ServiceError("FAILED_PRECONDITION", f"model resource {ids.resource_id} is stopped; create it again",
                           key="model_resources_id")
    ckpt_id = body.get("resume_from_checkpoint_id")
    uri = _uri_of(ckpt_id) if ckpt_id else ""
    load_optimizer = body.get("load_optimizer")
    if load_optimizer is not None and not isinstance(load_optimizer, bool):
        raise invalid(f"load_optimizer must be a boolean, got {load_optimizer!r}", key="load_optimizer")
    with_optimizer = bool(uri) and load_optimizer is not False  # Together: omitted or true restores it
    lora = _lora(body.get("lora_config"))
    s = await asyncio.to_thread(resource.create_session, lora, name=str(body.get("display_name") or ""),
                                owner=owner, checkpoint_uri=uri, with_optimizer=with_optimizer)
    meta = body.get("metadata")
    if meta:
        if not isinstance(meta, dict):
            raise invalid("metadata must be an object", key="metadata")
        await asyncio.to_thread(resource.registry.update_session, s.session_id, metadata=dict(meta))
    ids.extras(s.session_id).resume_from_checkpoint_id = ckpt_id or None
    return _session_json(resource, ids, s)


@router.get("/training-sessions")
@_routes
async def list_sessions(request: Request) -> Any:
    """Every session this storage holds (earlier runs' too), newest first, from the model registry's keyset
    pager; filters status / model_resources_id; cursor ``after`` (the last session id of the previous page)."""
    resource, ids, owner = _ctx(request)
    q = request.query_params
    limit = _limit(q)
    status = q.getlist("status")
    ours = [k for k, v in _SESSION_STATUS.items() if v in status]
    mr = q.get("model_resources_id")
    if (status and not ours) or (mr and mr != ids.resource_id):
        return {"data": [], "meta": {"has_more": False, "limit": limit, "next_cursor": ""}}
    reg, tag = resource.registry, owner_tag(owner)
    cursor = await asyncio.to_thread(reg.cursor_after, "sessions", q["after"]) if q.get("after") else ""
    rows, nxt = await asyncio.to_thread(reg.list_sessions, tag, status=ours, limit=limit, cursor=cursor)
    data = [_session_json(resource, ids, _live(resource, r.session_id, owner), r) for r in rows]
    return {"data": data, "meta": {"has_more": bool(nxt), "limit": limit,
                                   "next_cursor": rows[-1].session_id if nxt else ""}}


def _limit(q: Any) -> int:
    limit = tw.int64(q.get("limit", 100), "limit")
    if not 1 <= limit <= 100:
        raise invalid(f"limit must be in [1, 100], got {limit}", key="limit")
    return limit


@router.get("/training-sessions/{session_id}")
@_routes
async def get_session(session_id: str, request: Request) -> Any:
    """A live session, or one of an earlier run of this server (from the model registry)."""
    resource, ids, owner = _ctx(request)
    row = await asyncio.to_thread(_session_row, resource, session_id, owner)
    return _session_json(resource, ids, _live(resource, session_id, owner), row)


@router.patch("/training-sessions/{session_id}")
@_routes
async def update_session(session_id: str, request: Request) -> Any:
    """display_name ("" clears it) and metadata (given fields replace, "" clears one), kept in the model
    registry (they show after a restart too); sessions of earlier runs can be renamed as well."""
    resource, ids, owner = _ctx(request)
    _session_row(resource, session_id, owner)
    body = await _json(request)
    name, meta = body.get("display_name"), body.get("metadata")
    if "display_name" in body and not isinstance(name, str):
        raise invalid("display_name must be a string", key="display_name")
    if meta is not None and not isinstance(meta, dict):
        raise invalid("metadata must be an object", key="metadata")
    ex = ids.extras(session_id)
    with ex.lock:  # read-modify-write of the metadata
        row = _session_row(resource, session_id, owner)
        merged = dict(row.metadata)
        for k, v in (meta or {}).items():
            if isinstance(v, dict):
                cur = {**merged.get(k, {}), **v}
                merged[k] = {kk: vv for kk, vv in cur.items() if vv != ""}
            elif v == "":
                merged.pop(k, None)
            else:
                merged[k] = v
        resource.registry.update_session(session_id, display_name=name if "display_name" in body else None,
                                         metadata=merged if meta is not None else None)
        ex.updated_at = time.time()
    return _session_json(resource, ids, _live(resource, session_id, owner), _session_row(resource, session_id, owner))


@router.post("/training-sessions/{session_id}/stop")
@_routes
async def stop_session(session_id: str, request: Request) -> Any:
    """Stops at once (queued operations are cancelled): the answer is already STOPPED."""
    resource, ids, owner = _ctx(request)
    s = await asyncio.to_thread(resource.stop_session, session_id, owner)
    ids.extras(session_id).updated_at = time.time()
    return _session_json(resource, ids, s)


# ----- operations --------------------------------------------------------------------------------
def _op_error(err: ServiceError | None, ran: bool) -> dict[str, Any]:
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


def _output(resource: Any, entry: OpEntry, recs: list[Any]) -> dict[str, Any]:
    """The COMPLETED operation's output (never null: custom-forward-backward's is {})."""
    kind, res = entry.kind, recs[0].result
    if kind == "forward-backward":
        return tw.forward_result(res, entry.extra.get("masks"), entry.extra.get("with_outputs", False))
    if kind == "custom-forward-backward":
        return {}
    if kind == "optim-step":
        return {"step": int(res.step)}
    if kind == "weights-sync":
        return {"weights_version": int(res.policy_version)}
    if kind == "sample":
        return {"results": [tw.sample_result(ps, n, entry.extra["prompt_logprobs"], entry.extra["topk"])
                            for ps, n in zip(res, entry.extra["prompt_lens"])]}
    return {"checkpoint": _ckpt_short(res)}  # training- / inference-checkpoint (the adapter one)


def _op_json(resource: Any, ids: TogetherIds, op_id: str) -> dict[str, Any]:
    entry = ids.ops[op_id]
    recs = [resource.book.get(r) for r in entry.records]
    failed = next((r for r in recs if r.status in (FAILED, CANCELLED)), None)
    out: dict[str, Any] = {"id": op_id}
    if failed is not None:
        out.update(status=_OP_STATUS[FAILED], error=_op_error(failed.error, failed.started_at > 0))
    elif all(r.status == SUCCEEDED for r in recs):
        out.update(status=_OP_STATUS[SUCCEEDED], output=_output(resource, entry, recs))
    else:
        out["status"] = _OP_STATUS[RUNNING if any(r.status != QUEUED for r in recs) else QUEUED]
    return out


async def _hold(resource: Any, ids: TogetherIds, op_id: str, seconds: float) -> None:
    """Wait (without a thread) until the operation is terminal or `seconds` pass."""
    deadline = time.monotonic() + seconds
    recs = [resource.book.get(r) for r in ids.ops[op_id].records]
    delay = 0.002
    while not all(r.terminal for r in recs) and not any(r.status in (FAILED, CANCELLED) for r in recs):
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


async def _op_body(request: Request, ids: TogetherIds, session_id: str, owner: str) -> dict[str, Any]:
    """The operation's body; with ``payload_id`` the uploaded full body (the inline one is truncated)."""
    body = await _json(request)
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


def _prepare(resource: Any, kind: str, body: dict[str, Any], session_id: str, key: str,
             owner: str) -> tuple[Callable[[int], list[Any]], dict[str, Any]]:
    """Parse and check the body (errors name sample and key); returns (submit at seq -> records, output extras)."""
    extra: dict[str, Any] = {}
    if kind == "forward-backward":
        loss_name, params = tw.loss(body.get("loss"))
        samples = tw.samples(body.get("samples"))
        forward_only = bool(body.get("forward_only", False))
        extra = {"masks": [tw.excluded(inp) for _, inp in samples],
                 "with_outputs": bool(body.get("return_loss_fn_outputs", forward_only))}
        return (lambda seq: [resource.submit_forward(
            session_id, seq, key, samples=samples, loss_fn=loss_name, loss_params=params, backward=not forward_only,
            return_logprobs=True, return_elementwise=False, owner=owner)]), extra
    if kind == "custom-forward-backward":
        samples = tw.samples(body.get("samples"))
        grads = body.get("gradients")
        if not isinstance(grads, list):
            raise invalid("gradients must be a list with one Gradient per sample", key="gradients")
        arrays = []
        for i, g in enumerate(grads):
            td = g.get("gradient", g.get("values", g)) if isinstance(g, dict) else g
            arrays.append(tw.tensor(td, i, "gradients"))
        for i, (_, inp) in enumerate(samples):
            if set(inp) - {"target_tokens"}:
                raise invalid(f"custom_forward_backward takes target_tokens only here, got {sorted(inp)}",
                              sample_index=i, key=sorted(set(inp) - {"target_tokens"})[0])
        return (lambda seq: [resource.submit_custom_forward_backward(
            session_id, seq, key, samples=samples, gradients=arrays, return_logprobs=False, owner=owner)]), extra
    if kind == "optim-step":
        if body.get("muon_params") is not None:
            raise invalid("muon_params: the Muon optimizer is not supported here (Adam only)", key="muon_params")
        adam = body.get("adam_params") or {}
        if not isinstance(adam, dict):
            raise invalid("adam_params must be an object", key="adam_params")
        values = {k: tw.number(v, k, "adam_params.") for k, v in adam.items() if v is not None}
        values.setdefault("grad_clip_norm", TOGETHER_GRAD_CLIP_NORM)
        return (lambda seq: [resource.submit_optim_step(session_id, seq, key, values, owner=owner)]), extra
    if kind == "weights-sync":
        mode = body.get("weight_sync_type", "WEIGHT_SYNC_TYPE_SYNCHRONOUS")
        if mode not in ("WEIGHT_SYNC_TYPE_SYNCHRONOUS", "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH",
                        "WEIGHT_SYNC_TYPE_PIPELINE"):
            raise invalid(f"weight_sync_type {mode!r} is not a WeightSyncType", key="weight_sync_type")
        background = mode != "WEIGHT_SYNC_TYPE_SYNCHRONOUS"  # PIPELINE: published in the background too
        return (lambda seq: [resource.submit_weights_sync(session_id, seq, key, background, owner=owner)]), extra
    if kind == "sample":
        if body.get("return_routed_experts"):
            raise invalid("return_routed_experts: this model is not a mixture of experts", key="return_routed_experts")
        inputs = body.get("model_inputs")
        if not isinstance(inputs, list):
            raise invalid("model_inputs must be a list of ModelInput", key="model_inputs")
        prompts = [tw.tokens(m, i, "model_inputs") for i, m in enumerate(inputs)]
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise invalid("sampling_params must be an object", key="sampling_params")
        stop = sp.get("stop") or []
        if isinstance(stop, str) or not all(isinstance(x, str) for x in stop):
            raise invalid("sampling_params.stop must be a list of strings", key="stop")
        # Unset max_tokens: DEFAULT_MAX_TOKENS bounded by the context the longest prompt leaves (as on the Tinker API).
        lim = resource.limits
        default_max = max(1, min(DEFAULT_MAX_TOKENS, lim.max_new_tokens, lim.max_seq_len - max(map(len, prompts),
                                                                                              default=0)))
        params = {"max_tokens": tw.int64(sp["max_tokens"], "max_tokens") if sp.get("max_tokens") is not None
                  else default_max,
                  "temperature": tw.number(sp["temperature"], "temperature") if "temperature" in sp else None,
                  "top_k": tw.int64(sp["top_k"], "top_k") if "top_k" in sp else None,
                  "top_p": tw.number(sp["top_p"], "top_p") if "top_p" in sp else None,
                  "seed": tw.int64(sp["seed"], "seed") if sp.get("seed") is not None else None,
                  "stop": list(stop)}
        if params["top_k"] is not None and params["top_k"] < 0:
            params["top_k"] = 0  # -1 = off, as in vLLM
        n = tw.int64(body.get("num_samples", 1), "num_samples")
        plp = bool(body.get("prompt_logprobs", False))
        topk = tw.int64(body.get("topk_prompt_logprobs", 0), "topk_prompt_logprobs")
        extra = {"prompt_lens": [len(p) for p in prompts], "prompt_logprobs": plp, "topk": topk}
        return (lambda seq: [submit_sample(resource, session_id, seq, key, prompts=prompts, params=params,
                                           num_samples=n, prompt_logprobs=plp or topk > 0,
                                           top_k_prompt_logprobs=topk, owner=owner)]), extra
    if kind == "training-checkpoint":
        name = f"tg-{uuid.uuid4().hex[:12]}"
        return (lambda seq: [resource.submit_save_state(session_id, seq, key, name, owner=owner)]), extra
    if kind == "inference-checkpoint":
        # Together serves both variants of an inference checkpoint: the adapter and the merged
        # model, saved back to back in the queue (same step). The merged one is hidden in listings.
        name = f"tg-{uuid.uuid4().hex[:12]}"
        return (lambda seq: [resource.submit_save_weights(session_id, seq, key, name, False, owner=owner),
                             resource.submit_save_weights(session_id, seq + 1, key + ":merged",
                                                          name + MERGED_SUFFIX, True, owner=owner)]), extra
    raise ServiceError("NOT_FOUND", f"unknown operation kind {kind!r}; one of {list(_OP_KINDS)}", key="kind")


def _refused(resource: Any, ids: TogetherIds, op_id: str) -> ServiceError | None:
    """The validation error of an operation refused at submission (FAILED without having started), if any."""
    for r in ids.ops[op_id].records:
        rec = resource.book.get(r)
        if rec.status == FAILED and rec.started_at == 0.0 and rec.error is not None and rec.error.code != "INTERNAL":
            return rec.error
    return None


@router.post("/training-sessions/{session_id}/operations/{kind}")
@_routes
async def submit_operation(session_id: str, kind: str, request: Request) -> Any:
    """Queue an operation in arrival order; a retried Idempotency-Key returns the original operation."""
    resource, ids, owner = _ctx(request)
    if kind not in _OP_KINDS:
        raise ServiceError("NOT_FOUND", f"unknown operation kind {kind!r}; one of {list(_OP_KINDS)}", key="kind")
    s = resource.get_session(session_id, owner)
    key = request.headers.get("idempotency-key") or ""
    if not key:
        raise invalid("the Idempotency-Key header is required", key="Idempotency-Key")
    with ids.lock:
        known = ids.by_key.get((session_id, key))
    if known is not None:
        if ids.ops[known].kind != kind:
            raise ServiceError("ABORTED", f"Idempotency-Key {key!r} was used for a {ids.ops[known].kind} operation",
                               key="Idempotency-Key")
        refused = _refused(resource, ids, known)
        if refused is not None:
            return _error(refused)
        await _hold(resource, ids, known, POST_HOLD_S)
        return _op_json(resource, ids, known)
    resource.active_session(session_id, owner)  # a stopped session: 400 before any parsing
    body = await _op_body(request, ids, session_id, owner)
    payload = body.pop("__payload__", None)
    submit, extra = await asyncio.to_thread(_prepare, resource, kind, body, session_id, f"together:{key}", owner)
    ex = ids.extras(session_id)

    def queue() -> str:
        with ex.lock:  # arrival order: the next seq_ids of the session's queue
            with ids.lock:
                known = ids.by_key.get((session_id, key))
            if known is not None:
                return known
            recs = submit(s.queue.next_seq_id)
            op_id = recs[-1].operation_id
            with ids.lock:
                ids.ops[op_id] = OpEntry(kind, session_id, [r.operation_id for r in recs], extra)
                ids.by_key[(session_id, key)] = op_id
                if len(ids.ops) > 2 * OPS_KEPT:
                    ids.prune(resource.book)
            return op_id

    op_id = await asyncio.to_thread(queue)
    if payload is not None:
        with ids.lock:
            ids.payloads.pop(payload.payload_id, None)
        payload.path.unlink(missing_ok=True)
    refused = _refused(resource, ids, op_id)
    if refused is not None:
        return _error(refused)  # refused by validation at submission: nothing ran
    await _hold(resource, ids, op_id, POST_HOLD_S)
    return _op_json(resource, ids, op_id)


@router.get("/training-sessions/{session_id}/operations/{kind}/{op_id}")
@_routes
async def get_operation(session_id: str, kind: str, op_id: str, request: Request) -> Any:
    """The operation's state; held up to GET_HOLD_S while it runs, so the SDK's 0.5 s poll rarely waits."""
    resource, ids, owner = _ctx(request)
    resource.get_session(session_id, owner)
    with ids.lock:
        entry = ids.ops.get(op_id)
    if entry is None or entry.session_id != session_id or entry.kind != kind:
        raise ServiceError("NOT_FOUND", f"unknown {kind} operation {op_id!r} in session {session_id}",
                           key="operation_id")
    await _hold(resource, ids, op_id, GET_HOLD_S)
    return _op_json(resource, ids, op_id)


# ----- large payloads ------------------------------------------------------------------------------
def _base(request: Request) -> str:
    return str(request.base_url).rstrip("/")


@router.post("/training-sessions/{session_id}/payloads/upload-url")
@_routes
async def payload_upload_url(session_id: str, request: Request) -> Any:
    """A payload id and a signed URL (valid URL_TTL_S) to PUT an operation's JSON body to."""
    resource, ids, owner = _ctx(request)
    resource.active_session(session_id, owner)
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
    url = f"{_base(request)}/v1/rl/files/payloads/{pid}?expires={exp}&sig={ids.sign('put', pid, exp)}"
    return {"payload_id": pid, "upload_url": url, "expires_at": tw.rfc3339(float(exp))}


@router.post("/training-sessions/{session_id}/payloads/{payload_id}/download-url")
@_routes
async def payload_download_url(session_id: str, payload_id: str, request: Request) -> Any:
    resource, ids, owner = _ctx(request)
    resource.get_session(session_id, owner)
    with ids.lock:
        p = ids.payloads.get(payload_id)
    if p is None or p.owner != owner or p.session_id != session_id or not p.complete:
        raise ServiceError("NOT_FOUND", f"unknown payload {payload_id!r}", key="payload_id")
    exp = str(int(time.time() + URL_TTL_S))
    url = f"{_base(request)}/v1/rl/files/payloads/{payload_id}?expires={exp}&sig={ids.sign('get', payload_id, exp)}"
    return {"payload_id": payload_id, "download_url": url, "expires_at": tw.rfc3339(float(exp))}


@router.put("/files/payloads/{payload_id}")
@_routes
async def put_payload(payload_id: str, request: Request) -> Any:
    """The signed upload: the body is streamed to disk, at most max_payload_bytes (413 beyond)."""
    _, ids, _ = _ctx(request)
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
@_routes
async def get_payload(payload_id: str, request: Request) -> Any:
    _, ids, _ = _ctx(request)
    ids.check_sig(request.query_params.get("sig", ""), request.query_params.get("expires", ""), "get", payload_id)
    with ids.lock:
        p = ids.payloads.get(payload_id)
    if p is None or not p.complete:
        raise ServiceError("NOT_FOUND", f"unknown payload {payload_id!r}", key="payload_id")
    return FileResponse(p.path, media_type="application/json")


# ----- checkpoints ---------------------------------------------------------------------------------
def _checkpoint_json(resource: Any, c: Any) -> dict[str, Any]:
    out = {"id": _ckpt_id(c), "base_model": _model_name(resource), "created_at": tw.rfc3339(c.created_at),
           "session_id": c.session_id, "step": int(c.step),
           "type": "CHECKPOINT_TYPE_INFERENCE" if c.kind == "weights" else "CHECKPOINT_TYPE_TRAINING"}
    s = next((s for s in resource.list_sessions_all() if s.session_id == c.session_id), None)
    if s is not None:
        out["lora_rank"] = int(s.lora.rank)
    return out


@router.get("/checkpoints")
@_routes
async def list_checkpoints(request: Request) -> Any:
    """The caller's checkpoints, newest first; filters session_id, type, base_model; cursor after, limit."""
    resource, _, owner = _ctx(request)
    q = request.query_params
    kind = {"CHECKPOINT_TYPE_TRAINING": "state", "CHECKPOINT_TYPE_INFERENCE": "weights", None: None}
    if q.get("type") not in kind:
        raise invalid(f"type must be CHECKPOINT_TYPE_TRAINING or CHECKPOINT_TYPE_INFERENCE, got {q.get('type')!r}",
                      key="type")
    limit = _limit(q)
    if q.get("base_model") and q["base_model"] != _model_name(resource):
        return {"data": [], "meta": {"has_more": False, "limit": limit, "next_cursor": ""}}
    # The model registry's keyset pager (a checkpoint whose files are gone is not listed); the merged twins
    # of inference checkpoints are hidden, so a page may hold fewer than `limit`.
    reg = resource.registry
    cursor = await asyncio.to_thread(reg.cursor_after, "checkpoints", _uri_of(q["after"])) if q.get("after") else ""
    ckpts, nxt = await asyncio.to_thread(resource.page_checkpoints, owner, session_id=q.get("session_id") or "",
                                         kind=kind[q.get("type")] or "", limit=limit, cursor=cursor)
    rows = [_checkpoint_json(resource, c) for c in _visible(ckpts, reg)]
    last = reg.cursor_key(nxt) if nxt else ""
    return {"data": rows, "meta": {"has_more": bool(nxt), "limit": limit,
                                   "next_cursor": _ckpt_id_of_uri(last) if last else ""}}


def _ckpt_id_of_uri(uri: str) -> str:
    sid, kind, name = uri[len(URI_SCHEME):].split("/", 2)
    return f"{sid}.{kind}.{name}"


@router.get("/checkpoints/{checkpoint_id}")
@_routes
async def get_checkpoint(checkpoint_id: str, request: Request) -> Any:
    resource, _, owner = _ctx(request)
    c = await asyncio.to_thread(resource.get_checkpoint, _uri_of(checkpoint_id), owner)
    return _checkpoint_json(resource, c)


@router.get("/checkpoints/{checkpoint_id}/download")
@_routes
async def download_checkpoint(checkpoint_id: str, request: Request) -> Any:
    """Signed URLs (valid URL_TTL_S) for the files of an inference checkpoint's variant (MERGED by default)."""
    resource, ids, owner = _ctx(request)
    variant = request.query_params.get("variant") or "CHECKPOINT_VARIANT_MERGED"
    if variant not in ("CHECKPOINT_VARIANT_MERGED", "CHECKPOINT_VARIANT_ADAPTER", "CHECKPOINT_VARIANT_UNSPECIFIED"):
        raise invalid(f"variant {variant!r} is not a CheckpointVariant", key="variant")
    uri = _uri_of(checkpoint_id)
    c = await asyncio.to_thread(resource.get_checkpoint, uri, owner)
    if c.kind != "weights":
        raise invalid(f"checkpoint {checkpoint_id} is a training checkpoint; only inference checkpoints download",
                      key="checkpoint_id")
    if variant != "CHECKPOINT_VARIANT_ADAPTER" and not c.merged:
        sibling = f"{uri}{MERGED_SUFFIX}"
        try:
            c = await asyncio.to_thread(resource.get_checkpoint, sibling, owner)
        except ServiceError:
            raise invalid(f"checkpoint {checkpoint_id} has no merged variant (it was saved as an adapter only); "
                          "ask for variant=CHECKPOINT_VARIANT_ADAPTER", key="variant") from None
    elif variant == "CHECKPOINT_VARIANT_ADAPTER" and c.merged:
        raise invalid(f"checkpoint {checkpoint_id} is a merged model with no adapter variant", key="variant")
    ckpt, files = await asyncio.to_thread(resource.checkpoint_files, c.uri, owner)  # verified: DATA_LOSS otherwise
    exp = str(int(time.time() + URL_TTL_S))
    cid = _ckpt_id(ckpt)
    base = _base(request)
    # The SDK saves each file under its base name, so nested paths (none in our checkpoints) are left out.
    return {"data": [{"filename": rel, "size": int(size),
                      "url": f"{base}/v1/rl/files/checkpoints/{cid}/{rel}?expires={exp}"
                             f"&sig={ids.sign('ckpt', cid, rel, exp)}"}
                     for rel, _, size, _ in files if "/" not in rel]}


@router.get("/files/checkpoints/{checkpoint_id}/{filename}")
@_routes
async def checkpoint_file(checkpoint_id: str, filename: str, request: Request) -> Any:
    """One file of one checkpoint, for the holder of a signed URL; only names in its manifest are served."""
    resource, ids, _ = _ctx(request)
    ids.check_sig(request.query_params.get("sig", ""), request.query_params.get("expires", ""), "ckpt",
                  checkpoint_id, filename)
    c = await asyncio.to_thread(resource.store.get, _uri_of(checkpoint_id), verify=False)
    names = set(c.files or {}) | {"manifest.json"}
    if filename not in names:
        raise ServiceError("NOT_FOUND", f"checkpoint {checkpoint_id} has no file {filename!r}", key="filename")
    return FileResponse(c.path / filename, filename=filename)
