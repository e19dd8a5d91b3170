"""Checkpoint store: a storage directory of atomically written, manifested checkpoints (docs/design.md §8).

Layout: `<storage>/sessions/<session_id>/<kind>/<name>/` with `manifest.json`
(file sizes and sha256). A checkpoint is written into a hidden temporary
directory and renamed into place when complete, so a listing never shows a
partial one: a writer killed halfway leaves only a `.tmp-<name>-<pid>-*`
directory without a manifest, which listings skip and which the next store
opened on the directory removes once process <pid> is gone. URIs:
`together-train://<session_id>/<kind>/<name>`.

Ownership: the manifest records `owner` as a sha256 tag of the API key that
wrote the checkpoint ("" without authentication), so checkpoints stay
private to their key after the resource restarts and their session is gone.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from together_train_server.service.errors import ServiceError, invalid

log = logging.getLogger(__name__)
URI_SCHEME = "together-train://"
KINDS = ("weights", "state")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class Checkpoint:
    """One complete checkpoint on disk."""

    uri: str
    session_id: str
    kind: str
    name: str
    path: Path
    size_bytes: int
    step: int
    merged: bool
    created_at: float
    owner: str = ""        # owner_tag() of the writing API key
    files: dict | None = None   # relative path -> {"size", "sha256"} (manifest.json excluded)


def owner_tag(owner: str) -> str:
    """What the manifest stores for an API key: "" without one, else a sha256 tag (never the key)."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32] if owner else ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def validate_name(name: str) -> str:
    """A checkpoint name: 1-128 of [A-Za-z0-9._-], not starting with '.' or '-'.

    Raises:
        ServiceError: INVALID_ARGUMENT (key "name") for anything else, which
            rules out path traversal ("../x", "a/b", absolute paths).
    """
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise invalid(
            f"invalid checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            key="name",
        )
    return name


