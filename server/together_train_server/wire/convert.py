"""Translate between protobuf messages and the service/engine layer's plain values."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from google.protobuf import json_format

from together_train._proto import common_pb2, generator_pb2, resource_pb2, session_pb2
from together_train.tensors import from_tensor, to_tensor
from together_train_server.engines.types import GenOutput, LoraConfig
from together_train_server.service.interfaces import (
    Checkpoint, Limits, ResourceApi, SampleOutput, SessionRecord, WeightsSyncOutcome, check_counts)
from together_train_server.service.errors import invalid
from together_train_server.wire.errors import error_detail

_STATUS = {name: session_pb2.OperationStatus.Value(name) for name in ("QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED")}
_SESSION_STATE = {"ACTIVE": resource_pb2.ACTIVE, "STOPPED": resource_pb2.STOPPED, "EXPIRED": resource_pb2.EXPIRED}


def lora_from_proto(msg: common_pb2.LoraConfig, has_field: bool) -> LoraConfig:
    """Wire LoraConfig message -> the engines' LoraConfig; an absent message gives the defaults."""
    if not has_field:
        return LoraConfig()
    return LoraConfig(
        rank=msg.rank or 16,
        alpha=msg.alpha or 32.0,
        dropout=msg.dropout,
        target_modules=tuple(msg.target_modules),
        train_unembed=msg.train_unembed,
        seed=msg.seed,
    )


def lora_to_proto(spec: LoraConfig) -> common_pb2.LoraConfig:
    return common_pb2.LoraConfig(
        rank=spec.rank,
        alpha=spec.alpha,
        dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        train_unembed=spec.train_unembed,
        seed=spec.seed,
    )


def _check_tensor_bytes(tensor: common_pb2.Tensor, n: int, *, sample_index: int, key: str) -> None:
    """Refuse a tensor whose bytes cannot be an [n] array (8 bytes a value at most) before decoding it."""
    if len(tensor.data) > 8 * n:
        raise invalid(
            f"tensor of {len(tensor.data)} bytes is larger than {n} values (the sample's model_input length) "
            f"can take ({8 * n} bytes at 8 bytes a value)",
            sample_index=sample_index,
            key=key,
        )


