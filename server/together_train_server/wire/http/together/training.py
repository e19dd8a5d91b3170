"""The training operation kinds: parse a body into a submission (`Prepared`) and render the result.

One ``prepare_<kind>(resource, body, session_id, key, owner)`` per kind (errors name sample and key;
nothing is submitted until the returned function runs at the session queue's next seq_id) and one
``output_<kind>(entry, records)`` for the COMPLETED operation's output (never null). `operations.KINDS`
maps each kind to its pair.
"""

from __future__ import annotations

import uuid
from typing import Any

from together_train_server.service.errors import invalid
from together_train_server.service.interfaces import ResourceApi
from together_train_server.wire.http.together.ids import MERGED_SUFFIX, OpEntry, Prepared
from together_train_server.wire.http.together.parsing import loss, number, samples, tensor
from together_train_server.wire.http.together.rendering import ckpt_short, excluded, forward_result

# Together's documented default when AdamParams.grad_clip_norm is unset (ours is 0 = off).
TOGETHER_GRAD_CLIP_NORM = 1.0
WEIGHT_SYNC_TYPES = ("WEIGHT_SYNC_TYPE_SYNCHRONOUS", "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH", "WEIGHT_SYNC_TYPE_PIPELINE")


def prepare_forward_backward(resource: ResourceApi, body: dict[str, Any], session_id: str, key: str,
                             owner: str) -> Prepared:
    """``forward-backward`` (``forward_only``: a forward pass): a loss over samples."""
    loss_name, params = loss(body.get("loss"))
    batch = samples(body.get("samples"))
    forward_only = bool(body.get("forward_only", False))
    extra = {"masks": [excluded(inp) for _, inp in batch],
             "with_outputs": bool(body.get("return_loss_fn_outputs", forward_only))}
    return (lambda seq: [resource.submissions.submit_forward(
        session_id, seq, key, samples=batch, loss_fn=loss_name, loss_params=params, backward=not forward_only,
        return_logprobs=True, return_elementwise=False, owner=owner)]), extra


def prepare_custom_forward_backward(resource: ResourceApi, body: dict[str, Any], session_id: str, key: str,
                                    owner: str) -> Prepared:
    """``custom-forward-backward``: the caller's per-token gradients of its own loss w.r.t. the logprobs."""
    batch = samples(body.get("samples"))
    grads = body.get("gradients")
    if not isinstance(grads, list):
        raise invalid("gradients must be a list with one Gradient per sample", key="gradients")
    arrays = []
    for i, g in enumerate(grads):
        td = g.get("gradient", g.get("values", g)) if isinstance(g, dict) else g
        arrays.append(tensor(td, i, "gradients"))
    for i, (_, inp) in enumerate(batch):
        if set(inp) - {"target_tokens"}:
            raise invalid(f"custom_forward_backward takes target_tokens only here, got {sorted(inp)}",
                          sample_index=i, key=sorted(set(inp) - {"target_tokens"})[0])
    return (lambda seq: [resource.submissions.submit_custom_forward_backward(
        session_id, seq, key, samples=batch, gradients=arrays, return_logprobs=False, owner=owner)]), {}


def prepare_optim_step(resource: ResourceApi, body: dict[str, Any], session_id: str, key: str,
                       owner: str) -> Prepared:
    """``optim-step``: AdamW with the given ``adam_params`` (Muon is refused)."""
    if body.get("muon_params") is not None:
        raise invalid("muon_params: the Muon optimizer is not supported here (Adam only)", key="muon_params")
    adam = body.get("adam_params") or {}
    if not isinstance(adam, dict):
        raise invalid("adam_params must be an object", key="adam_params")
    values = {k: number(v, k, "adam_params.") for k, v in adam.items() if v is not None}
    values.setdefault("grad_clip_norm", TOGETHER_GRAD_CLIP_NORM)
    return (lambda seq: [resource.submissions.submit_optim_step(session_id, seq, key, values, owner=owner)]), {}


def prepare_weights_sync(resource: ResourceApi, body: dict[str, Any], session_id: str, key: str,
                         owner: str) -> Prepared:
    """``weights-sync``: publish the trained weights to the generators (in the background unless SYNCHRONOUS)."""
    mode = body.get("weight_sync_type", "WEIGHT_SYNC_TYPE_SYNCHRONOUS")
    if mode not in WEIGHT_SYNC_TYPES:
        raise invalid(f"weight_sync_type {mode!r} is not a WeightSyncType", key="weight_sync_type")
    background = mode != "WEIGHT_SYNC_TYPE_SYNCHRONOUS"  # PIPELINE: published in the background too
    return (lambda seq: [resource.submit_weights_sync(session_id, seq, key, background, owner=owner)]), {}


def prepare_training_checkpoint(resource: ResourceApi, body: dict[str, Any], session_id: str, key: str,
                                owner: str) -> Prepared:
    """``training-checkpoint``: the adapter and optimizer state, under a fresh name."""
    name = f"tg-{uuid.uuid4().hex[:12]}"
    return (lambda seq: [resource.submit_save_state(session_id, seq, key, name, owner=owner)]), {}


def prepare_inference_checkpoint(resource: ResourceApi, body: dict[str, Any], session_id: str, key: str,
                                 owner: str) -> Prepared:
    """``inference-checkpoint``: the adapter and the merged model, saved back to back in the queue (same step).

    Together serves both variants of an inference checkpoint; the merged one is hidden in listings.
    """
    name = f"tg-{uuid.uuid4().hex[:12]}"
    return (lambda seq: [resource.submit_save_weights(session_id, seq, key, name, False, owner=owner),
                         resource.submit_save_weights(session_id, seq + 1, key + ":merged",
                                                      name + MERGED_SUFFIX, True, owner=owner)]), {}


def output_forward_backward(entry: OpEntry, recs: list[Any]) -> dict[str, Any]:
    """ForwardBackwardResult ``{loss, metrics, loss_fn_outputs?}``."""
    return forward_result(recs[0].result, entry.extra.get("masks"), entry.extra.get("with_outputs", False))


def output_custom_forward_backward(entry: OpEntry, recs: list[Any]) -> dict[str, Any]:
    """Nothing to report (``{}``, not null)."""
    return {}


def output_optim_step(entry: OpEntry, recs: list[Any]) -> dict[str, Any]:
    """The trainer step after the update."""
    return {"step": int(recs[0].result.step)}


def output_weights_sync(entry: OpEntry, recs: list[Any]) -> dict[str, Any]:
    """The published weights version."""
    return {"weights_version": int(recs[0].result.policy_version)}


def output_checkpoint(entry: OpEntry, recs: list[Any]) -> dict[str, Any]:
    """The saved checkpoint (an inference checkpoint: its adapter one)."""
    return {"checkpoint": ckpt_short(recs[0].result)}
