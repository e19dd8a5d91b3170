"""Translate checkpoint lifecycle messages (save options, registry rows) for the gRPC servicers."""

from __future__ import annotations

from typing import Any

from together_train._proto import common_pb2, session_pb2
from together_train_server.service.interfaces import CheckpointRow, checkpoint_type


def save_options_from_proto(req: session_pb2.SaveStateRequest | session_pb2.SaveWeightsRequest) -> dict[str, Any]:
    """SaveStateRequest / SaveWeightsRequest lifecycle fields -> `SaveOptions.checked` keyword arguments
    (validated when the operation is prepared, so a bad one fails that operation in its seq_id order)."""
    return {"user_metadata": dict(req.user_metadata), "ttl_seconds": int(req.ttl_seconds),
            "pinned": bool(req.pinned), "keep_last": int(req.keep_last)}


def row_to_proto(row: CheckpointRow) -> common_pb2.CheckpointInfo:
    """A model-registry row -> CheckpointInfo with user metadata, expiry, pin, base model, owner tag and type."""
    return common_pb2.CheckpointInfo(
        uri=row.uri, session_id=row.session_id, kind=row.kind, name=row.name, size_bytes=int(row.size_bytes),
        step=int(row.step), merged=row.variant == "merged", created_at=float(row.created_at),
        user_metadata={str(k): str(v) for k, v in row.metadata.items()}, expires_at=float(row.expires_at or 0.0),
        pinned=bool(row.pinned), base_model=row.base_model, owner=row.owner, type=checkpoint_type(row))
