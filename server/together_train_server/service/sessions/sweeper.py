"""`SessionSweeper`: the thread that pages out idle sessions and expires those idle past ``--idle-timeout``.

Every ``min(10 s, timeouts / 4)`` it asks the trainer runtime to page out sessions no operation used
for ``--page-out-idle`` (service/sessions/pager.py), and, with ``idle_timeout_s`` > 0 (off by
default), expires each session idle that long after a training checkpoint its owner can resume from
(docs/design.md §6). The checkpoint is written on the runtime's thread, in the scheduler's order.
"""

from __future__ import annotations

import logging
import threading
import time

from together_train_server.service.checkpoints.store import CheckpointStore
from together_train_server.service.core.runtime import TrainerRuntime
from together_train_server.service.core.session_record import ACTIVE, EXPIRED, SessionRecord
from together_train_server.service.sessions.manager import SessionLifecycle
from together_train_server.service.sessions.pager import PagingConfig
from together_train_server.service.sessions.table import SessionTable

log = logging.getLogger(__name__)


class SessionSweeper:
    """The expiry / page-out sweeper thread (module docstring); started by `start`, ended by `close`.

    Args:
        table: the live sessions (their idle timers and queues).
        lifecycle: stops a session that expired.
        runtime: the trainer runtime (page-outs and idle checkpoints run on its thread).
        store: where an expiring session's checkpoint is written.
        paging: ``page_idle_s``: a session idle this long is paged out (0: only for room).
    """

    def __init__(self, table: SessionTable, lifecycle: SessionLifecycle, runtime: TrainerRuntime,
                 store: CheckpointStore, paging: PagingConfig) -> None:
        self.table = table
        self.lifecycle = lifecycle
        self.runtime = runtime
        self.store = store
        self.paging = paging
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._sweep_loop, name="session-expiry", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the sweeper."""
        self._closed.set()

    def _sweep_loop(self) -> None:
        idle_timeout_s = self.table.idle_timeout_s
        period = min([10.0] + [t / 4 for t in (idle_timeout_s, self.paging.page_idle_s) if t > 0])
        while not self._closed.wait(period):
            now = time.time()
            if self.paging.page_idle_s > 0:
                self.runtime.page_out_idle(self.table.idle_for, self.paging.page_idle_s)
            if idle_timeout_s <= 0:
                continue
            for s in self.table.list_sessions_all():
                if s.state == ACTIVE and now > self.table.expires_at(s) and not s.queue.pending():
                    self._discard_idle(s)

    def _discard_idle(self, s: SessionRecord) -> None:
        """Expire a session idle past ``idle_timeout_s``: first a training checkpoint its owner can resume from.

        The checkpoint is named ``idle-<step>-<epoch seconds>``; when it cannot be written the session is
        kept (and the error logged), never discarded without one.
        """
        name = f"idle-{s.step}-{int(time.time())}"

        def checkpoint() -> bool:   # on the runtime's thread: nothing of the session runs meanwhile
            if s.queue.pending() or s.state != ACTIVE:
                return False
            step = self.runtime.step(s.session_id)
            with self.store.writer(s.session_id, "state", name, step=step, owner=s.owner) as tmp:
                self.runtime.save_state(s.session_id, tmp)
            return True

        try:
            if not self.runtime.call(checkpoint, session_id=s.session_id, tenant=s.owner, kind="idle_checkpoint"):
                return
        except Exception:
            log.exception("session %s is idle past --idle-timeout but its checkpoint %r could not be written; "
                          "it is kept", s.session_id, name)
            return
        log.info("session %s idle for %.0f s: checkpoint %s written, session expired", s.session_id,
                 time.time() - s.last_active_at, self.store.uri(s.session_id, "state", name))
        self.lifecycle.stop_session(s.session_id, s.owner, state=EXPIRED)
