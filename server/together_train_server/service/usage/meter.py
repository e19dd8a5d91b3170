"""`UsageMeter`: what each session (and so each API key) used, summed in memory and flushed to SQLite.

Quantities (`store.FIELDS`, plus ``checkpoint_bytes``):

- ``prefill_tokens``: prompt tokens a replica computed for a sample call (prompt minus prefix-cache hits),
  and every token of a session's compute_logprobs;
- ``prefix_cache_tokens``: prompt tokens served from a replica's prefix cache;
- ``sampled_tokens``: tokens generated (all sequences of a call);
- ``trained_tokens``: model_input tokens of succeeded forward_backward / custom_forward_backward;
- ``forward_tokens``: model_input tokens of succeeded forward (no gradient);
- ``optimizer_steps``: succeeded optim_steps;
- ``trainer_seconds``: wall seconds the trainer worker spent running the session's operations (any outcome);
- ``sampler_seconds``: wall seconds of the session's succeeded sample and compute_logprobs calls on replicas;
- ``checkpoint_bytes``: bytes of the session's checkpoints now in storage (the registry's rows).

Events are added in memory and written every `flush_s` seconds and at close, in one transaction: a
kill -9 loses at most the last `flush_s` seconds of metering, never a checkpoint or a step. Sampling
outside a session (OpenAI inference of the base model or a checkpoint) belongs to no session and is
not metered here (its answer carries OpenAI's ``usage``).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

from together_train_server.service.usage.store import FIELDS, FLOAT_FIELDS, UsageStore

if TYPE_CHECKING:
    from together_train_server.service.core.operations import OperationRecord

log = logging.getLogger(__name__)
_TOKEN_KINDS = {"forward_backward": "trained_tokens", "custom_forward_backward": "trained_tokens",
                "forward": "forward_tokens"}


@dataclass
class UsageTotals:
    """Sums of one session (``session_id`` set) or one API key (``session_id`` ""); ``key`` is the owner tag
    ("" without API keys). Tokens and steps are counts, seconds wall-clock seconds, bytes bytes."""

    key: str = ""
    session_id: str = ""
    prefill_tokens: int = 0
    prefix_cache_tokens: int = 0
    sampled_tokens: int = 0
    trained_tokens: int = 0
    forward_tokens: int = 0
    optimizer_steps: int = 0
    trainer_seconds: float = 0.0
    sampler_seconds: float = 0.0
    checkpoint_bytes: int = 0

    def add(self, values: dict[str, float]) -> None:
        for f in FIELDS:
            v = values.get(f, 0)
            setattr(self, f, getattr(self, f) + (float(v) if f in FLOAT_FIELDS else int(v)))

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class UsageMeter:
    """Metering of one resource.

    Args:
        store: the ``usage`` table.
        owner_of: a session id -> its owner tag (None: unknown session, its events are dropped).
        tag_of: an API key -> its owner tag (`checkpoints.store.owner_tag`).
        flush_s: seconds between writes of the sums gathered in memory.
    """

    def __init__(self, store: UsageStore, owner_of: Callable[[str], str | None], tag_of: Callable[[str], str],
                 flush_s: float = 1.0) -> None:
        self.store = store
        self._owner_of = owner_of
        self._tag_of = tag_of
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[str, collections.Counter]] = {}
        self._closed = threading.Event()
        self._flush_s = flush_s
        self._thread = threading.Thread(target=self._flush_loop, name="usage-flush", daemon=True)
        self._thread.start()

    def add(self, session_id: str, **deltas: float) -> None:
        """Add `deltas` (`store.FIELDS` names) to a session's sums; no session or an unknown one: nothing."""
        if not session_id or not any(deltas.values()):
            return
        owner = self._owner_of(session_id)
        if owner is None:
            return
        with self._lock:
            _, sums = self._pending.setdefault(session_id, (owner, collections.Counter()))
            sums.update({k: v for k, v in deltas.items() if v})

    def operation_ended(self, rec: OperationRecord, status: str) -> None:
        """A trainer operation ends with `status` (an `OperationRecord`): its tokens or step when it SUCCEEDED,
        its trainer seconds (``rec.trainer_s``) in any case."""
        ok = status == "SUCCEEDED"
        deltas: dict[str, float] = {"trainer_seconds": float(getattr(rec, "trainer_s", 0.0))}
        if ok and rec.kind in _TOKEN_KINDS:
            deltas[_TOKEN_KINDS[rec.kind]] = int(rec.tokens)
        if ok and rec.kind == "optim_step":
            deltas["optimizer_steps"] = 1
        self.add(rec.session_id, **deltas)

    def flush(self) -> None:
        """Write the sums gathered in memory (kept in memory and retried next time when the write fails)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        try:
            self.store.add({sid: (owner, dict(sums)) for sid, (owner, sums) in pending.items()})
        except Exception:
            log.exception("usage: writing %d sessions' sums failed; kept in memory", len(pending))
            with self._lock:
                for sid, (owner, sums) in pending.items():
                    self._pending.setdefault(sid, (owner, collections.Counter()))[1].update(sums)

    def _flush_loop(self) -> None:
        while not self._closed.wait(self._flush_s):
            self.flush()

    def close(self) -> None:
        """Stop the flush thread and write what is left."""
        self._closed.set()
        self._thread.join(timeout=5)
        self.flush()

    def sessions(self) -> dict[str, UsageTotals]:
        """Every metered session's sums (stored + not yet written + checkpoint bytes), by session id."""
        out: dict[str, UsageTotals] = {}
        stored = self.store.rows()
        with self._lock:
            pending = {sid: (owner, dict(sums)) for sid, (owner, sums) in self._pending.items()}
        for source in (stored, pending):
            for sid, (owner, values) in source.items():
                out.setdefault(sid, UsageTotals(key=owner, session_id=sid)).add(values)
        for sid, (owner, nbytes) in self.store.checkpoint_bytes().items():
            out.setdefault(sid, UsageTotals(key=owner, session_id=sid)).checkpoint_bytes += nbytes
        return out

    def tokens_of_owner(self, owner: str) -> int:
        """model_input tokens an API key trained on and scored so far (trained + forward tokens)."""
        k = self.keys().get(self._tag_of(owner))
        return 0 if k is None else k.trained_tokens + k.forward_tokens

    def keys(self, sessions: dict[str, UsageTotals] | None = None) -> dict[str, UsageTotals]:
        """Every key's sums (its sessions' sums added up), by owner tag."""
        out: dict[str, UsageTotals] = {}
        for s in (self.sessions() if sessions is None else sessions).values():
            k = out.setdefault(s.key, UsageTotals(key=s.key))
            k.add(s.as_dict())
            k.checkpoint_bytes += s.checkpoint_bytes
        return out
