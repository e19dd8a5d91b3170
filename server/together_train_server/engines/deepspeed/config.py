"""The DeepSpeed config the engines build, and the user's overrides merged over it."""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["ENGINE_OWNED_KEYS", "base_config", "check_overrides", "deepspeed_available", "merge_config"]

# Keys that the engine derives from its own semantics (sum-loss gradients, per-step clipping).
ENGINE_OWNED_KEYS = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu",
                               "gradient_accumulation_steps", "gradient_clipping", "optimizer", "scheduler"})


def deepspeed_available() -> bool:
    """True when ``import deepspeed`` works (the ``deepspeed`` extra)."""
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


def merge_config(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in recursively (dicts merge, other values replace).

    Returns a new dict; neither argument is modified.
    """
    out = dict(base)
    for key, val in overrides.items():
        if isinstance(val, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_config(out[key], val)
        else:
            out[key] = val
    return out


def check_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The user's ``deepspeed_config`` entries, refused where they name a key the engine owns.

    Raises:
        ValueError: a batch-size, clipping, optimizer or scheduler key, or ``zero_optimization.stage``.
    """
    fixed = ENGINE_OWNED_KEYS & set(overrides or {})
    if fixed or "stage" in dict((overrides or {}).get("zero_optimization") or {}):
        raise ValueError(f"deepspeed_config may not set {sorted(fixed) or ['zero_optimization.stage']}: "
                         "the engine owns them (set the stage with --zero-stage / zero_stage)")
    return dict(overrides or {})


def base_config(world_size: int, zero_stage: int, bf16: bool) -> dict[str, Any]:
    """The engine's DeepSpeed config: one micro-batch per rank per step, no DeepSpeed clipping.

    The engines accumulate sum-loss gradients themselves and set ZeRO's clipping per
    ``optim_step`` (``optimizer.clip_grad``), so DeepSpeed's own is 0.
    """
    return {
        "train_batch_size": world_size,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,           # ours, set per step on the ZeRO optimizer
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": bf16},
    }
