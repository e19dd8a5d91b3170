"""`CheckpointInfo`: a saved checkpoint."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from together_train._proto import common_pb2

__all__ = ["CheckpointInfo"]


@dataclass(frozen=True)
class CheckpointInfo:
    """A saved checkpoint (docs/design.md §8).

    Attributes:
        uri: ``together-train://<session_id>/<kind>/<name>``; pass it to
            `load_state`, `create_session(checkpoint_uri=...)`, `compute_logprobs`.
        session_id, name: who saved it and under what name.
        kind: ``"weights"`` (inference checkpoint) or ``"state"`` (training checkpoint).
        path: the checkpoint directory on the resource host (a `pathlib.Path`;
            directly readable when the resource runs on this machine, e.g. from
            `launch_local`; else use `ResourceClient.download_checkpoint`), or None.
        size_bytes: total size of its files.
        step: optimizer steps of the session when saved.
        merged: for weights: a merged full model rather than a PEFT adapter.
        created_at: Unix seconds.
    """

    uri: str
    session_id: str
    kind: str
    name: str
    path: pathlib.Path | None = None
    size_bytes: int = 0
    step: int = 0
    merged: bool = False
    created_at: float = 0.0

    @classmethod
    def from_proto(cls, msg: common_pb2.CheckpointInfo) -> "CheckpointInfo":
        return cls(
            uri=msg.uri,
            session_id=msg.session_id,
            kind=msg.kind,
            name=msg.name,
            path=pathlib.Path(msg.path) if msg.path else None,
            size_bytes=int(msg.size_bytes),
            step=int(msg.step),
            merged=bool(msg.merged),
            created_at=float(msg.created_at),
        )

    def to_proto(self) -> common_pb2.CheckpointInfo:
        return common_pb2.CheckpointInfo(
            uri=self.uri,
            session_id=self.session_id,
            kind=self.kind,
            name=self.name,
            path=str(self.path) if self.path is not None else "",
            size_bytes=self.size_bytes,
            step=self.step,
            merged=self.merged,
            created_at=self.created_at,
        )
