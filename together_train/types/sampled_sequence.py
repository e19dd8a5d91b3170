"""`SampledSequence`: one completion, with the `VersionSpan`s that say which policy version made which tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from together_train._proto import generator_pb2

__all__ = ["SampledSequence", "VersionSpan"]


@dataclass(frozen=True)
class VersionSpan:
    """Tokens ``[start, end)`` of a sampled sequence came from `policy_version` (-1 = base model)."""

    start: int
    end: int
    policy_version: int


_STOP_REASONS = {generator_pb2.STOP: "stop", generator_pb2.LENGTH: "length"}


@dataclass
class SampledSequence:
    """One completion.

    Attributes:
        tokens: the new token ids (the prompt is not repeated).
        logprobs: one float per token: its logprob under the temperature-scaled
            distribution it was sampled from.
        stop_reason: ``"stop"`` (stop string, stop token or EOS) or ``"length"``
            (max_tokens or the context length).
        version_spans: which policy version produced which tokens.
    """

    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    version_spans: list[VersionSpan] = field(default_factory=list)

    @classmethod
    def from_proto(cls, msg: generator_pb2.SampledSequence) -> "SampledSequence":
        return cls(
            tokens=list(msg.tokens),
            logprobs=list(msg.logprobs),
            stop_reason=_STOP_REASONS.get(msg.stop_reason, "stop"),  # type: ignore[arg-type]
            version_spans=[VersionSpan(int(v.start), int(v.end), int(v.policy_version)) for v in msg.version_spans],
        )
