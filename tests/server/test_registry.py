"""The model registry (SQLite under --storage): rows follow the checkpoint files, survive restarts, import old dirs.

Unit part: a `CheckpointStore` with a `Registry` on a temporary directory.
End to end: a real resource restarted on the same storage lists and loads
what the first one saved.
"""

from __future__ import annotations

import json
import os
import sqlite3

import numpy as np
import pytest

from together_train_server.service.checkpoints.store import CheckpointStore
from together_train_server.service.errors import ServiceError
from together_train_server.service.checkpoints.registry import FILENAME, Registry, base_model_of


def _write(store: CheckpointStore, session: str, kind: str, name: str, *, step: int = 1, merged: bool = False,
           owner: str = "") -> str:
    with store.writer(session, kind, name, step=step, merged=merged, owner=owner) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/tiny-base"}))
        (tmp / "weights.bin").write_bytes(bytes(range(step % 200 + 1)))
    return store.uri(session, kind, name)


def _open(root) -> tuple[Registry, CheckpointStore]:
    reg = Registry(root)
    store = CheckpointStore(root, registry=reg, base_model="tiny-base")
    return reg, store


def test_rows_follow_writes_and_deletes_newest_first_with_cursor(tmp_path):
    reg, store = _open(tmp_path)
    assert reg.reconcile(store).imported == []
    uris = [_write(store, "s-aaa", "weights", f"w{i}", step=i) for i in range(5)]
    merged = _write(store, "s-bbb", "weights", "m", merged=True)
    state = _write(store, "s-bbb", "state", "st")
    rows, cur = reg.list_checkpoints("", limit=3)
    assert [r.uri for r in rows] == [state, merged, uris[4]] and cur  # newest first
    rows2, cur2 = reg.list_checkpoints("", limit=3, cursor=cur)
    assert [r.uri for r in rows2] == [uris[3], uris[2], uris[1]]
    rows3, cur3 = reg.list_checkpoints("", limit=3, cursor=cur2)
    assert [r.uri for r in rows3] == [uris[0]] and cur3 == ""
    assert [r.uri for r in reg.list_checkpoints("", variant="merged")[0]] == [merged]
    assert [r.uri for r in reg.list_checkpoints("", kind="state")[0]] == [state]
    assert len(reg.list_checkpoints("", session_id="s-aaa")[0]) == 5
    row = reg.checkpoint(uris[2])
    assert (row.kind, row.variant, row.step, row.base_model) == ("weights", "adapter", 2, "tiny-base")
    ck = store.get(uris[2])
    assert row.size_bytes == ck.size_bytes and row.created_at == ck.created_at
    import hashlib
    assert row.manifest_sha256 == hashlib.sha256((ck.path / "manifest.json").read_bytes()).hexdigest()
    store.delete(uris[2])
    assert reg.checkpoint(uris[2]) is None and uris[2] not in [c.uri for c in store.list()]
    with pytest.raises(ServiceError, match="kind must be"):
        reg.list_checkpoints("", kind="weight")
    with pytest.raises(ServiceError, match="malformed cursor"):
        reg.list_checkpoints("", cursor="garbage")


def test_owner_scoped(tmp_path):
    reg, store = _open(tmp_path)
    from together_train_server.service.checkpoints.store import owner_tag

    a = _write(store, "s-a", "weights", "x", owner="alice")
    _write(store, "s-b", "weights", "y", owner="bob")
    assert [r.uri for r in reg.list_checkpoints(owner_tag("alice"))[0]] == [a]
    assert reg.list_checkpoints("")[0] == []  # anonymous sees neither


def test_half_written_checkpoint_never_appears(tmp_path):
    reg, store = _open(tmp_path)
    with pytest.raises(RuntimeError):
        with store.writer("s-a", "weights", "broken", step=1) as tmp:
            (tmp / "part.bin").write_bytes(b"x" * 100)
            raise RuntimeError("writer died halfway")
    assert reg.uris() == [] and store.list() == [] and store.scan() == []
    # a registration that fails removes the renamed directory again: files and rows never disagree
    orig = reg.record_checkpoint
    reg.record_checkpoint = lambda *a, **k: (_ for _ in ()).throw(sqlite3.OperationalError("disk I/O error"))
    with pytest.raises(sqlite3.OperationalError):
        _write(store, "s-a", "weights", "unregistrable")
    reg.record_checkpoint = orig
    assert store.scan() == [] and reg.uris() == []


