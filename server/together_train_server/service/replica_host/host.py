"""A generator replica's adapters: which session's version it serves, which are loaded, and the engine calls.

The replica's gRPC servicer (wire/generator_servicer.py) translates messages to
these calls and back; everything it decides about adapters is decided here, so
the rules are tested by calling `ReplicaHost` directly (tests/engines/test_replica_host.py).

Rules:
- Versions: each session's latest pushed version is kept (`versions`); a push of
  an older version than the one held is ignored (answered with the held one),
  so a late retry never replaces newer weights.
- Residency: at most ``max_adapters`` adapters loaded in the engine, the least
  recently used dropped first (`AdapterResidency`). An evicted adapter keeps
  its version here; a request for it answers "holds no weights" (retryable
  FAILED_PRECONDITION), and the resource re-pushes it, which loads it again.
- Locks: one lock for the tables; one per session so a push never lands between
  a scoring request's version read and its scoring (the reported version is the
  one that scored), and an eviction never drops an adapter pushed again meanwhile.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

from together_train_server.engines.interfaces import GeneratorEngine
from together_train_server.engines.types import GenOutput, LoraConfig, SamplingParams
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.replica_host.residency import AdapterResidency

__all__ = ["HostStatus", "ReplicaHost", "Resolved"]


@dataclass(frozen=True)
class Resolved:
    """What a request samples with: ``adapter`` (the session's key, None = the base model) at ``version``
    (the version held when the request was resolved; -1 for the base)."""

    adapter: str | None
    version: int


BASE = Resolved(None, -1)


@dataclass(frozen=True)
class HostStatus:
    """A snapshot for Health: requests in flight, each session's held version, the engine's weights dtype
    name and its count of sampled tokens."""

    outstanding: int
    versions: dict[str, int]
    dtype: str
    sampled_tokens: int


class ReplicaHost:
    """One replica's adapter table over its generator engine. Thread-safe.

    Args:
        generator: the `GeneratorEngine` (torch or vLLM) it loads adapters into and samples with.
        replica_id: the name its "holds no weights" errors give (default a random one).
        max_adapters: most adapters loaded in the engine at once (0 = no limit).

    Raises:
        ValueError: a negative `max_adapters`.
    """

    def __init__(self, generator: GeneratorEngine, replica_id: str | None = None, max_adapters: int = 0) -> None:
        self.generator = generator
        self.replica_id = replica_id or f"replica-{uuid.uuid4().hex[:8]}"
        self.residency = AdapterResidency(max_adapters)
        self._versions: dict[str, int] = {}
        self._lock = threading.Lock()
        self._session_locks: dict[str, threading.Lock] = {}
        self._outstanding = 0

    # -- adapters --------------------------------------------------------------------------------------------

    def resolve(self, session_id: str) -> Resolved:
        """The adapter a request of `session_id` uses ("" = the base model); it becomes the most recently used.

        Raises:
            ServiceError: FAILED_PRECONDITION "holds no weights for session" (retryable, ``key`` "session_id")
                when nothing was pushed for it here or it was evicted: the resource re-pushes and retries.
        """
        if not session_id:
            return BASE
        with self._lock:
            if session_id not in self._versions or self.residency.is_evicted(session_id):
                raise self._lacks(session_id)
            self.residency.touch(session_id)
            return Resolved(session_id, self._versions[session_id])

    def load(self, session_id: str, spec: LoraConfig, tensors: Mapping[str, torch.Tensor], version: int) -> int:
        """Serve `session_id` with `tensors` (PEFT state-dict keys, any float dtype, CPU; copied by the engine)
        tagged `version`, unless a newer version is held; evicts the least recently used past the limit.

        Returns:
            The version now held for the session: `version`, or the newer one that was kept.

        Raises:
            ServiceError: INVALID_ARGUMENT "pushed adapter rejected" (``key`` "tensors") when the engine
                refuses the spec or tensors; the previous version keeps serving.
        """
        with self._session_lock(session_id):
            with self._lock:
                held = self._versions.get(session_id, -1)
            if held > version:
                return held   # an older version arriving late never replaces a newer one
            try:
                self.generator.load_adapter(session_id, spec, tensors, version=version)
            except ValueError as e:
                raise invalid(f"pushed adapter rejected: {e}", key="tensors") from None
            with self._lock:
                self._versions[session_id] = version
                victims = self.residency.loaded(session_id)
        self._evict(victims)
        return version

    def drop(self, session_id: str) -> None:
        """Forget `session_id`'s adapter and version (unknown: nothing happens)."""
        with self._lock:
            known = self._versions.pop(session_id, None)
            loaded = self.residency.forget(session_id)
        if known is not None and loaded:
            self.generator.drop_adapter(session_id)

    def versions(self) -> dict[str, int]:
        """Session id -> the version held (evicted adapters included: they are re-pushed on demand)."""
        with self._lock:
            return dict(self._versions)

    # -- requests --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count a sampling request as outstanding (Health reports it) for the block's duration."""
        with self._lock:
            self._outstanding += 1
        try:
            yield
        finally:
            with self._lock:
                self._outstanding -= 1

    def submit(self, resolved: Resolved, prompt: list[int], params: SamplingParams, num_samples: int = 1, *,
               prompt_logprobs: bool = False, top_k_prompt_logprobs: int = 0,
               on_token: Callable[[int, int, float], Any] | None = None) -> Future:
        """`GeneratorEngine.submit` with the resolved adapter; a future of `GenOutput` (see `outcome`).

        Raises:
            ValueError: the engine's refusal of the prompt or parameters. ServiceError: "holds no weights"
                when the adapter was evicted since `resolve`.
        """
        try:
            return self.generator.submit(prompt, params, max(1, num_samples), resolved.adapter,
                                      prompt_logprobs=prompt_logprobs, top_k_prompt_logprobs=top_k_prompt_logprobs,
                                      on_token=on_token)
        except KeyError:   # evicted between the table lookup and the engine's
            raise self._lacks(resolved.adapter or "") from None

    def outcome(self, fut: Future, resolved: Resolved) -> tuple[GenOutput, int]:
        """The request's output and the version that served it (the engine's tag, when it reports one).

        Raises:
            concurrent.futures.CancelledError: the request was cancelled. ServiceError: "holds no weights"
                (evicted). What the engine raised otherwise.
        """
        try:
            out = fut.result()
        except KeyError:
            raise self._lacks(resolved.adapter or "") from None
        served = out.adapter_version
        return out, (int(served) if resolved.adapter is not None and served is not None else resolved.version)

    def compute_logprobs(self, sequences: list[list[int]], session_id: str | None) -> tuple[list[np.ndarray], int]:
        """Untempered logprobs (float32 ``[len - 1]`` per sequence, nats) under `session_id`'s adapter (None =
        the base model, version -1), and the version that scored: no push of the session lands in between.

        Raises:
            ServiceError: "holds no weights" (see `resolve`). ValueError: the engine's refusal of a sequence.
        """
        if session_id is None:
            return self.generator.compute_logprobs(sequences, None), BASE.version
        with self._session_lock(session_id):
            resolved = self.resolve(session_id)
            return self.generator.compute_logprobs(sequences, resolved.adapter), resolved.version

    def status(self) -> HostStatus:
        """Requests in flight, versions held, the weights dtype and the tokens sampled so far."""
        with self._lock:
            return HostStatus(self._outstanding, dict(self._versions), str(self.generator.dtype),
                              int(getattr(self.generator, "stats", {}).get("sampled_tokens", 0)))

    # -- internals -------------------------------------------------------------------------------------------

    def _session_lock(self, session_id: str) -> threading.Lock:
        with self._lock:
            return self._session_locks.setdefault(session_id, threading.Lock())

    def _lacks(self, session_id: str) -> ServiceError:
        """The "holds no weights" answer: the resource's pool re-pushes the adapter and retries."""
        why = (f" (evicted: this replica keeps the {self.residency.capacity} most recently used adapters, "
               "--max-adapters)" if self.residency.is_evicted(session_id) else "")
        return ServiceError("FAILED_PRECONDITION", f"replica {self.replica_id} holds no weights for session "
                            f"{session_id}{why}", key="session_id", retryable=True)

    def _evict(self, keys: list[str]) -> None:
        """Drop evicted adapters from the engine (requests already using one finish on it)."""
        for key in keys:
            with self._session_lock(key):
                with self._lock:
                    still = self.residency.is_evicted(key)   # not pushed again meanwhile
                if still:
                    try:
                        self.generator.drop_adapter(key)
                    except KeyError:
                        pass
