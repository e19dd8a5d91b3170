"""Background keep-alive of a `ResourceClient`'s sessions (like Tinker's heartbeat).

A resource expires a session after ``--idle-timeout`` seconds without a call
(3600 s by default). A script that spends longer than that evaluating or
computing rewards would lose its session, so while a `ResourceClient` and a
`Session` object both live, one daemon thread per client sends the
``KeepAlive`` RPC for that session every *interval* seconds:

- ``keepalive_interval_s="auto"`` (the default): a quarter of the session's
  idle timeout as the server reports it (``SessionInfo.expires_at -
  SessionInfo.last_active_at``, both on the server's clock), so three
  heartbeats can be lost before the session expires; `DEFAULT_INTERVAL_S`
  when the server reports no expiry.
- a number: that many seconds.
- ``None``: no keep-alive; sessions expire after the idle timeout as before.

What stops it: `Session.stop` / `Session.close` (that session),
`ResourceClient.close` (all, and the thread ends), the `Session` object being
garbage-collected (an unreferenced session is abandoned and expires), a
``KeepAlive`` answered NOT_FOUND or FAILED_PRECONDITION (the session is gone,
stopped or expired). A killed client process sends nothing, so its sessions
expire. Failures are logged at DEBUG on the ``together_train`` logger and
never raised; a transient one (e.g. UNAVAILABLE) is retried after
``min(interval, RETRY_AFTER_FAILURE_S)``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from together_train.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from together_train.retry import NO_RETRY

if TYPE_CHECKING:
    from together_train._client_handle import ClientHandle
    from together_train.session import Session

__all__ = ["SessionKeepAlive", "DEFAULT_INTERVAL_S", "RETRY_AFTER_FAILURE_S"]

logger = logging.getLogger("together_train")

#: Interval (seconds) under ``"auto"`` when the server reports no idle timeout.
DEFAULT_INTERVAL_S = 60.0
#: Wait (seconds, at most) before retrying a keep-alive that failed transiently.
RETRY_AFTER_FAILURE_S = 5.0
# Never heartbeat more often than this, whatever the server's idle timeout.
_MIN_INTERVAL_S = 0.05


def check_interval(keepalive_interval_s: Any) -> None:
    """Raise InvalidArgumentError (key ``keepalive_interval_s``) unless it is ``"auto"``, None or a positive
    finite number of seconds."""
    if keepalive_interval_s is None or keepalive_interval_s == "auto":
        return
    if isinstance(keepalive_interval_s, bool) or not isinstance(keepalive_interval_s, (int, float)) or not (
        0 < keepalive_interval_s < float("inf")
    ):
        raise InvalidArgumentError(
            f"keepalive_interval_s must be 'auto', None or a positive number of seconds, "
            f"got {keepalive_interval_s!r}",
            key="keepalive_interval_s",
        )


def interval_for(info: Any, configured: float | str) -> float:
    """Seconds between heartbeats of one session.

    Args:
        info: the session's latest `SessionInfo` (``expires_at`` and
            ``last_active_at`` in Unix seconds, server clock).
        configured: a number of seconds, or ``"auto"`` (a quarter of the
            reported idle timeout, else `DEFAULT_INTERVAL_S`).
    """
    if configured != "auto":
        return max(_MIN_INTERVAL_S, float(configured))
    idle = float(info.expires_at) - float(info.last_active_at)
    if not idle > 0:
        return DEFAULT_INTERVAL_S
    return max(_MIN_INTERVAL_S, idle / 4.0)


class SessionKeepAlive:
    """The heartbeat thread of one `ResourceClient` (created by the client).

    Holds the client and the sessions only weakly, so it keeps neither alive;
    the thread is a daemon, so it never keeps the process alive either. The
    thread starts with the first registered session.
    """

    def __init__(self, client: "ClientHandle", interval: float | str) -> None:
        self._client_ref = weakref.ref(client)
        self.interval = interval
        self._sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()
        self._due: "weakref.WeakKeyDictionary[Session, float]" = weakref.WeakKeyDictionary()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The heartbeat thread (None until a session was registered)."""
        return self._thread

    def register(self, session: "Session") -> None:
        """Keep `session` alive from now on (first heartbeat one interval after its last info)."""
        with self._cond:
            if self._closed:
                return
            self._sessions.add(session)
            self._due[session] = time.monotonic() + interval_for(session._info, self.interval)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="together-train-keepalive", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def unregister(self, session: "Session") -> None:
        """Stop keeping `session` alive (it was stopped)."""
        with self._cond:
            self._sessions.discard(session)
            self._due.pop(session, None)

    def sessions(self) -> list["Session"]:
        """The sessions currently kept alive."""
        with self._cond:
            return list(self._sessions)

    def close(self) -> None:
        """Tell the thread to end (at once when idle; a KeepAlive RPC in flight
        ends when the client closes its channel). Does not wait: see `join`."""
        with self._cond:
            self._closed = True
            self._sessions.clear()
            self._due.clear()
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the thread to end; True when it has (or never started)."""
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        return t is None or not t.is_alive()

    # ----------------------------------------------------------------- thread
    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = [s for s in self._sessions if self._due.get(s, now) <= now]
                if not due:
                    wake = min(self._due.values(), default=now + 3600.0)
                    self._cond.wait(max(0.0, wake - now))
                    continue
            for s in due:
                if not self._beat(s):
                    return
            del due, s

    def _beat(self, session: "Session") -> bool:
        """One KeepAlive for `session`; False when the client is gone or closed."""
        client = self._client_ref()
        if client is None or client.closed:
            return False
        if session._stopped:
            self.unregister(session)
            return True
        interval = interval_for(session._info, self.interval)
        try:
            # No retry loop and a bounded deadline: the next heartbeat is the retry.
            info = client._keep_alive_rpc(session.session_id, timeout=min(client.timeout, max(1.0, interval)), retry=NO_RETRY)
        except (NotFoundError, FailedPreconditionError) as err:
            logger.debug("keep-alive of session %s stopped: %s", session.session_id, err)
            self.unregister(session)
            return True
        except Exception as err:
            if client.closed:
                return False
            logger.debug("keep-alive of session %s failed (retrying): %s", session.session_id, err)
            with self._cond:
                if session in self._sessions:
                    self._due[session] = time.monotonic() + min(interval, RETRY_AFTER_FAILURE_S)
            return True
        with self._cond:
            if session in self._sessions and not session._stopped:
                session._info = info
                self._due[session] = time.monotonic() + interval_for(info, self.interval)
        return True
