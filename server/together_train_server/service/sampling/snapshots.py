"""Sampling from fixed weights: snapshots of a session's adapter, and Tinker-style sampling parameters.

Our gRPC `Sample` reads a session's *synced* adapter, which `weights_sync`
replaces. The Tinker contract is different: a sampling client made by
``save_weights_for_sampler`` / ``save_weights_and_get_sampling_client``
samples "on the weights saved when the client was created", whatever the
training does afterwards. A *snapshot* gives that: the session's adapter at
one point of its operation order, pushed to every replica under a key of its
own (``snap:<id>``) that nothing ever updates. Snapshots are ephemeral: the
`SnapshotStore` keeps each API key's `max_snapshots` most recently used ones
loaded and drops the key's older ones from the replicas (sampling one then says so); one goes
when its caller releases it (`release`: the SDK's ``Snapshot.close``), and all
of a session's go with `release_session` (a Tinker model that stops).
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from together_train_server.service.errors import ServiceError

if TYPE_CHECKING:
    from together_train_server.service.core.operations import OperationRecord
    from together_train_server.service.replicas.pool import ReplicaPool
    from together_train_server.service.training.submissions import Submissions


@dataclass(frozen=True)
class Snapshot:
    """Fixed weights to sample from.

    Attributes:
        key: the replicas' adapter key ("" = the base model: a fresh adapter is B = 0).
        version: the session's step when taken (-1 = base model).
        session_id: the session it was taken from.
        snapshot_id: its name for callers (``snap-<hex>``).
        owner: the API key that took it ("" = unauthenticated).
    """

    key: str
    version: int
    session_id: str
    snapshot_id: str = ""
    owner: str = ""


class SnapshotStore:
    """Snapshots of session adapters on the replicas, most recently used kept.

    Args:
        submissions: queues the snapshot in its session's order (its sessions and engine).
        pool: the replicas the snapshots are pushed to.
        max_snapshots: snapshots kept loaded on the replicas per API key; the
            key's least recently used beyond it is dropped (each costs one
            adapter's memory on every replica; base-model snapshots cost none
            and do not count).
    """

    MAX_GONE = 4096  # released / dropped ids remembered, so using one again says which

    def __init__(self, submissions: Submissions, pool: ReplicaPool[Any], max_snapshots: int = 8) -> None:
        self.submissions = submissions
        self.pool = pool
        self.max_snapshots = max_snapshots
        self._lock = threading.Lock()
        self._live: OrderedDict[str, Snapshot] = OrderedDict()  # snapshot_id -> Snapshot, least recently used first
        self._gone: OrderedDict[str, tuple[Snapshot, str]] = OrderedDict()  # snapshot_id -> (it, why)

    def submit_snapshot(self, session_id: str, seq_id: int, idempotency_key: str, owner: str = "") -> OperationRecord:
        """Queue a snapshot of the session's adapter at this point of its operation order.

        Runs on the trainer worker in seq order (after every earlier
        forward_backward / optim_step / load of the session), copies the adapter
        tensors and pushes them to every replica under a new key. Result: a
        `Snapshot` (key "" and version -1 for a fresh adapter, B = 0, which is the base model).

        Errors (as a FAILED operation): FAILED_PRECONDITION without replicas.
        """
        runtime, pool = self.submissions.runtime, self.pool
        s = self.submissions.sessions.get_session(session_id, owner)

        def prepare() -> Callable[[], Any]:
            if len(pool) == 0:
                raise ServiceError("FAILED_PRECONDITION",
                                   "this resource has no generator replicas to sample with (--generators N)")

            def run() -> Snapshot:
                version = int(runtime.step(session_id))
                ident = uuid.uuid4().hex[:16]
                if s.fresh_at(version):  # the fresh adapter (B = 0) is the base model; loaded weights are not
                    snap = Snapshot("", -1, session_id, f"snap-{ident}", owner)
                else:
                    tensors = runtime.adapter_tensors(session_id, pool.snapshot_dtype())
                    snap = Snapshot(f"snap:{ident}", version, session_id, f"snap-{ident}", owner)
                    pool.push_all(snap.key, version, s.lora, tensors)
                self._remember(snap)
                return snap

            return run

        return self.submissions.submit(session_id, owner, seq_id, idempotency_key, "snapshot", prepare)

    def _remember(self, snap: Snapshot) -> None:
        """Keep `snap` live; past the limit, drop the least recently used snapshot of the same API key and kind.

        The limit is per key, so one key's snapshots never push another's out, and it counts only snapshots
        holding an adapter on the replicas (`max_snapshots`): a base-model snapshot (key "") holds nothing
        there and is bounded only by `MAX_GONE`."""
        limit = self.max_snapshots if snap.key else self.MAX_GONE
        with self._lock:
            self._live[snap.snapshot_id] = snap
            mine = [o for o in self._live.values() if o.owner == snap.owner and bool(o.key) == bool(snap.key)]
            old = mine[:max(0, len(mine) - limit)]   # _live is least recently used first
            for o in old:
                del self._live[o.snapshot_id]
                self._forget(o, f"was dropped from the replicas (only the {limit} most recently used snapshots "
                                "of each API key are kept)")
        for o in old:
            self._drop(o)

    def _forget(self, snap: Snapshot, why: str) -> None:
        """Remember why `snap` is gone (caller holds the lock)."""
        self._gone[snap.snapshot_id] = (snap, why)
        while len(self._gone) > self.MAX_GONE:
            self._gone.popitem(last=False)

    def _drop(self, snap: Snapshot) -> None:
        if snap.key:  # a base-model snapshot holds nothing on the replicas
            self.pool.drop_all(snap.key)

    def check(self, snap: Snapshot) -> None:
        """Mark a snapshot used. Raises ServiceError FAILED_PRECONDITION when it was released or dropped."""
        with self._lock:
            if snap.snapshot_id in self._live:
                self._live.move_to_end(snap.snapshot_id)
                return
            gone = self._gone.get(snap.snapshot_id)
        if not snap.key and (gone is None or not gone[1].startswith("was released")):
            return  # the base model: nothing on the replicas to lose
        why = gone[1] if gone is not None else "was released"
        raise ServiceError(
            "FAILED_PRECONDITION",
            f"the weights snapshot {snap.snapshot_id} (session {snap.session_id}, step {snap.version}) {why}; "
            "take a new snapshot (or save the weights again for a new sampling client)",
            key="snapshot_id",
        )

    def get(self, snapshot_id: str, owner: str = "") -> Snapshot:
        """The snapshot named `snapshot_id`, marked used (`check`).

        Raises:
            ServiceError: NOT_FOUND naming it (unknown, or another API key's); FAILED_PRECONDITION
                naming it when it was released or dropped from the replicas.
        """
        with self._lock:
            snap = self._live.get(snapshot_id) or self._gone.get(snapshot_id, (None, ""))[0]
        if snap is None or (snap.owner and snap.owner != owner):
            raise ServiceError("NOT_FOUND", f"unknown snapshot {snapshot_id!r}", key="snapshot_id")
        self.check(snap)
        return snap

    def release(self, snapshot_id: str, owner: str = "") -> bool:
        """Drop a snapshot from the replicas; False when it was gone already (released or dropped).

        Raises:
            ServiceError: NOT_FOUND naming it (unknown, or another API key's).
        """
        with self._lock:
            snap = self._live.get(snapshot_id)
            gone = self._gone.get(snapshot_id)
            mine = snap if snap is not None else (gone[0] if gone is not None else None)
            if mine is None or (mine.owner and mine.owner != owner):
                raise ServiceError("NOT_FOUND", f"unknown snapshot {snapshot_id!r}", key="snapshot_id")
            if snap is None:
                return False
            del self._live[snapshot_id]
            self._forget(snap, "was released")
        self._drop(snap)
        return True

    def release_session(self, session_id: str) -> None:
        """Drop every snapshot taken from `session_id` from the replicas."""
        with self._lock:
            gone = [s for s in self._live.values() if s.session_id == session_id]
            for snap in gone:
                del self._live[snap.snapshot_id]
                self._forget(snap, "was released")
        for snap in gone:
            self._drop(snap)
