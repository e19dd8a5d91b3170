"""`WeightsSyncResult`: result of weights_sync."""

from __future__ import annotations

from dataclasses import dataclass

from together_train._proto import session_pb2

__all__ = ["WeightsSyncResult"]


@dataclass(frozen=True)
class WeightsSyncResult:
    """Result of `weights_sync`.

    Attributes:
        policy_version: the version pushed (= optimizer steps taken).
        num_replicas: generator replicas that received it.
        num_bytes: adapter bytes pushed per replica.
        seconds: wall time of the push.
    """

    policy_version: int
    num_replicas: int
    num_bytes: int
    seconds: float

    @classmethod
    def from_proto(cls, msg: session_pb2.WeightsSyncResult) -> "WeightsSyncResult":
        return cls(int(msg.policy_version), int(msg.num_replicas), int(msg.num_bytes), float(msg.seconds))

    def to_proto(self) -> session_pb2.WeightsSyncResult:
        return session_pb2.WeightsSyncResult(
            policy_version=self.policy_version, num_replicas=self.num_replicas, num_bytes=self.num_bytes, seconds=self.seconds
        )
