"""What a rollout produced: transitions of an episode, episodes of a group, groups of a step.

Every sampled token keeps the sampler's logprob (of the temperature-scaled distribution it was
drawn from: the q of the importance ratio) and the policy version that produced it (from the
result's ``version_spans``), so off-policy batches (async mode) are corrected token by token and
their staleness is measured. `RolloutBatch` round-trips through JSON: async runs store the batch
sampled for the next step in their checkpoint record, and ``--resume`` trains it as the
uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Transition:
    """One turn: the context, the sampled action and what the env made of it.

    Attributes:
        observation: int token ids the action was sampled from (whole context).
        action: int token ids sampled. logprobs: float, one per action token (sampler's q).
        versions: int, one per action token: the policy version that sampled it.
        reward: the env's reward for this step. episode_done: whether it ended the episode.
        metrics: the env's numbers for this step.
    """

    observation: list[int]
    action: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    episode_done: bool
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One episode, in order."""

    transitions: list[Transition]

    @property
    def reward(self) -> float:
        """Sum of the step rewards."""
        return float(sum(t.reward for t in self.transitions))


@dataclass
class TrajectoryGroup:
    """The episodes of one env group and their group rewards (`EnvGroupBuilder.compute_group_rewards`)."""

    trajectories: list[Trajectory]
    group_rewards: list[float]

    def total_rewards(self) -> list[float]:
        """Return of each episode: step rewards + group reward."""
        return [t.reward + g for t, g in zip(self.trajectories, self.group_rewards)]


@dataclass
class RolloutBatch:
    """The groups sampled for training step `step`; `sampling_seconds`: first request -> last result;
    `prompt_tokens`: prompt tokens of its sample requests (every turn), `prompt_cache_hit_tokens`: those the
    generator served from its prefix cache (``SampleResult.prompt_cache_hit_tokens``);
    `metrics`: numbers of the whole batch the rollout source adds to the step's record (e.g. agent runs)."""

    step: int
    groups: list[TrajectoryGroup]
    sampling_seconds: float | None = None
    prompt_tokens: int = 0
    prompt_cache_hit_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RolloutBatch":
        groups = [TrajectoryGroup([Trajectory([Transition(**t) for t in traj["transitions"]])
                                   for traj in g["trajectories"]], list(g["group_rewards"]))
                  for g in d["groups"]]
        return cls(int(d["step"]), groups, d.get("sampling_seconds"), int(d.get("prompt_tokens", 0)),
                   int(d.get("prompt_cache_hit_tokens", 0)), dict(d.get("metrics") or {}))

    def min_version(self) -> int | None:
        """The oldest policy version among the batch's sampled tokens (None: no token sampled)."""
        vs = [v for g in self.groups for traj in g.trajectories for t in traj.transitions for v in t.versions]
        return min(vs) if vs else None
