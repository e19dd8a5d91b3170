"""`AdamParams`: AdamW hyperparameters of one optimizer step, and their defaults and ranges.

`ADAM_DEFAULTS` and `ADAM_RANGES` are the one home of these rules: the
server's request validation (``together_train_server.service.validation``)
and its trainer engines read them from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from together_train._proto import common_pb2
from together_train.types._checks import check_types, invalid

__all__ = ["AdamParams", "ADAM_FIELDS", "ADAM_DEFAULTS", "ADAM_RANGES", "adam_range_error"]

ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm", "lora_plus_ratio")
# What an unset optional field means (torch.optim.AdamW's defaults; no clipping; plain LoRA).
ADAM_DEFAULTS: dict[str, float] = {
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
    "lora_plus_ratio": 1.0,
}
# field -> (the range in words, whether a finite value is inside it)
ADAM_RANGES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "learning_rate": (">= 0", lambda v: v >= 0),
    "beta1": ("in [0, 1)", lambda v: 0.0 <= v < 1.0),
    "beta2": ("in [0, 1)", lambda v: 0.0 <= v < 1.0),
    "eps": ("> 0", lambda v: v > 0),
    "weight_decay": (">= 0", lambda v: v >= 0),
    "grad_clip_norm": (">= 0", lambda v: v >= 0),
    "lora_plus_ratio": ("> 0", lambda v: v > 0),
}


def adam_range_error(values: Mapping[str, float], order: tuple[str, ...] = ADAM_FIELDS) -> tuple[str, str] | None:
    """The first field of ``order`` whose value is not finite or outside `ADAM_RANGES`: ``(field, range)``.

    None when every value is in range. ``values`` holds numbers (type checks are the caller's).
    """
    for name in order:
        text, ok = ADAM_RANGES[name]
        if not (math.isfinite(values[name]) and ok(values[name])):
            return name, text
    return None


@dataclass(frozen=True)
class AdamParams:
    """AdamW hyperparameters for one `optim_step`; sent in full on every step
    (there is no hidden schedule: vary `learning_rate` yourself).

    Args:
        learning_rate: step size (> = 0) of the A matrices (and of every other
            trained parameter).
        beta1, beta2: moment decay rates, in [0, 1).
        eps: denominator epsilon (> 0).
        weight_decay: decoupled (AdamW) weight decay, >= 0.
        grad_clip_norm: clip the global L2 gradient norm to this value; 0 = off.
        lora_plus_ratio: LoRA+: learning rate of B matrices / that of A matrices (> 0).
    """

    learning_rate: float
    beta1: float = ADAM_DEFAULTS["beta1"]
    beta2: float = ADAM_DEFAULTS["beta2"]
    eps: float = ADAM_DEFAULTS["eps"]
    weight_decay: float = ADAM_DEFAULTS["weight_decay"]
    grad_clip_norm: float = ADAM_DEFAULTS["grad_clip_norm"]
    lora_plus_ratio: float = ADAM_DEFAULTS["lora_plus_ratio"]

    def validate(self) -> "AdamParams":
        """Check every field's range (`optim_step` calls this unless validate=False).

        Raises:
            InvalidArgumentError: naming the field (also for a value of the wrong type).
        """
        self._check_types()
        for name in ADAM_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.integer, np.floating)) or adam_range_error({name: value}, (name,)):
                raise invalid(f"AdamParams.{name} is out of range: {value!r}", key=name)
        return self

    def _check_types(self) -> None:
        if self.learning_rate is None:
            raise invalid("AdamParams.learning_rate is required (a number >= 0), got None", key="learning_rate")
        check_types("AdamParams", [(f, getattr(self, f), "number") for f in ADAM_FIELDS])

    def to_proto(self) -> common_pb2.AdamParams:
        """The wire message (every field set).

        Raises:
            InvalidArgumentError: a field of the wrong type (ranges are left to `validate`).
        """
        self._check_types()
        return common_pb2.AdamParams(
            learning_rate=float(self.learning_rate),
            beta1=float(self.beta1),
            beta2=float(self.beta2),
            eps=float(self.eps),
            weight_decay=float(self.weight_decay),
            grad_clip_norm=float(self.grad_clip_norm),
            lora_plus_ratio=float(self.lora_plus_ratio),
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.AdamParams) -> "AdamParams":
        """Fields left unset take this class's defaults (learning_rate: 0)."""
        kw = {f: getattr(msg, f) for f in ADAM_FIELDS if msg.HasField(f)}
        kw.setdefault("learning_rate", 0.0)
        return cls(**kw)
