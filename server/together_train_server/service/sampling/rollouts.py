"""Rollouts: OpenAI calls recorded token for token, for training agents written against ``openai``.

An agent's client uses ``http://HOST:PORT/v1/rollouts/{rollout_id}`` as its
``base_url`` (any id the caller picks: letters, digits, ``-``, ``_``, at most
128). Every ``/chat/completions`` or ``/completions`` call under it is served
exactly as under ``/v1`` and appended to the rollout, in order, as a
`RecordedCall`: the prompt token ids as the server rendered them (chat
template, tools included), and per choice the sampled token ids (the stop
token included when one ended it), the sampler's logprob of each (of the
temperature-scaled distribution it was drawn from: the q of an importance
ratio), the policy version that sampled each, the finish reason and the
text; plus the request's messages. Re-tokenizing chat text never gives back
the sampled tokens exactly, so a trainer uses these ids, not the text.

A rollout belongs to the API key that made its first call: another key gets
NOT_FOUND (404) for it, as for one that does not exist. The store is
bounded (`RolloutStore`: ``--max-rollouts``, ``--max-rollout-mb``,
``--rollout-ttl`` of ``together-train serve``): past a bound the least
recently written rollouts are dropped, and rollouts untouched for the TTL
expire.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from together_train_server.service.errors import ServiceError, invalid

ROLLOUT_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# Defaults of the serve flags (README "Serving"): count, megabytes, seconds untouched.
DEFAULT_MAX_ROLLOUTS = 10_000
DEFAULT_MAX_MB = 1024
DEFAULT_TTL_S = 24 * 3600.0


def check_rollout_id(rollout_id: Any) -> str:
    """`rollout_id` when it is 1-128 letters, digits, ``-`` or ``_``.

    Raises:
        ServiceError: INVALID_ARGUMENT (key "rollout_id") naming the id otherwise.
    """
    if not isinstance(rollout_id, str) or not ROLLOUT_ID.fullmatch(rollout_id):
        raise invalid(f"rollout id {rollout_id!r} is invalid: use 1-128 letters, digits, '-' or '_'",
                      key="rollout_id")
    return rollout_id


@dataclass
class RecordedChoice:
    """One sampled choice of a call.

    Attributes:
        tokens: int token ids sampled, in order (the stop token included when one ended it).
        logprobs: float, one per token: the sampler's logprob (temperature-scaled distribution).
        policy_versions: int, one per token: the version that sampled it (a training session's
            step, 0 = its base; -1 = the base model; a checkpoint's step).
        finish_reason: "stop" | "length" (as the response said; "tool_calls" for parsed tool calls).
        text: the text the response showed.
    """

    tokens: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str
    text: str

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "logprobs": self.logprobs, "policy_versions": self.policy_versions,
                "finish_reason": self.finish_reason, "text": self.text}


@dataclass
class RecordedCall:
    """One call of a rollout.

    Attributes:
        model: the request's ``model``.
        prompt_tokens: int token ids of the prompt as rendered and sampled from.
        choices: the call's choices for this prompt, in index order.
        messages: the request's chat messages (None for /completions).
        created: unix seconds when recorded.
    """

    model: str
    prompt_tokens: list[int]
    choices: list[RecordedChoice]
    messages: Any = None
    created: float = field(default_factory=time.time)

    def nbytes(self) -> int:
        """Bytes charged to the store: 8 per token id, logprob and version, plus the texts' JSON."""
        tokens = len(self.prompt_tokens) + sum(3 * len(c.tokens) for c in self.choices)
        text = sum(len(c.text) for c in self.choices) + len(json.dumps(self.messages)) + len(self.model)
        return 8 * tokens + text

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "prompt_tokens": self.prompt_tokens,
                "choices": [c.to_json() for c in self.choices], "messages": self.messages,
                "created": self.created}


@dataclass
class Rollout:
    """A rollout: its owner's calls in order; `nbytes` as charged (`RecordedCall.nbytes`)."""

    rollout_id: str
    owner: str
    calls: list[RecordedCall] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    nbytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """``GET /v1/rollouts/{id}``'s body."""
        return {"rollout_id": self.rollout_id, "object": "rollout", "created": self.created,
                "calls": [c.to_json() for c in self.calls]}

    def summary(self) -> dict[str, Any]:
        """The dashboard's row: id, calls, sampled tokens, bytes, times."""
        return {"rollout_id": self.rollout_id, "calls": len(self.calls),
                "sampled_tokens": sum(len(ch.tokens) for c in self.calls for ch in c.choices),
                "bytes": self.nbytes, "created": self.created, "updated": self.updated}


