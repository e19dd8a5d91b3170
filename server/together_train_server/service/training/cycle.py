"""The clock cycle on the trainer runtime: ready forwards of several sessions run as one engine call.

Policy (docs/design.md §5): a cycle starts as soon as the trainer worker is
free and takes what is ready, no fixed wait (``serve --batch-window-ms N``
waits up to N ms for more when only one forward is ready and another session
ran an operation within ``max(2 s, 10 windows)``: a lone session's pipelined
loop never waits for a window). It takes the
scheduler's next set of ready operations of distinct sessions, up to the
engine's ``micro_batch_tokens`` tokens (``ReadyQueue.get_batch``: the fair
scheduler's order). Of these, the forward / forward_backward /
custom_forward_backward operations run as the cycle while the memory estimate
of all their samples as one micro-batch passes the same admission rule as one
operation (``MemoryAdmission.admits``); the others (optim_step, checkpoints, a
forward that does not fit) run one by one after it. Sessions are distinct, so
every session's operations stay strictly in order. A long operation is never
held back by more than one cycle of short ones, nor short ones by more than
the long one, and the engine runs an operation that cannot share a pass
(``cross_session.joins_pass``) alone. The runtime's ``forward_many`` runs the
cycle's operations in as few passes over the base as fit; operations that
cannot share a pass run alone, as before. A cycle of one operation runs it as
before (``record.run``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from together_train_server.engines.cross_session import ForwardItem
from together_train_server.engines.types import ForwardOutput
from together_train_server.service.errors import ServiceError, internal_error, invalid

if TYPE_CHECKING:
    from together_train_server.service.training.memory_admission import MemoryAdmission
    from together_train_server.service.core.scheduler import ReadyQueue
    from together_train_server.service.core.operations import OperationRecord

__all__ = ["CycleRun", "ClockCycle", "CycleEngine"]


class CycleEngine(Protocol):
    """What a cycle runs its forwards through: the trainer runtime's ``forward_many`` (on its thread)."""

    def forward_many(self, items: Sequence[ForwardItem]) -> list[ForwardOutput | BaseException]: ...


class CycleRun:
    """A forward operation's ``run`` that also carries its engine arguments (``item``) for a cycle.

    Calling it runs the operation alone (``fn()``), as any record's ``run``.
    """

    def __init__(self, fn: Callable[[], Any], item: ForwardItem) -> None:
        self.fn = fn
        self.item = item

    def __call__(self) -> Any:
        return self.fn()


@dataclass
class ClockCycle:
    """What the trainer runtime needs to run a cycle (built by `TrainerRuntime.use_cycle` when the engine
    declares ``clock_cycle``).

    Attributes:
        runtime: the trainer runtime (its ``forward_many``, on its own thread).
        admission: ``MemoryAdmission`` (its ``admits(lens, backward)``).
        budget_tokens: a cycle's tokens at most (the engine's ``micro_batch_tokens``).
        window_s: how long to wait for a second ready operation (0: no wait).
        active_s: a session that had an operation taken within ``max(active_s, 10 x window_s)`` seconds
            is active; the window is waited only when another session than the ready one is.
    """

    runtime: CycleEngine
    admission: MemoryAdmission
    window_s: float = 0.0
    budget_tokens: int = 8192
    active_s: float = 2.0
    _seen: dict[str, float] = field(default_factory=dict, repr=False)   # session id -> last taken (monotonic)

    @staticmethod
    def item_of(record: OperationRecord) -> ForwardItem | None:
        """The record's engine arguments when it may join a cycle (None: it runs on its own)."""
        run = getattr(record, "run", None)
        return run.item if isinstance(run, CycleRun) else None

    def fits(self, items: Sequence[ForwardItem]) -> bool:
        """The items' tokens within the cycle budget and their samples admitted as one micro-batch."""
        lens = [len(s.model_input) for it in items for s in it.samples]
        if sum(lens) > self.budget_tokens:
            return False
        return self.admission.admits(lens, any(it.backward for it in items))

    def take(self, ready: ReadyQueue[OperationRecord]) -> list[OperationRecord]:
        """The next set of ready records of distinct sessions (``ReadyQueue.get_batch`` up to the engine's
        ``micro_batch_tokens``, in the scheduler's order); with a window, when only one forward is ready,
        what becomes ready within it is added. Empty once the queue is closed."""
        budget = self.budget_tokens
        batch = ready.get_batch(budget)
        if (batch and self.window_s > 0 and len(batch) == 1 and self.item_of(batch[0]) is not None
                and self._others_active(batch[0].session_id)):
            batch += ready.get_batch(budget, timeout=self.window_s)
        now = time.monotonic()
        for rec in batch:
            if rec.session_id:   # not the runtime's own calls (the sweeper's page-outs)
                self._seen[rec.session_id] = now
        return batch

    def _others_active(self, session_id: str) -> bool:
        """Whether a session other than ``session_id`` had an operation taken recently (``active_s``)."""
        horizon = time.monotonic() - max(self.active_s, 10 * self.window_s)
        for sid in [sid for sid, t in self._seen.items() if t < horizon]:
            del self._seen[sid]
        return any(sid != session_id for sid in self._seen)

    def pick(self, records: Sequence[OperationRecord]) -> list[OperationRecord]:
        """The records (in order) whose forwards run as the cycle: each session's first record when it is a
        forward that `fits` beside those picked before it. A session with a record passed over adds
        nothing after it, so every session's order holds when the rest run after the cycle."""
        picked: list[OperationRecord] = []
        items: list[ForwardItem] = []
        passed: set[str] = set()
        for rec in records:
            item = self.item_of(rec)
            if rec.session_id not in passed and item is not None and self.fits(items + [item]):
                picked.append(rec)
                items.append(item)
            passed.add(rec.session_id)
        return picked

    def run(self, records: Sequence[OperationRecord]) -> list[tuple[bool, Any]]:
        """Run the cycle's records' forwards in one engine call; per record ``(ok, result or ServiceError)``."""
        items: list[ForwardItem] = []
        for r in records:
            item = self.item_of(r)
            if item is None:  # `pick` never gives one
                raise ValueError(f"operation {r.operation_id} ({r.kind}) cannot join a clock cycle")
            items.append(item)
        outs = self.runtime.forward_many(items)
        return [self._settled(r, o) for r, o in zip(records, outs)]

    @staticmethod
    def _settled(record: OperationRecord, out: ForwardOutput | BaseException) -> tuple[bool, Any]:
        if not isinstance(out, BaseException):
            return True, out
        if isinstance(out, FloatingPointError):   # as _run_forward: a non-finite loss/gradient is the input's
            return False, invalid(str(out))
        if isinstance(out, ServiceError):
            return False, out
        if hasattr(out, "grpc_code"):
            return False, ServiceError(out.grpc_code, str(out))
        return False, internal_error(out, what=record.kind, session_id=record.session_id,
                                     operation_id=record.operation_id)
