"""Operation message -> typed result: which result type each operation kind resolves to."""

from __future__ import annotations

from typing import Any, Callable

from together_train._proto import session_pb2
from together_train.types import (
    CheckpointInfo,
    ForwardResult,
    LoadStateResult,
    OptimStepResult,
    WeightsSyncResult,
)

__all__ = ["converter_for"]

Converter = Callable[[session_pb2.Operation], Any]

# The Operation's ``result`` oneof field -> how to read it.
_BY_FIELD: dict[str, Converter] = {
    "forward": lambda op: ForwardResult.from_proto(op.forward),
    "optim_step": lambda op: OptimStepResult.from_proto(op.optim_step),
    "weights_sync": lambda op: WeightsSyncResult.from_proto(op.weights_sync),
    "checkpoint": lambda op: CheckpointInfo.from_proto(op.checkpoint),
    "load_state": lambda op: LoadStateResult.from_proto(op.load_state),
}

# Operation kind -> its result field.
_FIELD_OF_KIND = {
    "forward": "forward",
    "forward_backward": "forward",
    "custom_forward_backward": "forward",
    "optim_step": "optim_step",
    "weights_sync": "weights_sync",
    "save_state": "checkpoint",
    "save_weights": "checkpoint",
    "load_state": "load_state",
}


def _convert_any(op: session_pb2.Operation) -> Any:
    """An operation of unknown kind: read whichever result field is set (None if none)."""
    which = op.WhichOneof("result")
    return _BY_FIELD[which](op) if which in _BY_FIELD else None


def converter_for(kind: str, storage_dir: Any = None) -> Converter:
    """The function turning a finished ``Operation`` of `kind` into its typed result.

    Known kinds read their own result field; others read whichever field is set.
    `storage_dir`: the resource's storage directory on this machine, if known (a
    checkpoint's ``path`` is resolved in it; the wire carries only its URI).
    """
    field = _FIELD_OF_KIND.get(kind)
    conv = _BY_FIELD[field] if field is not None else _convert_any
    if storage_dir is None or field not in ("checkpoint", None):
        return conv

    def with_path(op: session_pb2.Operation) -> Any:
        if op.WhichOneof("result") == "checkpoint":
            return CheckpointInfo.from_proto(op.checkpoint, storage_dir)
        return conv(op)

    return with_path
