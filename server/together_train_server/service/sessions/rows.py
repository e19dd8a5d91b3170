"""`SessionRows`: what the model registry and the replicas say about sessions, limited to what a key may see.

The registry holds a row for every session this storage ever held (this run's and earlier ones');
the replica pool's view lists adapter versions by key. Reads only: no trainer, no thread.
"""

from __future__ import annotations

from typing import Any, Iterable

from together_train_server.service.checkpoints.registry import Registry, SessionRow
from together_train_server.service.checkpoints.store import owner_tag
from together_train_server.service.errors import ServiceError
from together_train_server.service.replicas.pool import ReplicaPool
from together_train_server.service.sessions.table import SessionTable


class SessionRows:
    """Registry rows of sessions and the replicas' view of their adapters, per API key.

    Args:
        registry: the model registry (a row per session, of this run and earlier ones).
        table: the live sessions (whose adapters a key may see on the replicas).
        pool: the generator replicas.
    """

    def __init__(self, registry: Registry, table: SessionTable, pool: ReplicaPool[Any]) -> None:
        self.registry = registry
        self.table = table
        self.pool = pool

    def replica_view(self, owner: str | None) -> list[dict[str, Any]]:
        """The replica pool's `snapshot()`, with adapter versions limited to what `owner` may see.

        A replica's ``versions`` keys are adapter keys (session ids, ``ckpt:<uri>``,
        ``snap:<id>``); a key is kept when it names one of `owner`'s sessions (every
        session without API keys); `owner` None (an anonymous scrape with keys on)
        sees none. ``hidden`` counts the keys left out.
        """
        visible = {s.session_id for s in self.table.list_sessions(owner)} if owner is not None else set()
        out = []
        for r in self.pool.snapshot():
            shown = {k: v for k, v in r["versions"].items() if any(sid in k for sid in visible)}
            out.append({**r, "versions": shown, "hidden": len(r["versions"]) - len(shown)})
        return out

    def session_row(self, session_id: str, owner: str = "") -> SessionRow:
        """The model registry's row of a session this storage ever held (live, or of an earlier run).

        Raises:
            ServiceError: NOT_FOUND for an unknown session or one of another API key.
        """
        row = self.registry.session(session_id)
        if row is None or row.owner != owner_tag(owner):
            raise ServiceError("NOT_FOUND", f"unknown session {session_id!r}", key="session_id")
        return row

    def page_session_rows(self, owner: str = "", *, status: Iterable[str] = (), limit: int = 0,
                          after: str = "", offset: int = 0) -> tuple[list[SessionRow], str]:
        """`owner`'s sessions from the model registry (earlier runs' too), newest first.

        Args:
            status: registry statuses to keep (ACTIVE, STOPPED, ...; empty = any).
            limit: rows per page (0 = all).
            after: the session id the page resumes after ("" = from the newest).
            offset: rows skipped first (APIs that page by offset, as Tinker's).

        Returns:
            (rows, the next page's cursor or "" when this is the last page).

        Raises:
            ServiceError: INVALID_ARGUMENT (key "after") for an unknown `after`.
        """
        cursor = self.registry.cursor_after("sessions", after) if after else ""
        return self.registry.list_sessions(owner_tag(owner), status=list(status), limit=limit, cursor=cursor,
                                           offset=offset)

    def update_session_info(self, session_id: str, owner: str = "", *, display_name: str | None = None,
                            metadata: dict[str, Any] | None = None) -> None:
        """Set a session's display name and/or user metadata (replaced as a whole) in the model registry.

        Sessions of earlier runs can be updated too; None leaves a field as it is.

        Raises:
            ServiceError: NOT_FOUND for an unknown session or one of another API key.
        """
        self.session_row(session_id, owner)
        self.registry.update_session(session_id, display_name=display_name, metadata=metadata)

    def count_session_rows(self, owner: str = "") -> int:
        """How many sessions of `owner` the model registry holds (every run of this storage)."""
        return self.registry.count("sessions", owner_tag(owner))
