"""Learning-rate schedules of the supervised loop: a function of (step, total steps, config)
only, so a resumed run uses the same learning rate at every step as an uninterrupted one."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["SCHEDULES", "Schedule", "learning_rate_at"]

SCHEDULES = ("constant", "linear")

#: ``(0-based step, total steps, config) -> learning rate``.
Schedule = Callable[[int, int, Any], float]


def learning_rate_at(step: int, total: int, cfg: Any) -> float:
    """Learning rate of 0-based `step` of `total`, from ``cfg.learning_rate`` (peak),
    ``cfg.lr_schedule`` and ``cfg.warmup_steps``: linear warmup over the warmup steps
    (lr(k) = peak * (k + 1) / warmup), then constant, or linear decay to 0 at `total`
    (lr(total - 1) = peak / (total - warmup)).

    Raises:
        ValueError: an unknown ``lr_schedule``.
    """
    warmup = getattr(cfg, "warmup_steps", 0)
    if warmup and step < warmup:
        return cfg.learning_rate * (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    if cfg.lr_schedule == "linear":
        span = max(1, total - warmup)
        return cfg.learning_rate * (1.0 - (step - warmup) / span)
    raise ValueError(f"lr_schedule must be one of {SCHEDULES}, got {cfg.lr_schedule!r}")
