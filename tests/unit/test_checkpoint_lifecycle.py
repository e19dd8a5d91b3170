"""Checkpoint metadata, search, TTL, keep-last-K and pins (service/checkpoints/lifecycle.py) on a real store.

A `CheckpointStore` and `Registry` on a temporary directory (the files and SQLite rows a resource writes);
the end-to-end path through a server is tests/server/test_checkpoint_search_e2e.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from together_train_server.service.checkpoints.lifecycle import (
    MAX_KEY_CHARS, MAX_METADATA_BYTES, MAX_METADATA_PAIRS, MAX_VALUE_CHARS, CheckpointLifecycle, SaveOptions)
from together_train_server.service.checkpoints.registry import FILENAME, Registry
from together_train_server.service.checkpoints.store import CheckpointStore, owner_tag
from together_train_server.service.errors import ServiceError


def _open(root: Path, admin: frozenset[str] = frozenset()) -> tuple[Registry, CheckpointStore, CheckpointLifecycle]:
    reg = Registry(root)
    store = CheckpointStore(root, registry=reg, base_model="tiny-base")
    return reg, store, CheckpointLifecycle(store, reg, admin_keys=admin)


def _save(store: CheckpointStore, lc: CheckpointLifecycle, session: str, kind: str, name: str, *, owner: str = "",
          merged: bool = False, nbytes: int = 100, **opts) -> str:
    o = SaveOptions.checked(**opts)
    with store.writer(session, kind, name, step=1, merged=merged, owner=owner, record=o.record(time.time())) as tmp:
        (tmp / "weights.bin").write_bytes(os.urandom(nbytes))
    lc.after_save(session, kind, o)
    return store.uri(session, kind, name)


def _files_on_disk(root: Path) -> set[str]:
    """Walk the storage directory: the ``<session>/<kind>/<name>`` directory of every file under ``sessions/``
    (temporary ``.tmp-*`` and trash ``.del-*`` ones included)."""
    base = root / "sessions"
    return {"/".join(p.relative_to(base).parts[:3]) for p in base.rglob("*") if p.is_file()}


@pytest.mark.parametrize("md, key", [
    ({"": "x"}, "user_metadata."),
    ({"k" * (MAX_KEY_CHARS + 1): "x"}, "user_metadata." + "k" * (MAX_KEY_CHARS + 1)),
    ({"run": 3}, "user_metadata.run"),
    ({"note": "v" * (MAX_VALUE_CHARS + 1)}, "user_metadata.note"),
    ({f"k{i}": "v" for i in range(MAX_METADATA_PAIRS + 1)}, "user_metadata"),
    ({f"k{i}": "v" * 1000 for i in range(20)}, "user_metadata"),  # 20 pairs of 1000 chars > 16 KiB
    (["run", "a"], "user_metadata"),
])
def test_bad_metadata_is_refused_naming_the_key_and_nothing_is_stored(tmp_path, md, key):
    reg, store, lc = _open(tmp_path)
    with pytest.raises(ServiceError) as err:
        _save(store, lc, "s-a", "weights", "w", user_metadata=md)
    assert err.value.code == "INVALID_ARGUMENT" and err.value.key == key, err.value
    assert _files_on_disk(tmp_path) == set() and reg.uris() == []
    assert MAX_METADATA_BYTES == 16 * 1024


def test_search_by_metadata_type_session_newest_first_with_cursor(tmp_path):
    reg, store, lc = _open(tmp_path)
    uris = [_save(store, lc, "s-a", "weights", f"w{i}", user_metadata={"run": "r1", "i": str(i)}, nbytes=10 + i)
            for i in range(5)]
    st = _save(store, lc, "s-a", "state", "st", user_metadata={"run": "r1"})
    mg = _save(store, lc, "s-b", "weights", "m", merged=True, user_metadata={"run": "r2"})
    rows, cur = lc.search(user_metadata={"run": "r1"}, limit=2)
    assert [r.uri for r in rows] == [st, uris[4]] and cur
    seen = [r.uri for r in rows]
    while cur:
        rows, cur = lc.search(user_metadata={"run": "r1"}, limit=2, cursor=cur)
        seen += [r.uri for r in rows]
    assert seen == [st, *uris[::-1]]  # newest first, every page once
    assert [r.uri for r in lc.search(user_metadata={"run": "r1", "i": "3"})[0]] == [uris[3]]
    assert lc.search(user_metadata={"run": "R1"})[0] == []  # exact, case-sensitive
    assert [r.uri for r in lc.search(type="training")[0]] == [st]
    assert [r.uri for r in lc.search(type="merged")[0]] == [mg]
    assert len(lc.search(type="sampler")[0]) == 5
    assert [r.uri for r in lc.search(session_id="s-b")[0]] == [mg]
    assert lc.search(base_model="other")[0] == [] and len(lc.search(base_model="tiny-base")[0]) == 7
    row = lc.search(user_metadata={"i": "2"})[0][0]
    assert row.size_bytes == store.get(uris[2]).size_bytes == 12
    for bad in (0, 201, -1):
        with pytest.raises(ServiceError, match="limit must be 1-200") as err:
            lc.search(limit=bad)
        assert err.value.key == "limit"
    assert len(lc.search(limit=200)[0]) == 7 and len(lc.search(limit=1)[0]) == 1
    with pytest.raises(ServiceError, match="type must be one of") as err:
        lc.search(type="state")
    assert err.value.key == "type"


def test_search_is_per_key_and_admin_sees_others(tmp_path):
    reg, store, lc = _open(tmp_path, admin=frozenset({"root"}))
    a = _save(store, lc, "s-a", "weights", "a", owner="alice", user_metadata={"t": "x"})
    b = _save(store, lc, "s-b", "weights", "b", owner="bob", user_metadata={"t": "x"})
    assert [r.uri for r in lc.search("alice", user_metadata={"t": "x"})[0]] == [a]
    with pytest.raises(ServiceError) as err:
        lc.search("alice", of_owner=owner_tag("bob"))
    assert err.value.code == "PERMISSION_DENIED" and err.value.key == "owner"
    assert [r.uri for r in lc.search("root", of_owner=owner_tag("bob"))[0]] == [b]
    assert [r.uri for r in lc.search("root", of_owner="*")[0]] == [b, a]
    with pytest.raises(ServiceError) as err:  # another key's checkpoint is not there for alice
        lc.update(b, "alice", user_metadata={})
    assert err.value.code == "NOT_FOUND"
    assert lc.update(b, "root", pinned=True).pinned
    assert lc.usage("alice") == {owner_tag("alice"): store.get(a).size_bytes}
    assert lc.usage("root") == {owner_tag("alice"): store.get(a).size_bytes, owner_tag("bob"): store.get(b).size_bytes}


def test_metadata_ttl_and_pin_edits_persist(tmp_path):
    reg, store, lc = _open(tmp_path)
    u = _save(store, lc, "s-a", "state", "st", user_metadata={"a": "1"})
    t0 = time.time()
    row = lc.update(u, user_metadata={"b": "2"}, ttl_seconds=100)
    assert row.metadata == {"b": "2"} and t0 + 100 <= row.expires_at <= time.time() + 100
    lc.update(u, pinned=True)
    reg.close()
    reg2 = Registry(tmp_path)
    row = reg2.checkpoint(u)
    assert (row.metadata, row.pinned) == ({"b": "2"}, True) and row.expires_at
    lc2 = CheckpointLifecycle(CheckpointStore(tmp_path, registry=reg2), reg2)
    assert lc2.update(u, ttl_seconds=None).expires_at is None
    for bad in (-1, 1.5, 10 * 365 * 86400 + 1, "3600"):
        with pytest.raises(ServiceError) as err:
            lc2.update(u, ttl_seconds=bad)
        assert err.value.key == "ttl_seconds", bad
    assert reg2.checkpoint(u).metadata == {"b": "2"}  # a refused edit changes nothing
    with pytest.raises(ServiceError) as err:
        lc2.update(u, user_metadata={"x": "v" * (MAX_VALUE_CHARS + 1)})
    assert err.value.key == "user_metadata.x" and reg2.checkpoint(u).metadata == {"b": "2"}


def test_ttl_sweep_deletes_exactly_the_expired_unpinned_and_frees_storage(tmp_path, caplog):
    reg, store, lc = _open(tmp_path)
    short = _save(store, lc, "s-a", "weights", "short", ttl_seconds=5)
    pinned = _save(store, lc, "s-a", "weights", "pinned", ttl_seconds=5, pinned=True)
    long = _save(store, lc, "s-a", "state", "long", ttl_seconds=3600)
    never = _save(store, lc, "s-b", "weights", "never")
    now = time.time()
    assert lc.sweep(now) == []  # nothing expired yet
    with caplog.at_level(logging.INFO, logger="together_train_server"):
        assert lc.sweep(now + 10) == [short]
    assert f"audit: checkpoint deleted uri={short}" in caplog.text and "reason=ttl" in caplog.text
    assert sorted(reg.uris()) == sorted([pinned, long, never])
    assert _files_on_disk(tmp_path) == {"s-a/weights/pinned", "s-a/state/long", "s-b/weights/never"}  # no orphan
    assert lc.sweep(now + 7200) == [long]
    assert _files_on_disk(tmp_path) == {"s-a/weights/pinned", "s-b/weights/never"}
    assert lc.storage_bytes("") == sum(store.get(u).size_bytes for u in (pinned, never))


def test_keep_last_per_session_and_kind_spares_pinned(tmp_path):
    reg, store, lc = _open(tmp_path)
    p = _save(store, lc, "s-a", "weights", "w0", pinned=True)
    for i in range(1, 5):
        _save(store, lc, "s-a", "weights", f"w{i}", keep_last=2)
    st = _save(store, lc, "s-a", "state", "st0")
    other = _save(store, lc, "s-b", "weights", "x")
    names = sorted(Path(u).name for u in reg.uris("s-a"))
    assert names == ["st0", "w0", "w3", "w4"]  # newest 2 unpinned weights + the pinned one + the state
    lc.set_session_keep_last("s-a", 1)
    _save(store, lc, "s-a", "state", "st1")
    assert sorted(Path(u).name for u in reg.uris("s-a")) == ["st1", "w0", "w3", "w4"]
    assert st not in reg.uris() and p in reg.uris() and other in reg.uris()
    assert _files_on_disk(tmp_path) == {"s-a/weights/w0", "s-a/weights/w3", "s-a/weights/w4", "s-a/state/st1",
                                        "s-b/weights/x"}
    with pytest.raises(ServiceError) as err:
        lc.set_session_keep_last("s-a", -1)
    assert err.value.key == "keep_last"


def test_registry_of_an_earlier_release_is_migrated(tmp_path):
    """A schema-1 file (no expires_at / pinned) opens, keeps its rows and takes metadata, TTL and pins."""
    db = sqlite3.connect(tmp_path / FILENAME)
    db.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE checkpoints (uri TEXT PRIMARY KEY, session_id TEXT NOT NULL, kind TEXT NOT NULL,
            variant TEXT NOT NULL, name TEXT NOT NULL, base_model TEXT NOT NULL DEFAULT '', step INTEGER NOT NULL,
            size_bytes INTEGER NOT NULL, manifest_sha256 TEXT NOT NULL, created_at REAL NOT NULL,
            display_name TEXT NOT NULL DEFAULT '', metadata TEXT NOT NULL DEFAULT '{}',
            owner TEXT NOT NULL DEFAULT '');
        CREATE TABLE sessions (session_id TEXT PRIMARY KEY, owner TEXT NOT NULL DEFAULT '',
            base_model TEXT NOT NULL DEFAULT '', lora TEXT NOT NULL DEFAULT '{}', status TEXT NOT NULL,
            step INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, stopped_at REAL,
            display_name TEXT NOT NULL DEFAULT '', metadata TEXT NOT NULL DEFAULT '{}');
        INSERT INTO meta VALUES ('schema_version', '1');
        INSERT INTO checkpoints VALUES ('together-train://s-old/weights/w', 's-old', 'weights', 'adapter', 'w',
            'tiny-base', 3, 42, 'abc', 1000.0, '', '{}', '');
    """)
    db.commit()
    db.close()
    reg = Registry(tmp_path)
    row = reg.checkpoint("together-train://s-old/weights/w")
    assert (row.step, row.size_bytes, row.expires_at, row.pinned) == (3, 42, None, False)
    reg.update_checkpoint(row.uri, metadata={"k": "v"}, expires_at=5.0, pinned=True)
    row = reg.checkpoint(row.uri)
    assert (row.metadata, row.expires_at, row.pinned) == ({"k": "v"}, 5.0, True)
    assert reg._query("SELECT value FROM meta WHERE key = 'schema_version'")[0][0] == "2"


