"""The model registry: sessions and checkpoints in an SQLite file under the storage directory (docs/design.md §8).

``<storage>/registry.sqlite3`` (standard library `sqlite3`, WAL journal,
every change one transaction) records

- every checkpoint: URI, session, kind (``state`` | ``weights``), variant
  (``adapter`` | ``merged``), base model, step, size, sha256 of its
  manifest, created time, display name, user metadata, owner tag;
- every session: LoRA config, status, step, created / stopped times, base
  model, owner tag (never the API key itself).

The checkpoint files stay the truth about content; the registry is the index
that lists them. They never disagree silently: a checkpoint's row is written
only after its directory was renamed into place (so a half-written checkpoint
never has a row), `reconcile` compares both at startup and reports a
directory without a row or a row without its files (logged, returned, and
never listed), and a listing skips (and reports) a row whose manifest is gone.
A storage directory of an earlier release (no registry file) is imported on
first start: every complete checkpoint directory gets its row.

Listings are newest first with an opaque cursor (``created_at`` and URI of the
last row), filtered by owner, session, kind, variant and base model.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from together_train_server.service.checkpoints.store import Checkpoint, CheckpointStore

log = logging.getLogger(__name__)
SCHEMA_VERSION = 2  # 2: checkpoints.expires_at and .pinned (lifecycle.py); added to a version-1 file at open
FILENAME = "registry.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    uri TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('state', 'weights')),
    variant TEXT NOT NULL CHECK (variant IN ('adapter', 'merged')),
    name TEXT NOT NULL,
    base_model TEXT NOT NULL DEFAULT '',
    step INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    manifest_sha256 TEXT NOT NULL,
    created_at REAL NOT NULL,
    display_name TEXT NOT NULL DEFAULT '',
    metadata TEXT NOT NULL DEFAULT '{}',
    owner TEXT NOT NULL DEFAULT '',
    expires_at REAL,
    pinned INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS checkpoints_by_time ON checkpoints (owner, created_at DESC, uri DESC);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL DEFAULT '',
    base_model TEXT NOT NULL DEFAULT '',
    lora TEXT NOT NULL DEFAULT '{}',
    status TEXT NOT NULL,
    step INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    stopped_at REAL,
    display_name TEXT NOT NULL DEFAULT '',
    metadata TEXT NOT NULL DEFAULT '{}',
    server_pid INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sessions_by_time ON sessions (owner, created_at DESC, session_id DESC);
"""


@dataclass(frozen=True)
class CheckpointRow:
    """One registered checkpoint (what listings return)."""

    uri: str
    session_id: str
    kind: str
    variant: str
    name: str
    base_model: str
    step: int
    size_bytes: int
    manifest_sha256: str
    created_at: float
    display_name: str
    metadata: dict[str, Any]
    owner: str
    expires_at: float | None = None  # Unix seconds; None: never expires
    pinned: bool = False             # never removed by TTL or keep-last


@dataclass(frozen=True)
class SessionRow:
    """One registered session."""

    session_id: str
    owner: str
    base_model: str
    lora: dict[str, Any]
    status: str
    step: int
    created_at: float
    stopped_at: float | None
    display_name: str
    metadata: dict[str, Any]
    server_pid: int = 0


@dataclass
class Reconciliation:
    """What `Registry.reconcile` found.

    Attributes:
        imported: URIs of checkpoint directories given a row (first start only).
        unregistered: URIs of complete checkpoint directories without a row (reported, not listed).
        missing_files: URIs of rows whose directory or manifest is gone (reported, not listed).
    """

    imported: list[str] = field(default_factory=list)
    unregistered: list[str] = field(default_factory=list)
    missing_files: list[str] = field(default_factory=list)


def _cursor(created_at: float, key: str) -> str:
    return f"{created_at!r}|{key}"


def _parse_cursor(cursor: str) -> tuple[float, str]:
    from together_train_server.service.errors import invalid

    try:
        t, key = cursor.split("|", 1)
        return float(t), key
    except ValueError:
        raise invalid(f"malformed cursor {cursor!r} (pass back next_cursor of the previous page)", key="cursor") from None


