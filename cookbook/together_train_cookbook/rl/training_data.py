"""Trajectories -> policy-loss samples: observation tokens masked, action tokens trained.

For each episode the turns are laid out as one token sequence while each next observation
starts with the previous ``observation + action`` (a prefix-stable chat: the env's reply is
appended); otherwise the sequence is cut and the turn starts a new sample. Per token:
``mask`` 1 on action tokens and 0 on observation tokens, ``logprobs`` = the sampler's q on action
tokens (0 elsewhere), ``advantages`` = the advantage on action tokens (0 elsewhere); shifted by
`samples.build_policy_sample`. Groups whose advantages are all 0 are skipped (no signal).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import together_train as tt

from together_train_cookbook.rl.advantages import Advantages
from together_train_cookbook.rl.trajectory import Trajectory, TrajectoryGroup
from together_train_cookbook.samples import build_policy_sample


def trajectory_sequences(traj: Trajectory, advantages: Sequence[np.ndarray]) -> list[tuple[list[int], np.ndarray, np.ndarray, np.ndarray]]:
    """(tokens [m], q [m], advantages [m], mask [m]) per training sequence of one episode.

    Raises:
        ValueError: an advantage array whose length is not its action's.
    """
    out: list[tuple[list[int], np.ndarray, np.ndarray, np.ndarray]] = []
    toks: list[int] = []
    q: list[float] = []
    adv: list[float] = []
    mask: list[float] = []

    def flush() -> None:
        if toks:
            out.append((list(toks), np.asarray(q), np.asarray(adv), np.asarray(mask)))

    for t, a in zip(traj.transitions, advantages):
        a = np.asarray(a, np.float64)
        if a.shape != (len(t.action),):
            raise ValueError(f"advantages of a {len(t.action)}-token action have shape {list(a.shape)}")
        if toks and t.observation[:len(toks)] == toks:
            new_obs = t.observation[len(toks):]
        else:  # the env rewrote the history: a new sample
            flush()
            toks, q, adv, mask = [], [], [], []
            new_obs = t.observation
        toks += list(new_obs) + list(t.action)
        q += [0.0] * len(new_obs) + list(t.logprobs)
        adv += [0.0] * len(new_obs) + list(a)
        mask += [0.0] * len(new_obs) + [1.0] * len(t.action)
    flush()
    return out


def build_samples(groups: Sequence[TrajectoryGroup], advantages: Advantages) -> tuple[list[tt.Sample], list[np.ndarray]]:
    """Policy samples of the groups with any advantage != 0, and their masks (per position, [n_i]).

    Sequences without an action token (an empty completion) are left out."""
    samples, masks = [], []
    for g, g_adv in zip(groups, advantages):
        if not any(np.any(np.asarray(a) != 0) for traj in g_adv for a in traj):
            continue
        for traj, t_adv in zip(g.trajectories, g_adv):
            for toks, q, adv, mask in trajectory_sequences(traj, t_adv):
                if not mask.any():
                    continue
                s = build_policy_sample(toks, q, adv, mask=mask)
                samples.append(s)
                masks.append(s.loss_fn_inputs["mask"])
    return samples, masks
