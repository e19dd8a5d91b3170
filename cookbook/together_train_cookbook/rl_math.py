"""The numbers of policy-gradient RL, in numpy (no server): group-relative advantages and
the per-step diagnostics the RL and distillation recipes log.

Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, §4.1.2):
for one prompt, G completions with rewards ``r_1..r_G``,

    A_i = r_i - mean(r)                      (scale_by_std=False; Dr. GRPO, Liu et al. 2025,
                                              "Understanding R1-Zero-Like Training", arXiv:2503.20783)
    A_i = (r_i - mean(r)) / (std(r) + eps)   (scale_by_std=True; GRPO's original normalisation)

``std`` is the population standard deviation (ddof=0) of the group. A group whose rewards are
all equal gets A = 0 everywhere (no learning signal). ``A_i`` is the same for every completion
token of sample i (outcome supervision).

Diagnostics over the completion tokens of a batch (q = sampler logprob of each sampled token,
of the temperature-scaled distribution; p = the trainer's logprob of the same token under the
weights being trained, from ``forward_backward(..., return_logprobs=True)``):

    kl_sampler = mean(q - p)        a Monte-Carlo estimate of KL(sampler || trainer) (k1 estimator);
                                    ~0 on-policy, grows with staleness in async mode
    entropy    = -mean(q)           estimate of the sampler's per-token entropy
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def group_advantages(rewards: Sequence[float] | np.ndarray, scale_by_std: bool = False, eps: float = 1e-6) -> np.ndarray:
    """Advantages of one group of completions of the same prompt.

    Args:
        rewards: float [G], G >= 1.
        scale_by_std: divide by ``std(rewards) + eps`` (population std).
        eps: keeps the division finite for constant groups (whose numerators are 0 anyway).

    Returns:
        float64 [G]; sums to 0 (up to rounding).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {list(r.shape)}")
    a = r - r.mean()
    if scale_by_std:
        a = a / (r.std() + eps)
    return a


def kl_and_entropy(
    sampler_logprobs: Sequence[np.ndarray], trainer_logprobs: Sequence[np.ndarray], masks: Sequence[np.ndarray]
) -> tuple[float, float]:
    """(mean of q - p, -mean of q) over the positions where mask != 0, pooled over samples.

    Args:
        sampler_logprobs: per sample float [n_i], q per position (as in the sample's ``logprobs``).
        trainer_logprobs: per sample float [n_i], p per position.
        masks: per sample float [n_i], 1 on sampled (completion) positions.
    """
    q = np.concatenate([np.asarray(x, np.float64)[np.asarray(m) != 0] for x, m in zip(sampler_logprobs, masks)])
    p = np.concatenate([np.asarray(x, np.float64)[np.asarray(m) != 0] for x, m in zip(trainer_logprobs, masks)])
    if q.size == 0:
        return float("nan"), float("nan")
    return float((q - p).mean()), float(-q.mean())
