"""Single-turn tasks with a checker (`problems.Problem`: the arithmetic task, a prompt JSONL) as envs.

`ProblemEnv`: observation = the prompt rendered with the chat template; one step; reward 1 when
the problem's checker accepts the parsed response, else 0 (`Problem.reward`).
`ProblemDataset`: step k takes ``batch_size`` problems drawn with ``random.Random(f"rl-{seed}-{k}")``
(no state carried, so ``--resume`` continues exactly), each a group of ``group_size`` envs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from together_train_cookbook.codec import Codec
from together_train_cookbook.problems import Problem
from together_train_cookbook.rl.dataset import RLDataset
from together_train_cookbook.rl.env import Action, Env, Observation, StepResult
from together_train_cookbook.rl.env_group import EnvGroupBuilder, RepeatedEnv


class ProblemEnv(Env):
    """One attempt at `problem`; metric ``env/correct``."""

    def __init__(self, problem: Problem, codec: Codec) -> None:
        self.problem, self.codec = problem, codec

    def initial_observation(self) -> Observation:
        return self.codec.build_generation_prompt(self.problem.messages)

    def step(self, action: Action) -> StepResult:
        reward = self.problem.reward(self.codec.parse_response(action))
        return StepResult(reward, True, None, {"correct": reward})


class ProblemDataset(RLDataset):
    """``batch_size`` problems per step from `problems`, ``group_size`` attempts each."""

    def __init__(self, problems: Sequence[Problem], codec: Codec, batch_size: int, group_size: int, seed: int = 0):
        if not problems:
            raise ValueError("ProblemDataset needs at least one problem")
        self.problems, self.codec = list(problems), codec
        self.batch_size, self.group_size, self.seed = batch_size, group_size, seed

    def indices(self, step: int) -> list[int]:
        """Indices of the problems of `step` (a generator seeded by (seed, step))."""
        rng = random.Random(f"rl-{self.seed}-{step}")
        return rng.sample(range(len(self.problems)), min(self.batch_size, len(self.problems)))

    def get_batch(self, step: int) -> list[EnvGroupBuilder]:
        return [RepeatedEnv(lambda p=self.problems[i]: ProblemEnv(p, self.codec), self.group_size)
                for i in self.indices(step)]
