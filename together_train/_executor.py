"""`DaemonExecutor`: the SDK's worker threads (client-side calls, operation polling)."""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from typing import Any, Callable, TypeVar

__all__ = ["DaemonExecutor"]

T = TypeVar("T")


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
                except BaseException as exc:
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
