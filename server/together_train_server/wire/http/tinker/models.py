"""Tinker training models (one of our sessions each): create, create-by-load and load, info."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from together_train_server.service.errors import invalid
from together_train_server.wire.http.tinker.base import _ctx, router
from together_train_server.wire.http.tinker.ids import to_our_uri, to_tinker_path
from together_train_server.wire.http.tinker.parsing import _dedupe_key, _get, _json, _lora_from_tinker, _seq
from together_train_server.wire.http.tinker.results import _future, _submit


@router.post("/create_model")
async def create_model(request: Request) -> dict[str, Any]:
    """A LoRA training model = one of our sessions; future -> {model_id}."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    cs = ids.live_session(_get(body, "session_id", str), owner)
    model_seq_id = _get(body, "model_seq_id", int)
    resource.check_base_model(_get(body, "base_model", str, None))
    opt = body.get("optimizer_config") or {}
    if isinstance(opt, dict) and opt.get("type", "adamw") != "adamw":
        raise invalid(f"optimizer {opt.get('type')!r} is not supported; this resource trains with AdamW",
                      key="optimizer_config")
    lora_cfg = _get(body, "lora_config", dict, None)
    if lora_cfg is None:
        raise invalid("lora_config is required: this resource trains LoRA adapters", key="lora_config")
    spec = _lora_from_tinker(lora_cfg)
    model_id = f"{cs.session_id}:train:{model_seq_id}"
    meta = _get(body, "user_metadata", dict, None) or {}

    def create() -> dict[str, Any]:
        if model_id not in cs.models:  # a re-sent create finds the model made by the first
            s = resource.sessions.create_session(spec, name=model_id, owner=owner)
            if meta:  # the run's user_metadata, kept in the model registry
                resource.session_rows.update_session_info(s.session_id, owner, metadata=meta)
            ids.add_model(cs, model_id, s.session_id)
        return {"type": "create_model", "model_id": model_id}

    return _future(resource.submissions.run_detached("tinker_create_model", create), model_id)


@router.post("/get_info")
async def get_info(request: Request) -> dict[str, Any]:
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    model_id = _get(body, "model_id", str)
    s = resource.session_table.get_session(ids.ours(model_id, owner), owner)
    name = resource.base_model_name()
    return {
        "type": "get_info",
        # tokenizer_id goes to AutoTokenizer.from_pretrained in the SDK: the model directory loads offline.
        # model_name is what the SDK's sampling clients pass to AutoTokenizer: the directory too.
        "model_data": {"arch": resource.model_architecture(), "model_name": name, "tokenizer_id": name},
        "model_id": model_id,
        "is_lora": True,
        "lora_rank": int(s.lora.rank),
        "model_name": name,
    }


@router.post("/load_weights")
async def load_weights(request: Request) -> Any:
    """Create-via-load ({session_id, model_seq_id, path, optimizer}: a new model from a training checkpoint,
    id "{session_id}:train:{model_seq_id}") or a load into an existing model ({model_id, seq_id})."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    # The session or model first, then the payload.
    if body.get("session_id") is not None:
        cs = ids.live_session(_get(body, "session_id", str), owner)
    else:
        model_id = _get(body, "model_id", str)
        ours = ids.usable(resource, model_id, owner)
    uri = to_our_uri(_get(body, "path", str))
    with_optimizer = _get(body, "optimizer", bool, False)
    if body.get("session_id") is not None:
        model_id = f"{cs.session_id}:train:{_get(body, 'model_seq_id', int)}"
        resource.check_base_model(_get(body, "base_model", str, None))

        def create() -> dict[str, Any]:
            if model_id not in cs.models:
                s = resource.sessions.create_session(None, name=model_id, owner=owner, checkpoint_uri=uri,
                                            with_optimizer=with_optimizer)
                ids.add_model(cs, model_id, s.session_id)
            return {"type": "load_weights", "path": to_tinker_path(uri), "model_id": model_id}

        return _future(resource.submissions.run_detached("tinker_load_weights", create), model_id)
    seq_id = body.get("seq_id")
    rec = await asyncio.to_thread(_submit, resource.submit_load_state, ours, _seq(seq_id),
                                  _dedupe_key(seq_id, json.dumps(body, sort_keys=True).encode()), uri, with_optimizer,
                                  owner=owner)
    if isinstance(rec, Response):
        return rec
    ids.op_extra[rec.operation_id] = {"type": "load_weights", "path": to_tinker_path(uri), "model_id": model_id}
    return _future(rec, model_id)
