"""An RL environment: what the policy sees, and what its actions earn.

An episode alternates observation -> action: the loop samples an action (token ids) from the
policy given the observation (the full token context, e.g. a chat rendered with the model's
template up to the assistant header), calls `Env.step(action)`, and gets a reward and either the
next observation or the end of the episode. A single-turn task ends after one step; a multi-turn
task (a dialogue, a tool call whose result the model must use) returns a next observation that
usually extends ``observation + action`` with the environment's reply.

Only action tokens are trained: tokens of an observation (the prompt, the environment's replies)
get mask 0. When a next observation starts with ``observation + action`` the turns are trained as
one sequence; otherwise (a template that rewrites history) each turn is its own sample.

Envs are synchronous; the rollout loop keeps every env of a batch in flight at once by submitting
all sample requests of a turn before waiting (`rl.rollouts`). Model (the name and the shape):
tinker-cookbook's ``rl.types.Env``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

Observation = list[int]  # token ids: the whole context the next action is sampled from
Action = list[int]  # sampled token ids (the stop token included when sampling stopped on it)


@dataclass
class StepResult:
    """What `Env.step` returns.

    Attributes:
        reward: reward of this step (the episode's return is the sum over its steps, plus any
            group reward from `EnvGroupBuilder.compute_group_rewards`).
        episode_done: True ends the episode; `next_observation` is then ignored.
        next_observation: the context of the next action (token ids), when not done.
        metrics: numbers logged as ``env/<name>`` (mean over the batch's steps that report them).
    """

    reward: float
    episode_done: bool
    next_observation: Observation | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Env(ABC):
    """One episode of a task. Make a fresh Env per episode (`EnvGroupBuilder.make_envs`)."""

    @abstractmethod
    def initial_observation(self) -> Observation:
        """Token ids of the first context to sample from (e.g. `Codec.build_generation_prompt`)."""

    @abstractmethod
    def step(self, action: Action) -> StepResult:
        """Grade `action` (sampled token ids) and move the episode on.

        Raises:
            whatever the task raises; the training step fails with it (the session is stopped).
        """
