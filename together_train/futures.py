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
import threading
from typing import Any, Callable, Generator, Generic, TypeVar

import grpc

from together_train.errors import OperationCancelledError

__all__ = ["CallCanceller", "OperationFuture"]

T = TypeVar("T")
logger = logging.getLogger("together_train")


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
        False. A client-side call (``sample``, ``compute_logprobs``) is cancelled
        before it is sent or while it runs: its RPC is cancelled, and the resource
        cancels the replica call serving it (a sample's streams leave the replica's
        batch at its next decode step); False once it finished otherwise. Calling it
        again on a cancelled future returns True and sends nothing.
        """
        if self._inner.cancelled():
            return True
        if self._inner.done():  # a running call cancelled earlier ended with OperationCancelledError: still True
            return self.cancelled()
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
            except BaseException as exc:
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


class CallCanceller:
    """The canceller of a client-side call (``sample``, ``compute_logprobs``): cancels its RPC in flight.

    The call runs each attempt through `run`; `OperationFuture.cancel` calls this object, which
    cancels the RPC in flight (and any later attempt), so the call fails with
    `OperationCancelledError` at once. gRPC's cancel is local: the server sees the call end.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: set[grpc.Future] = set()
        self._cancelled = False

    def run(self, call: grpc.Future, what: str) -> Any:
        """``call.result()``; `OperationCancelledError` naming `what` when cancelled (grpc.RpcError otherwise)."""
        with self._lock:
            self._calls.add(call)
            cancelled = self._cancelled
        if cancelled:
            call.cancel()
        try:
            return call.result()
        except grpc.FutureCancelledError:
            raise OperationCancelledError(f"{what} was cancelled") from None
        except grpc.RpcError as err:
            if self._cancelled and err.code() == grpc.StatusCode.CANCELLED:
                raise OperationCancelledError(f"{what} was cancelled") from None
            raise
        finally:
            with self._lock:
                self._calls.discard(call)

    def __call__(self, fut: OperationFuture) -> bool:
        if fut._inner.cancel():  # not started yet
            return True
        with self._lock:
            self._cancelled = True
            calls = list(self._calls)
        if not calls:  # between attempts, or waiting for a weights_sync: no RPC will be sent
            return not fut._inner.done() or fut.cancelled()
        for call in calls:
            call.cancel()
        try:  # the worker returns as soon as its RPC is cancelled
            fut._inner.exception(timeout=30)
        except (cf.TimeoutError, cf.CancelledError):
            pass
        return fut.cancelled()