class Registry:
    """The SQLite registry of one storage directory (thread-safe: one connection under a lock).

    Args:
        storage: the storage directory (the file is ``storage/registry.sqlite3``).

    Attributes:
        created: True when this open created the file (the storage is imported by `reconcile`).
    """

    def __init__(self, storage: Path) -> None:
        self.path = Path(storage) / FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.created = not self.path.exists()
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a committed row survives a power cut, like the fsynced files
            self._db.executescript(_SCHEMA)
            self._migrate()

    def _migrate(self) -> None:
        """Add the columns a file written by an earlier release lacks (each one ALTER TABLE; rows keep their
        values, new columns their defaults), then record SCHEMA_VERSION. Caller holds the lock."""
        added = (("sessions", "server_pid", "INTEGER NOT NULL DEFAULT 0"),
                 ("checkpoints", "expires_at", "REAL"),
                 ("checkpoints", "pinned", "INTEGER NOT NULL DEFAULT 0"))
        for table, col, decl in added:
            if col not in {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {col} {decl}")
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self, sql: str, args: Iterable[Any] = ()) -> None:
        """Run `sql` in one transaction; a failure rolls it back and raises the statement's own error.

        SQLite ends the transaction itself on some errors (SQLITE_FULL: "database or disk is full",
        SQLITE_IOERR, ...), after which ROLLBACK fails with "no transaction is active": that second
        error must not replace the first, which says what happened (a full disk is then refused
        RESOURCE_EXHAUSTED by the checkpoint store, not an internal error).
        """
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(sql, tuple(args))
                self._db.execute("COMMIT")
            except BaseException as err:
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error as rollback_err:
                        log.warning("registry: rollback after %r failed: %s", err, rollback_err)
                raise

    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # ----- checkpoints -----------------------------------------------------------------------
    def record_checkpoint(self, ckpt: Checkpoint, *, base_model: str = "", manifest_sha256: str = "",
                          display_name: str = "", metadata: dict[str, Any] | None = None,
                          expires_at: float | None = None, pinned: bool = False) -> None:
        """Register a complete checkpoint (a `checkpoints.Checkpoint`, already renamed into place).

        `metadata`: the user metadata (str -> str, checked by lifecycle.validate_user_metadata);
        `expires_at`: Unix seconds after which the TTL sweep deletes it (None: never); `pinned`: never removed.
        """
        self._tx(
            "INSERT OR REPLACE INTO checkpoints (uri, session_id, kind, variant, name, base_model, step, size_bytes, "
            "manifest_sha256, created_at, display_name, metadata, owner, expires_at, pinned) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (ckpt.uri, ckpt.session_id, ckpt.kind, "merged" if ckpt.merged else "adapter", ckpt.name, base_model,
             int(ckpt.step), int(ckpt.size_bytes), manifest_sha256, float(ckpt.created_at), display_name,
             json.dumps(metadata or {}), ckpt.owner, expires_at, int(bool(pinned))),
        )

    def update_checkpoint(self, uri: str, *, metadata: dict[str, str] | None = None,
                          expires_at: float | None | bool = False, pinned: bool | None = None) -> None:
        """Change a checkpoint's user metadata (replaced as a whole), expiry time (None: never; False: as is)
        or pin (None: as is), in one transaction."""
        sets: list[str] = []
        args: list[Any] = []
        if metadata is not None:
            sets.append("metadata = ?")
            args.append(json.dumps(metadata))
        if expires_at is not False:
            sets.append("expires_at = ?")
            args.append(expires_at)
        if pinned is not None:
            sets.append("pinned = ?")
            args.append(int(bool(pinned)))
        if sets:
            self._tx(f"UPDATE checkpoints SET {', '.join(sets)} WHERE uri = ?", [*args, uri])

    def expired_checkpoints(self, now: float) -> list[CheckpointRow]:
        """Unpinned checkpoints (any owner) whose expiry time is at or before `now`, oldest expiry first."""
        rows = self._query("SELECT * FROM checkpoints WHERE expires_at IS NOT NULL AND expires_at <= ? AND pinned = 0 "
                           "ORDER BY expires_at, uri", (now,))
        return [self._ckpt_row(r) for r in rows]

    def storage_bytes(self, owner: str | None = None) -> dict[str, int]:
        """Registered checkpoint bytes per owner tag (one owner's only when given; {} when it has none)."""
        sql, args = "SELECT owner, SUM(size_bytes) FROM checkpoints", []
        if owner is not None:
            sql, args = sql + " WHERE owner = ?", [owner]
        return {r[0]: int(r[1]) for r in self._query(sql + " GROUP BY owner", args) if r[1] is not None}

    def remove_checkpoint(self, uri: str) -> None:
        self._tx("DELETE FROM checkpoints WHERE uri = ?", (uri,))

    def uris(self, session_id: str = "") -> list[str]:
        """Every registered checkpoint URI (of one session when given), any owner."""
        if session_id:
            return [r["uri"] for r in self._query("SELECT uri FROM checkpoints WHERE session_id = ?", (session_id,))]
        return [r["uri"] for r in self._query("SELECT uri FROM checkpoints")]

    def close_stale_sessions(self, status: str = "ENDED_BY_RESTART") -> int:
        """At startup: sessions still ACTIVE whose server process is gone died with it; mark them.

        Sessions of another live resource sharing this storage directory stay ACTIVE.
        Returns how many were marked.
        """
        from together_train_server.service.checkpoints.store import _pid_alive

        rows = self._query("SELECT session_id, server_pid FROM sessions WHERE status = 'ACTIVE'")
        dead = [r["session_id"] for r in rows
                if r["server_pid"] != os.getpid() and not (r["server_pid"] > 0 and _pid_alive(r["server_pid"]))]
        for sid in dead:
            self._tx("UPDATE sessions SET status = ?, stopped_at = ? WHERE session_id = ? AND status = 'ACTIVE'",
                     (status, time.time(), sid))
        return len(dead)

    def checkpoint(self, uri: str) -> CheckpointRow | None:
        rows = self._query("SELECT * FROM checkpoints WHERE uri = ?", (uri,))
        return self._ckpt_row(rows[0]) if rows else None

    @staticmethod
    def _ckpt_row(r: sqlite3.Row) -> CheckpointRow:
        d = dict(r)
        d["metadata"] = json.loads(d["metadata"] or "{}")
        d["pinned"] = bool(d["pinned"])
        return CheckpointRow(**d)

    def list_checkpoints(self, owner: str | None, *, session_id: str = "", kind: str = "", variant: str = "",
                         base_model: str = "", limit: int = 0, cursor: str = "", offset: int = 0,
                         metadata: dict[str, str] | None = None) -> tuple[list[CheckpointRow], str]:
        """Checkpoints of `owner` (an owner tag; None: every owner's), newest first, filtered; returns
        (rows, next cursor or "").

        Args:
            session_id, kind, variant, base_model: "" = any.
            metadata: user metadata pairs that must all match exactly (None / {} = any).
            limit: rows per page (0 = all).
            cursor: ``next_cursor`` of the previous page ("" = from the newest).
            offset: rows skipped first.

        Raises:
            ServiceError: INVALID_ARGUMENT for a malformed cursor, kind or variant (naming it).
        """
        from together_train_server.service.errors import invalid

        if kind and kind not in ("state", "weights"):
            raise invalid(f"kind must be 'state' or 'weights', got {kind!r}", key="kind")
        if variant and variant not in ("adapter", "merged"):
            raise invalid(f"variant must be 'adapter' or 'merged', got {variant!r}", key="variant")
        sql, args = "SELECT * FROM checkpoints WHERE 1", []
        if owner is not None:
            sql, args = sql + " AND owner = ?", [owner]
        for col, v in (("session_id", session_id), ("kind", kind), ("variant", variant), ("base_model", base_model)):
            if v:
                sql += f" AND {col} = ?"
                args.append(v)
        for k, v in sorted((metadata or {}).items()):  # exact match on each pair (json_each: any key spelling)
            sql += " AND EXISTS (SELECT 1 FROM json_each(checkpoints.metadata) AS m WHERE m.key = ? AND m.value = ?)"
            args += [k, v]
        return self._page(sql, args, "uri", self._ckpt_row, limit, cursor, offset)

    # ----- sessions --------------------------------------------------------------------------
    def record_session(self, session_id: str, *, owner: str, base_model: str, lora: dict[str, Any], status: str,
                       step: int, created_at: float, display_name: str = "",
                       metadata: dict[str, Any] | None = None) -> None:
        """Register a new session (owner: its owner tag)."""
        self._tx("INSERT OR REPLACE INTO sessions VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                 (session_id, owner, base_model, json.dumps(lora), status, int(step), float(created_at), None,
                  display_name, json.dumps(metadata or {}), os.getpid()))

    def update_session(self, session_id: str, *, status: str | None = None, step: int | None = None,
                       stopped: bool = False, display_name: str | None = None,
                       metadata: dict[str, Any] | None = None) -> None:
        """Record a session's new status / step (``stopped``: set its stopped time to now), display
        name or user metadata (replaced as a whole); None leaves a field as it is. One transaction."""
        sets: list[str] = []
        args: list[Any] = []
        if display_name is not None:
            sets.append("display_name = ?")
            args.append(display_name)
        if metadata is not None:
            sets.append("metadata = ?")
            args.append(json.dumps(metadata))
        if status is not None:
            sets.append("status = ?")
            args.append(status)
        if step is not None:
            sets.append("step = ?")
            args.append(int(step))
        if stopped:
            sets.append("stopped_at = ?")
            args.append(time.time())
        if sets:
            self._tx(f"UPDATE sessions SET {', '.join(sets)} WHERE session_id = ?", [*args, session_id])

    @staticmethod
    def _session_row(r: sqlite3.Row) -> SessionRow:
        d = dict(r)
        d["lora"], d["metadata"] = json.loads(d["lora"]), json.loads(d["metadata"])
        return SessionRow(**d)

    def session(self, session_id: str) -> SessionRow | None:
        """A session's row (any owner), None when unknown."""
        rows = self._query("SELECT * FROM sessions WHERE session_id = ?", (session_id,))
        return self._session_row(rows[0]) if rows else None

    def list_sessions(self, owner: str, *, status: str | Iterable[str] = "", limit: int = 0, cursor: str = "",
                      offset: int = 0) -> tuple[list[SessionRow], str]:
        """Sessions of `owner` (tag), newest first; returns (rows, next cursor or "").

        Args:
            status: one status or several ("" / empty = any).
            limit, cursor, offset: see `_page`.
        """
        sql, args = "SELECT * FROM sessions WHERE owner = ?", [owner]
        statuses = [status] if isinstance(status, str) else list(status)
        statuses = [x for x in statuses if x]
        if statuses:
            sql += f" AND status IN ({','.join('?' * len(statuses))})"
            args += statuses
        return self._page(sql, args, "session_id", self._session_row, limit, cursor, offset)

    def count(self, table: str, owner: str) -> int:
        """Rows of `owner` (tag) in ``sessions`` or ``checkpoints``."""
        if table not in ("sessions", "checkpoints"):
            raise ValueError(f"no table {table!r}")
        return int(self._query(f"SELECT COUNT(*) FROM {table} WHERE owner = ?", (owner,))[0][0])

    def cursor_after(self, table: str, key: str) -> str:
        """The cursor that resumes a listing after the row `key` (a session id or checkpoint URI).

        APIs whose cursor is the last id of the previous page (Together's ``after``) page with this.

        Raises:
            ServiceError: INVALID_ARGUMENT (key "after") when no such row is registered.
        """
        from together_train_server.service.errors import invalid

        col = {"sessions": "session_id", "checkpoints": "uri"}[table]
        rows = self._query(f"SELECT created_at FROM {table} WHERE {col} = ?", (key,))
        if not rows:
            raise invalid(f"after: {key!r} is not a listed {table[:-1]} (pass the last id of the previous page)",
                          key="after")
        return _cursor(float(rows[0][0]), key)

    @staticmethod
    def cursor_key(cursor: str) -> str:
        """The id (session id or checkpoint URI) of the row a cursor resumes after."""
        return _parse_cursor(cursor)[1]

    def _page(self, sql: str, args: list[Any], key: str, to_row: Callable[[sqlite3.Row], Any], limit: int, cursor: str,
              offset: int = 0) -> tuple[list, str]:
        """Newest-first keyset page of `sql` (a filtered SELECT): ``(created_at, key)`` orders and resumes it.

        Fetches ``limit + 1`` rows to know whether another page follows; returns
        (rows, next cursor or ""). ``limit`` 0 = every row. ``offset`` skips that
        many rows first (APIs that page by offset, as Tinker's).
        """
        if cursor:
            t, k = _parse_cursor(cursor)
            sql += f" AND (created_at < ? OR (created_at = ? AND {key} < ?))"
            args = [*args, t, t, k]
        sql += f" ORDER BY created_at DESC, {key} DESC"
        if limit > 0 or offset > 0:
            sql += " LIMIT ? OFFSET ?"
            args = [*args, limit + 1 if limit > 0 else -1, max(0, int(offset))]
        rows = [to_row(r) for r in self._query(sql, args)]
        more = limit > 0 and len(rows) > limit
        rows = rows[:limit] if limit > 0 else rows
        return rows, (_cursor(rows[-1].created_at, getattr(rows[-1], key)) if more else "")

    # ----- consistency -----------------------------------------------------------------------
    def reconcile(self, store: CheckpointStore, base_model_of: Callable[[Checkpoint], str] | None = None) -> Reconciliation:
        """Compare rows with the checkpoint directories of `store` (a `CheckpointStore`).

        On the first start (`created`), every complete directory is imported
        (a storage directory of an earlier release); later, a directory
        without a row and a row without its files are reported (logged at
        WARNING and returned) and never listed.

        Args:
            base_model_of: ``(Checkpoint) -> str`` for imported rows (default "").
        """
        from together_train_server.service.checkpoints.store import _sha256

        out = Reconciliation()
        on_disk = {c.uri: c for c in store.scan()}
        rows = {r["uri"] for r in self._query("SELECT uri FROM checkpoints")}
        for uri, c in sorted(on_disk.items()):
            if uri in rows:
                continue
            if self.created or self._query("SELECT value FROM meta WHERE key = 'imported'") == []:
                self.record_checkpoint(c, base_model=base_model_of(c) if base_model_of else "",
                                       manifest_sha256=_sha256(c.path / "manifest.json"))
                out.imported.append(uri)
            else:
                out.unregistered.append(uri)
        out.missing_files = sorted(rows - set(on_disk))
        self._tx("INSERT OR REPLACE INTO meta VALUES ('imported', ?)", (str(time.time()),))
        if out.imported:
            log.info("registry %s: imported %d checkpoint(s) of an existing storage directory", self.path,
                     len(out.imported))
        for uri in out.unregistered:
            log.warning("registry %s: checkpoint directory %s has no registry row (written by a process that "
                        "stopped before registering it?); it is not listed", self.path, uri)
        for uri in out.missing_files:
            log.warning("registry %s: checkpoint %s is registered but its files are gone; it is not listed",
                        self.path, uri)
        return out


def base_model_of(ckpt: Checkpoint) -> str:
    """The base model id of an imported checkpoint: the basename of its adapter's ``base_model_name_or_path``
    (a merged model's ``config.json`` ``_name_or_path``), "" when neither says."""
    for name, key in (("adapter_config.json", "base_model_name_or_path"), ("config.json", "_name_or_path")):
        f = Path(ckpt.path) / name
        if f.is_file():
            try:
                v = json.loads(f.read_text()).get(key) or ""
            except ValueError:
                continue
            if v:
                return Path(v).name
    return ""