def samples_from_proto(samples, limits: Limits | None = None) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Decode wire samples; a malformed tensor is INVALID_ARGUMENT naming sample and key.

    With ``limits``, counts and sizes are checked on the message first (samples,
    tokens per sample and per request, bytes per tensor), so an oversized request
    is refused before any array is built (``validation.check_counts``).
    """
    if limits is not None:
        check_counts([len(s.model_input) for s in samples], limits)
        for i, s in enumerate(samples):
            if len(s.model_input) == 0:  # named as such, not as an oversized tensor
                raise invalid("model_input is empty", sample_index=i, key="model_input")
            for key, tensor in s.loss_fn_inputs.items():
                _check_tensor_bytes(tensor, len(s.model_input), sample_index=i, key=key)
    out = []
    for i, s in enumerate(samples):
        inputs = {}
        for key, tensor in s.loss_fn_inputs.items():
            try:
                inputs[key] = from_tensor(tensor)
            except ValueError as e:
                raise invalid(str(e), sample_index=i, key=key) from None
        out.append((np.asarray(s.model_input, dtype=np.int64), inputs))
    return out


def gradients_from_proto(tensors, samples=None, limits: Limits | None = None) -> list[np.ndarray]:
    """Decode CustomForwardBackward gradients; a malformed tensor is INVALID_ARGUMENT naming sample and key.

    With ``samples`` and ``limits`` the gradient count and each tensor's bytes are
    checked against the samples before decoding (one [n] array per sample).
    """
    if limits is not None and samples is not None:
        if len(tensors) > limits.max_samples_per_batch:
            raise invalid(
                f"{len(tensors)} gradients arrays exceed the limit of {limits.max_samples_per_batch} per request",
                key="gradients",
            )
        if len(tensors) != len(samples):   # the count first: an extra array belongs to no sample
            raise invalid(f"{len(tensors)} gradients arrays for {len(samples)} samples: send one per sample",
                          key="gradients")
        for i, t in enumerate(tensors):
            _check_tensor_bytes(t, len(samples[i].model_input), sample_index=i, key="gradients")
    out = []
    for i, t in enumerate(tensors):
        try:
            out.append(from_tensor(t))
        except ValueError as e:
            raise invalid(str(e), sample_index=i, key="gradients") from None
    return out


def loss_params_from_proto(cfg: common_pb2.LossConfig) -> dict[str, Any]:
    """LossConfig.params (a Struct) -> {name: value}.

    Numbers become floats, strings and bools stay, null becomes None, nested
    structs/lists become dicts/lists (the loss table then refuses their type).

    Raises:
        ServiceError: INVALID_ARGUMENT naming the parameter for a NaN or +-inf
            number (protobuf's JSON conversion would fail without naming it).
    """
    if not cfg.HasField("params"):
        return {}
    out: dict[str, Any] = {}
    for name, value in cfg.params.fields.items():
        kind = value.WhichOneof("kind")
        if kind == "number_value":
            v = value.number_value
            if not math.isfinite(v):
                raise invalid(f"loss parameter {name!r} must be a finite number, got {v}", key=name)
            out[name] = v
        elif kind == "string_value":
            out[name] = value.string_value
        elif kind == "bool_value":
            out[name] = value.bool_value
        elif kind in (None, "null_value"):
            out[name] = None
        else:
            try:
                out[name] = json_format.MessageToDict(value)
            except ValueError as err:  # a NaN nested inside
                raise invalid(f"loss parameter {name!r}: {err}", key=name) from None
    return out


def adam_from_proto(msg: common_pb2.AdamParams) -> dict[str, float | None]:
    return {f: (getattr(msg, f) if msg.HasField(f) else None) for f in (
        "learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm", "lora_plus_ratio")}


def checkpoint_to_proto(c: Checkpoint) -> common_pb2.CheckpointInfo:
    return common_pb2.CheckpointInfo(
        uri=c.uri,
        session_id=c.session_id,
        kind=c.kind,
        name=c.name,
        # No filesystem path over the wire: a remote client learns the URI only (a local one resolves it).
        size_bytes=c.size_bytes,
        step=c.step,
        merged=c.merged,
        created_at=c.created_at,
    )


def operation_to_proto(rec) -> session_pb2.Operation:
    """OperationRecord -> Operation, with the result once SUCCEEDED."""
    op = session_pb2.Operation(
        operation_id=rec.operation_id,
        session_id=rec.session_id,
        seq_id=rec.seq_id,
        kind=rec.kind,
        status=_STATUS[rec.status],
        created_at=rec.created_at,
        started_at=rec.started_at,
        finished_at=rec.finished_at,
        queue_position=getattr(rec, "queue_position", 0),
    )
    if rec.error is not None:
        op.error.CopyFrom(error_detail(rec.error))
    if rec.status != "SUCCEEDED" or rec.result is None:
        return op
    r = rec.result
    if rec.kind in ("forward", "forward_backward", "custom_forward_backward"):
        fr = op.forward
        fr.loss = float(r.loss)
        fr.metrics.update({k: float(v) for k, v in r.metrics.items()})
        n = len(r.logprobs or r.elementwise_loss or [])
        for i in range(n):
            out = fr.outputs.add()
            if r.logprobs is not None:
                out.logprobs.CopyFrom(to_tensor(np.asarray(r.logprobs[i], dtype=np.float32)))
            if r.elementwise_loss is not None:
                out.elementwise_loss.CopyFrom(to_tensor(np.asarray(r.elementwise_loss[i], dtype=np.float32)))
    elif rec.kind == "optim_step":
        op.optim_step.CopyFrom(
            session_pb2.OptimStepResult(step=r.step, grad_norm=r.grad_norm, learning_rate=r.learning_rate)
        )
    elif rec.kind == "weights_sync":
        assert isinstance(r, WeightsSyncOutcome)
        op.weights_sync.CopyFrom(
            session_pb2.WeightsSyncResult(
                policy_version=r.policy_version, num_replicas=r.num_replicas, num_bytes=r.num_bytes, seconds=r.seconds
            )
        )
    elif rec.kind in ("save_weights", "save_state"):
        op.checkpoint.CopyFrom(checkpoint_to_proto(r))
    elif rec.kind == "load_state":
        op.load_state.CopyFrom(session_pb2.LoadStateResult(step=r.step, with_optimizer=r.with_optimizer))
    elif rec.kind == "snapshot":
        op.snapshot.CopyFrom(session_pb2.SnapshotResult(snapshot_id=r.snapshot_id, policy_version=r.version))
    return op


def session_to_proto(resource: ResourceApi, s: SessionRecord) -> resource_pb2.SessionInfo:
    return resource_pb2.SessionInfo(
        session_id=s.session_id,
        name=s.name,
        lora=lora_to_proto(s.lora),
        state=_SESSION_STATE[s.state],
        step=s.step,
        synced_version=s.synced_version,
        created_at=s.created_at,
        last_active_at=s.last_active_at,
        expires_at=resource.session_table.expires_at(s),
        next_seq_id=s.next_seq_id,
        num_trainable_params=s.num_trainable_params,
    )


def capabilities_to_proto(caps: dict[str, Any]) -> resource_pb2.Capabilities:
    limits = caps["limits"]
    msg = resource_pb2.Capabilities(
        protocol_version=caps["protocol_version"],
        model_id=caps["model_id"],
        vocab_size=caps["vocab_size"],
        max_seq_len=caps["max_seq_len"],
        mode=caps["mode"],
        operations=caps["operations"],
        max_lora_rank=caps["max_lora_rank"],
        lora_target_modules=caps["lora_target_modules"],
        max_sessions=caps["max_sessions"],
        sampling=resource_pb2.SamplingLimits(
            max_tokens=limits.max_new_tokens,
            max_num_samples=limits.max_num_samples,
            max_stop_sequences=limits.max_stop_sequences,
            max_top_k_prompt_logprobs=limits.max_top_k_prompt_logprobs,
        ),
        num_replicas=caps["num_replicas"],
        max_tokens_per_batch=limits.max_tokens_per_batch,
        max_samples_per_batch=limits.max_samples_per_batch,
        adam_defaults=common_pb2.AdamParams(**caps["adam_defaults"]),
        generator_engine=caps["generator_engine"],
        trainer_backend=caps["trainer_backend"],
        dtype=caps["dtype"],
        tokenizer_sha256=caps.get("tokenizer_sha256", ""),
        trainer_capabilities=caps.get("trainer_capabilities", []),
    )
    for spec in caps["losses"]:
        ls = msg.losses.add(name=spec.name, formula=spec.formula, available=spec.available)
        for inp in spec.inputs:
            ls.inputs.add(name=inp.name, dtype=inp.dtype, required=inp.required, description=inp.description)
        for p in spec.params:
            ls.params.add(
                name=p.name,
                type=p.type,
                required=p.required,
                default="" if p.default is None else str(p.default),
                choices=[str(c) for c in (p.choices or ())],
                description=p.description,
            )
    return msg


def gen_output_to_proto(out: GenOutput | SampleOutput, version: int, replica_id: str) -> generator_pb2.SampleResponse:
    """An engine's `GenOutput` (a replica) or a routed `SampleOutput` (the resource) as a SampleResponse; every
    sequence's one version span is `version` (an engine never switches weights inside a request)."""
    resp = generator_pb2.SampleResponse(policy_version=version, replica_id=replica_id,
                                        prompt_cache_hit_tokens=int(getattr(out, "prompt_cache_hit_tokens", 0)))
    for seq in out.sequences:
        resp.sequences.add(
            tokens=seq.tokens,
            logprobs=seq.logprobs,
            stop_reason=generator_pb2.STOP if seq.stop_reason == "stop" else generator_pb2.LENGTH,
            version_spans=[generator_pb2.VersionSpan(start=0, end=len(seq.tokens), policy_version=version)],
            untempered_logprobs=seq.untempered_logprobs or [],
            top_logprobs=[generator_pb2.TopKLogprobs(token_ids=ids, logprobs=lps) for ids, lps in seq.top_logprobs or []],
        )
    if out.prompt_logprobs is not None:
        resp.prompt_logprobs.extend(out.prompt_logprobs)
    if out.top_k_prompt_logprobs is not None:
        for ids, lps in out.top_k_prompt_logprobs:
            resp.top_k_prompt_logprobs.add(token_ids=ids, logprobs=lps)
    return resp
