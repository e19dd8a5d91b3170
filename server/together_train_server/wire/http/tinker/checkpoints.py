"""Tinker checkpoint routes: save_weights (training state), save_weights_for_sampler, weights_info, delete."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from together_train_server.service.errors import invalid
from together_train_server.wire.http.tinker.base import ATTN_MODULES, MLP_MODULES, _ctx, router
from together_train_server.wire.http.tinker.ids import Sampler, _run_id, to_our_uri
from together_train_server.wire.http.tinker.parsing import _dedupe_key, _get, _json, _seq
from together_train_server.wire.http.tinker.results import _future, _submit


def _save_options(body: dict[str, Any]) -> dict[str, Any]:
    """The request's ttl_seconds and user_metadata as `SaveOptions.checked` arguments (checked when the save is
    prepared: a bad one fails that operation naming it)."""
    return {"user_metadata": body.get("user_metadata"), "ttl_seconds": body.get("ttl_seconds")}


@router.post("/save_weights")
async def save_weights(request: Request) -> Any:
    """save_state: a training checkpoint (weights + optimizer) -> future {path: tinker://.../weights/<name>}."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    model_id = _get(body, "model_id", str)
    ours = ids.usable(resource, model_id, owner)
    name = _get(body, "path", str, None) or f"step-{uuid.uuid4().hex[:8]}"
    seq_id = body.get("seq_id")
    rec = await asyncio.to_thread(_submit, resource.submit_save_state, ours, _seq(seq_id),
                                  _dedupe_key(seq_id, json.dumps(body, sort_keys=True).encode()), name, owner=owner,
                                  options=_save_options(body))
    return rec if isinstance(rec, Response) else _future(rec, model_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> Any:
    """Named: a sampler checkpoint (PEFT adapter) -> {path}. Ephemeral (sampling_session_seq_id): a sampling
    session on a snapshot of the weights (kind "snapshot") or on the session's live weights ("inflight")
    -> {sampling_session_id}."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    model_id = _get(body, "model_id", str)
    ours = ids.usable(resource, model_id, owner)
    seq_id = body.get("seq_id")
    # The SDK draws a new sampling_session_seq_id on every attempt of an ephemeral save (its retry after a
    # timeout re-sends the same seq_id with the next counter value), so it is not part of the request's identity.
    ident = {k: v for k, v in body.items() if k != "sampling_session_seq_id"}
    seq, key = _seq(seq_id), _dedupe_key(seq_id, json.dumps(ident, sort_keys=True).encode())
    name = _get(body, "path", str, None)
    if name:
        rec = await asyncio.to_thread(_submit, resource.submit_save_weights, ours, seq, key, name, False, owner=owner,
                                      options=_save_options(body))
        return rec if isinstance(rec, Response) else _future(rec, model_id)
    ss_seq = _get(body, "sampling_session_seq_id", int, None)
    if ss_seq is None:
        raise invalid("save_weights_for_sampler needs a path (a named checkpoint) or sampling_session_seq_id",
                      key="path")
    kind = _get(body, "kind", str, "snapshot")
    if kind == "snapshot":
        rec = await asyncio.to_thread(_submit, resource.snapshots.submit_snapshot, ours, seq, key, owner)
    elif kind == "inflight":
        # The session's own replica adapter, updated by every later inflight save (weights_sync). Synchronous:
        # once the save completes every replica serves these weights or newer (the inflight contract's floor).
        rec = await asyncio.to_thread(_submit, resource.submit_weights_sync, ours, seq, key, False, owner=owner)
    else:
        raise invalid(f"kind must be 'snapshot' or 'inflight', got {kind!r}", key="kind")
    if isinstance(rec, Response):
        return rec
    if rec.operation_id in ids.op_extra:  # a re-submission: the first attempt's sampling session stands
        return _future(rec, model_id)
    client_session = ids.models[model_id][0]
    ids.add_sampler(Sampler(f"{client_session}:sample:{ss_seq}", owner, source_op=rec.operation_id,
                            session_id=ours, inflight=kind == "inflight"))
    return _future(rec, model_id)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
    resource, ids, owner = _ctx(request)
    uri = to_our_uri(f"tinker://{_run_id(ids, run_id, owner)}/{checkpoint_id}", "checkpoint_id")
    resource.checkpoints.delete_checkpoint(uri, owner)
    return {}


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
    """Set (seconds from now) or remove (null) a checkpoint's TTL (RestClient.set_checkpoint_ttl_from_tinker_path)."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    uri = to_our_uri(f"tinker://{_run_id(ids, run_id, owner)}/{checkpoint_id}", "checkpoint_id")
    await asyncio.to_thread(resource.lifecycle.update, uri, owner, ttl_seconds=body.get("ttl_seconds"))
    return {}


@router.post("/weights_info")
async def weights_info(request: Request) -> dict[str, Any]:
    """The LoRA shape of a checkpoint (from its training state, or its PEFT adapter config)."""
    resource, _, owner = _ctx(request)
    body = await _json(request)
    uri = to_our_uri(_get(body, "tinker_path", str), "tinker_path")
    cfg = await asyncio.to_thread(resource.checkpoints.adapter_config, uri, owner)
    targets = set(cfg.get("target_modules") or ())
    return {
        "base_model": resource.base_model_name(),
        "is_lora": True,
        "lora_rank": cfg.get("r"),
        "train_unembed": bool(cfg.get("modules_to_save")),
        "train_mlp": bool(targets & set(MLP_MODULES)) if targets else None,
        "train_attn": bool(targets & set(ATTN_MODULES)) if targets else None,
    }
