"""The RL loop and its task interfaces (after tinker-cookbook's ``rl``).

A task is an `Env` (``initial_observation()``, ``step(action) -> StepResult(reward,
episode_done, next_observation, metrics)``), made in groups by an `EnvGroupBuilder` (one prompt,
``group_size`` episodes, optional group rewards) and served per step by an `RLDataset`.
`ChatEnv` writes a multi-turn task in messages; `ProblemEnv` / `ProblemDataset` wrap the
single-turn checkable `problems.Problem`. `train.run(cfg, dataset, codec=...)` trains any of
them: rollouts with per-token policy versions and sampler logprobs, group-centred advantages
(or another `AdvantageFn`), sync or async (one step off-policy), the loss of ``cfg.loss``,
evaluation, checkpoints and exact ``--resume``.

Files: env, env_group, dataset, chat_env, problem_env, trajectory, rollouts, advantages,
training_data, evaluation, config, train.
"""

from together_train_cookbook.rl.advantages import AdvantageFn, GroupCentered, group_stats
from together_train_cookbook.rl.chat_env import ChatEnv, ChatStep
from together_train_cookbook.rl.config import LOSSES, Config
from together_train_cookbook.rl.dataset import RLDataset, SeededEnvDataset
from together_train_cookbook.rl.env import Action, Env, Observation, StepResult
from together_train_cookbook.rl.env_group import EnvGroupBuilder, RepeatedEnv
from together_train_cookbook.rl.evaluation import Evaluator, ProblemEvaluator, RolloutEvaluator
from together_train_cookbook.rl.problem_env import ProblemDataset, ProblemEnv
from together_train_cookbook.rl.rollouts import SamplingSettings, sampler_seed, submit_rollouts
from together_train_cookbook.rl.trajectory import RolloutBatch, Trajectory, TrajectoryGroup, Transition
from together_train_cookbook.rl.training_data import build_samples

__all__ = [
    "Action", "AdvantageFn", "ChatEnv", "ChatStep", "Config", "Env", "EnvGroupBuilder", "Evaluator",
    "GroupCentered", "LOSSES", "Observation", "ProblemDataset", "ProblemEnv", "ProblemEvaluator",
    "RLDataset", "RepeatedEnv", "RolloutBatch", "RolloutEvaluator", "SamplingSettings", "SeededEnvDataset",
    "StepResult", "Trajectory", "TrajectoryGroup", "Transition", "build_samples", "group_stats",
    "sampler_seed", "submit_rollouts",
]
