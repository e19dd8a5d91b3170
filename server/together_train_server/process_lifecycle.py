"""How a server process (`serve`, `generator`, `deploy`) waits for its end: a signal, or its parent gone.

Both commands that run until stopped share these two loops, so SIGTERM/SIGINT and the parent-watch behave the
same in every process of a resource.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger("together_train_server")


def watch_parent(parent_pid: int, stop: threading.Event) -> None:
    """Set ``stop`` when the parent process is gone, so no replica outlives its resource (polls once a second)."""
    while not stop.wait(1.0):
        if os.getppid() != parent_pid:
            log.warning("parent %d is gone; shutting down", parent_pid)
            stop.set()


def wait_for_stop(stop: threading.Event) -> None:
    """Block the main thread until SIGTERM/SIGINT (or another thread) sets ``stop``."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
