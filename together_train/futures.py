"""`OperationFuture`: the handle every SDK call that does work returns at once.

Two kinds of backing:

- a **server operation** (``forward_backward``, ``optim_step``, ``weights_sync``,
  checkpoints, ...): the server queued it and returned an operation id. A
  shared `OperationPoller` (a small pool of daemon threads per client) follows
  it with the ``WaitOperation`` long poll. Because a session's operations run
  strictly in order, the poller long-polls only the *oldest* unfinished
  operation of each session; when it ends, the next one is asked (usually
  already finished, so one cheap call). So a session with 100 operations in
  flight costs one waiting RPC, not 100 busy threads.
- a **client-side call** (``sample``, ``compute_logprobs``): a blocking RPC run
  on the client's worker threads.

Either way the future holds the typed result (`ForwardResult`,
`OptimStepResult`, ...) or the typed exception (`TogetherTrainError`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Generic, TypeVar

from together_train._proto import session_pb2
from together_train.errors import (
    ClientClosedError,
    InternalError,
    OperationCancelledError,
    TogetherTrainError,
    from_error_detail,
)
from together_train.retry import RetryPolicy

__all__ = ["OperationFuture", "OperationPoller", "DaemonExecutor", "TERMINAL_STATUSES", "status_name"]

T = TypeVar("T")
logger = logging.getLogger("together_train")

TERMINAL_STATUSES = frozenset({session_pb2.SUCCEEDED, session_pb2.FAILED, session_pb2.CANCELLED})


def status_name(status: int) -> str:
    """``"QUEUED"``, ``"RUNNING"``, ``"SUCCEEDED"``, ``"FAILED"``, ``"CANCELLED"`` (or UNSPECIFIED)."""
    return session_pb2.OperationStatus.Name(status) if status in session_pb2.OperationStatus.values() else "UNSPECIFIED"


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


class OperationFuture(Generic[T]):
    """Result of an SDK operation that may not have finished yet.

    Obtained from `Session` methods; not constructed by users. Thread-safe.

    Attributes:
        operation_id: server operation id, or None for a client-side call
            (``sample``, ``compute_logprobs``).
        kind: ``"forward_backward"``, ``"optim_step"``, ``"sample"``, ...
        seq_id: the operation's position in its session's order, or None.

    Use ``fut.result()`` to block, ``await fut`` in asyncio, or
    ``add_done_callback``. Submitting several operations back to back and
    waiting afterwards pipelines them on the server.
    """

    def __init__(
        self,
        inner: cf.Future,
        *,
        kind: str = "",
        operation_id: str | None = None,
        seq_id: int | None = None,
        canceller: Callable[["OperationFuture[T]"], bool] | None = None,
    ) -> None:
        self._inner = inner
        self.kind = kind
        self.operation_id = operation_id
        self.seq_id = seq_id
        self._canceller = canceller

    # ------------------------------------------------------------------ state
    def done(self) -> bool:
        """True when the operation finished (succeeded, failed or was cancelled)."""
        return self._inner.done()

    def cancelled(self) -> bool:
        """True when the operation was cancelled (by `cancel`, the session stopping or the server)."""
        if self._inner.cancelled():
            return True
        if not self._inner.done():
            return False
        return isinstance(self._inner.exception(), OperationCancelledError)

    def _cancel_error(self) -> OperationCancelledError:
        what = f"operation {self.operation_id}" if self.operation_id else f"{self.kind or 'call'}"
        return OperationCancelledError(f"{what} was cancelled", operation_id=self.operation_id)

    # ------------------------------------------------------------------ results
    def result(self, timeout: float | None = None) -> T:
        """Block until done and return the typed result.

        Args:
            timeout: seconds to wait; None = forever.

        Raises:
            TimeoutError: still not done after `timeout` (the operation keeps running).
            OperationCancelledError: the operation was cancelled.
            TogetherTrainError: (a subclass per status code) the operation failed.
        """
        try:
            return self._inner.result(timeout)
        except cf.CancelledError as exc:
            if isinstance(exc, OperationCancelledError):
                raise
            raise self._cancel_error() from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until done; the exception the operation failed with, or None.

        A cancelled operation returns its `OperationCancelledError`.

        Raises:
            TimeoutError: still not done after `timeout`.
        """
        try:
            return self._inner.exception(timeout)
        except cf.CancelledError:
            return self._cancel_error()

    def add_done_callback(self, fn: Callable[["OperationFuture[T]"], Any]) -> None:
        """Call ``fn(self)`` once done (at once if already done), on the thread
        that completes it. Exceptions raised by `fn` are logged and ignored."""

        def call(_: cf.Future) -> None:
            try:
                fn(self)
            except Exception:
                logger.exception("exception in OperationFuture done callback")

        self._inner.add_done_callback(call)

    def cancel(self) -> bool:
        """Try to cancel; True when the operation is (now) cancelled.

        A server operation can only be cancelled while QUEUED (this sends
        ``CancelOperation``); one that started runs to the end and this returns
        False. A client-side call can only be cancelled before it is sent.
        """
        if self._inner.cancelled():
            return True
        if self._inner.done():
            return False
        if self._canceller is not None:
            return self._canceller(self)
        return self._inner.cancel()

    # ------------------------------------------------------------------ asyncio
    def __await__(self) -> Generator[Any, None, T]:
        """``await fut`` returns the result or raises like `result`, without
        blocking the event loop."""
        loop = asyncio.get_running_loop()
        aio: asyncio.Future = loop.create_future()

        def transfer() -> None:
            if aio.done():
                return
            try:
                aio.set_result(self.result(0))
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting task
                aio.set_exception(exc)

        def on_done(_: cf.Future) -> None:
            try:
                loop.call_soon_threadsafe(transfer)
            except RuntimeError:  # loop closed
                pass

        self._inner.add_done_callback(on_done)
        return aio.__await__()

    async def result_async(self) -> T:
        """Coroutine form of `result` (same as ``await fut``)."""
        return await self

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled() else "done" if self.done() else "pending"
        op = f" {self.operation_id}" if self.operation_id else ""
        return f"<OperationFuture {self.kind}{op} {state}>"


# --------------------------------------------------------------------------- worker threads


class DaemonExecutor:
    """A minimal thread pool of daemon threads, started on demand.

    Daemon threads keep a forgotten client (or a long poll in flight) from
    holding up interpreter exit, which `concurrent.futures.ThreadPoolExecutor`
    would do.
    """

    def __init__(self, max_workers: int, name: str = "together-train") -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        self._max = max_workers
        self._name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> cf.Future:
        """Run ``fn(*args)`` on a worker; returns a standard Future."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("executor is shut down")
            self._q.put((fut, fn, args))
            if self._idle == 0 and len(self._threads) < self._max:
                t = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            else:
                self._idle -= 1 if self._idle > 0 else 0
        return fut

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:  # noqa: BLE001
                    fut.set_exception(exc)
                else:
                    fut.set_result(result)
            del item, fut, fn, args
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Stop accepting work; workers exit after their current task. Queued
        tasks that did not start are cancelled."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            n = len(self._threads)
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(n):
            self._q.put(None)


# --------------------------------------------------------------------------- poller


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

    def pending_count(self) -> int:
        with self._lock:
            return sum(len(g.pending) for g in self._groups.values())

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
        except Exception as exc:  # noqa: BLE001 - never let a chain die silently
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
        except Exception as exc:  # noqa: BLE001
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