_SWEEPER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from together_train_server.service.checkpoints.lifecycle import CheckpointLifecycle
    from together_train_server.service.checkpoints.registry import Registry
    from together_train_server.service.checkpoints.store import CheckpointStore
    root = Path(sys.argv[1])
    reg = Registry(root)
    store = CheckpointStore(root, registry=reg)
    print("ready", flush=True)
    CheckpointLifecycle(store, reg).sweep(time.time() + 10)
    print("done", flush=True)
""")


def test_sweep_killed_midway_leaves_each_checkpoint_whole_or_unlisted(tmp_path):
    """SIGKILL a process sweeping 60 expired checkpoints at several points: after a restart every listed
    checkpoint verifies against its manifest (none half-deleted), and a new sweep finishes the job."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for trial, delay in enumerate((0.0, 0.05, 0.15, 0.4)):
        root = tmp_path / f"t{trial}"
        reg, store, lc = _open(root)
        uris = [_save(store, lc, "s-a", "weights", f"w{i:02d}", ttl_seconds=1, nbytes=64 << 10) for i in range(60)]
        keep = _save(store, lc, "s-a", "weights", "keep", ttl_seconds=1, pinned=True)
        reg.close()
        proc = subprocess.Popen([sys.executable, "-c", _SWEEPER, str(root)], env=env, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        reg, store, lc = _open(root)  # a restart: the store drops interrupted deletions' trash
        listed = [c.uri for c in store.list()]
        for uri in listed:
            store.get(uri, verify=True)  # whole: every file there, sizes and sha256 as in the manifest
        assert keep in listed and set(listed) <= set(uris) | {keep}
        assert not [d for d in _files_on_disk(root) if "/." in d]  # no .del-/.tmp- leftovers
        lc.sweep(time.time() + 10)
        assert [c.uri for c in store.list()] == [keep], trial
        assert _files_on_disk(root) == {"s-a/weights/keep"}
        assert json.loads((root / "sessions/s-a/weights/keep/manifest.json").read_text())["name"] == "keep"
        reg.close()