def _fill(reg: Registry) -> None:
    """Cap the registry's file at its current size (SQLite's max_page_count, on its own connection) and
    fill it: the next row is SQLITE_FULL ("database or disk is full"), as on a full disk."""
    reg._db.execute(f"PRAGMA max_page_count = {reg._db.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(sqlite3.OperationalError):  # rows of a session without files: never listed
        for i in range(10_000):
            reg._db.execute("INSERT INTO checkpoints (uri, session_id, kind, variant, name, base_model, step, size_bytes, "
                            "manifest_sha256, created_at, display_name, metadata, owner) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                            (f"together-train://s-filler/weights/f{i}", "s-filler", "weights", "adapter", f"f{i}", "", 0, 0, "",
                             0.0, "", "{}", ""))


def test_full_database_surfaces_its_own_error_not_the_rollbacks(tmp_path):
    # SQLite rolls a SQLITE_FULL transaction back itself; the registry's ROLLBACK then failed with
    # "cannot rollback - no transaction is active", which hid the full disk.
    reg, store = _open(tmp_path)
    _write(store, "s-aaa", "weights", "before")
    _fill(reg)
    ckpt = store.list()[0]
    with pytest.raises(sqlite3.OperationalError) as err:
        reg.record_checkpoint(ckpt, metadata={"note": "x" * 10_000})
    assert err.value.sqlite_errorcode == sqlite3.SQLITE_FULL, err.value
    assert "database or disk is full" in str(err.value)


def test_save_into_a_full_registry_is_resource_exhausted_and_leaves_nothing(tmp_path):
    reg, store = _open(tmp_path)
    kept = _write(store, "s-aaa", "weights", "before")
    _fill(reg)
    with pytest.raises(ServiceError) as err:
        _write(store, "s-aaa", "weights", "after")
    assert err.value.code == "RESOURCE_EXHAUSTED", err.value
    assert "storage is full" in err.value.message and store.uri("s-aaa", "weights", "after") in err.value.message, err.value
    assert [c.uri for c in store.list()] == [kept]
    assert not (tmp_path / "sessions" / "s-aaa" / "weights" / "after").exists()
    assert [d.name for d in (tmp_path / "sessions" / "s-aaa" / "weights").iterdir()] == ["before"]  # no partial
    # space again: the same save succeeds (the registry was left consistent)
    reg._db.execute("DELETE FROM checkpoints WHERE session_id = 's-filler'")
    assert _write(store, "s-aaa", "weights", "after") in [c.uri for c in store.list()]


def test_import_of_an_old_storage_dir_and_reports(tmp_path, caplog):
    old = CheckpointStore(tmp_path)  # the previous release: no registry
    u1 = _write(old, "s-old", "weights", "a")
    u2 = _write(old, "s-old", "state", "b", step=3)
    assert not (tmp_path / FILENAME).exists()
    reg, store = _open(tmp_path)
    rep = reg.reconcile(store, base_model_of)
    assert sorted(rep.imported) == sorted([u1, u2]) and rep.unregistered == [] and rep.missing_files == []
    assert reg.checkpoint(u1).base_model == "tiny-base" and reg.checkpoint(u2).step == 3
    assert sorted(c.uri for c in store.list()) == sorted([u1, u2])
    reg.close()
    # later: a directory written behind the registry's back, and a registered one whose files went away
    stray = _write(CheckpointStore(tmp_path), "s-x", "weights", "stray")
    import shutil
    shutil.rmtree(old.get(u1, verify=False).path)
    reg, store = _open(tmp_path)
    with caplog.at_level("WARNING"):
        rep = reg.reconcile(store, base_model_of)
    assert rep.imported == [] and rep.unregistered == [stray] and rep.missing_files == [u1]
    assert stray in caplog.text and u1 in caplog.text
    assert [c.uri for c in store.list()] == [u2]  # neither is shown
    with pytest.raises(ServiceError, match="not in the model registry"):
        store.get(stray)


def test_sessions_rows(tmp_path):
    reg = Registry(tmp_path)
    reg.record_session("s-1", owner="", base_model="m", lora={"rank": 4}, status="ACTIVE", step=0, created_at=1.0)
    reg.record_session("s-2", owner="", base_model="m", lora={"rank": 8}, status="ACTIVE", step=0, created_at=2.0)
    reg.update_session("s-1", status="STOPPED", step=5, stopped=True)
    rows, _ = reg.list_sessions("")
    assert [r.session_id for r in rows] == ["s-2", "s-1"]
    assert (rows[1].status, rows[1].step, rows[1].lora) == ("STOPPED", 5, {"rank": 4}) and rows[1].stopped_at
    assert reg.close_stale_sessions() == 0  # this process is alive: its sessions are not stale
    assert rows[0].server_pid == os.getpid()
    reg._tx("UPDATE sessions SET server_pid = ?", (2 ** 22 + 12345,))  # a pid no process has (pid_max 2^22)
    assert reg.close_stale_sessions() == 1
    assert reg.list_sessions("", status="ENDED_BY_RESTART")[0][0].session_id == "s-2"


