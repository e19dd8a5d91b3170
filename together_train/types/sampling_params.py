"""`SamplingParams`: how to sample completions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from together_train._proto import common_pb2
from together_train.types._checks import check_types, invalid, is_int

__all__ = ["SamplingParams", "MIN_TEMPERATURE"]

#: Smallest non-zero sampling temperature (the server refuses smaller ones too): the float32
#: logits are divided by it, and below this they overflow to inf and every logprob is NaN.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions (docs/design.md §7).

    Args:
        max_tokens: most new tokens per completion (required, > 0).
        temperature: 0 = greedy; otherwise at least `MIN_TEMPERATURE` (1e-5): a smaller
            one would overflow the logits it divides, so it is refused (InvalidArgumentError,
            here and on the server), never silently made greedy. Logprobs are of the
            temperature-scaled distribution.
        top_k: keep the k most likely tokens; 0 = off.
        top_p: nucleus sampling mass in (0, 1]; 1 = off.
        seed: same seed, same tokens; the i-th of `num_samples` uses its own
            stream. None = a random seed.
        stop: stop strings (a single string is accepted); the stop text is
            included in the returned tokens.
        stop_token_ids: token ids that end generation (included in the output).
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        min_p: keep only tokens whose probability (after temperature) is at least
            ``min_p`` times the most likely token's, in [0, 1]; 0 = off (vLLM's min_p).
    """

    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        # Integers (numpy ones too) become ints; anything else is kept for validate() to name.
        ids = tuple(int(t) if is_int(t) else t for t in (self.stop_token_ids or ()))
        object.__setattr__(self, "stop_token_ids", ids)

    def validate(self) -> "SamplingParams":
        """Check the ranges (`sample` calls this unless validate=False); the
        server checks its limits (`Capabilities.sampling`).

        Raises:
            InvalidArgumentError: naming the field (also for a value of the wrong type).
        """
        self._check_types()
        stop = self.stop
        # wire types: max_tokens / top_k int32, seed int64 (protobuf would raise a bare ValueError)
        for key, value, bits in (("max_tokens", self.max_tokens, 32), ("top_k", self.top_k, 32), ("seed", self.seed, 64)):
            if value is None and key == "seed":
                continue
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise invalid(f"SamplingParams.{key} must be an integer, got {value!r}", key=key)
            if not -(2 ** (bits - 1)) <= int(value) < 2 ** (bits - 1):
                raise invalid(f"SamplingParams.{key} must fit in int{bits}, got {value!r}", key=key)
        if not isinstance(self.max_tokens, (int, np.integer)) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise invalid(f"SamplingParams.max_tokens must be an integer > 0, got {self.max_tokens!r}", key="max_tokens")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise invalid(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}", key="temperature")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise invalid(
                f"SamplingParams.temperature {self.temperature!r} is too small to divide the logits by: "
                f"use 0 for greedy or >= {MIN_TEMPERATURE}",
                key="temperature",
            )
        if self.top_k < 0:
            raise invalid(f"SamplingParams.top_k must be >= 0, got {self.top_k!r}", key="top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise invalid(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}", key="top_p")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise invalid(f"SamplingParams.min_p must be in [0, 1], got {self.min_p!r}", key="min_p")
        if any(not isinstance(s, str) or not s for s in stop):
            raise invalid("SamplingParams.stop must hold non-empty strings", key="stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise invalid("SamplingParams.stop_token_ids must be >= 0", key="stop_token_ids")
        return self

    def _check_types(self) -> None:
        check_types("SamplingParams", [
            ("temperature", self.temperature, "number"), ("top_p", self.top_p, "number"), ("min_p", self.min_p, "number"),
            ("stop_token_ids", self.stop_token_ids, "ints"),
        ])

    def to_proto(self) -> common_pb2.SamplingParams:
        """The wire message.

        Raises:
            InvalidArgumentError: temperature, top_p or stop_token_ids of the wrong type.
        """
        self._check_types()
        msg = common_pb2.SamplingParams(
            max_tokens=int(self.max_tokens),
            temperature=float(self.temperature),
            top_k=int(self.top_k),
            top_p=float(self.top_p),
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=bool(self.ignore_eos),
            min_p=float(self.min_p),
        )
        if self.seed is not None:
            msg.seed = int(self.seed)
        return msg

    @classmethod
    def from_proto(cls, msg: common_pb2.SamplingParams) -> "SamplingParams":
        return cls(
            max_tokens=msg.max_tokens,
            temperature=msg.temperature if msg.HasField("temperature") else 1.0,
            top_k=msg.top_k,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            min_p=msg.min_p if msg.HasField("min_p") else 0.0,
        )
