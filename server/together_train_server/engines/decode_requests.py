"""What `TorchGeneratorEngine` keeps of a request while it waits, prefills and decodes (scheduler thread only).

A `DecodeRequest` holds the request's parameters and what its streams produced so far; a `DecodeRow` is
one of its streams, one row of the running batch (its KV-cache row, mask row, position and pending logits).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .torch_adapters import _Adapter
from .types import SamplingParams

__all__ = ["DecodeRequest", "DecodeRow"]


@dataclass(eq=False)
class DecodeRequest:
    prompt: list[int]
    params: SamplingParams
    n: int
    adapter: _Adapter | None
    want_plp: bool
    top_k_plp: int
    future: Future
    gens: list[torch.Generator] = field(default_factory=list)
    budget: int = 0
    stop_ids: frozenset = frozenset()
    max_stop: int = 0
    tokens: list[list[int]] = field(default_factory=list)
    lps: list[list[float]] = field(default_factory=list)
    ulps: list[list[float]] | None = None      # params.top_logprobs set: per stream, untempered logprobs
    tops: list[list[tuple[list[int], list[float]]]] | None = None  # ... and the k most likely per position
    reasons: list[str | None] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    open_streams: int = 0
    plp: list[float] | None = None
    topk: list | None = None
    on_token: Callable[[int, int, float], Any] | None = None
    hit: int = 0                # prompt tokens served from the prefix cache
    matchers: list | None = None  # per stream: the grammar's matcher (params.constraint; engines/grammar.py)

    @property
    def ns(self) -> int:
        """The prefix-cache namespace of its weights (0: the base model)."""
        return self.adapter.ns if self.adapter is not None else 0

    @property
    def weights_replaced(self) -> bool:
        """Its adapter's weights were replaced since it was admitted: its keys/values are never looked up again."""
        return self.adapter is not None and self.adapter.key is None


@dataclass(eq=False)
class DecodeRow:
    req: DecodeRequest
    stream: int
