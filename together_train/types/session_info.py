"""`SessionInfo`: state of a session as the resource sees it."""

from __future__ import annotations

from dataclasses import dataclass

from together_train._proto import resource_pb2
from together_train.types.lora_config import LoraConfig

__all__ = ["SessionInfo"]

_SESSION_STATES = {
    resource_pb2.ACTIVE: "active",
    resource_pb2.STOPPED: "stopped",
    resource_pb2.EXPIRED: "expired",
}


@dataclass(frozen=True)
class SessionInfo:
    """State of a session as the resource sees it.

    Attributes:
        session_id, name: identity and free-form label.
        lora: the adapter's configuration.
        state: ``"active"``, ``"stopped"``, ``"expired"`` (or ``"unspecified"``).
        step: optimizer steps taken (= current policy version).
        synced_version: policy version last published to the replicas (-1 = none).
        created_at, last_active_at, expires_at: Unix seconds.
        next_seq_id: the seq_id the next operation must carry.
        num_trainable_params: parameters the optimizer updates.
    """

    session_id: str
    name: str
    lora: LoraConfig
    state: str
    step: int
    synced_version: int
    created_at: float
    last_active_at: float
    expires_at: float
    next_seq_id: int
    num_trainable_params: int

    @classmethod
    def from_proto(cls, msg: resource_pb2.SessionInfo) -> "SessionInfo":
        return cls(
            session_id=msg.session_id,
            name=msg.name,
            lora=LoraConfig.from_proto(msg.lora),
            state=_SESSION_STATES.get(msg.state, "unspecified"),
            step=int(msg.step),
            synced_version=int(msg.synced_version),
            created_at=float(msg.created_at),
            last_active_at=float(msg.last_active_at),
            expires_at=float(msg.expires_at),
            next_seq_id=int(msg.next_seq_id),
            num_trainable_params=int(msg.num_trainable_params),
        )