class RolloutStore:
    """Recorded rollouts in memory, bounded by count, bytes and age; thread-safe.

    Args:
        max_rollouts: rollouts kept; recording one more drops the least recently written.
        max_bytes: bytes kept (`RecordedCall.nbytes`); past it the least recently written
            rollouts are dropped (a single call bigger than this is refused, RESOURCE_EXHAUSTED).
        ttl_s: a rollout not written for this many seconds expires.
        clock: seconds (tests move it).
    """

    def __init__(self, max_rollouts: int = DEFAULT_MAX_ROLLOUTS, max_bytes: int = DEFAULT_MAX_MB << 20,
                 ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time) -> None:
        if max_rollouts < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError(f"rollout bounds must be positive: max_rollouts={max_rollouts}, max_bytes={max_bytes}, "
                             f"ttl_s={ttl_s}")
        self.max_rollouts, self.max_bytes, self.ttl_s, self.clock = max_rollouts, max_bytes, ttl_s, clock
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Rollout] = OrderedDict()  # least recently written first
        self._bytes = 0
        self.dropped = 0  # rollouts dropped by a bound or expired (the dashboard shows it)

    def _expire(self, now: float) -> None:
        while self._items:
            rid, r = next(iter(self._items.items()))
            if now - r.updated < self.ttl_s:
                break
            self._drop(rid)

    def _drop(self, rollout_id: str) -> None:
        r = self._items.pop(rollout_id)
        self._bytes -= r.nbytes
        self.dropped += 1

    def _owned(self, owner: str, rollout_id: str) -> Rollout:
        r = self._items.get(rollout_id)
        if r is None or r.owner != owner:  # another key's rollout is as absent as a missing one
            raise ServiceError("NOT_FOUND", f"rollout {rollout_id!r} does not exist (it may have expired: "
                               f"rollouts untouched for {self.ttl_s:.0f} s or past the store's bounds are dropped)",
                               key="rollout_id")
        return r

    def check_writable(self, owner: str, rollout_id: str) -> None:
        """Raise before sampling what `record` would: a bad id (400) or another key's rollout (404)."""
        check_rollout_id(rollout_id)
        with self._lock:
            self._expire(self.clock())
            if rollout_id in self._items:
                self._owned(owner, rollout_id)

    def record(self, owner: str, rollout_id: str, calls: Sequence[RecordedCall]) -> None:
        """Append `calls` to the rollout (made on its first call, owned by `owner`).

        Raises:
            ServiceError: INVALID_ARGUMENT for a bad id; NOT_FOUND when another key owns it;
                RESOURCE_EXHAUSTED for calls larger than the whole store.
        """
        check_rollout_id(rollout_id)
        size = sum(c.nbytes() for c in calls)
        if size > self.max_bytes:
            raise ServiceError("RESOURCE_EXHAUSTED", f"this call's record ({size} bytes) exceeds the rollout store "
                               f"({self.max_bytes} bytes, --max-rollout-mb)", key="rollout_id")
        with self._lock:
            now = self.clock()
            self._expire(now)
            r = self._items.get(rollout_id)
            if r is None:
                r = self._items[rollout_id] = Rollout(rollout_id, owner, created=now, updated=now)
            else:
                self._owned(owner, rollout_id)
                self._items.move_to_end(rollout_id)
            r.calls.extend(calls)
            r.nbytes += size
            r.updated = now
            self._bytes += size
            while len(self._items) > self.max_rollouts or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def get(self, owner: str, rollout_id: str) -> Rollout:
        """The rollout (its calls so far). Raises ServiceError INVALID_ARGUMENT (bad id), NOT_FOUND."""
        check_rollout_id(rollout_id)
        with self._lock:
            self._expire(self.clock())
            r = self._owned(owner, rollout_id)
            return Rollout(r.rollout_id, r.owner, list(r.calls), r.created, r.updated, r.nbytes)

    def delete(self, owner: str, rollout_id: str) -> None:
        """Free the rollout. Raises ServiceError INVALID_ARGUMENT (bad id), NOT_FOUND."""
        check_rollout_id(rollout_id)
        with self._lock:
            self._owned(owner, rollout_id)
            r = self._items.pop(rollout_id)
            self._bytes -= r.nbytes

    def list(self, owner: str | None = None) -> list[dict[str, Any]]:
        """Summaries (`Rollout.summary`, plus ``owner`` when listing all), newest write first;
        `owner` None = every key's (the dashboard's operator view)."""
        with self._lock:
            self._expire(self.clock())
            rows = [r for r in reversed(self._items.values()) if owner is None or r.owner == owner]
            return [{**r.summary(), **({"owner": r.owner} if owner is None else {})} for r in rows]

    def stats(self) -> dict[str, int]:
        """``rollouts``, ``bytes``, ``dropped`` and the bounds (for the dashboard)."""
        with self._lock:
            return {"rollouts": len(self._items), "bytes": self._bytes, "dropped": self.dropped,
                    "max_rollouts": self.max_rollouts, "max_bytes": self.max_bytes, "ttl_s": int(self.ttl_s)}


def calls_of(model: str, prompts: Sequence[Sequence[int]], choices: Sequence[Any], n: int, messages: Any = None,
             version_floor: int | None = None) -> list[RecordedCall]:
    """The `RecordedCall` of each prompt of a finished request.

    Args:
        model: the request's model. prompts: int token ids of each prompt as sampled.
        choices: `inference.Choice` objects (index = prompt index * n + sample index), each with
            its replica sequence (``sampled``: sampler logprobs and versions).
        n: choices per prompt. messages: the request's chat messages (None for /completions).
        version_floor: versions below it are raised to it (a training session's base model is its
            version 0, which the replicas report as the base's -1).
    """
    calls = []
    for i, prompt in enumerate(prompts):
        mine = sorted((c for c in choices if c.index // n == i), key=lambda c: c.index)
        rec = []
        for c in mine:
            seq = c.sampled
            versions = [int(v) for v in (seq.versions if seq is not None else [])]
            if version_floor is not None:
                versions = [max(v, version_floor) for v in versions]
            rec.append(RecordedChoice([int(t) for t in c.tokens], [float(x) for x in (seq.logprobs if seq else [])],
                                      versions, c.finish_reason, c.text))
        calls.append(RecordedCall(model, [int(t) for t in prompt], rec, messages))
    return calls
