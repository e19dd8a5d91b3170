"""`UsageStore`: the ``usage`` table of the resource's registry file (``storage/registry.sqlite3``).

One row per session: its owner tag (a sha256 tag of the API key, never the key) and running sums of
every metered quantity (`FIELDS`). Sums only grow: `add` upserts deltas in one transaction. Storage
bytes of checkpoints are not stored here: they are read from the registry's ``checkpoints`` table, so
a deleted checkpoint stops counting.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Mapping

# Metered quantities: tokens and steps are integers, seconds floats.
INT_FIELDS = ("prefill_tokens", "prefix_cache_tokens", "sampled_tokens", "trained_tokens", "forward_tokens",
              "optimizer_steps")
FLOAT_FIELDS = ("trainer_seconds", "sampler_seconds")
FIELDS = INT_FIELDS + FLOAT_FIELDS

_SCHEMA = "CREATE TABLE IF NOT EXISTS usage (session_id TEXT PRIMARY KEY, owner TEXT NOT NULL DEFAULT '', " + ", ".join(
    f"{f} {'INTEGER' if f in INT_FIELDS else 'REAL'} NOT NULL DEFAULT 0" for f in FIELDS) + ")"
_UPSERT = (f"INSERT INTO usage (session_id, owner, {', '.join(FIELDS)}) VALUES (?, ?, {', '.join('?' for _ in FIELDS)}) "
           f"ON CONFLICT(session_id) DO UPDATE SET " + ", ".join(f"{f} = {f} + excluded.{f}" for f in FIELDS))


class UsageStore:
    """The ``usage`` table (its own connection to the registry file; thread-safe under a lock).

    Args:
        path: the registry file (`Registry.path`).
    """

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(_SCHEMA)

    def add(self, deltas: Mapping[str, tuple[str, Mapping[str, float]]]) -> None:
        """Add ``{session_id: (owner tag, {field: delta})}`` in one transaction (all or nothing).

        Raises:
            sqlite3.Error: the write failed (nothing was added).
        """
        rows = [(sid, owner, *(d.get(f, 0) for f in FIELDS)) for sid, (owner, d) in deltas.items()]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(_UPSERT, rows)
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def rows(self) -> dict[str, tuple[str, dict[str, float]]]:
        """Every session's ``(owner tag, {field: sum})``."""
        with self._lock:
            cur = self._db.execute(f"SELECT session_id, owner, {', '.join(FIELDS)} FROM usage")
            return {r[0]: (r[1], dict(zip(FIELDS, r[2:]))) for r in cur.fetchall()}

    def checkpoint_bytes(self) -> dict[str, tuple[str, int]]:
        """Every session's ``(owner tag, bytes of its registered checkpoints)`` (the registry's table)."""
        with self._lock:
            try:
                cur = self._db.execute("SELECT session_id, owner, SUM(size_bytes) FROM checkpoints "
                                       "GROUP BY session_id, owner")
            except sqlite3.OperationalError:  # no checkpoints table yet
                return {}
            return {r[0]: (r[1], int(r[2] or 0)) for r in cur.fetchall()}

    def close(self) -> None:
        with self._lock:
            self._db.close()
