"""`Rollout`: the calls an agent made under one OpenAI rollout URL, token for token.

An OpenAI client whose ``base_url`` is ``http://HOST:PORT/v1/rollouts/{rollout_id}``
is served as under ``/v1`` and every call is recorded (`ResourceClient.get_rollout`):
the prompt token ids as the server rendered them, and per choice the sampled
token ids (the stop token included), the sampler's logprobs and the policy
version of each token, so a trainer never re-tokenizes text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from together_train._proto import resource_pb2

__all__ = ["Rollout", "RolloutCall", "RolloutChoice"]


@dataclass
class RolloutChoice:
    """One sampled choice.

    Attributes:
        tokens: int token ids sampled (the stop token included when one ended it).
        logprobs: float per token: the sampler's logprob (temperature-scaled distribution).
        policy_versions: int per token: the version that sampled it (a training session's step,
            0 = its start; -1 = the base model; an inference checkpoint's step).
        finish_reason: ``"stop"`` or ``"length"``. text: the text the response showed.
    """

    tokens: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str
    text: str

    @classmethod
    def from_proto(cls, m: resource_pb2.RolloutChoice) -> "RolloutChoice":
        return cls(list(m.tokens), list(m.logprobs), list(m.policy_versions), m.finish_reason, m.text)


@dataclass
class RolloutCall:
    """One call (one prompt of it): the prompt as rendered, its choices, the request's messages."""

    model: str
    prompt_tokens: list[int]
    choices: list[RolloutChoice]
    messages: Any = None
    created: float = 0.0

    @classmethod
    def from_proto(cls, m: resource_pb2.RolloutCall) -> "RolloutCall":
        return cls(m.model, list(m.prompt_tokens), [RolloutChoice.from_proto(c) for c in m.choices],
                   json.loads(m.messages_json) if m.messages_json else None, m.created)


@dataclass
class Rollout:
    """A rollout's calls, in the order they were made."""

    rollout_id: str
    calls: list[RolloutCall] = field(default_factory=list)
    created: float = 0.0

    @classmethod
    def from_proto(cls, m: resource_pb2.Rollout) -> "Rollout":
        return cls(m.rollout_id, [RolloutCall.from_proto(c) for c in m.calls], m.created)
