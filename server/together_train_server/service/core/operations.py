"""Operation records and per-session ordering (docs/design.md §5); the runtime runs them (runtime.py).

Every trainer-side request becomes an `OperationRecord` as soon as it is
accepted. A session's operations run strictly in `seq_id` order: one that
arrives early (a gap before it) waits in the session's hold-back buffer until
the missing ones arrive. Ready operations of all sessions wait in one
`scheduler.ReadyQueue` (fair across API keys and their sessions, or FIFO)
served by the one thread of `runtime.TrainerRuntime`, because all sessions share one frozen base
model and the trainer engine is not thread-safe. An idempotency key seen before
returns the first request's record, so a retried `optim_step` never runs twice.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from together_train_server.service.errors import ServiceError, internal_error

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
log = logging.getLogger(__name__)


@dataclass

class OperationRecord:
    """State of one queued operation.

    `result` holds the engine's result object once SUCCEEDED; `error` a
    ServiceError once FAILED or CANCELLED. Times are Unix seconds.
    """

    operation_id: str
    session_id: str
    seq_id: int
    kind: str
    run: Callable[[], Any] | None
    status: str = QUEUED
    result: Any = None
    error: ServiceError | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float = 0.0
    finished_at: float = 0.0
    # model_input tokens of a training request (metrics: together_train_tokens_trained_total; scheduling cost).
    tokens: int = 0
    # The owning session's API key ("" without keys): the fair scheduler's tenant. Never sent to a client.
    tenant: str = field(default="", repr=False)
    # Wall seconds the trainer worker spent in run() (usage metering: trainer_seconds).
    trainer_s: float = 0.0
    # Set by the trainer worker once the operation is ready: its ReadyQueue's position lookup.
    locate: Callable[[str], int] | None = field(default=None, repr=False)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def queue_position(self) -> int:
        """1-based place among ready operations in the order the trainer runs them now (1 = next); 0 when not
        QUEUED or not ready yet (held back until an earlier seq_id of its session arrives)."""
        locate = self.locate
        return locate(self.operation_id) if locate is not None and self.status == QUEUED else 0


class OperationBook:
    """All operation records of the resource, with waiting and bounded retention.

    Terminal records are kept for `retention_s` seconds (at least the newest
    `min_kept`), so a client that reconnects can still fetch a result.
    """

    def __init__(self, retention_s: float = 3600.0, min_kept: int = 10_000) -> None:
        self._records: dict[str, OperationRecord] = {}
        self._order: collections.deque[str] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._retention_s = retention_s
        self._min_kept = min_kept
        # Called once per record when it becomes terminal (telemetry: logs, metrics, curves).
        self.on_end: Callable[[OperationRecord], None] | None = None
        # Called with (record, final status) under the book's lock before the record turns terminal, so
        # whoever sees it ended also sees this hook's effect (usage metering). Must be quick and not raise.
        self.before_end: Callable[[OperationRecord, str], None] | None = None

    def add(self, record: OperationRecord) -> None:
        with self._cond:
            self._records[record.operation_id] = record
            self._order.append(record.operation_id)
            self._evict_locked()
        if record.terminal:  # refused at submission (validation): it ended as it was accepted
            self._ended(record)

    def _ended(self, record: OperationRecord) -> None:
        if self.on_end is not None:
            try:
                self.on_end(record)
            except Exception:
                logging.getLogger(__name__).exception("telemetry of operation %s failed", record.operation_id)

    def get(self, operation_id: str) -> OperationRecord:
        """Raises ServiceError NOT_FOUND for an unknown or evicted id."""
        with self._cond:
            rec = self._records.get(operation_id)
        if rec is None:
            raise ServiceError("NOT_FOUND", f"unknown operation {operation_id!r}", key="operation_id")
        return rec

    def close(self) -> None:
        """Shutting down: every `wait` returns now (long-polls end; the clients poll the restarted resource)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait(self, operation_id: str, timeout: float) -> OperationRecord:
        """Block until the operation is terminal, `timeout` seconds pass, or the book is closed."""
        rec = self.get(operation_id)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not rec.terminal and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return rec

    def run_detached(self, session_id: str, kind: str, fn: Callable[[], Any]) -> OperationRecord:
        """Run `fn` on its own thread as an operation outside any session queue.

        For work that has no place in a session's seq order but that a client
        still waits on as a future (creating a session, sampling): the record
        is returned at once (RUNNING) and ends SUCCEEDED with `fn`'s result or
        FAILED with its ServiceError (any other exception becomes INTERNAL).
        `session_id` ("" for none) scopes who may read the record.
        """
        rec = OperationRecord(
            operation_id=f"op-{uuid.uuid4().hex}", session_id=session_id, seq_id=-1, kind=kind, run=None,
            status=RUNNING, started_at=time.time(),
        )
        self.add(rec)

        def body() -> None:
            try:
                result = fn()
            except ServiceError as err:
                self.update(rec, status=FAILED, error=err, finished_at=time.time())
            except Exception as err:
                error = ServiceError(err.grpc_code, str(err)) if hasattr(err, "grpc_code") else internal_error(
                    err, what=kind, session_id=session_id, operation_id=rec.operation_id)
                self.update(rec, status=FAILED, error=error, finished_at=time.time())
            else:
                self.update(rec, status=SUCCEEDED, result=result, finished_at=time.time())

        threading.Thread(target=body, name=f"detached-{kind}", daemon=True).start()
        return rec

    def update(self, record: OperationRecord, **changes: Any) -> None:
        with self._cond:
            was_terminal = record.terminal
            status = changes.get("status", record.status)
            if not was_terminal and status in TERMINAL and self.before_end is not None:
                self.before_end(record, status)
            for k, v in changes.items():
                setattr(record, k, v)
            ended = record.terminal and not was_terminal
            self._cond.notify_all()
        if ended:
            self._ended(record)

    def _evict_locked(self) -> None:
        cutoff = time.time() - self._retention_s
        while len(self._order) > self._min_kept:
            rec = self._records.get(self._order[0])
            if rec is not None and not (rec.terminal and rec.finished_at < cutoff):
                break
            self._order.popleft()
            self._records.pop(rec.operation_id if rec else "", None)


