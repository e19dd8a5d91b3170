"""The clock cycle on the trainer worker: ready forwards of several sessions run as one engine call.

Policy (docs/design.md §5): a cycle starts as soon as the trainer worker is
free and takes what is ready, no fixed wait (``serve --batch-window-ms N``
waits up to N ms for more when only one operation is ready). It takes the
operation at the head of the queue and, behind it, every further ready
forward / forward_backward / custom_forward_backward that is the next
operation of another session, in queue order, while their tokens fit the
cycle's budget (the engine's ``micro_batch_tokens``) and the memory estimate
of all their samples as one micro-batch passes the same admission rule as one
operation (``MemoryAdmission.admits``). A session whose next operation is not
a forward (an optim_step, a checkpoint), does not fit, or is already in the
cycle adds nothing more: each session's operations stay strictly in order,
while sessions overtake one another only within a cycle. What is left keeps its
queue order and heads the next cycles, so a long operation is never held back
by more than one cycle of short ones, nor short ones by more than the long one. The engine (``forward_many``) runs the
cycle's operations in as few passes over the base as fit; operations that
cannot share a pass run alone, as before. A cycle of one operation runs it as
before (``record.run``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from together_train_server.engines.cross_session import ForwardItem
from together_train_server.service.errors import ServiceError, internal_error, invalid

__all__ = ["CycleRun", "ClockCycle", "SCAN_MAX"]

SCAN_MAX = 256   # ready records a cycle looks through behind its head


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
    """What the trainer worker needs to run a cycle.

    Attributes:
        engine: the trainer engine (``forward_many``, ``micro_batch_tokens``).
        lock: the engine lock (held for the whole cycle).
        admission: ``MemoryAdmission`` (its ``admits(lens, backward)``).
        window_s: how long to wait for a second ready operation (0: no wait).
    """

    engine: Any
    lock: Any
    admission: Any
    window_s: float = 0.0

    @staticmethod
    def item_of(record: Any) -> ForwardItem | None:
        """The record's engine arguments when it may join a cycle (None: it runs on its own)."""
        run = getattr(record, "run", None)
        return run.item if isinstance(run, CycleRun) else None

    def fits(self, items: Sequence[ForwardItem]) -> bool:
        """The items' tokens within the cycle budget and their samples admitted as one micro-batch."""
        lens = [len(s.model_input) for it in items for s in it.samples]
        if sum(lens) > int(getattr(self.engine, "micro_batch_tokens", 0)):
            return False
        return self.admission.admits(lens, any(it.backward for it in items))

    def take(self, first: Any, ready: Callable[[float], list[Any]], remove: Callable[[Any], None]) -> list[Any]:
        """The records of the cycle headed by ``first`` (module docstring).

        ``ready(timeout_s)`` lists the records ready behind ``first`` in queue order (waiting up to
        ``timeout_s`` for one when there are none); ``remove(record)`` takes one of them out of the
        queue. A session's records keep their order: once one of its records is passed over, none of
        its later ones joins. Only ``first`` is taken when it cannot join a cycle.
        """
        item = self.item_of(first)
        if item is None:
            return [first]
        taken, items = [first], [item]
        passed = {first.session_id}
        for rec in ready(self.window_s)[:SCAN_MAX]:
            item = self.item_of(rec)
            if rec.session_id not in passed and item is not None and self.fits(items + [item]):
                taken.append(rec)
                items.append(item)
            passed.add(rec.session_id)
        for rec in taken[1:]:
            remove(rec)
        return taken

    def run(self, records: Sequence[Any]) -> list[tuple[bool, Any]]:
        """Run the cycle's records' forwards in one engine call; per record ``(ok, result or ServiceError)``."""
        items = [self.item_of(r) for r in records]
        with self.lock:
            outs = self.engine.forward_many(items)
        return [self._settled(r, o) for r, o in zip(records, outs)]

    @staticmethod
    def _settled(record: Any, out: Any) -> tuple[bool, Any]:
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
