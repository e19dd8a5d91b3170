"""`SessionTable`: the live sessions of this resource, their owner checks and idle timers.

A session is one LoRA adapter with its AdamW state, step counter and operation queue
(`SessionRecord`, service/core/session_record.py). The table holds the records (any state) and
answers who may see or use one; it never calls the trainer (that is `SessionLifecycle`'s, through
the runtime) and starts no thread (the sweeper, sessions/sweeper.py, reads it).
"""

from __future__ import annotations

import threading
import time

from together_train_server.service.core.session_record import ACTIVE, EXPIRED, SessionRecord
from together_train_server.service.errors import ServiceError
from together_train_server.service.tenancy.quotas import Quotas


class SessionTable:
    """The records of the resource's sessions, by id (thread-safe).

    Args:
        max_sessions: concurrent ACTIVE sessions allowed (RESOURCE_EXHAUSTED past it, `reserve`).
        quotas: per-API-key limits (max_sessions_per_key, `reserve`).
        idle_timeout_s: a session with no call for this long expires (`expires_at`; 0: never).
    """

    def __init__(self, max_sessions: int, quotas: Quotas, idle_timeout_s: float) -> None:
        self.max_sessions = max_sessions
        self.quotas = quotas
        self.idle_timeout_s = idle_timeout_s
        self._sessions: dict[str, SessionRecord] = {}
        self._lock = threading.Lock()

    def reserve(self, record: SessionRecord) -> None:
        """Add a session being created (its slot is held before the slow adapter creation).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED past ``max_sessions`` or the owner's max_sessions_per_key.
        """
        with self._lock:
            active = sum(1 for s in self._sessions.values() if s.state == ACTIVE)
            if active >= self.max_sessions:
                raise ServiceError(
                    "RESOURCE_EXHAUSTED",
                    f"this resource already has {active} active sessions (max_sessions={self.max_sessions}); "
                    "stop one first",
                    retryable=True,
                )
            self.quotas.check_session(sum(1 for s in self._sessions.values()
                                          if s.state == ACTIVE and s.owner == record.owner))
            self._sessions[record.session_id] = record

    def remove(self, session_id: str) -> None:
        """Forget a session whose creation failed."""
        with self._lock:
            self._sessions.pop(session_id, None)

    def find(self, session_id: str) -> SessionRecord | None:
        """The record of `session_id` (any owner, any state); None when unknown."""
        with self._lock:
            return self._sessions.get(session_id)

    def get_session(self, session_id: str, owner: str = "") -> SessionRecord:
        """Raises ServiceError NOT_FOUND for an unknown id (or one owned by another key)."""
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None or (s.owner and s.owner != owner):
            raise ServiceError("NOT_FOUND", f"unknown session {session_id!r}", key="session_id")
        return s

    def active_session(self, session_id: str, owner: str = "") -> SessionRecord:
        """The session if ACTIVE, touching both its idle timers (a call that uses it: discard and page-out).

        Raises:
            ServiceError: NOT_FOUND for an unknown id; FAILED_PRECONDITION for
                a stopped or expired session.
        """
        s = self._live(session_id, owner)
        s.last_op_at = s.last_active_at = time.time()
        return s

    def _live(self, session_id: str, owner: str) -> SessionRecord:
        """The session if ACTIVE, touching no timer (raises as `active_session`)."""
        s = self.get_session(session_id, owner)
        if s.state != ACTIVE:
            raise ServiceError(
                "FAILED_PRECONDITION",
                f"session {session_id} is {s.state.lower()}; create a new session"
                + (" (it expired after an idle timeout; call keep_alive to prevent that)" if s.state == EXPIRED else ""),
                key="session_id",
            )
        return s

    def list_sessions(self, owner: str = "") -> list[SessionRecord]:
        with self._lock:
            return [s for s in self._sessions.values() if not s.owner or s.owner == owner]

    def list_sessions_all(self) -> list[SessionRecord]:
        with self._lock:
            return list(self._sessions.values())

    def keep_alive(self, session_id: str, owner: str = "") -> SessionRecord:
        """A heartbeat: the session is not discarded as idle (``last_active_at``), but it is still paged out
        once no operation used it for ``--page-out-idle`` (``last_op_at`` is left as it is).

        Raises:
            ServiceError: as `active_session`.
        """
        s = self._live(session_id, owner)
        s.last_active_at = time.time()
        return s

    def expires_at(self, s: SessionRecord) -> float:
        """When the idle session is discarded (epoch seconds); 0.0 when discarding is off (``idle_timeout_s`` 0)."""
        return s.last_active_at + self.idle_timeout_s if self.idle_timeout_s > 0 else 0.0

    def is_idle(self, session_id: str) -> bool:
        """Nothing of the session is queued or running (the pager pages out only such sessions)."""
        with self._lock:
            s = self._sessions.get(session_id)
        return s is None or not s.queue.pending()

    def idle_for(self, session_id: str) -> float:
        """Seconds since an operation last used the session (heartbeats do not count: keep_alive)."""
        with self._lock:
            s = self._sessions.get(session_id)
        return 0.0 if s is None else time.time() - s.last_op_at
