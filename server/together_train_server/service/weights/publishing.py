"""Weight publishing of a `Resource`: weights_sync, pushes after a load, and checkpoint adapters for scoring.

The trainer worker only snapshots adapter tensors; pushes to the generator
replicas run on a thread per push, chained per session so they reach the
replicas in submission order (`_publish_async`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from together_train_server.service.errors import ServiceError, internal_error, invalid
from together_train_server.service.training.operations import OperationRecord
from together_train_server.service.resource_state import ResourceState
from together_train_server.service.sampling.snapshots import Snapshot
from together_train_server.service.sessions.manager import ACTIVE, SessionRecord

log = logging.getLogger(__name__)


@dataclass
class WeightsSyncOutcome:
    """Result of a weights_sync: the version published and what it cost."""

    policy_version: int
    num_replicas: int
    num_bytes: int
    seconds: float



class WeightsPublishingMixin(ResourceState):
    """Publishing adapters to the replicas: weights_sync, after a load, and saved checkpoints for scoring."""

    def submit_weights_sync(
        self, session_id: str, seq_id: int, idempotency_key: str, background: bool, owner: str = ""
    ) -> OperationRecord:
        """Queue a weights_sync: publish the session's current adapter to every replica.

        The trainer worker only snapshots the adapter tensors; the push runs on
        its own thread (`_publish_async`), so other sessions keep training
        while it waits. Synchronous mode completes when every replica in
        routing serves the new version, or once the sync deadline
        (`Deadlines.for_sync`, ~1 s for a LoRA) passed and one does: a slower
        replica is not routed to for this session until it holds the version
        (`ReplicaPool.publish`); one that misses the push deadline
        (`Deadlines.for_bytes`) or is found hung by the probes is taken out of
        routing until it has been re-pushed. The result's ``num_replicas``
        counts the replicas that took the version; UNAVAILABLE naming each
        replica when none did. Background mode completes once the
        tensors are snapshotted and the push is under way (samples report
        which version served them).
        """
        s = self.get_session(session_id, owner)

        def prepare() -> Callable[[], Any]:
            if len(self.pool) == 0:
                raise ServiceError(
                    "FAILED_PRECONDITION",
                    "this resource has no generator replicas; weights_sync needs at least one (--generators N)",
                )

            def run() -> WeightsSyncOutcome | concurrent.futures.Future:
                # On the trainer worker only the snapshot (a copy: training goes on during the push),
                # taken in the replicas' dtype: one converting pass, the buffer pushed as it is.
                t0 = time.perf_counter()
                version = self.engine.step(session_id)
                tensors = self.engine.adapter_tensors(session_id, self.pool.snapshot_dtype())

                def push() -> WeightsSyncOutcome:
                    if s.state != ACTIVE:
                        raise ServiceError("CANCELLED", f"session {session_id} was {s.state.lower()} before its push")
                    nbytes, replicas = self.pool.publish(session_id, version, s.lora, tensors)
                    s.synced_version = max(s.synced_version, version)
                    if s.state != ACTIVE:  # stopped while pushing: its drop_all may have run before the push
                        self.pool.drop_all(session_id)
                    seconds = time.perf_counter() - t0
                    self.telemetry.weights_pushed(session_id, version, nbytes, replicas, seconds)
                    return WeightsSyncOutcome(version, replicas, nbytes, seconds)

                done = self._publish_async(s, push)
                if not background:
                    # Succeeds once every replica still in routing serves `version` (laggards are
                    # taken out of routing until re-pushed); UNAVAILABLE when none took it.
                    return done
                done.add_done_callback(
                    lambda f: f.exception() and log.warning("background weights_sync of %s v%d failed: %s",
                                                            session_id, version, f.exception())
                )
                nbytes = sum(int(t.numel()) * t.element_size() for t in tensors.values())
                return WeightsSyncOutcome(version, len(self.pool), nbytes, time.perf_counter() - t0)

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "weights_sync", prepare)

    def submit_snapshot(self, session_id: str, seq_id: int, idempotency_key: str, owner: str = "") -> OperationRecord:
        """Queue a snapshot of the session's adapter at this point of its operation order: fixed weights to
        sample from, pushed to every replica under a key of its own (see `service.sampling.SnapshotStore`).
        Result: a `Snapshot` (key "" and version -1 at step 0, the base model)."""
        return self._snapshots.submit_snapshot(session_id, seq_id, idempotency_key, owner)

    def check_snapshot(self, snap: Snapshot) -> None:
        """Mark a snapshot used. Raises ServiceError FAILED_PRECONDITION when it was released."""
        self._snapshots.check(snap)

    def release_snapshots(self, session_id: str) -> None:
        """Drop every snapshot taken from `session_id` from the replicas."""
        self._snapshots.release_session(session_id)

    def _loaded_snapshot(self, s: SessionRecord) -> dict[str, Any] | None:
        """The adapter tensors `_publish_loaded` pushes (caller holds engine_lock); None when nothing is."""
        if self.engine.mode == "full" or len(self.pool) == 0 or s.step <= 0:
            return None
        return self.engine.adapter_tensors(s.session_id, self.pool.snapshot_dtype())

    def _publish_loaded(self, s: SessionRecord, step: int, tensors: dict[str, Any] | None) -> None:
        """After a load: make the replicas serve the loaded weights (`tensors`) under `step`.

        The step may go down (loading an older checkpoint), and replicas never
        replace a version by an older one, so the session's adapter is dropped
        from every replica first. Step 0 is the base model (B = 0): nothing is
        pushed. Without replicas only the bookkeeping changes.
        """
        if self.engine.mode == "full":
            return  # full-weight sessions have no adapter to push; replicas keep serving the base model
        if len(self.pool) > 0:
            self.pool.drop_all(s.session_id)
            if step > 0 and tensors is not None:
                self.pool.push_all(s.session_id, step, s.lora, tensors)
        s.synced_version = step

    def _publish_async(self, s: SessionRecord, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` (a push to the replicas) on its own thread, after the session's previous one.

        The trainer worker never waits on a replica: an operation returns this
        future and stays RUNNING until it resolves. Chaining on the session's
        previous publish keeps its pushes in submission order (a load_state's
        drop + push and a weights_sync never overtake each other). Errors other
        than ServiceError become INTERNAL (logged with the traceback).
        """
        out: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            prev, s.publish_tail = s.publish_tail, out

        def body() -> None:
            if prev is not None:
                concurrent.futures.wait([prev])
            try:
                out.set_result(fn())
            except ServiceError as err:
                out.set_exception(err)
            except Exception as err:
                out.set_exception(internal_error(err, what="weights push", session_id=s.session_id))

        threading.Thread(target=body, name=f"publish-{s.session_id}", daemon=True).start()
        return out

    MAX_SCORING_CHECKPOINTS = 4

    def checkpoint_scoring_key(self, uri: str, owner: str = "") -> tuple[str, int]:
        """Make a saved checkpoint's adapter servable for compute_logprobs; returns (replica key, step).

        The PEFT adapter directory of a `save_weights` (unmerged) or
        `save_state` checkpoint is read and pushed to every replica under the
        synthetic key ``"ckpt:<uri>"`` with the checkpoint's step as its
        version (re-pushed to restarted replicas like a session's adapter).
        The `MAX_SCORING_CHECKPOINTS` most recently used stay loaded; older
        ones are dropped from the replicas.

        Raises:
            ServiceError: INVALID_ARGUMENT (malformed URI, merged checkpoint),
                NOT_FOUND (unknown or another key's), DATA_LOSS (corrupted or
                unreadable), FAILED_PRECONDITION (no replicas, or the adapter
                does not fit this model).
        """
        from together_train_server.engines.lora import read_peft_adapter

        ckpt = self.get_checkpoint(uri, owner)
        if ckpt.merged:
            raise invalid(f"{uri} is a merged model; compute_logprobs scores unmerged adapter checkpoints", key="uri")
        if len(self.pool) == 0:
            raise ServiceError("FAILED_PRECONDITION", "this resource has no generator replicas to score with")
        with self._scoring_lock:
            hit = self._scoring_ckpts.pop(uri, None)
            if hit is not None:
                self._scoring_ckpts[uri] = hit  # most recently used last
                return hit
            ckpt = self.get_checkpoint(uri, owner, verify=True)
            try:
                spec, tensors = read_peft_adapter(ckpt.path)
            except (OSError, ValueError, KeyError) as e:
                raise ServiceError("DATA_LOSS", f"checkpoint {uri} has no readable adapter: {e}", key="uri") from e
            key = f"ckpt:{uri}"
            try:
                self.pool.push_all(key, ckpt.step, spec, tensors)
            except ServiceError as e:
                if e.code == "INTERNAL":  # the replica refused the tensors
                    raise ServiceError("FAILED_PRECONDITION", f"checkpoint {uri} does not fit this model: {e.message}",
                                       key="uri") from e
                raise
            self._scoring_ckpts[uri] = (key, ckpt.step)
            while len(self._scoring_ckpts) > self.MAX_SCORING_CHECKPOINTS:
                old = next(iter(self._scoring_ckpts))
                old_key, _ = self._scoring_ckpts.pop(old)
                self.pool.drop_all(old_key)
            return key, ckpt.step
