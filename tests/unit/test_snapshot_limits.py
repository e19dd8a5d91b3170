"""Which snapshots `SnapshotStore` drops past its limit (service/sampling/snapshots.py): per API key, loaded ones only.

A newcomer's try found one key's 9 snapshots pushing another key's out (the limit was one pool for every key) and
fresh-adapter snapshots, which hold nothing on the replicas, pushing trained ones out. The store's bookkeeping is
driven directly here; the replica pool is a recorder of `drop_all` calls (what the store asks the replicas to
free), since the rule under test is the store's own.
"""

from __future__ import annotations

import pytest

from together_train_server.service.errors import ServiceError
from together_train_server.service.sampling.snapshots import Snapshot, SnapshotStore


class DropRecorder:
    """The part of ReplicaPool the store calls when it drops a snapshot."""

    def __init__(self) -> None:
        self.dropped: list[str] = []

    def drop_all(self, key: str) -> None:
        self.dropped.append(key)


def snap(i: int, owner: str, loaded: bool = True) -> Snapshot:
    if loaded:
        return Snapshot(f"snap:{owner}{i}", i, f"s-{owner}", f"snap-{owner}{i}", owner)
    return Snapshot("", -1, f"s-{owner}", f"snap-{owner}-base{i}", owner)


def test_one_keys_snapshots_never_push_anothers_out():
    pool = DropRecorder()
    store = SnapshotStore(submissions=None, pool=pool, max_snapshots=2)  # type: ignore[arg-type]
    a0 = snap(0, "A")
    store._remember(a0)
    for i in range(5):
        store._remember(snap(i, "B"))
    store.check(a0)  # still live: B's five only dropped B's own oldest
    assert pool.dropped == ["snap:B0", "snap:B1", "snap:B2"], pool.dropped
    with pytest.raises(ServiceError) as info:
        store.check(snap(0, "B"))
    assert info.value.code == "FAILED_PRECONDITION" and "snap-B0" in info.value.message
    assert "of each API key" in info.value.message, info.value.message


def test_base_model_snapshots_do_not_count():
    pool = DropRecorder()
    store = SnapshotStore(submissions=None, pool=pool, max_snapshots=2)  # type: ignore[arg-type]
    trained = snap(1, "A")
    store._remember(trained)
    for i in range(10):
        store._remember(snap(i, "A", loaded=False))
    store.check(trained)
    assert pool.dropped == [], pool.dropped
    store._remember(snap(2, "A"))
    store._remember(snap(3, "A"))   # the third loaded one of A: its least recently used goes
    assert pool.dropped == ["snap:A1"], pool.dropped
