"""Each adapter's AdamW: its two param groups (LoRA+), the hyper-parameter check and one step.

Every hyper-parameter is written into the param groups on each step (no hidden
schedule): group A (lora_A, an lm_head copy) gets ``lr``, group B (lora_B)
``lr * lora_plus_ratio``; both get ``betas``, ``eps``, ``weight_decay`` (decoupled).
The DeepSpeed workers set ZeRO's groups through the same `set_hyperparameters`.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch

from together_train.types.adam_params import ADAM_FIELDS, adam_range_error

from .types import AdamParams, OptimOutput

__all__ = ["adamw_step", "check_adam", "drop_grads", "grad_norm", "new_adamw", "set_hyperparameters"]


def new_adamw(params_a: Sequence[torch.nn.Parameter], params_b: Sequence[torch.nn.Parameter]) -> torch.optim.AdamW:
    """A fresh AdamW with group ``"A"`` (lr) and group ``"B"`` (lr * lora_plus_ratio); lr set per step."""
    return torch.optim.AdamW([{"params": list(params_a), "name": "A"}, {"params": list(params_b), "name": "B"}],
                             lr=0.0, foreach=False)


def check_adam(cfg: AdamParams) -> float:
    """Check AdamW hyper-parameters (before any state changes); returns the learning rate as a float.

    Raises:
        ValueError: naming the first field that is not finite or outside its range (the
            SDK's ``ADAM_RANGES``, which the service validated against already), e.g.
            ``"learning_rate must be finite and >= 0, got -1.0"``.
    """
    values = {f: float(getattr(cfg, f)) for f in ADAM_FIELDS}
    bad = adam_range_error(values)
    if bad is not None:
        name, text = bad
        raise ValueError(f"{name} must be finite and {text}, got {getattr(cfg, name)}")
    return values["learning_rate"]


def set_hyperparameters(groups: Iterable[dict[str, Any]], cfg: AdamParams, lr: float) -> None:
    """Write ``cfg`` into AdamW param groups: ``lr`` (``* lora_plus_ratio`` for the group named "B"),
    betas, eps, weight_decay."""
    for g in groups:
        g["lr"] = lr * (float(cfg.lora_plus_ratio) if g.get("name") == "B" else 1.0)
        g["betas"] = (float(cfg.beta1), float(cfg.beta2))
        g["eps"] = float(cfg.eps)
        g["weight_decay"] = float(cfg.weight_decay)


def drop_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Set every parameter's accumulated gradient to None."""
    for p in params:
        p.grad = None


def grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """Global L2 norm of the accumulated gradients (0 when none)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.nn.utils.get_total_norm(grads, 2.0))


def adamw_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], cfg: AdamParams,
               step: int) -> OptimOutput:
    """One AdamW step of ``optimizer`` over the accumulated gradients of ``params``, then drop them.

    With ``grad_clip_norm > 0`` the gradients are clipped by ``torch.nn.utils.clip_grad_norm_``
    (global L2 norm over ``params``). Parameters without a gradient are skipped by AdamW (as in
    torch). ``step`` is the adapter's count before this step.

    Returns:
        OptimOutput(step + 1, pre-clip grad norm, learning rate of A).

    Raises:
        ValueError: invalid hyper-parameters (nothing changes). FloatingPointError: non-finite
            gradient norm; the step is not applied (the caller drops the gradients: its backend
            may hold more than ``p.grad``).
    """
    lr = check_adam(cfg)
    with_grad = [p for p in params if p.grad is not None]
    norm = 0.0
    if with_grad:
        if cfg.grad_clip_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(with_grad, float(cfg.grad_clip_norm)))
        else:
            norm = grad_norm(with_grad)
    if not math.isfinite(norm):
        raise FloatingPointError(f"non-finite gradient norm ({norm}); step skipped, gradients dropped")
    set_hyperparameters(optimizer.param_groups, cfg, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return OptimOutput(step=step + 1, grad_norm=norm, learning_rate=lr)
