"""Advantages: how much better each sampled token did than expected.

An advantage function maps a step's `TrajectoryGroup` list to one float array per transition
(one value per action token) and a dict of metrics. The default, `GroupCentered`, is GRPO's
outcome advantage (`rl_math.group_advantages`): an episode's return minus the mean return of its
group (optionally divided by the group's std), the same value on every action token of every turn
of that episode. Groups whose advantages are all 0 (equal returns) carry no signal and are not
trained (`training_data.build_samples`). Other estimators plug in the same way, e.g. per-token
advantages from a teacher's logprobs (`recipes.distill`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import together_train as tt

from together_train_cookbook.rl.trajectory import TrajectoryGroup
from together_train_cookbook.rl_math import group_advantages

#: advantages[g][e][t]: float64 [len(action)] for transition t of episode e of group g
Advantages = list[list[list[np.ndarray]]]


class AdvantageFn(Protocol):
    """How the RL loop turns a batch of trajectory groups into per-token advantages (e.g. `GroupCentered`)."""

    def __call__(self, groups: Sequence[TrajectoryGroup], session: tt.Session) -> tuple[Advantages, dict[str, float]]:
        """Advantages of every action token of `groups`, and metrics to log. `session`: the
        policy's session (e.g. ``session.client`` to score with another model)."""
        ...


def group_stats(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """How much learning signal a batch carries: the number and fraction of groups whose returns
    are not all equal (``frac_groups_with_signal``; only those are trained), all 1
    (``frac_groups_solved``) and all 0 (``frac_groups_unsolved``)."""
    rewards = [np.asarray(g.total_rewards(), np.float64) for g in groups]
    signal = [bool(np.ptp(r) > 0) for r in rewards]
    return {
        "groups_with_signal": int(sum(signal)),
        "frac_groups_with_signal": float(np.mean(signal)),
        "frac_groups_solved": float(np.mean([bool(np.all(r == 1.0)) for r in rewards])),
        "frac_groups_unsolved": float(np.mean([bool(np.all(r == 0.0)) for r in rewards])),
    }


class GroupCentered:
    """``A = R - mean(R of the group)`` (``/ std`` with `scale_by_std`: GRPO; without: Dr. GRPO),
    broadcast over the episode's action tokens. Metrics: `group_stats`."""

    def __init__(self, scale_by_std: bool = False) -> None:
        self.scale_by_std = scale_by_std

    def __call__(self, groups: Sequence[TrajectoryGroup], session: tt.Session | None = None) -> tuple[Advantages, dict[str, float]]:
        out: Advantages = []
        for g in groups:
            adv = group_advantages(g.total_rewards(), self.scale_by_std)
            out.append([[np.full(len(t.action), a) for t in traj.transitions] for traj, a in zip(g.trajectories, adv)])
        return out, group_stats(groups)
