"""`OperationPoller`: follows server operations to completion and resolves their futures.

A session's operations run strictly in order, so the poller long-polls
(``WaitOperation``) only the *oldest* unfinished operation of each session;
when it ends, the next one is asked (usually already finished, so one cheap
call). A session with 100 operations in flight costs one waiting RPC, not
100 busy threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from together_train._executor import DaemonExecutor
from together_train._proto import session_pb2
from together_train.errors import (
    ClientClosedError,
    InternalError,
    OperationCancelledError,
    TogetherTrainError,
    from_error_detail,
)
from together_train.retry import RetryPolicy

__all__ = ["OperationPoller", "resolve_operation", "TERMINAL_STATUSES"]

logger = logging.getLogger("together_train")

TERMINAL_STATUSES = frozenset({session_pb2.SUCCEEDED, session_pb2.FAILED, session_pb2.CANCELLED})


def _safe_set_result(fut: cf.Future, value: Any) -> None:
    try:
        fut.set_result(value)
    except cf.InvalidStateError:  # cancelled or resolved meanwhile
        pass


def _safe_set_exception(fut: cf.Future, exc: BaseException) -> None:
    try:
        fut.set_exception(exc)
    except cf.InvalidStateError:
        pass



@dataclass
class _Tracked:
    operation_id: str
    seq_id: int
    inner: cf.Future
    convert: Callable[[session_pb2.Operation], Any]
    polls: int = 0


class _Group:
    __slots__ = ("pending", "running", "use_get")

    def __init__(self) -> None:
        self.pending: dict[str, _Tracked] = {}
        self.running = False
        self.use_get = False


class OperationPoller:
    """Follows server operations to completion and resolves their futures.

    One chain per group (session): it long-polls the oldest unfinished
    operation with ``WaitOperation`` and, after each answer, reschedules
    itself on the shared pool, so many sessions share few threads fairly.
    If the server does not implement ``WaitOperation``, ``GetOperation`` is
    polled with a growing interval (50 ms .. 1 s) instead.

    Args:
        wait_op: ``(operation_id, timeout_s) -> Operation``, one WaitOperation call.
        get_op: ``(operation_id) -> Operation``, one GetOperation call.
        retry: policy around each call (retryable errors only).
        executor: the pool the chains run on.
        long_poll_s: the wait asked of the server per call.
    """

    def __init__(
        self,
        wait_op: Callable[[str, float], session_pb2.Operation],
        get_op: Callable[[str], session_pb2.Operation],
        retry: RetryPolicy,
        executor: DaemonExecutor,
        long_poll_s: float = 20.0,
    ) -> None:
        self._wait_op = wait_op
        self._get_op = get_op
        self._retry = retry
        self._executor = executor
        self._long_poll_s = long_poll_s
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}
        self._closed = False

    def track(
        self,
        group: str,
        op: session_pb2.Operation,
        inner: cf.Future,
        convert: Callable[[session_pb2.Operation], Any],
    ) -> None:
        """Resolve `inner` when `op` ends (at once when it already has)."""
        if op.status in TERMINAL_STATUSES:
            resolve_operation(op, inner, convert)
            return
        tracked = _Tracked(op.operation_id, int(op.seq_id), inner, convert)
        with self._lock:
            if self._closed:
                _safe_set_exception(inner, _closed_error(op.operation_id))
                return
            g = self._groups.setdefault(group, _Group())
            g.pending[op.operation_id] = tracked
            start = not g.running
            g.running = True
        if start:
            self._schedule(group)

    def _schedule(self, group: str) -> None:
        try:
            self._executor.submit(self._step, group)
        except RuntimeError:  # executor shut down
            with self._lock:
                g = self._groups.get(group)
                if g:
                    g.running = False

    def _step(self, group: str) -> None:
        with self._lock:
            g = self._groups.get(group)
            if g is None:
                return
            for op_id in [k for k, t in g.pending.items() if t.inner.done()]:
                del g.pending[op_id]
            if not g.pending or self._closed:
                g.running = False
                if not g.pending:
                    del self._groups[group]
                return
            head = min(g.pending.values(), key=lambda t: t.seq_id)
            use_get = g.use_get
        delay = 0.0
        try:
            if use_get:
                op = self._retry.call(lambda: self._get_op(head.operation_id), what="GetOperation")
                if op.status not in TERMINAL_STATUSES:
                    delay = min(0.05 * 1.5**head.polls, 1.0)
                    head.polls += 1
            else:
                op = self._retry.call(
                    lambda: self._wait_op(head.operation_id, self._long_poll_s), what="WaitOperation"
                )
        except TogetherTrainError as err:
            if err.code == "UNIMPLEMENTED" and not use_get:
                with self._lock:
                    g.use_get = True
            else:
                _safe_set_exception(head.inner, err)
        except Exception as exc:
            _safe_set_exception(head.inner, InternalError(f"polling failed: {exc!r}", operation_id=head.operation_id))
        else:
            if op.status in TERMINAL_STATUSES:
                resolve_operation(op, head.inner, head.convert)
        if delay:
            time.sleep(delay)
        self._schedule(group)

    def close(self) -> None:
        """Fail every pending future with `ClientClosedError` and stop polling."""
        with self._lock:
            self._closed = True
            groups, self._groups = self._groups, {}
        for g in groups.values():
            for t in g.pending.values():
                _safe_set_exception(t.inner, _closed_error(t.operation_id))


def _closed_error(operation_id: str) -> ClientClosedError:
    return ClientClosedError(
        f"the client was closed before operation {operation_id} finished; it may still run on the server",
        operation_id=operation_id,
    )


def resolve_operation(
    op: session_pb2.Operation, inner: cf.Future, convert: Callable[[session_pb2.Operation], Any]
) -> None:
    """Complete `inner` from a terminal Operation: converted result on SUCCEEDED,
    the typed error from ``Operation.error`` on FAILED / CANCELLED."""
    if op.status == session_pb2.SUCCEEDED:
        try:
            value = convert(op)
        except Exception as exc:
            _safe_set_exception(
                inner, InternalError(f"could not decode the result of {op.kind}: {exc!r}", operation_id=op.operation_id)
            )
            return
        _safe_set_result(inner, value)
    elif op.status == session_pb2.CANCELLED:
        err = from_error_detail(op.error, operation_id=op.operation_id, default_code="CANCELLED")
        if not isinstance(err, OperationCancelledError):
            err = OperationCancelledError(err.message, operation_id=op.operation_id)
        _safe_set_exception(inner, err)
    else:
        if op.HasField("error"):
            err = from_error_detail(op.error, operation_id=op.operation_id, default_code="INTERNAL")
        else:
            err = InternalError(f"operation {op.operation_id} failed without an error detail", operation_id=op.operation_id)
        _safe_set_exception(inner, err)
