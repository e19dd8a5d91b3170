"""Client-session liveness: release what a client holds once its heartbeats stop.

An HTTP client API with client sessions (the Tinker API: a `ServiceClient` is one client
session, its training models are our sessions) heartbeats while its process lives. The tinker SDK
sends one every 10 s (``SESSION_HEARTBEAT_PERIOD_SEC`` in tinker/lib/internal_client_holder.py) and
warns after 120 s without a successful one that "the session will be terminated". A client whose
process exits without ``close()`` (a crash, SIGKILL, a script that never closes) stops
heartbeating: after `DEFAULT_TIMEOUT_S` (``serve --client-heartbeat-timeout-s``) without one, its
client session is released: its models are stopped (their checkpoints stay), so their slots count
against ``--max-sessions`` no longer. A release is final: a heartbeat arriving later is answered as
for a finished session.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

# The tinker SDK's own threshold: it warns after 120 s without a heartbeat that the session will end.
DEFAULT_TIMEOUT_S = 120.0


class HeartbeatWatch:
    """A daemon thread that releases client sessions whose last heartbeat is older than `timeout_s`.

    Args:
        sessions: returns the client sessions to watch; each has ``last_heartbeat`` (time.time()
            seconds) and ``finished`` (bool) attributes.
        release: called once per expired, unfinished client session (from the watch thread); it
            must mark it finished. An exception is logged and retried on the next round.
        timeout_s: seconds without a heartbeat before a release (> 0).
        period_s: seconds between checks; default min(timeout_s / 4, 5 s).
    """

    def __init__(self, sessions: Callable[[], Iterable[Any]], release: Callable[[Any], None], timeout_s: float,
                 period_s: float | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the client heartbeat timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.period_s = float(period_s if period_s is not None else min(self.timeout_s / 4, 5.0))
        self._sessions, self._release = sessions, release
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="client-heartbeats", daemon=True)
        self._thread.start()

    def expired(self, now: float | None = None) -> list[Any]:
        """The unfinished client sessions whose last heartbeat is more than `timeout_s` old."""
        now = time.time() if now is None else now
        return [cs for cs in list(self._sessions()) if not cs.finished and now - cs.last_heartbeat > self.timeout_s]

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            for cs in self.expired():
                try:
                    log.warning("client session %s sent no heartbeat for %.0f s: releasing its models",
                                getattr(cs, "session_id", cs), time.time() - cs.last_heartbeat)
                    self._release(cs)
                except Exception:
                    log.exception("could not release client session %s", getattr(cs, "session_id", cs))

    def close(self) -> None:
        self._stop.set()
