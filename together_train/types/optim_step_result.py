"""`OptimStepResult`: result of optim_step."""

from __future__ import annotations

from dataclasses import dataclass

from together_train._proto import session_pb2

__all__ = ["OptimStepResult"]


@dataclass(frozen=True)
class OptimStepResult:
    """Result of `optim_step`.

    Attributes:
        step: optimizer steps taken so far including this one (= the new policy version).
        grad_norm: global L2 norm of the accumulated gradient *before* clipping.
        learning_rate: the learning rate used (of the A matrices).
    """

    step: int
    grad_norm: float
    learning_rate: float

    @classmethod
    def from_proto(cls, msg: session_pb2.OptimStepResult) -> "OptimStepResult":
        return cls(step=int(msg.step), grad_norm=float(msg.grad_norm), learning_rate=float(msg.learning_rate))

    def to_proto(self) -> session_pb2.OptimStepResult:
        return session_pb2.OptimStepResult(step=self.step, grad_norm=self.grad_norm, learning_rate=self.learning_rate)
