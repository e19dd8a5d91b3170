"""A group of envs for one prompt: the unit advantages are centred over.

GRPO-style training samples the same prompt several times and compares the returns within the
group (`rl.advantages`), so an `EnvGroupBuilder` makes ``n`` envs that start from the same state.
`compute_group_rewards` adds rewards that need the whole group (pairwise preferences, a
tournament); the default adds none. Model: tinker-cookbook's ``rl.types.EnvGroupBuilder``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from together_train_cookbook.rl.env import Env

if TYPE_CHECKING:
    from together_train_cookbook.rl.trajectory import Trajectory


class EnvGroupBuilder(ABC):
    """Makes the envs of one group."""

    @abstractmethod
    def make_envs(self) -> Sequence[Env]:
        """Fresh envs, usually copies of one prompt (the group size is their number)."""

    def compute_group_rewards(self, trajectories: Sequence["Trajectory"]) -> list[float]:
        """Extra reward per trajectory, computed from the whole finished group (default 0)."""
        return [0.0] * len(trajectories)


class RepeatedEnv(EnvGroupBuilder):
    """``group_size`` envs from one factory: ``RepeatedEnv(lambda: MyEnv(prompt), 8)``.

    The factory is called once per env and must give identical starting states (draw any
    randomness before, e.g. from a seeded ``random.Random``)."""

    def __init__(self, make_env: Callable[[], Env], group_size: int) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.make_env, self.group_size = make_env, group_size

    def make_envs(self) -> list[Env]:
        return [self.make_env() for _ in range(self.group_size)]