def _fsync_tree(root: Path) -> None:
    """Flush a directory's files to disk before it is renamed into place (best effort)."""
    for p in [*root.rglob("*"), root]:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def _disk_full(e: BaseException | None) -> bool:
    """ENOSPC / EDQUOT anywhere in `e`'s chain (safetensors reports it as a SafetensorError naming os error 28;
    the registry's SQLite as SQLITE_FULL, "database or disk is full")."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if getattr(e, "sqlite_errorcode", None) == getattr(sqlite3, "SQLITE_FULL", 13):  # the constant is 3.11+; 13 is SQLite's code
            return True
        if "No space left on device" in str(e) or "os error 28" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _storage_full(uri: str) -> ServiceError:
    """The refusal of a checkpoint write that hit a full disk (nothing of it was kept)."""
    return ServiceError("RESOURCE_EXHAUSTED", f"checkpoint {uri} not written: the resource's storage is full (no "
                        "space left on device); nothing was kept, training can go on", key="name")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class CheckpointStore:
    """Writes, lists, verifies and deletes checkpoints under one storage directory.

    Args:
        root: the storage directory.
        registry: the model registry (`registry.Registry`) indexing these checkpoints, or None. With
            one, a write registers the checkpoint after its rename (a registration failure removes the
            directory again), a delete removes the row, and listings and lookups show only registered
            checkpoints whose files are there (`Registry.reconcile` reports the others).
        base_model: the base model id recorded with each checkpoint written here.
    """

    def __init__(self, root: Path, registry: "Any | None" = None, base_model: str = "") -> None:
        self.root = Path(root)
        (self.root / "sessions").mkdir(parents=True, exist_ok=True)
        self.registry = registry
        self.base_model = base_model
        self.remove_stale_partials()

    def remove_stale_partials(self) -> int:
        """Delete temporary directories of writers whose process is gone; returns how many.

        Names are `.tmp-<name>-<pid>-<random>` (writes) and `.del-*` (deletes
        interrupted after their rename); a live pid's directory is left alone.
        """
        n = 0
        for d in (self.root / "sessions").glob("*/*/.*"):
            m = re.match(r"^\.tmp-.*-(\d+)-[^-]*$", d.name)
            stale = d.name.startswith(".del-") or (m is not None and not _pid_alive(int(m.group(1))))
            if stale and d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
                n += 1
        return n

    def uri(self, session_id: str, kind: str, name: str) -> str:
        return f"{URI_SCHEME}{session_id}/{kind}/{name}"

    def parse_uri(self, uri: str) -> tuple[str, str, str]:
        """Split a checkpoint URI into (session_id, kind, name).

        Raises:
            ServiceError: INVALID_ARGUMENT (key "uri") for a malformed URI.
        """
        if not uri.startswith(URI_SCHEME):
            raise invalid(f"checkpoint URI must start with {URI_SCHEME!r}, got {uri!r}", key="uri")
        parts = uri[len(URI_SCHEME):].split("/")
        if len(parts) != 3 or parts[1] not in KINDS:
            raise invalid(f"checkpoint URI must be {URI_SCHEME}<session>/<weights|state>/<name>, got {uri!r}", key="uri")
        session_id, kind, name = parts
        if not _NAME_RE.match(session_id):
            raise invalid(f"bad session id in checkpoint URI {uri!r}", key="uri")
        validate_name(name)
        return session_id, kind, name

    def _dir(self, session_id: str, kind: str, name: str) -> Path:
        return self.root / "sessions" / session_id / kind / name

    @contextmanager
    def writer(
        self, session_id: str, kind: str, name: str, *, step: int, merged: bool = False, owner: str = "",
        record: dict[str, Any] | None = None,
    ) -> Iterator[Path]:
        """Yield a temporary directory to fill; on success it is manifested and renamed into place.

        `owner` is the API key ("" without authentication); its `owner_tag` is recorded. `record`: more
        fields of the registry row (`Registry.record_checkpoint`'s metadata, expires_at, pinned).

        Raises:
            ServiceError: ALREADY_EXISTS when a checkpoint of that name exists.
        """
        validate_name(name)
        final = self._dir(session_id, kind, name)
        if final.exists():
            raise ServiceError(
                "ALREADY_EXISTS", f"checkpoint {self.uri(session_id, kind, name)} already exists", key="name"
            )
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-{os.getpid()}-", dir=final.parent))
        try:
            yield tmp
            files = {}
            for p in sorted(tmp.rglob("*")):
                if p.is_file():
                    files[str(p.relative_to(tmp))] = {"size": p.stat().st_size, "sha256": _sha256(p)}
            manifest = {
                "uri": self.uri(session_id, kind, name),
                "session_id": session_id,
                "kind": kind,
                "name": name,
                "step": step,
                "merged": merged,
                "created_at": time.time(),
                "owner": owner_tag(owner),
                "files": files,
            }
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            _fsync_tree(tmp)
            if final.exists():  # a concurrent writer of the same name won
                raise ServiceError(
                    "ALREADY_EXISTS", f"checkpoint {self.uri(session_id, kind, name)} already exists", key="name"
                )
            os.rename(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if _disk_full(e):  # a clear refusal rather than an internal error; nothing was kept
                raise _storage_full(self.uri(session_id, kind, name)) from e
            raise
        if self.registry is not None:
            try:  # the row only after the rename: a half-written checkpoint never has one
                self.registry.record_checkpoint(self._load(final), base_model=self.base_model,
                                                manifest_sha256=_sha256(final / "manifest.json"), **(record or {}))
            except BaseException as e:
                shutil.rmtree(final, ignore_errors=True)  # never a directory the registry does not know
                if _disk_full(e):
                    raise _storage_full(self.uri(session_id, kind, name)) from e
                raise

    def _load(self, path: Path) -> Checkpoint:
        m = json.loads((path / "manifest.json").read_text())
        return Checkpoint(
            uri=m["uri"],
            session_id=m["session_id"],
            kind=m["kind"],
            name=m["name"],
            path=path,
            size_bytes=sum(f["size"] for f in m["files"].values()),
            step=int(m["step"]),
            merged=bool(m.get("merged", False)),
            created_at=float(m["created_at"]),
            owner=str(m.get("owner", "")),
            files=dict(m["files"]),
        )

    def get(self, uri: str, *, verify: bool = True) -> Checkpoint:
        """Look up a checkpoint; with verify, check every file's size and sha256.

        Raises:
            ServiceError: NOT_FOUND for an unknown URI, DATA_LOSS when a file is
                missing or its size or sha256 differs from the manifest.
        """
        session_id, kind, name = self.parse_uri(uri)
        path = self._dir(session_id, kind, name)
        if not (path / "manifest.json").is_file():
            raise ServiceError("NOT_FOUND", f"no checkpoint {uri}", key="uri")
        if self.registry is not None and self.registry.checkpoint(uri) is None:
            raise ServiceError("NOT_FOUND", f"checkpoint {uri} is on disk but not in the model registry (see the "
                               "server log: it was not registered when written)", key="uri")
        if verify:
            m = json.loads((path / "manifest.json").read_text())
            for rel, meta in m["files"].items():
                f = path / rel
                if not f.is_file() or f.stat().st_size != meta["size"] or _sha256(f) != meta["sha256"]:
                    raise ServiceError(
                        "DATA_LOSS", f"checkpoint {uri} is corrupted: {rel} does not match its manifest", key="uri"
                    )
        return self._load(path)

    def list(self, session_id: str | None = None) -> list[Checkpoint]:
        """Complete checkpoints, oldest first (temporary directories are skipped).

        With a registry: the registered ones whose manifest is there (a row
        without files is skipped and logged; a directory without a row is not listed).

        Raises:
            ServiceError: INVALID_ARGUMENT (key "session_id") for a malformed id.
        """
        if session_id and not _NAME_RE.match(session_id):
            raise invalid(f"invalid session id {session_id!r}", key="session_id")
        if self.registry is not None:
            out = []
            for uri in self.registry.uris(session_id or ""):
                path = self._dir(*self.parse_uri(uri))
                if (path / "manifest.json").is_file():
                    out.append(self._load(path))
                else:
                    log.warning("checkpoint %s is registered but its files are gone; not listed", uri)
            return sorted(out, key=lambda c: c.created_at)
        return self.scan(session_id)

    def scan(self, session_id: str | None = None) -> builtins.list[Checkpoint]:
        """Every complete checkpoint directory on disk, oldest first, registered or not."""
        base = self.root / "sessions"
        pattern = f"{session_id}/*/*/manifest.json" if session_id else "*/*/*/manifest.json"
        out = [self._load(p.parent) for p in base.glob(pattern) if not p.parent.name.startswith(".")]
        return sorted(out, key=lambda c: c.created_at)

    def delete(self, uri: str) -> None:
        """Remove a checkpoint. Raises ServiceError NOT_FOUND when absent."""
        ckpt = self.get(uri, verify=False)
        trash = ckpt.path.with_name(f".del-{ckpt.name}-{time.time_ns()}")
        os.rename(ckpt.path, trash)
        if self.registry is not None:
            self.registry.remove_checkpoint(uri)
        shutil.rmtree(trash, ignore_errors=True)
