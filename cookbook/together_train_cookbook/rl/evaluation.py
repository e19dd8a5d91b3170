"""Held-out evaluation inside the RL loop: a callable ``evaluator(session) -> {metric: value}``.

- `ProblemEvaluator`: greedy answers to held-out `Problem` prompts graded by their checkers
  (`evaluation.evaluate`, the same numbers the SFT recipe reports): ``held_out_accuracy``.
- `RolloutEvaluator`: greedy (temperature 0) episodes of held-out env groups: ``eval_reward``
  (mean return) and, when the envs report ``correct`` on their last step, ``held_out_accuracy``
  (mean of it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import together_train as tt

from together_train_cookbook.codec import Codec
from together_train_cookbook.evaluation import evaluate
from together_train_cookbook.problems import Problem
from together_train_cookbook.rl.env_group import EnvGroupBuilder
from together_train_cookbook.rl.rollouts import SamplingSettings, submit_rollouts


class Evaluator(Protocol):
    """What the RL loop calls to evaluate the policy (e.g. `ProblemEvaluator`): metrics to log."""

    def __call__(self, session: tt.Session) -> dict[str, float]:
        """Metrics of the session's last synced version."""
        ...


class ProblemEvaluator:
    """Greedy accuracy on `problems` (max `max_tokens` new tokens each)."""

    def __init__(self, problems: Sequence[Problem], codec: Codec, max_tokens: int) -> None:
        self.items, self.codec, self.max_tokens = [p.eval_item() for p in problems], codec, max_tokens

    def __len__(self) -> int:
        return len(self.items)

    def __call__(self, session: tt.Session) -> dict[str, float]:
        return {"held_out_accuracy": evaluate(session, self.codec, self.items, self.max_tokens)[0]}


class RolloutEvaluator:
    """Greedy episodes of `builders` (each group's envs all run; use groups of one)."""

    def __init__(self, builders: Sequence[EnvGroupBuilder], sampling: SamplingSettings) -> None:
        self.builders = list(builders)
        self.sampling = SamplingSettings(sampling.max_tokens, 0.0, sampling.stop_token_ids, sampling.stop_strings)

    def __len__(self) -> int:
        return len(self.builders)

    def __call__(self, session: tt.Session) -> dict[str, float]:
        batch = submit_rollouts(session, self.builders, self.sampling, step=0, seed=0).collect()
        trajs = [t for g in batch.groups for t in g.trajectories]
        out = {"eval_reward": float(np.mean([r for g in batch.groups for r in g.total_rewards()]))}
        if trajs and all("correct" in t.transitions[-1].metrics for t in trajs):
            out["held_out_accuracy"] = float(np.mean([t.transitions[-1].metrics["correct"] for t in trajs]))
        return out
