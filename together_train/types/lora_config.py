"""`LoraConfig`: shape and initialisation of a session's LoRA adapter."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from together_train._proto import common_pb2
from together_train.types._checks import check_types, invalid

__all__ = ["LoraConfig"]


@dataclass(frozen=True)
class LoraConfig:
    """Shape and initialisation of a session's LoRA adapter.

    Args:
        rank: LoRA rank r (>= 1; the server's limit is `Capabilities.max_lora_rank`).
        alpha: scaling numerator; the adapter output is scaled by alpha / rank.
        dropout: dropout probability on the adapter input during training, in [0, 1).
        target_modules: module names to adapt; empty = every linear layer of the
            transformer blocks (`Capabilities.lora_target_modules` lists them).
        train_unembed: also train the output embedding (lm_head) as a full parameter.
        seed: seed of the adapter initialisation (A random, B zero).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    train_unembed: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", (self.target_modules,))
        else:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))

    def validate(self) -> "LoraConfig":
        """Check the ranges the client knows (the server checks its own limits).

        Raises:
            InvalidArgumentError: naming the field (also for a value of the wrong type).
        """
        self._check_types()
        if not isinstance(self.rank, (int, np.integer)) or self.rank < 1:
            raise invalid(f"LoRA rank must be an integer >= 1, got {self.rank!r}", key="rank")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise invalid(f"LoRA alpha must be > 0, got {self.alpha!r}", key="alpha")
        if not 0.0 <= self.dropout < 1.0:
            raise invalid(f"LoRA dropout must be in [0, 1), got {self.dropout!r}", key="dropout")
        return self

    def _check_types(self) -> None:
        check_types("LoraConfig", [
            ("rank", self.rank, "int"), ("alpha", self.alpha, "number"), ("dropout", self.dropout, "number"),
            ("target_modules", self.target_modules, "strs"), ("seed", self.seed, "int"),
        ])
        if not isinstance(self.train_unembed, (bool, np.bool_)):
            raise invalid(f"LoraConfig.train_unembed must be a bool, got {self.train_unembed!r}", key="train_unembed")

    def to_proto(self) -> common_pb2.LoraConfig:
        """The wire message.

        Raises:
            InvalidArgumentError: a field of the wrong type (ranges are left to `validate`).
        """
        self._check_types()
        return common_pb2.LoraConfig(
            rank=int(self.rank),
            alpha=float(self.alpha),
            dropout=float(self.dropout),
            target_modules=list(self.target_modules),
            train_unembed=bool(self.train_unembed),
            seed=int(self.seed),
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.LoraConfig) -> "LoraConfig":
        return cls(
            rank=msg.rank or 16,
            alpha=msg.alpha or 32.0,
            dropout=msg.dropout,
            target_modules=tuple(msg.target_modules),
            train_unembed=msg.train_unembed,
            seed=msg.seed,
        )
