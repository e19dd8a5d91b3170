"""Model resources (``/v1/rl/model-resources``, ``/v1/rl/supported-models``): this server is ONE of them.

It is READY from the start: ``create`` with the base model this server holds returns it (another base
model is a 400 naming ours); ``stop`` without ``force`` is refused while sessions are active, with
``force`` it stops every session of the caller's key; the next ``create`` makes it READY again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request

from together_train_server.service.interfaces import ResourceApi, owner_tag
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.wire.sampling_params import DEFAULT_MAX_TOKENS
from together_train_server.wire.http.together.ids import TogetherIds
from together_train_server.wire.http.together.parsing import int64, json_body
from together_train_server.wire.http.together.rendering import rfc3339
from together_train_server.wire.http.together.routing import ctx, router, routes


def resource_json(resource: ResourceApi, ids: TogetherIds, owner: str) -> dict[str, Any]:
    """This server as a Together ModelResource (its expiry: the caller's last activity + the idle timeout)."""
    ready = ids.status == "MODEL_RESOURCES_STATUS_READY"
    last = max([s.last_active_at for s in resource.session_table.list_sessions(owner)] + [ids.created_at])
    return {
        "id": ids.resource_id,
        "base_model": resource.base_model_name(),
        "compute_config": {"num_generator_replicas": resource.num_replicas()},
        "created_at": rfc3339(ids.created_at),
        "updated_at": rfc3339(ids.updated_at),
        "created_by": owner_tag(owner) or "local",
        "inactive_timeout": int(resource.idle_timeout_s),
        "lora_enabled": resource.trains_lora(),
        "optimizer_config": {"adam": {}},
        "status": ids.status,
        "status_details": {},
        "expires_at": rfc3339(max(last + resource.idle_timeout_s, ids.expires_at)) if ready else None,
    }


def check_resource(ids: TogetherIds, resource_id: str) -> None:
    """NOT_FOUND unless `resource_id` is this server's model resource."""
    if resource_id != ids.resource_id:
        raise ServiceError("NOT_FOUND", f"unknown model resource {resource_id!r}; this server is model resource "
                                        f"{ids.resource_id!r}", key="model_resources_id")


@router.post("/model-resources")
@routes
async def create_model_resource(request: Request) -> Any:
    """This server's resource, READY, when `base_model` is the model it holds (400 naming it otherwise)."""
    resource, ids, owner = ctx(request)
    body = await json_body(request)
    base_model = body.get("base_model")
    if not isinstance(base_model, str) or not base_model:
        raise invalid("base_model is required", key="base_model")
    resource.check_base_model(base_model)
    if body.get("lora_enabled") is False and resource.trains_lora():
        raise invalid("this server hosts LoRA sessions (started without --full-weights); lora_enabled=false is not "
                      "available here", key="lora_enabled")
    if body.get("base_weights_ref"):
        raise invalid("base_weights_ref is not supported: this server trains the weights it was started with",
                      key="base_weights_ref")
    want = (body.get("compute_config") or {}).get("num_generator_replicas")
    if want is not None and int64(want, "num_generator_replicas") != resource.num_replicas():
        raise invalid(f"this server runs {resource.num_replicas()} generator replicas (serve --generators N); "
                      f"compute_config.num_generator_replicas={want} cannot be provisioned",
                      key="num_generator_replicas")
    if (body.get("optimizer_config") or {}).get("muon") is not None:
        raise invalid("the Muon optimizer is not supported here (Adam only)", key="optimizer_config.muon")
    with ids.lock:
        ids.status, ids.updated_at = "MODEL_RESOURCES_STATUS_READY", time.time()
    return resource_json(resource, ids, owner)


@router.get("/model-resources")
@routes
async def list_model_resources(request: Request) -> Any:
    """This server's resource (filter: ``status``)."""
    resource, ids, owner = ctx(request)
    status = request.query_params.getlist("status")
    data = [resource_json(resource, ids, owner)]
    data = [d for d in data if not status or d["status"] in status]
    return {"data": data, "meta": {"has_more": False, "limit": 100, "next_cursor": ""}}


@router.get("/model-resources/{resource_id}")
@routes
async def get_model_resource(resource_id: str, request: Request) -> Any:
    """This server's resource; NOT_FOUND for another id."""
    resource, ids, owner = ctx(request)
    check_resource(ids, resource_id)
    return resource_json(resource, ids, owner)


@router.post("/model-resources/{resource_id}/extend-expiry")
@routes
async def extend_expiry(resource_id: str, request: Request) -> Any:
    """Keep the caller's sessions from expiring for at least `seconds` (60-86400): their idle timers restart."""
    resource, ids, owner = ctx(request)
    check_resource(ids, resource_id)
    seconds = int64((await json_body(request)).get("seconds"), "seconds")
    if not 60 <= seconds <= 86400:
        raise invalid(f"seconds must be in [60, 86400], got {seconds}", key="seconds")
    if ids.status != "MODEL_RESOURCES_STATUS_READY":
        raise ServiceError("FAILED_PRECONDITION", f"model resource {resource_id} is not READY", key="status")
    for s in resource.session_table.list_sessions(owner):
        if s.state == "ACTIVE":
            resource.session_table.keep_alive(s.session_id, owner)
    with ids.lock:
        ids.expires_at = max(ids.expires_at, time.time() + seconds)
    return resource_json(resource, ids, owner)


@router.post("/model-resources/{resource_id}/stop")
@routes
async def stop_model_resource(resource_id: str, request: Request) -> Any:
    """Refused (400) while the caller has active sessions, unless ?force=true stops them."""
    resource, ids, owner = ctx(request)
    check_resource(ids, resource_id)
    force = request.query_params.get("force", "false").lower() in ("true", "1")
    active = [s.session_id for s in resource.session_table.list_sessions(owner) if s.state == "ACTIVE"]
    if ids.status != "MODEL_RESOURCES_STATUS_READY":
        raise ServiceError("FAILED_PRECONDITION", f"model resource {resource_id} is already stopped", key="status")
    if active and not force:
        raise ServiceError("FAILED_PRECONDITION", f"model resource {resource_id} has {len(active)} active training "
                           f"sessions ({', '.join(active)}); stop them first or pass force=true", key="force")
    for sid in active:
        await asyncio.to_thread(resource.sessions.stop_session, sid, owner)
    with ids.lock:
        ids.status, ids.updated_at = "MODEL_RESOURCES_STATUS_STOPPED", time.time()
    return resource_json(resource, ids, owner)


@router.get("/supported-models")
@routes
async def supported_models(request: Request) -> Any:
    """The one base model this server holds, with its limits (LoRA rank, sequence length, batch size)."""
    resource, _, _ = ctx(request)
    caps = resource.capabilities()
    lim = caps["limits"]
    return {"data": [{
        "base_model": resource.base_model_name(),
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