class Enqueuer(Protocol):
    """Where a `SessionQueue` releases its ready operations: the `runtime.TrainerRuntime`."""

    def enqueue(self, record: OperationRecord) -> None: ...


class SessionQueue:
    """Per-session submission order (`seq_id`) and idempotency keys.

    seq_ids start at 0 and increase by 1. An operation whose seq_id is ahead
    of the next expected one is held back until the gap is filled; a seq_id
    already used (with a different idempotency key) is refused.
    """

    _HELD_MAX = 1024

    def __init__(self, session_id: str, book: OperationBook, worker: Enqueuer, owner: str = "") -> None:
        self.session_id = session_id
        self.owner = owner  # the session's API key: its records' scheduling tenant
        self._book = book
        self._worker = worker
        self._lock = threading.Lock()
        self.next_seq_id = 0
        self._held: dict[int, OperationRecord] = {}
        self._by_key: dict[str, OperationRecord] = {}
        self._live: dict[str, OperationRecord] = {}

    def submit(
        self,
        seq_id: int,
        idempotency_key: str,
        kind: str,
        run: Callable[[], Any] | None,
        error: ServiceError | None = None,
        tokens: int = 0,
    ) -> OperationRecord:
        """Accept an operation; returns its record (the first one's on a retry).

        `tokens`: model_input tokens of a training request (reported in metrics and logs).

        With `error` (a request that failed validation) the record is FAILED
        from the start but still occupies its seq_id, so order is kept.

        Raises:
            ServiceError: FAILED_PRECONDITION for a reused or negative seq_id,
                RESOURCE_EXHAUSTED when too many operations are held back.
        """
        with self._lock:
            if idempotency_key and idempotency_key in self._by_key:
                return self._by_key[idempotency_key]
            if seq_id < 0:
                raise ServiceError("INVALID_ARGUMENT", f"seq_id must be >= 0, got {seq_id}", key="seq_id")
            if seq_id < self.next_seq_id or seq_id in self._held:
                raise ServiceError(
                    "FAILED_PRECONDITION",
                    f"seq_id {seq_id} was already used in session {self.session_id}; "
                    f"the next operation must carry seq_id {self.next_seq_id}",
                    key="seq_id",
                )
            if len(self._held) >= self._HELD_MAX:
                raise ServiceError(
                    "RESOURCE_EXHAUSTED",
                    f"{len(self._held)} operations wait for seq_id {self.next_seq_id}",
                    key="seq_id",
                    retryable=True,
                )
            rec = OperationRecord(
                operation_id=f"op-{uuid.uuid4().hex}",
                session_id=self.session_id,
                seq_id=seq_id,
                kind=kind,
                run=run,
                tokens=tokens,
                tenant=self.owner,
            )
            if error is not None:
                rec.status, rec.error, rec.finished_at, rec.run = FAILED, error, time.time(), None
            self._book.add(rec)
            if idempotency_key:
                self._by_key[idempotency_key] = rec
            self._live[rec.operation_id] = rec
            self._held[seq_id] = rec
            while self.next_seq_id in self._held:
                ready = self._held.pop(self.next_seq_id)
                self.next_seq_id += 1
                self._worker.enqueue(ready)
            self._prune_locked()
            return rec

    def cancel(self, record: OperationRecord) -> bool:
        """Cancel a QUEUED operation; returns False when it already started."""
        with self._lock:
            if record.status != QUEUED:
                return False
            self._book.update(
                record,
                status=CANCELLED,
                error=ServiceError("CANCELLED", f"operation {record.operation_id} was cancelled"),
                finished_at=time.time(),
            )
            return True

    def cancel_all(self, reason: str) -> int:
        """Cancel every queued or held-back operation (session stop)."""
        n = 0
        with self._lock:
            for rec in list(self._live.values()):
                if rec.status == QUEUED:
                    self._book.update(
                        rec,
                        status=CANCELLED,
                        error=ServiceError("CANCELLED", reason),
                        finished_at=time.time(),
                    )
                    n += 1
            self._held.clear()
        return n

    def pending(self) -> list[OperationRecord]:
        with self._lock:
            return [r for r in self._live.values() if not r.terminal]

    def _prune_locked(self) -> None:
        for op_id in [k for k, r in self._live.items() if r.terminal]:
            del self._live[op_id]
        if len(self._by_key) > 100_000:  # keys of long-finished operations
            for key in itertools.islice(list(self._by_key), 50_000):
                del self._by_key[key]
