"""Weight publishing: weights_sync's push, pushes after a load, the publish chain of each session.

`WeightsPublisher` is one of the parts `Resource` is composed of (service/resource.py). The trainer
worker only snapshots adapter tensors; pushes to the generator replicas run on a thread per push,
chained per session so they reach the replicas in submission order (`publish_async`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

from together_train_server.engines.lora import tensor_bytes
from together_train_server.service.errors import ServiceError, internal_error
from together_train_server.service.replicas.pool import ReplicaPool
from together_train_server.service.core.runtime import TrainerRuntime
from together_train_server.service.core.session_record import ACTIVE, SessionRecord
from together_train_server.service.telemetry import Telemetry

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class WeightsSyncOutcome:
    """Result of a weights_sync: the version published and what it cost."""

    policy_version: int
    num_replicas: int
    num_bytes: int
    seconds: float


class WeightsPublisher:
    """Publishing sessions' adapters to the replicas: weights_sync, after a load, in each session's order.

    Args:
        runtime: the trainer runtime (adapter snapshots, on its thread).
        pool: the generator replicas (may be empty).
        telemetry: records each push (`Telemetry.weights_pushed`).
    """

    def __init__(self, runtime: TrainerRuntime, pool: ReplicaPool[Any], telemetry: Telemetry) -> None:
        self.runtime = runtime
        self.pool = pool
        self.telemetry = telemetry
        self._lock = threading.Lock()  # guards each session's publish_tail

    def prepare_sync(self, s: SessionRecord, background: bool) -> Callable[[], Callable[[], Any]]:
        """The `prepare` of a weights_sync operation (`Submissions.submit`): publish `s`'s current adapter.

        The trainer worker only snapshots the adapter tensors; the push runs on
        its own thread (`publish_async`), so other sessions keep training
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
        which version served them). FAILED_PRECONDITION (at submission) without replicas.
        """

        def prepare() -> Callable[[], Any]:
            if len(self.pool) == 0:
                raise ServiceError(
                    "FAILED_PRECONDITION",
                    "this resource has no generator replicas; weights_sync needs at least one (--generators N)",
                )
            return lambda: self._sync(s, background)

        return prepare

    def _sync(self, s: SessionRecord, background: bool) -> WeightsSyncOutcome | concurrent.futures.Future:
        # On the trainer worker only the snapshot (a copy: training goes on during the push),
        # taken in the replicas' dtype: one converting pass, the buffer pushed as it is.
        session_id = s.session_id
        t0 = time.perf_counter()
        version = self.runtime.step(session_id)
        fresh = s.fresh_at(version)  # read with the tensors: a later load does not make these loaded weights
        tensors = self.runtime.adapter_tensors(session_id, self.pool.snapshot_dtype())

        def push() -> WeightsSyncOutcome:
            if s.state != ACTIVE:
                raise ServiceError("CANCELLED", f"session {session_id} was {s.state.lower()} before its push")
            nbytes, replicas = self.pool.publish(session_id, version, s.lora, tensors)
            s.synced_version = max(s.synced_version, version)
            if not fresh:
                s.serves_base = False
            if s.state != ACTIVE:  # stopped while pushing: its drop_all may have run before the push
                self.pool.drop_all(session_id)
            seconds = time.perf_counter() - t0
            self.telemetry.weights_pushed(session_id, version, nbytes, replicas, seconds)
            return WeightsSyncOutcome(version, replicas, nbytes, seconds)

        done = self.publish_async(s, push)
        if not background:
            # Succeeds once every replica still in routing serves `version` (laggards are
            # taken out of routing until re-pushed); UNAVAILABLE when none took it.
            return done

        def report(f: concurrent.futures.Future[WeightsSyncOutcome]) -> None:
            if f.exception() is not None:
                log.warning("background weights_sync of %s v%d failed: %s", session_id, version, f.exception())

        done.add_done_callback(report)
        nbytes = tensor_bytes(tensors)
        return WeightsSyncOutcome(version, len(self.pool), nbytes, time.perf_counter() - t0)

    def loaded_snapshot(self, s: SessionRecord) -> Mapping[str, torch.Tensor] | None:
        """After a load into `s` (on the runtime's thread): mark its adapter loaded and copy the tensors
        `publish_loaded` pushes; None when nothing is pushed (full mode, no replicas)."""
        s.loaded = True
        if self.runtime.mode == "full" or len(self.pool) == 0:
            return None
        return self.runtime.adapter_tensors(s.session_id, self.pool.snapshot_dtype())

    def publish_loaded(self, s: SessionRecord, step: int, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """After a load: make the replicas serve the loaded weights (`tensors`) under `step`.

        The step may go down (loading an older checkpoint), and replicas never
        replace a version by an older one, so the session's adapter is dropped
        from every replica first. Loaded weights are pushed whatever their
        step: a step-0 checkpoint or an imported adapter is not the fresh
        adapter (B = 0), so from now on the session is never served by the
        base model. Without replicas only the bookkeeping changes.
        """
        if self.runtime.mode == "full":
            return  # full-weight sessions have no adapter to push; replicas keep serving the base model
        if len(self.pool) > 0:
            self.pool.drop_all(s.session_id)
            if tensors is not None:
                self.pool.push_all(s.session_id, step, s.lora, tensors)
        s.synced_version = step
        s.serves_base = False

    def publish_async(self, s: SessionRecord, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` (a push to the replicas, or what must follow one) on its own thread, after the
        session's previous one.

        The trainer worker never waits on a replica: an operation returns this
        future and stays RUNNING until it resolves. Chaining on the session's
        previous publish keeps its pushes in submission order (a load_state's
        drop + push and a weights_sync never overtake each other). Errors other
        than ServiceError become INTERNAL (logged with the traceback).
        """
        out: concurrent.futures.Future[T] = concurrent.futures.Future()
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
