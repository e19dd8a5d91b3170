"""`OperationStatus`: where an operation stands (queued at which place, running, ended)."""

from __future__ import annotations

from dataclasses import dataclass

from together_train._proto import session_pb2

__all__ = ["OperationStatus"]

_STATUSES = {
    session_pb2.QUEUED: "queued",
    session_pb2.RUNNING: "running",
    session_pb2.SUCCEEDED: "succeeded",
    session_pb2.FAILED: "failed",
    session_pb2.CANCELLED: "cancelled",
}


@dataclass(frozen=True)
class OperationStatus:
    """Where an operation stands, as `Session.operation_status` reads it from the resource.

    Attributes:
        operation_id, session_id, kind: identity (kind e.g. ``"forward_backward"``).
        seq_id: its place in the session's order (-1 for work outside a session queue).
        status: ``"queued"``, ``"running"``, ``"succeeded"``, ``"failed"``, ``"cancelled"`` (or ``"unspecified"``).
        queue_position: while queued and ready, its 1-based place in the order the trainer runs ready
            operations now (1 = next; fair across API keys by default, docs/operating.md); 0 when running,
            ended, or held back until an earlier seq_id of its session arrives. The place can move as other
            keys' work arrives.
        created_at, started_at, finished_at: Unix seconds (0 = not yet).
    """

    operation_id: str
    session_id: str
    seq_id: int
    kind: str
    status: str
    queue_position: int
    created_at: float
    started_at: float
    finished_at: float

    @classmethod
    def from_proto(cls, msg: session_pb2.Operation) -> "OperationStatus":
        return cls(
            operation_id=msg.operation_id,
            session_id=msg.session_id,
            seq_id=int(msg.seq_id),
            kind=msg.kind,
            status=_STATUSES.get(msg.status, "unspecified"),
            queue_position=int(msg.queue_position),
            created_at=float(msg.created_at),
            started_at=float(msg.started_at),
            finished_at=float(msg.finished_at),
        )
