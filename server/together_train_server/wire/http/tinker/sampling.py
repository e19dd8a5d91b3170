"""Tinker sampling: sampling sessions on a snapshot, live weights, a checkpoint or the base model, and ``asample``."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request

from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.interfaces import SUCCEEDED
from together_train_server.wire.http.app import error_response
from together_train_server.wire.http.tinker.base import _ctx, router
from together_train_server.wire.http.tinker.ids import Sampler, TinkerIds, to_our_uri
from together_train_server.wire.http.tinker.parsing import _get, _json, _prompt_tokens
from together_train_server.wire.http.tinker.results import _sample_response_proto
from together_train_server.wire.http.tinker.sampling_params import tinker_sampling_params

if TYPE_CHECKING:
    from together_train_server.service.interfaces import ResourceApi


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict[str, Any]:
    """A sampling session on a saved checkpoint (model_path) or on the base model."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    cs = ids.live_session(_get(body, "session_id", str), owner)
    seq = _get(body, "sampling_session_seq_id", int)
    model_path = _get(body, "model_path", str, None)
    uri = ""
    if model_path:
        uri = to_our_uri(model_path, "model_path")
        await asyncio.to_thread(resource.checkpoints.get_checkpoint, uri, owner)  # NOT_FOUND now, not at the first sample
    else:
        resource.check_base_model(_get(body, "base_model", str, None))
    sampler = Sampler(f"{cs.session_id}:sample:{seq}", owner, checkpoint_uri=uri, model_path=model_path)
    ids.add_sampler(sampler)
    return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
    resource, ids, owner = _ctx(request)
    s = ids.sampler(sampler_id, owner)
    return {"sampler_id": s.sampler_id, "base_model": resource.base_model_name(),
            "model_path": s.model_path}


def _sampler_weights(resource: ResourceApi, ids: TinkerIds, s: Sampler, owner: str) -> tuple[str, int, str]:
    """(replica adapter key, version, our session id for scoping) a sampler samples with; "" key = base model."""
    if s.checkpoint_uri:
        key, version = resource.checkpoints.checkpoint_scoring_key(s.checkpoint_uri, owner)
        return key, version, ""
    if not s.source_op:
        return "", -1, ""
    rec = resource.submissions.wait_operation(s.source_op, 600.0, owner, max_wait_s=600.0)
    if rec.status != SUCCEEDED:
        raise ServiceError("FAILED_PRECONDITION", f"the weights save of this sampling client failed: {rec.error}",
                           key="sampling_session_id")
    if s.inflight:
        key, version = resource.sessions.check_sample_session(s.session_id, owner)
        return key, version, s.session_id
    snap = rec.result
    resource.snapshots.check(snap)
    return snap.key, snap.version, s.session_id


def _check_sampler_usable(resource: ResourceApi, ids: TinkerIds, s: Sampler, owner: str) -> None:
    """A sampler on live weights needs its model ACTIVE; one on a snapshot needs the snapshot kept.
    Raises ServiceError FAILED_PRECONDITION (nothing is waited for: a queued save is checked later)."""
    if s.inflight:
        resource.session_table.active_session(s.session_id, owner)
    elif s.source_op:
        rec = resource.submissions.get_operation(s.source_op, owner)
        if rec.status == SUCCEEDED:
            resource.snapshots.check(rec.result)


# Request fields of the 0.38 SDK this resource does not serve (refused when set, naming the field).
_UNSUPPORTED_SAMPLE = {"topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0, "target_prompt_logprobs": None,
                       "record_stability_info": False}


@router.post("/asample")
async def asample(request: Request) -> Any:
    """Sample (or score the prompt: compute_logprobs is max_tokens=1 with prompt logprobs) -> future with
    one sequence id per sample. A re-sent (sampling_session_id, seq_id) with the same body returns the
    first request's future; with another body it is a 409."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    if body.get("sampling_session_id") is None:
        # One-shot form (model_path / base_model): a sampling session of its own.
        model_path = _get(body, "model_path", str, None)
        uri = to_our_uri(model_path, "model_path") if model_path else ""
        if not uri:
            resource.check_base_model(_get(body, "base_model", str, None))
        s = Sampler(f"oneshot:{uuid.uuid4().hex[:12]}", owner, checkpoint_uri=uri, model_path=model_path)
    else:
        s = ids.sampler(_get(body, "sampling_session_id", str), owner)
        _check_sampler_usable(resource, ids, s, owner)  # before the payload
    for name, off in _UNSUPPORTED_SAMPLE.items():
        if body.get(name, off) not in (off, None):
            raise invalid(f"{name} is not supported by this resource", key=name)
    seq_id = _get(body, "seq_id", int, None)
    fingerprint = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    if seq_id is not None and seq_id in s.seqs:
        first_hash, op_id, n = s.seqs[seq_id]
        if first_hash != fingerprint:
            return error_response(ServiceError("ABORTED", f"seq_id {seq_id} of sampling session {s.sampler_id} was "
                                               "already used by a different request", key="seq_id"), 409)
        return {"request_id": op_id, "sample_sequence_ids": [f"{op_id}:{i}" for i in range(n)]}
    prompt = _prompt_tokens(body.get("prompt"))
    num_samples = _get(body, "num_samples", int, 1)
    want_prompt_lp = bool(_get(body, "prompt_logprobs", bool, False))
    topk_prompt = int(_get(body, "topk_prompt_logprobs", int, 0) or 0)
    last_n = _get(body, "prompt_logprobs_last_n", int, None)
    if last_n is not None and not ((want_prompt_lp or topk_prompt > 0) and 1 <= last_n <= len(prompt) - 1):
        raise invalid(f"prompt_logprobs_last_n must be in [1, len(prompt) - 1] with prompt_logprobs or "
                      f"topk_prompt_logprobs, got {last_n}",
                      key="prompt_logprobs_last_n")
    params = _get(body, "sampling_params", dict)
    sp = tinker_sampling_params(params, len(prompt), resource.limits)
    req = resource.sampling.request("", prompt, sp, num_samples=num_samples,
                                  prompt_logprobs=want_prompt_lp or topk_prompt > 0, top_k_prompt_logprobs=topk_prompt)
    # Which weights: resolved now for a loaded sampler (a released snapshot fails the call here).
    source_done = not s.source_op or resource.submissions.get_operation(s.source_op, owner).terminal
    key = version = scope = None
    if source_done:
        key, version, scope = await asyncio.to_thread(_sampler_weights, resource, ids, s, owner)

    def run() -> bytes:
        k = key
        if k is None:  # the weights save is still queued: wait for it (the SDK returns the client before)
            k, _, _ = _sampler_weights(resource, ids, s, owner)
        # Metrics: only the tokens (together_train_tokens_sampled_total); the operation itself ends as kind
        # tinker_sample.
        resp = resource.sampling.sample(dataclasses.replace(req, key=k), scope=scope or "", record="tokens")
        return _sample_response_proto(resp, len(prompt), last_n)

    rec = resource.submissions.run_detached("tinker_sample", run, session_id=scope or "")
    if seq_id is not None:
        s.seqs[seq_id] = (fingerprint, rec.operation_id, num_samples)
        if len(s.seqs) > 4096:  # the SDK re-sends recent seq_ids only
            for old in list(s.seqs)[:2048]:
                del s.seqs[old]
    return {"request_id": rec.operation_id, "sample_sequence_ids": [f"{rec.operation_id}:{i}" for i in range(num_samples)]}

