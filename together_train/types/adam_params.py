"""`AdamParams`: AdamW hyperparameters of one optimizer step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from together_train._proto import common_pb2
from together_train.types._checks import check_types, invalid

__all__ = ["AdamParams", "ADAM_FIELDS"]


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
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    lora_plus_ratio: float = 1.0

    def validate(self) -> "AdamParams":
        """Check every field's range (`optim_step` calls this unless validate=False).

        Raises:
            InvalidArgumentError: naming the field (also for a value of the wrong type).
        """
        self._check_types()
        checks = [
            ("learning_rate", self.learning_rate >= 0),
            ("beta1", 0.0 <= self.beta1 < 1.0),
            ("beta2", 0.0 <= self.beta2 < 1.0),
            ("eps", self.eps > 0),
            ("weight_decay", self.weight_decay >= 0),
            ("grad_clip_norm", self.grad_clip_norm >= 0),
            ("lora_plus_ratio", self.lora_plus_ratio > 0),
        ]
        for name, ok in checks:
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(value) or not ok:
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


ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm", "lora_plus_ratio")
