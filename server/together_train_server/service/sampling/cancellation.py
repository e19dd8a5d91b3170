"""A sample's caller going away, passed down to the replica call that serves it.

The wire layer makes a `CallerGone` per request and sets it when the caller is gone:
a gRPC client cancelled its call (``context.add_callback``), an HTTP client of a
``stream=true`` response disconnected. The replica client registers its call in
flight on it (`CallerGone.register`), so setting it cancels that call; the
replica sees its RPC end and cancels the engine's request, whose rows leave the
batch at the next decode step (engines/interfaces.GeneratorEngine.submit). A
call cancelled this way raises `SampleCancelled`: the pool neither retries it
elsewhere nor marks the replica down (nothing is wrong with it).
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Callable

from together_train_server.service.errors import ServiceError

__all__ = ["CallerGone", "SampleCancelled"]

log = logging.getLogger(__name__)


class SampleCancelled(ServiceError):
    """CANCELLED (not retryable): the sample's caller went away, so its replica call was cancelled."""

    def __init__(self, message: str = "the sample was cancelled: its caller went away") -> None:
        super().__init__("CANCELLED", message)


class CallerGone:
    """Set once (thread-safe) when a request's caller is gone; runs the cancel functions registered on it.

    Registered functions run on the thread that calls `set` (a gRPC callback thread, the
    HTTP event loop): they must not block (``grpc.Future.cancel`` does not). One that
    raises is logged and the others still run.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._fns: dict[int, Callable[[], object]] = {}
        self._ids = itertools.count()

    def is_set(self) -> bool:
        """True once the caller is gone."""
        return self._set

    def set(self) -> None:
        """Mark the caller gone and run every registered function (idempotent)."""
        with self._lock:
            if self._set:
                return
            self._set = True
            fns, self._fns = list(self._fns.values()), {}
        for fn in fns:
            self._run(fn)

    def register(self, fn: Callable[[], object]) -> Callable[[], None]:
        """Run `fn` when the caller goes (at once if it is gone already); returns the function that unregisters it."""
        with self._lock:
            if not self._set:
                i = next(self._ids)
                self._fns[i] = fn
                return lambda: self._unregister(i)
        self._run(fn)
        return lambda: None

    def _unregister(self, i: int) -> None:
        with self._lock:
            self._fns.pop(i, None)

    @staticmethod
    def _run(fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:
            log.exception("cancelling a call whose caller went away failed")
