"""Tinker training routes: forward_backward (protobuf body) and optim_step (AdamW)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from together_train_server.service.errors import invalid
from together_train_server.wire.http import tinker_wire as tw
from together_train_server.wire.http.tinker.base import PROTO, _ctx, router
from together_train_server.wire.http.tinker.parsing import _body_bytes, _dedupe_key, _get, _json, _loss_params, _samples, _seq
from together_train_server.wire.http.tinker.results import _future, _submit


@router.post("/forward_backward")
async def forward_backward(request: Request) -> Any:
    """Protobuf ForwardBackwardRequest -> future; ``forward_only`` runs a plain forward (no gradient)."""
    resource, ids, owner = _ctx(request)
    if PROTO not in request.headers.get("content-type", ""):
        raise invalid(f"forward_backward takes a protobuf body (Content-Type: {PROTO})")
    raw = await _body_bytes(request)
    msg = tw.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except Exception as e:
        raise invalid(f"the body is not a ForwardBackwardRequest: {e}") from None
    ours = ids.usable(resource, msg.model_id, owner)
    seq = _seq(msg.seq_id)
    samples = _samples(msg)
    rec = await asyncio.to_thread(
        _submit, resource.submissions.submit_forward, ours, seq, _dedupe_key(msg.seq_id, raw),
        samples=samples, loss_fn=msg.loss_fn, loss_params=_loss_params(msg), backward=not msg.forward_only,
        return_logprobs=True, return_elementwise=True, owner=owner,
    )
    return rec if isinstance(rec, Response) else _future(rec, msg.model_id)


_ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


@router.post("/optim_step")
async def optim_step(request: Request) -> Any:
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    model_id = _get(body, "model_id", str)
    ours = ids.usable(resource, model_id, owner)
    if "optimizer_params" in body:
        kind = (body["optimizer_params"] or {}).get("type") if isinstance(body["optimizer_params"], dict) else None
        raise invalid(f"optimizer {kind!r} is not supported; this resource steps AdamW (adam_params)",
                      key="optimizer_params")
    adam = _get(body, "adam_params", dict)
    unknown = sorted(set(adam) - set(_ADAM_KEYS) - {"type"})
    if unknown:
        raise invalid(f"unknown adam_params {unknown}; known: {list(_ADAM_KEYS)}", key=unknown[0])
    seq_id = body.get("seq_id")
    rec = await asyncio.to_thread(
        _submit, resource.submissions.submit_optim_step, ours, _seq(seq_id),
        _dedupe_key(seq_id, json.dumps(body, sort_keys=True).encode()),
        {k: adam.get(k) for k in _ADAM_KEYS}, owner=owner,
    )
    return rec if isinstance(rec, Response) else _future(rec, model_id)