def test_session_names_metadata_and_paging(tmp_path):
    """Display name / metadata setters persist (a new Registry on the file reads them); the keyset pager
    resumes after a named row (cursor_after), filters several statuses, and pages by offset."""
    reg = Registry(tmp_path)
    for i in range(5):
        reg.record_session(f"s-{i}", owner="t", base_model="m", lora={}, status="ACTIVE" if i % 2 else "STOPPED",
                           step=0, created_at=10.0 + (i // 2))  # equal times: the id breaks the tie
    reg.update_session("s-3", display_name="three", metadata={"wandb": {"project": "p"}})
    reg.update_session("s-3", step=7)  # other updates leave name and metadata as they are
    reg.close()
    reg = Registry(tmp_path)
    row = reg.session("s-3")
    assert (row.display_name, row.metadata, row.step) == ("three", {"wandb": {"project": "p"}}, 7)
    assert reg.session("nope") is None
    order = [r.session_id for r in reg.list_sessions("t")[0]]
    assert order == ["s-4", "s-3", "s-2", "s-1", "s-0"]
    seen, cursor = [], ""
    while True:
        rows, cursor = reg.list_sessions("t", limit=2, cursor=cursor)
        seen += [r.session_id for r in rows]
        if not cursor:
            break
        assert reg.cursor_key(cursor) == rows[-1].session_id
    assert seen == order
    rows, nxt = reg.list_sessions("t", limit=2, cursor=reg.cursor_after("sessions", "s-3"))
    assert [r.session_id for r in rows] == ["s-2", "s-1"] and reg.cursor_key(nxt) == "s-1"
    assert [r.session_id for r in reg.list_sessions("t", status=["ACTIVE", "ENDED_BY_RESTART"])[0]] == ["s-3", "s-1"]
    assert [r.session_id for r in reg.list_sessions("t", limit=2, offset=3)[0]] == ["s-1", "s-0"]
    assert [r.session_id for r in reg.list_sessions("t", offset=4)[0]] == ["s-0"]
    assert reg.count("sessions", "t") == 5 and reg.count("sessions", "other") == 0
    with pytest.raises(ServiceError, match="after: 'gone'"):
        reg.cursor_after("sessions", "gone")


def test_restart_lists_and_loads(tiny_model_dir, tmp_path):
    """A resource restarted on the same --storage lists every checkpoint and session, and loads them."""
    import together_train as tt

    args = ["--trainer-threads", "1", "--generator-threads", "1"]
    sample = tt.Sample(model_input=np.arange(1, 9), loss_fn_inputs={"target_tokens": np.arange(2, 10),
                                                                    "weights": np.ones(8, np.float32)})
    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=tmp_path, extra_args=args) as c:
        s = c.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
        s.forward_backward([sample], "cross_entropy")
        s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
        state = s.save_state("st").result(timeout=120)
        weights = s.save_weights("w").result(timeout=120)
        before = sorted(x.uri for x in c.list_checkpoints())
        loss = s.forward([sample], "cross_entropy").result(timeout=120).loss
    assert before == sorted([state.uri, weights.uri])
    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=tmp_path, extra_args=args) as c:
        assert sorted(x.uri for x in c.list_checkpoints()) == before
        # the SDK's registry filters and newest-first pages (gRPC ListCheckpoints)
        assert [x.uri for x in c.list_checkpoints(kind="state")] == [state.uri]
        assert [x.uri for x in c.list_checkpoints(variant="adapter", kind="weights")] == [weights.uri]
        assert c.list_checkpoints(base_model="another-model") == []
        page, cur = c.list_checkpoints_page(1)
        assert [x.uri for x in page] == [weights.uri] and cur
        page, cur = c.list_checkpoints_page(1, cur)
        assert [x.uri for x in page] == [state.uri] and cur == ""
        with pytest.raises(tt.errors.InvalidArgumentError, match="variant"):
            c.list_checkpoints(variant="lora")
        r = c.create_session(checkpoint_uri=state.uri)
        assert r.forward([sample], "cross_entropy").result(timeout=120).loss == pytest.approx(loss, rel=1e-6)
    db = sqlite3.connect(tmp_path / FILENAME)
    rows = dict(db.execute("SELECT session_id, status FROM sessions").fetchall())
    assert rows[s.session_id] == "ENDED_BY_RESTART" and rows[r.session_id] in ("ACTIVE", "ENDED_BY_RESTART",
                                                                                 "STOPPED")
    assert {u for (u,) in db.execute("SELECT uri FROM checkpoints")} == set(before)
