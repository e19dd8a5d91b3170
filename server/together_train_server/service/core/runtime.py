"""`TrainerRuntime`: the trainer engine's one owner and its only caller (docs/design.md §5).

As vLLM's ``EngineCore`` owns its model executor, the runtime owns the trainer engine: the
scheduler (`scheduler.ReadyQueue`) decides what runs next, the runtime runs it on its one
thread, nobody else touches the engine. Every engine call is a runtime method:

- the operations a session queues (forward, optim_step, checkpoints, weights pushes, snapshots)
  run on the runtime's thread as their records come out of the ready queue, and call the engine
  through the runtime's methods there;
- session create and drop, the sweeper's page-outs and idle checkpoints are `call`s: they join the
  same ready queue as a session's operations (`RuntimeCall`, never in the operation book) and the
  caller waits for their result;
- pure calls (``memory_estimate``, ``model_dims``, a checkpoint's metadata) change no engine state
  and run on the caller's thread.

A runtime method called off the runtime's thread is made a `call` of its own, so the engine is
never entered by two threads and no lock is handed around.

Paging (service/sessions/pager.py) is one hook here: every call naming a session pages it in first
(`SessionPager.ensure`); a create registers the session, a drop forgets its page. What the engine
can do (`TrainerCapabilities`) is read once, when the runtime is built: the clock cycle and
paging are set up then, and never probed at call time.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, TypeVar

from together_train_server.engines.interfaces import TrainerCapabilities, TrainerEngine
from together_train_server.engines.wrapped import WrappedTrainerEngine
from together_train_server.engines.types import AdamParams, ForwardOutput, LoraConfig, OptimOutput, Sample
from together_train_server.service.core.operations import (
    FAILED, QUEUED, RUNNING, SUCCEEDED, OperationBook, OperationRecord, SessionQueue)
from together_train_server.service.core.scheduler import ReadyQueue
from together_train_server.service.errors import ServiceError, internal_error

if TYPE_CHECKING:
    import torch

    from together_train_server.engines.cross_session import ForwardItem
    from together_train_server.engines.memory_estimate import MicroBatchEstimate

__all__ = ["Cycle", "PagingHook", "RuntimeCall", "TrainerRuntime"]

log = logging.getLogger(__name__)
T = TypeVar("T")
P = TypeVar("P", bound="PagingHook")
_ids = itertools.count(1)


class PagingHook(Protocol):
    """The runtime's paging hook (`sessions.pager.SessionPager`): called on the runtime's thread."""

    def ensure(self, session_id: str) -> None: ...

    def created(self, session_id: str, spec: LoraConfig, num_params: int) -> None: ...

    def dropped(self, session_id: str) -> bool: ...

    def has_idle(self, idle_for: Callable[[str], float], after_s: float) -> bool: ...

    def page_out_idle(self, idle_for: Callable[[str], float], after_s: float) -> int: ...

    def run_cycle(self, items: Sequence[ForwardItem],
                  many: Callable[[Sequence[ForwardItem]], list[ForwardOutput | BaseException]],
                  one: Callable[..., ForwardOutput]) -> list[ForwardOutput | BaseException]: ...


class Cycle(Protocol):
    """The clock cycle the runtime runs (`training.cycle.ClockCycle`)."""

    def take(self, ready: ReadyQueue[Any]) -> list[Any]: ...

    def pick(self, records: Sequence[Any]) -> list[Any]: ...

    def run(self, records: Sequence[Any]) -> list[tuple[bool, Any]]: ...


class RuntimeCall:
    """Work the runtime runs on its thread in the scheduler's order that is not a session's operation
    (session create/drop, the sweeper's page-outs and idle checkpoints): never in the operation book.

    What the scheduler reads (`scheduler.Queued`): ``operation_id``, ``session_id``, ``tenant``, ``tokens``
    (0: it costs ``FIXED_COST``), ``terminal``. The caller waits on ``future``.
    """

    def __init__(self, fn: Callable[[], Any], session_id: str, tenant: str, kind: str) -> None:
        self.fn = fn
        self.operation_id = f"rt-{next(_ids)}"
        self.session_id = session_id
        self.tenant = tenant
        self.kind = kind
        self.tokens = 0
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    @property
    def terminal(self) -> bool:
        return self.future.done()

    def execute(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn())
        except BaseException as err:  # the caller re-raises it
            self.future.set_exception(err)

    def refuse(self) -> None:
        """Shutting down before it ran: the caller gets a retryable UNAVAILABLE."""
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(ServiceError(
                "UNAVAILABLE", f"the resource is shutting down ({self.kind} not run); retry on the restarted resource",
                retryable=True))


class _PageIO:
    """The engine calls a `SessionPager` makes (write a session out, read it back, drop it), for the runtime's
    paging hook: the pager decides, these run, on the runtime's thread."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def save_session(self, adapter_id: str, path: str | os.PathLike) -> int:
        return int(self._engine.save_session(adapter_id, path))

    def load_session(self, adapter_id: str, spec: LoraConfig, path: str | os.PathLike) -> int:
        return int(self._engine.load_session(adapter_id, spec, path))

    def drop_adapter(self, adapter_id: str) -> None:
        self._engine.drop_adapter(adapter_id)


class TrainerRuntime:
    """One thread running ready operations of every session in its scheduler's order, and the only caller
    of the trainer engine (module docstring).

    With a clock cycle (`use_cycle`, when the engine declares ``clock_cycle``), the runtime takes a set of
    ready operations of distinct sessions at a time (``ReadyQueue.get_batch``) and runs their forwards as
    one cycle, the others one by one after it.

    An operation's run() may return a `concurrent.futures.Future` instead of
    its result: the runtime moves on at once and the operation stays RUNNING
    until the future resolves (its result, or its ServiceError).

    Args:
        engine: the trainer engine (with its hooks, engines/wrapped.py); nothing else may call it.
        book: the operation records.
        scheduler: ``"fair"`` (deficit round-robin across API keys, then sessions) or ``"fifo"``
            (service/core/scheduler.py).
    """

    def __init__(self, engine: TrainerEngine, book: OperationBook, scheduler: str = "fair") -> None:
        self._engine = engine
        self.book = book
        self.capabilities: TrainerCapabilities = engine.capabilities
        self.ready: ReadyQueue[Any] = ReadyQueue(scheduler)
        self.pager: PagingHook | None = None
        self.cycle: Cycle | None = None   # the clock cycle (service/training/cycle.py); None: one at a time
        self._closing = threading.Event()
        self._closed = threading.Event()
        self._refused = 0
        self._running: OperationRecord | None = None
        self._thread = threading.Thread(target=self._loop, name="trainer-runtime", daemon=True)
        self._thread.start()

    # ----- set up once, when the resource is built (capabilities checked here, never at call time)
    def use_pager(self, make: Callable[[Any], P | None]) -> P | None:
        """Page sessions with the pager ``make`` builds over the engine's page I/O, when the engine declares
        ``paging`` and trains LoRA (``make`` may return None: paging off). Returns the pager in use."""
        if self.capabilities.paging and self._engine.mode == "lora":
            # pages are written and read unhooked, as the engine's own (page writes have their own test
            # fault hook, engines/session_pages.py)
            inner = self._engine.inner if isinstance(self._engine, WrappedTrainerEngine) else self._engine
            pager = make(_PageIO(inner))
            self.pager = pager
            return pager
        return None

    def use_cycle(self, make: Callable[[TrainerRuntime], Cycle]) -> bool:
        """Run ready forwards of several sessions as one clock cycle when the engine declares ``clock_cycle``;
        returns whether it does."""
        if self.capabilities.clock_cycle:
            self.cycle = make(self)
        return self.cycle is not None

    # ----- what the engine is (read-only attributes, any thread)
    @property
    def model_id(self) -> str:
        return self._engine.model_id

    @property
    def model_dir(self) -> Path:
        return self._engine.model_dir

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self._engine.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self._engine.max_seq_len

    @property
    def dtype(self) -> str:
        return self._engine.dtype

    @property
    def mode(self) -> str:
        return self._engine.mode

    @property
    def lora_target_modules(self) -> Sequence[str]:
        return self._engine.lora_target_modules

    @property
    def backend_name(self) -> str:
        return self._engine.backend_name

    @property
    def micro_batch_tokens(self) -> int:
        return int(self._engine.micro_batch_tokens)

    # ----- running things on the runtime's thread
    def on_thread(self) -> bool:
        """Whether the caller is the runtime's thread."""
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[[], T], *, session_id: str = "", tenant: str = "", kind: str = "call") -> T:
        """Run ``fn`` on the runtime's thread in the scheduler's order (as an operation of ``session_id`` of
        API key ``tenant``) and return its result; on the runtime's thread, ``fn()`` at once.

        Raises:
            whatever ``fn`` raised; ServiceError UNAVAILABLE (retryable) once the runtime is shut down.
        """
        if self.on_thread():
            return fn()
        call = RuntimeCall(fn, session_id, tenant, kind)
        if self._closing.is_set():
            call.refuse()
        else:
            self.ready.put(call)
        while True:
            try:
                return call.future.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if self._closed.is_set():   # queued after the drain: it will never be taken
                    call.refuse()

    def _engine_call(self, session_id: str, fn: Callable[[], T], kind: str) -> T:
        """``fn()`` (an engine call naming ``session_id``) on the runtime's thread, the session paged in first."""
        if not self.on_thread():
            return self.call(lambda: self._engine_call(session_id, fn, kind), session_id=session_id, kind=kind)
        if self.pager is not None:
            self.pager.ensure(session_id)
        return fn()

    # ----- sessions
    def create_adapter(self, session_id: str, spec: LoraConfig) -> int:
        """The session's adapter (`TrainerEngine.create_adapter`); registered with the pager, which may page
        another session out to make room. Returns its trainable parameter count."""
        if not self.on_thread():
            return self.call(lambda: self.create_adapter(session_id, spec), session_id=session_id, kind="create")
        n = self._engine.create_adapter(session_id, spec)
        if self.pager is not None:
            self.pager.created(session_id, spec, n)
        return n

    def drop_adapter(self, session_id: str) -> None:
        """Free the session from the trainer (a paged-out one: delete its page instead)."""
        if not self.on_thread():
            return self.call(lambda: self.drop_adapter(session_id), session_id=session_id, kind="drop")
        if self.pager is None or self.pager.dropped(session_id):
            self._engine.drop_adapter(session_id)

    def page_out_idle(self, idle_for: Callable[[str], float], after_s: float) -> int:
        """Page out every idle resident session unused for ``after_s`` seconds (`SessionPager.page_out_idle`);
        returns how many (0 without paging)."""
        pager = self.pager
        if pager is None or not pager.has_idle(idle_for, after_s):   # queue nothing when nothing is due
            return 0
        return self.call(lambda: pager.page_out_idle(idle_for, after_s), kind="page_out")

    def step(self, session_id: str) -> int:
        """Optimizer steps the session took (its policy version)."""
        return self._engine_call(session_id, lambda: int(self._engine.step(session_id)), "step")

    # ----- training
    def forward(self, session_id: str, samples: Sequence[Sample], loss_fn: str,
                loss_params: Mapping[str, Any] | None = None, *, backward: bool = False,
                return_logprobs: bool = False, return_elementwise: bool = False) -> ForwardOutput:
        """`TrainerEngine.forward` of the session (see it for shapes and errors)."""
        return self._engine_call(session_id, lambda: self._engine.forward(
            session_id, samples, loss_fn, loss_params, backward=backward, return_logprobs=return_logprobs,
            return_elementwise=return_elementwise), "forward")

    def forward_many(self, items: Sequence[ForwardItem]) -> list[ForwardOutput | BaseException]:
        """A clock cycle (`CycleTrainer.forward_many`) once every item's session is in; per item its output or
        its own error. When paging one in pushed another of the cycle out (the budget holds fewer), the items
        run one by one through ``forward``; an item whose session cannot be paged in gets that error."""
        if not self.on_thread():
            return self.call(lambda: self.forward_many(items), kind="forward_many")
        many: Callable[[Sequence[ForwardItem]], list[ForwardOutput | BaseException]] = \
            self._engine.forward_many  # type: ignore[attr-defined]   # capabilities.clock_cycle: use_cycle
        if self.pager is None:
            return many(items)
        return self.pager.run_cycle(items, many, self.forward)

    def optim_step(self, session_id: str, cfg: AdamParams) -> OptimOutput:
        """One AdamW step of the session (`TrainerEngine.optim_step`)."""
        return self._engine_call(session_id, lambda: self._engine.optim_step(session_id, cfg), "optim_step")

    # ----- weights and checkpoints out and in
    def adapter_tensors(self, session_id: str, dtype: str = "float32") -> Mapping[str, torch.Tensor]:
        """A copy of the session's adapter weights (`TrainerEngine.adapter_tensors`)."""
        return self._engine_call(session_id, lambda: self._engine.adapter_tensors(session_id, dtype),
                                 "adapter_tensors")

    def save_adapter(self, session_id: str, out_dir: str | os.PathLike) -> None:
        self._engine_call(session_id, lambda: self._engine.save_adapter(session_id, out_dir), "save_adapter")

    def save_merged(self, session_id: str, out_dir: str | os.PathLike) -> None:
        self._engine_call(session_id, lambda: self._engine.save_merged(session_id, out_dir), "save_merged")

    def save_state(self, session_id: str, out_dir: str | os.PathLike) -> None:
        self._engine_call(session_id, lambda: self._engine.save_state(session_id, out_dir), "save_state")

    def load_state(self, session_id: str, state_dir: str | os.PathLike, with_optimizer: bool) -> int:
        """Load a training checkpoint into the session; returns its step."""
        return self._engine_call(session_id, lambda: int(self._engine.load_state(session_id, state_dir,
                                                                                 with_optimizer)), "load_state")

    # ----- pure calls (no engine state changes: the caller's thread)
    def memory_estimate(self, lens: Sequence[int], backward: bool, adapter_id: str | None = None) -> MicroBatchEstimate:
        return self._engine.memory_estimate(lens, backward, adapter_id)

    def model_dims(self) -> Any:
        return self._engine.model_dims()

    def read_state_meta(self, state_dir: str | os.PathLike) -> dict[str, Any]:
        return self._engine.read_state_meta(state_dir)

    def spec_from_meta(self, meta: Mapping[str, Any]) -> LoraConfig:
        return self._engine.spec_from_meta(meta)

    def state_differences(self, meta: Mapping[str, Any], spec: LoraConfig | None = None) -> list[str]:
        return self._engine.state_differences(meta, spec)

    def base_fingerprint(self) -> dict[str, Any]:
        return self._engine.base_fingerprint()

    # ----- the operation queue
    def new_queue(self, session_id: str, owner: str = "") -> SessionQueue:
        """A session's operation queue, releasing its operations into this runtime in seq_id order."""
        return SessionQueue(session_id, self.book, self, owner)

    def enqueue(self, record: OperationRecord) -> None:
        record.locate = self.ready.position
        self.ready.put(record)

    def close(self, timeout_s: float = 3.0) -> None:
        """Shut down (SIGTERM): the operation running finishes (waited for up to `timeout_s`); every
        one queued behind it FAILS with a retryable UNAVAILABLE (recorded in the book and the event
        log) and never runs, so the drain does not last as long as the queue. A checkpoint being
        written when the process ends is never listed (the store renames it into place once complete)."""
        self._closing.set()
        self.ready.close()
        self._thread.join(timeout=timeout_s)
        for rec in self.ready.drain():
            self._refuse(rec)
        self._closed.set()
        if self._thread.is_alive():  # the running operation outlasts the drain: record its end now
            running = self._running
            if running is not None and not running.terminal:
                self.book.update(running, status=FAILED, finished_at=time.time(), error=ServiceError(
                    "UNAVAILABLE", "the resource shut down while this operation ran; its effect is not kept "
                    "(retry on the restarted resource from the last checkpoint)", retryable=True))
        if self._refused:
            log.warning("trainer runtime shutting down: %d queued operations failed with UNAVAILABLE (retryable)",
                        self._refused)

    def _refuse(self, rec: OperationRecord | RuntimeCall) -> None:
        if isinstance(rec, RuntimeCall):
            rec.refuse()
            return
        with self.book._cond:  # (an RLock) the runtime's thread and close() may both drain the queue
            if rec.status != QUEUED:
                return
            self._refused += 1
            self.book.update(rec, status=FAILED, finished_at=time.time(), error=ServiceError(
                "UNAVAILABLE", "the resource is shutting down; retry on the restarted resource", retryable=True))

    def _loop(self) -> None:
        while True:
            if self.cycle is None:
                rec = self.ready.get()
                batch = [] if rec is None else [rec]
            else:
                batch = self.cycle.take(self.ready)
            if not batch:
                return
            todo = []
            for rec in batch:
                if isinstance(rec, RuntimeCall):
                    todo.append(rec)
                    continue
                if rec.status != QUEUED:  # cancelled while waiting
                    continue
                if self._closing.is_set():
                    self._refuse(rec)
                    continue
                todo.append(rec)
            cycle = self.cycle.pick(todo) if self.cycle is not None and len(todo) > 1 else []
            if len(cycle) < 2:
                cycle = []
            for rec in todo:   # the scheduler's order; the cycle runs at its first member's place
                if cycle and rec is cycle[0]:
                    self._run_cycle(cycle)
                if isinstance(rec, RuntimeCall):
                    rec.execute()
                elif rec not in cycle:
                    self._run_one(rec)

    def _run_cycle(self, records: list[OperationRecord]) -> None:
        """Run a clock cycle's records (``self.cycle.run``) and record each one's end."""
        assert self.cycle is not None
        now = time.time()
        log.info("clock cycle: %d operations of sessions %s in one engine call", len(records),
                 ", ".join(r.session_id for r in records))
        for r in records:
            self.book.update(r, status=RUNNING, started_at=now)
        self._running = records[0]
        t0 = time.perf_counter()
        try:
            outs = self.cycle.run(records)
        except Exception as err:  # the cycle itself failed: every record reports it
            outs = [(False, internal_error(err, what=r.kind, session_id=r.session_id, operation_id=r.operation_id))
                    for r in records]
        for r, (ok, value) in zip(records, outs):
            r.trainer_s = time.perf_counter() - t0
            if ok:
                self.book.update(r, status=SUCCEEDED, result=value, finished_at=time.time())
            else:
                self.book.update(r, status=FAILED, error=value, finished_at=time.time())
            r.run = None

    def _run_one(self, rec: OperationRecord) -> None:
        self._running = rec
        self.book.update(rec, status=RUNNING, started_at=time.time())
        try:
            result = self._timed(rec)
        except ServiceError as err:
            self.book.update(rec, status=FAILED, error=err, finished_at=time.time())
        except Exception as err:  # engine bug or OOM: report, keep serving
            self.book.update(
                rec,
                status=FAILED,
                # An engine error may name its status (e.g. the DeepSpeed backend's
                # RankFailure: UNAVAILABLE); engines carry the code name, not gRPC.
                # A coded engine error is a deliberate message; an uncoded one is logged with
                # its traceback under an error id that the client's message carries.
                error=ServiceError(err.grpc_code, str(err)) if hasattr(err, "grpc_code")
                else internal_error(err, what=rec.kind, session_id=rec.session_id,
                                    operation_id=rec.operation_id),
                finished_at=time.time(),
            )
        else:
            if isinstance(result, concurrent.futures.Future):
                # The trainer part is done; the rest (a weights push) finishes off this
                # thread, so other sessions keep training while it waits on replicas.
                result.add_done_callback(functools.partial(self._settle, rec))
            else:
                self.book.update(rec, status=SUCCEEDED, result=result, finished_at=time.time())
        finally:
            rec.run = None  # drop references to request tensors

    @staticmethod
    def _timed(rec: OperationRecord) -> Any:
        """rec.run(), its wall time in ``rec.trainer_s`` (set before the record ends, whatever happens)."""
        t0 = time.perf_counter()
        try:
            if rec.run is None:
                raise RuntimeError(f"operation {rec.operation_id} has nothing to run")
            return rec.run()
        finally:
            rec.trainer_s = time.perf_counter() - t0

    def _settle(self, rec: OperationRecord, fut: concurrent.futures.Future) -> None:
        """Finish an operation whose run() returned a Future: its result, or its ServiceError."""
        err = fut.exception()
        if err is None:
            self.book.update(rec, status=SUCCEEDED, result=fut.result(), finished_at=time.time())
        else:
            error = err if isinstance(err, ServiceError) else internal_error(
                err, what=rec.kind, session_id=rec.session_id, operation_id=rec.operation_id)
            self.book.update(rec, status=FAILED, error=error, finished_at=time.time())
