"""Checkpoints that look after themselves: user metadata, search, TTL, keep-last-K, pins, storage bytes.

`CheckpointLifecycle` is a part of the `Resource` (``resource.lifecycle``) over the checkpoint store
and the model registry (docs/design.md §8):

- user metadata: str -> str pairs on every checkpoint, given at save (`SaveOptions`) and replaced
  later (`update`); bounded by `MAX_METADATA_PAIRS`, `MAX_KEY_CHARS`, `MAX_VALUE_CHARS` and
  `MAX_METADATA_BYTES` (its JSON), a refusal names the key;
- `search`: exact metadata pairs, type (training / sampler / merged), base model, session, owner
  (another key's only for an admin key), newest first, a cursor, a limit of 1-200;
- TTL: an expiry time per checkpoint (``ttl_seconds`` at save or later, 1 s to 10 years); a thread
  deletes expired ones every `sweep_interval_s`, one audit log line per deletion;
- keep-last-K: after a save, the session's older checkpoints of the same kind past the newest K
  are deleted (``keep_last`` of the save call, else of the session); pinned ones never are;
- `storage_bytes(owner)`: registered checkpoint bytes of one API key (for usage metering).

Deletion goes through `CheckpointStore.delete`: the directory is renamed aside (atomic: the checkpoint
is complete or gone from its path), then its row is removed, then the files are freed. A sweep killed
between two steps leaves a row without files (never listed) or a ``.del-*`` directory (removed by the
next start), never a listed partial checkpoint.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from together_train_server.service.checkpoints.registry import CheckpointRow, Registry
from together_train_server.service.checkpoints.store import CheckpointStore, owner_tag
from together_train_server.service.errors import ServiceError, invalid

log = logging.getLogger(__name__)

MAX_METADATA_PAIRS = 64
MAX_KEY_CHARS = 128
MAX_VALUE_CHARS = 1024
MAX_METADATA_BYTES = 16 * 1024  # of the pairs' JSON
MAX_TTL_S = 10 * 365 * 86400
SEARCH_LIMIT = (1, 200)
# Search types -> (registry kind, variant); "" = any.
CHECKPOINT_TYPES = {"training": ("state", ""), "sampler": ("weights", "adapter"), "merged": ("weights", "merged")}
ALL_OWNERS = "*"


def validate_user_metadata(md: Any, key: str = "user_metadata") -> dict[str, str]:
    """User metadata as a str -> str dict within the bounds above.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the offending key (``user_metadata.<k>``) or the bound passed.
    """
    if md is None:
        return {}
    if not isinstance(md, dict):
        raise invalid(f"{key} must be an object of string -> string, got {type(md).__name__}", key=key)
    if len(md) > MAX_METADATA_PAIRS:
        raise invalid(f"{key} has {len(md)} pairs; at most {MAX_METADATA_PAIRS}", key=key)
    for k, v in md.items():
        if not isinstance(k, str) or not 1 <= len(k) <= MAX_KEY_CHARS:
            raise invalid(f"{key} key {k!r} must be a string of 1-{MAX_KEY_CHARS} characters", key=f"{key}.{k}")
        if not isinstance(v, str):
            raise invalid(f"{key}[{k!r}] must be a string, got {type(v).__name__}", key=f"{key}.{k}")
        if len(v) > MAX_VALUE_CHARS:
            raise invalid(f"{key}[{k!r}] has {len(v)} characters; at most {MAX_VALUE_CHARS}", key=f"{key}.{k}")
    size = len(json.dumps(md).encode())
    if size > MAX_METADATA_BYTES:
        raise invalid(f"{key} is {size} bytes as JSON; at most {MAX_METADATA_BYTES}", key=key)
    return dict(md)


def validate_ttl(ttl_seconds: Any) -> int | None:
    """A TTL in whole seconds (1 to 10 years); None / 0 = never expires.

    Raises:
        ServiceError: INVALID_ARGUMENT (key "ttl_seconds") for a negative, fractional or too long TTL.
    """
    if ttl_seconds is None or ttl_seconds == 0:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not 1 <= ttl_seconds <= MAX_TTL_S:
        raise invalid(f"ttl_seconds must be a whole number of seconds from 1 to {MAX_TTL_S} (10 years), or 0/None "
                      f"for never; got {ttl_seconds!r}", key="ttl_seconds")
    return int(ttl_seconds)


def validate_keep_last(keep_last: Any) -> int:
    """keep_last: 0 (keep all / the session's) or a positive count. Raises INVALID_ARGUMENT (key "keep_last")."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
        raise invalid(f"keep_last must be >= 0 (0 = keep every checkpoint), got {keep_last!r}", key="keep_last")
    return keep_last


@dataclass(frozen=True)
class SaveOptions:
    """What a save_state / save_weights call may add to its checkpoint (all optional).

    Attributes:
        user_metadata: str -> str pairs (see `validate_user_metadata`).
        ttl_seconds: seconds from the save until the checkpoint is deleted (None: never).
        pinned: never removed by TTL or keep-last.
        keep_last: after this save keep only the newest K of the session's checkpoints of this kind
            (0: the session's keep_last, if any).
    """

    user_metadata: dict[str, str] = field(default_factory=dict)
    ttl_seconds: int | None = None
    pinned: bool = False
    keep_last: int = 0

    @classmethod
    def checked(cls, user_metadata: Any = None, ttl_seconds: Any = None, pinned: bool = False,
                keep_last: Any = 0) -> "SaveOptions":
        """Validated options. Raises ServiceError INVALID_ARGUMENT naming the bad field."""
        return cls(validate_user_metadata(user_metadata), validate_ttl(ttl_seconds), bool(pinned),
                   validate_keep_last(0 if keep_last is None else keep_last))

    def record(self, now: float) -> dict[str, Any]:
        """The registry fields of a checkpoint saved at `now` (`CheckpointStore.writer(record=...)`)."""
        return {"metadata": self.user_metadata, "pinned": self.pinned,
                "expires_at": now + self.ttl_seconds if self.ttl_seconds else None}


class CheckpointLifecycle:
    """Metadata, search, TTL sweeps and keep-last-K over one store and registry (thread-safe).

    Args:
        store, registry: the resource's checkpoint store and model registry.
        on_deleted: called with each deleted URI (telemetry).
        admin_keys: API keys that may search and edit other keys' checkpoints.
        sweep_interval_s: seconds between TTL sweeps of `start`'s thread.
    """

    def __init__(self, store: CheckpointStore, registry: Registry, *,
                 on_deleted: Callable[[str], None] | None = None, admin_keys: frozenset[str] = frozenset(),
                 sweep_interval_s: float = 30.0) -> None:
        self.store, self.registry = store, registry
        self.on_deleted = on_deleted or (lambda uri: None)
        self.admin_tags = frozenset(owner_tag(k) for k in admin_keys)
        self.sweep_interval_s = float(sweep_interval_s)
        self._keep_last: dict[str, int] = {}
        self._lock = threading.Lock()  # one deletion pass at a time (sweep vs keep-last)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    # ----- background sweep ----------------------------------------------------------------
    def start(self) -> None:
        """Start the TTL sweeper thread (a first sweep runs at once: checkpoints that expired while down)."""
        self._thread = threading.Thread(target=self._loop, name="checkpoint-ttl", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()

    def _loop(self) -> None:
        while True:
            try:
                self.sweep()
            except Exception:  # a sweep that fails (disk, registry) is retried next round, never kills the thread
                log.exception("checkpoint TTL sweep failed; retrying in %.1f s", self.sweep_interval_s)
            if self._closed.wait(self.sweep_interval_s):
                return

    def sweep(self, now: float | None = None) -> list[str]:
        """Delete every unpinned checkpoint whose expiry time has passed; returns their URIs."""
        now = time.time() if now is None else now
        out = []
        for row in self.registry.expired_checkpoints(now):
            if self._delete(row, f"ttl: expired at {row.expires_at:.3f}"):
                out.append(row.uri)
        return out

    def _delete(self, row: CheckpointRow, reason: str) -> bool:
        """Free one checkpoint (files and row) and write its audit line; False when it was already gone."""
        with self._lock:
            try:
                self.store.delete(row.uri)
            except ServiceError:  # deleted meanwhile, or a row whose files are gone
                if self.registry.checkpoint(row.uri) is not None:
                    self.registry.remove_checkpoint(row.uri)
                return False
        log.info("audit: checkpoint deleted uri=%s owner=%s bytes=%d reason=%s", row.uri, row.owner or "-",
                 row.size_bytes, reason)
        self.on_deleted(row.uri)
        return True

    # ----- keep-last-K -----------------------------------------------------------------------
    def set_session_keep_last(self, session_id: str, keep_last: int) -> None:
        """A session's default keep_last (0: keep all). Raises INVALID_ARGUMENT for a negative count."""
        with self._lock:
            self._keep_last[session_id] = validate_keep_last(keep_last)

    def after_save(self, session_id: str, kind: str, options: SaveOptions | None) -> list[str]:
        """Apply keep-last-K after a save of `kind` in `session_id`; returns the deleted URIs (oldest first).

        K is the save's ``keep_last``, else the session's; pinned checkpoints are neither deleted nor counted.
        """
        k = (options.keep_last if options else 0) or self._keep_last.get(session_id, 0)
        if k <= 0:
            return []
        rows, _ = self.registry.list_checkpoints(None, session_id=session_id, kind=kind)  # newest first
        unpinned = [r for r in rows if not r.pinned]
        return [r.uri for r in reversed(unpinned[k:]) if self._delete(r, f"keep_last={k} of session {session_id}")]

    # ----- metadata, TTL, pins ---------------------------------------------------------------
    def _row_for(self, uri: str, owner: str) -> CheckpointRow:
        """The row of a checkpoint `owner` may change (its own; any with an admin key)."""
        self.store.parse_uri(uri)
        row = self.registry.checkpoint(uri)
        if row is None or (row.owner != owner_tag(owner) and owner_tag(owner) not in self.admin_tags):
            raise ServiceError("NOT_FOUND", f"no checkpoint {uri}", key="uri")
        return row

    def update(self, uri: str, owner: str = "", *, user_metadata: dict[str, str] | None = None,
               ttl_seconds: int | None | bool = False, pinned: bool | None = None) -> CheckpointRow:
        """Replace a checkpoint's user metadata, set its TTL (from now; None/0: never; False: as is) or pin.

        Raises:
            ServiceError: INVALID_ARGUMENT (bad URI, metadata or TTL, naming it), NOT_FOUND (unknown or another
                key's without an admin key).
        """
        md = validate_user_metadata(user_metadata) if user_metadata is not None else None
        expires: float | None | bool = False
        if ttl_seconds is not False:
            ttl = validate_ttl(ttl_seconds)
            expires = time.time() + ttl if ttl else None
        row = self._row_for(uri, owner)
        self.registry.update_checkpoint(row.uri, metadata=md, expires_at=expires, pinned=pinned)
        return self.registry.checkpoint(row.uri) or row

    def describe(self, uri: str, owner: str = "") -> CheckpointRow:
        """The registry row (metadata, expiry, pin, size) of a checkpoint `owner` may see."""
        return self._row_for(uri, owner)

    # ----- search ----------------------------------------------------------------------------
    def search(self, owner: str = "", *, user_metadata: dict[str, str] | None = None, type: str = "",
               base_model: str = "", session_id: str = "", of_owner: str = "", limit: int = 50,
               cursor: str = "") -> tuple[list[CheckpointRow], str]:
        """Checkpoints matching every filter, newest first: (rows, next cursor or "").

        Args:
            owner: the caller's API key.
            user_metadata: pairs that must all match exactly.
            type: "training" | "sampler" | "merged" ("" = any).
            base_model, session_id: "" = any.
            of_owner: "" = the caller's; another key's owner tag, or "*" for every key's (admin keys only).
            limit: 1-200 rows per page; cursor: the previous page's next cursor.

        Raises:
            ServiceError: INVALID_ARGUMENT naming a bad type, limit, metadata or cursor; PERMISSION_DENIED for
                `of_owner` without an admin key.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or not SEARCH_LIMIT[0] <= limit <= SEARCH_LIMIT[1]:
            raise invalid(f"limit must be {SEARCH_LIMIT[0]}-{SEARCH_LIMIT[1]}, got {limit!r}", key="limit")
        if type and type not in CHECKPOINT_TYPES:
            raise invalid(f"type must be one of {sorted(CHECKPOINT_TYPES)} or empty, got {type!r}", key="type")
        kind, variant = CHECKPOINT_TYPES.get(type, ("", ""))
        md = validate_user_metadata(user_metadata)
        tag: str | None = owner_tag(owner)
        if of_owner and of_owner != tag:
            if tag not in self.admin_tags:
                raise ServiceError("PERMISSION_DENIED", "searching another API key's checkpoints needs an admin key "
                                   "(serve --admin-key-file)", key="owner")
            tag = None if of_owner == ALL_OWNERS else of_owner
        rows, nxt = self.registry.list_checkpoints(tag, session_id=session_id, kind=kind, variant=variant,
                                                   base_model=base_model, limit=limit, cursor=cursor, metadata=md)
        live = [r for r in rows if (self.store.root / "sessions" / r.session_id / r.kind / r.name /
                                    "manifest.json").is_file()]  # a row whose files are gone is not listed
        return live, nxt

    def usage(self, owner: str = "") -> dict[str, int]:
        """Checkpoint bytes per owner tag: the caller's own; every key's for an admin key."""
        tag = owner_tag(owner)
        if tag in self.admin_tags:
            return self.registry.storage_bytes()
        return {tag: self.registry.storage_bytes(tag).get(tag, 0)}

    def storage_bytes(self, owner: str = "") -> int:
        """Bytes of the registered checkpoints of API key `owner` ("" = unauthenticated)."""
        return self.registry.storage_bytes(owner_tag(owner)).get(owner_tag(owner), 0)


def checkpoint_type(row: CheckpointRow) -> str:
    """A row's search type: "training", "sampler" or "merged"."""
    return "training" if row.kind == "state" else ("merged" if row.variant == "merged" else "sampler")
