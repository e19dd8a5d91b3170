"""`CheckpointInfo`: a saved checkpoint."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

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
        path: the checkpoint directory (a `pathlib.Path`) when the resource runs
            on this machine and the client knows its storage directory
            (`launch_local`, or ``ResourceClient(..., storage_dir=...)``); else
            None: the resource sends only the URI, never a filesystem path
            (use `ResourceClient.download_checkpoint`).
        size_bytes: total size of its files.
        step: optimizer steps of the session when saved.
        merged: for weights: a merged full model rather than a PEFT adapter.
        created_at: Unix seconds.
        user_metadata: free-form str -> str pairs (from `search_checkpoints` / `update_checkpoint`;
            {} in other listings).
        expires_at: Unix seconds when the resource deletes it (0.0 = never).
        pinned: never removed by TTL or keep-last.
        base_model: the base model id it was trained on.
        owner: sha256 tag of the API key that wrote it ("" without keys).
        type: ``"training"``, ``"sampler"`` or ``"merged"`` ("" when the listing did not say).
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
    user_metadata: dict[str, str] = field(default_factory=dict)
    expires_at: float = 0.0
    pinned: bool = False
    base_model: str = ""
    owner: str = ""
    type: str = ""

    @classmethod
    def from_proto(cls, msg: common_pb2.CheckpointInfo,
                   storage_dir: pathlib.Path | None = None) -> "CheckpointInfo":
        """The message's checkpoint; with `storage_dir` (the resource's storage directory on this
        machine) ``path`` is ``storage_dir/sessions/<session_id>/<kind>/<name>``, the store's layout."""
        if msg.path:
            path: pathlib.Path | None = pathlib.Path(msg.path)
        elif storage_dir is not None and msg.session_id and msg.kind and msg.name:
            path = pathlib.Path(storage_dir) / "sessions" / msg.session_id / msg.kind / msg.name
        else:
            path = None
        return cls(
            uri=msg.uri,
            session_id=msg.session_id,
            kind=msg.kind,
            name=msg.name,
            path=path,
            size_bytes=int(msg.size_bytes),
            step=int(msg.step),
            merged=bool(msg.merged),
            created_at=float(msg.created_at),
            user_metadata=dict(msg.user_metadata),
            expires_at=float(msg.expires_at),
            pinned=bool(msg.pinned),
            base_model=msg.base_model,
            owner=msg.owner,
            type=msg.type,
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
            user_metadata=self.user_metadata,
            expires_at=self.expires_at,
            pinned=self.pinned,
            base_model=self.base_model,
            owner=self.owner,
            type=self.type,
        )
