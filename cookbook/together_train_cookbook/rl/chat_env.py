"""A multi-turn chat env: the task speaks in messages, the loop in tokens.

Subclass `ChatEnv`, give it the opening messages, and implement `reply(text) -> ChatStep`: the
reward of the assistant's reply and, unless the episode ends, the messages the environment
answers with (a user's next question, a tool's result). The observation of each turn is the whole
conversation rendered with the model's chat template (`Codec.build_generation_prompt`), the
assistant's replies included as the text the model wrote, so the model sees what it would see at
inference. Example: `together_train_cookbook.envs.arithmetic_dialogue`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from together_train_cookbook.codec import Codec
from together_train_cookbook.rl.env import Action, Env, Observation, StepResult

Message = dict[str, Any]


@dataclass
class ChatStep:
    """A reply's outcome: `reward`; `done` ends the episode, else `messages` (e.g. one user or
    tool message) are appended and the model answers again; `metrics` are logged as ``env/<name>``."""

    reward: float
    done: bool
    messages: Sequence[Message] = ()
    metrics: dict[str, float] = field(default_factory=dict)


class ChatEnv(Env):
    """A conversation with the policy. Attributes: `codec`, `messages` (the history so far)."""

    def __init__(self, codec: Codec, messages: Sequence[Message]) -> None:
        self.codec = codec
        self.messages: list[Message] = [dict(m) for m in messages]

    @abstractmethod
    def reply(self, text: str) -> ChatStep:
        """Grade the assistant's reply `text` (parsed: stop token cut, whitespace stripped)."""

    def initial_observation(self) -> Observation:
        return self.codec.build_generation_prompt(self.messages)

    def step(self, action: Action) -> StepResult:
        text = self.codec.parse_response(action)
        self.messages.append({"role": "assistant", "content": text})
        out = self.reply(text)
        if out.done:
            return StepResult(out.reward, True, None, dict(out.metrics))
        if not out.messages:
            raise ValueError(f"{type(self).__name__}.reply: an episode that goes on needs the environment's messages")
        self.messages.extend(dict(m) for m in out.messages)
        return StepResult(out.reward, False, self.codec.build_generation_prompt(self.messages), dict(out.metrics))
