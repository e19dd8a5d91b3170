"""Sampling from fixed weights: snapshots of a session's adapter, and Tinker-style sampling parameters.

Our gRPC `Sample` reads a session's *synced* adapter, which `weights_sync`
replaces. The Tinker contract is different: a sampling client made by
``save_weights_for_sampler`` / ``save_weights_and_get_sampling_client``
samples "on the weights saved when the client was created", whatever the
training does afterwards. A *snapshot* gives that: the session's adapter at
one point of its operation order, pushed to every replica under a key of its
own (``snap:<id>``) that nothing ever updates. Snapshots are ephemeral: the
`SnapshotStore` keeps the `max_snapshots` most recently used ones loaded
and drops older ones from the replicas (sampling one then says so), and all
of a session's snapshots go when the caller releases them (its model stops).
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
        key: the replicas' adapter key ("" = the base model: a step-0 adapter is B = 0).
        version: the session's step when taken (-1 = base model).
        session_id: the session it was taken from.
    """

    key: str
    version: int
    session_id: str


class SnapshotStore:
    """Snapshots of session adapters on the replicas, most recently used kept.

    Args:
        submissions: queues the snapshot in its session's order (its sessions and engine).
        pool: the replicas the snapshots are pushed to.
        max_snapshots: snapshots kept loaded on the replicas; the least
            recently used beyond it is dropped (each costs one adapter's memory
            on every replica).
    """

    def __init__(self, submissions: Submissions, pool: ReplicaPool[Any], max_snapshots: int = 8) -> None:
        self.submissions = submissions
        self.pool = pool
        self.max_snapshots = max_snapshots
        self._lock = threading.Lock()
        self._live: OrderedDict[str, Snapshot] = OrderedDict()

    def submit_snapshot(self, session_id: str, seq_id: int, idempotency_key: str, owner: str = "") -> OperationRecord:
        """Queue a snapshot of the session's adapter at this point of its operation order.

        Runs on the trainer worker in seq order (after every earlier
        forward_backward / optim_step of the session), copies the adapter
        tensors and pushes them to every replica under a new key. Result: a
        `Snapshot` (key "" and version -1 at step 0, which is the base model).

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
                if version == 0:
                    return Snapshot("", -1, session_id)
                tensors = runtime.adapter_tensors(session_id, pool.snapshot_dtype())
                snap = Snapshot(f"snap:{uuid.uuid4().hex[:16]}", version, session_id)
                pool.push_all(snap.key, version, s.lora, tensors)
                self._remember(snap)
                return snap

            return run

        return self.submissions.submit(session_id, owner, seq_id, idempotency_key, "snapshot", prepare)

    def _remember(self, snap: Snapshot) -> None:
        with self._lock:
            self._live[snap.key] = snap
            old = []
            while len(self._live) > self.max_snapshots:
                old.append(self._live.popitem(last=False)[1])
        for o in old:
            self.pool.drop_all(o.key)

    def check(self, snap: Snapshot) -> None:
        """Mark a snapshot used. Raises ServiceError FAILED_PRECONDITION when it was released."""
        if not snap.key.startswith("snap:"):
            return
        with self._lock:
            if snap.key not in self._live:
                raise ServiceError(
                    "FAILED_PRECONDITION",
                    f"the weights snapshot of this sampling client (session {snap.session_id}, step {snap.version}) "
                    f"was released (only the {self.max_snapshots} most recently used are kept); "
                    "save the weights again for a new sampling client",
                    key="sampling_session_id",
                )
            self._live.move_to_end(snap.key)

    def release_session(self, session_id: str) -> None:
        """Drop every snapshot taken from `session_id` from the replicas."""
        with self._lock:
            gone = [k for k, s in self._live.items() if s.session_id == session_id]
            for k in gone:
                del self._live[k]
        for k in gone:
            self.pool.drop_all(k)
