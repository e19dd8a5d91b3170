"""`LoadStateResult`: result of load_state / load_state_with_optimizer."""

from __future__ import annotations

from dataclasses import dataclass

from together_train._proto import session_pb2

__all__ = ["LoadStateResult"]


@dataclass(frozen=True)
class LoadStateResult:
    """Result of `load_state` / `load_state_with_optimizer`.

    Attributes:
        step: the session's optimizer step count after loading.
        with_optimizer: whether optimizer moments were restored too.
    """

    step: int
    with_optimizer: bool

    @classmethod
    def from_proto(cls, msg: session_pb2.LoadStateResult) -> "LoadStateResult":
        return cls(step=int(msg.step), with_optimizer=bool(msg.with_optimizer))
