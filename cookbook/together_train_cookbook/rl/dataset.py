"""Where an RL run's episodes come from: one batch of env groups per step.

`RLDataset.get_batch(step)` must be a function of the step alone (derive any randomness from
(seed, step)), so a run resumed at step k (``--resume``) draws exactly the batches an
uninterrupted run would. `SeededEnvDataset` is the short way for generated tasks: a function of a
seeded ``random.Random`` makes one env, ``batch_size`` groups of ``group_size`` copies per step.
Model: tinker-cookbook's ``rl.types.RLDataset`` (indexed by batch).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from together_train_cookbook.rl.env import Env
from together_train_cookbook.rl.env_group import EnvGroupBuilder, RepeatedEnv


class RLDataset(ABC):
    """A sequence of batches of `EnvGroupBuilder`, one batch per training step."""

    @abstractmethod
    def get_batch(self, step: int) -> Sequence[EnvGroupBuilder]:
        """The env groups of training step `step` (a pure function of `step`)."""


class SeededEnvDataset(RLDataset):
    """Groups of envs made by ``make_env(rng)``; group j of step k gets a ``random.Random``
    seeded by (seed, k, j), the same one for each of its ``group_size`` envs.

    Args:
        make_env: draws one episode from `rng` (e.g. operands, a secret number) and returns its Env.
        batch_size: groups (prompts) per step. group_size: envs per group (samples per prompt).
        seed: the run's seed.
    """

    def __init__(self, make_env: Callable[[random.Random], Env], batch_size: int, group_size: int, seed: int = 0):
        self.make_env, self.batch_size, self.group_size, self.seed = make_env, batch_size, group_size, seed

    def get_batch(self, step: int) -> list[EnvGroupBuilder]:
        def group(j: int) -> EnvGroupBuilder:
            key = f"env-{self.seed}-{step}-{j}"
            return RepeatedEnv(lambda: self.make_env(random.Random(key)), self.group_size)

        return [group(j) for j in range(self.batch_size)]
