"""The model resource: sessions, their operation queues, weight versions and checkpoints.

`Resource` is the service layer the gRPC servicers call with plain Python
values. It validates every request before queuing it (a malformed request
becomes a FAILED operation that never touches state), runs operations on
one trainer worker in each session's `seq_id` order, publishes adapter
versions to the generator replicas and writes checkpoints.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from together_train_server.engines.losses import LOSS_SPECS
from together_train_server.engines.types import AdamConfig, LoraSpec, TrainSample
from together_train_server.service import validation
from together_train_server.service.checkpoints import CheckpointStore
from together_train_server.service.errors import ServiceError, invalid, unimplemented
from together_train_server.service.operations import (
    OperationBook,
    OperationRecord,
    SessionQueue,
    TrainerWorker,
)
from together_train_server.service.replicas import ReplicaPool

PROTOCOL_VERSION = "1"
ACTIVE, STOPPED, EXPIRED = "ACTIVE", "STOPPED", "EXPIRED"
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OPERATIONS = (
    "forward",
    "forward_backward",
    "custom_forward_backward",
    "optim_step",
    "weights_sync",
    "save_weights",
    "sample",
    "compute_logprobs",
)


@dataclass
class Session:
    """One LoRA adapter with its optimizer, step counter and operation queue."""

    session_id: str
    name: str
    lora: LoraSpec
    queue: SessionQueue
    num_trainable_params: int
    owner: str = ""
    state: str = ACTIVE
    created_at: float = field(default_factory=time.time)
    last_active_at: float = field(default_factory=time.time)
    # Policy version the replicas serve for this session. Version 0 is the
    # freshly initialised adapter (B = 0), identical to the base model.
    synced_version: int = 0
    step: int = 0


@dataclass
class WeightsSyncOutcome:
    """Result of a weights_sync: the version published and what it cost."""

    policy_version: int
    num_replicas: int
    num_bytes: int
    seconds: float


class Resource:
    """Sessions and operations over one trainer engine and a replica pool.

    Args:
        engine: a trainer engine (see docs/internals.md), e.g. TorchTrainerEngine.
        pool: generator replicas (may be empty: a trainer-only resource).
        storage_dir: where checkpoints are written.
        limits: request limits; vocab size and context length come from the engine.
        max_sessions: concurrent ACTIVE sessions allowed (RESOURCE_EXHAUSTED past it).
        idle_timeout_s: a session with no call for this long expires (DESIGN §6).
        generator_engine: name reported in capabilities.
    """

    def __init__(
        self,
        engine: Any,
        pool: ReplicaPool,
        storage_dir: Path,
        *,
        limits: validation.Limits | None = None,
        max_sessions: int = 8,
        idle_timeout_s: float = 3600.0,
        generator_engine: str = "torch",
    ) -> None:
        self.engine = engine
        self.pool = pool
        self.store = CheckpointStore(Path(storage_dir))
        self.limits = limits or validation.Limits(vocab_size=engine.vocab_size, max_seq_len=engine.max_seq_len)
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.generator_engine = generator_engine
        self.book = OperationBook()
        self.worker = TrainerWorker(self.book)
        # The engine is not thread-safe: the worker holds this lock while an
        # operation runs; session create/drop take it too.
        self.engine_lock = threading.RLock()
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="session-expiry", daemon=True)
        self._sweeper.start()

    # ----- capabilities -------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        """Everything GetCapabilities reports, as plain values."""
        return {
            "protocol_version": PROTOCOL_VERSION,
            "model_id": self.engine.model_id,
            "vocab_size": self.limits.vocab_size,
            "max_seq_len": self.limits.max_seq_len,
            "mode": "lora",
            "operations": list(OPERATIONS),
            "max_lora_rank": self.limits.max_lora_rank,
            "lora_target_modules": list(LORA_TARGET_MODULES),
            "max_sessions": self.max_sessions,
            "losses": list(LOSS_SPECS.values()),
            "limits": self.limits,
            "num_replicas": len(self.pool),
            "adam_defaults": dict(validation.ADAM_DEFAULTS),
            "generator_engine": self.generator_engine,
            "trainer_backend": type(self.engine).__name__,
            "dtype": str(getattr(self.engine, "dtype", "float32")),
        }

    # ----- sessions ------------------------------------------------------------------------
    def create_session(
        self, lora: LoraSpec, *, name: str = "", owner: str = "", checkpoint_uri: str = "", with_optimizer: bool = False
    ) -> Session:
        """Create a LoRA session (adapter + AdamW + step counter).

        Raises:
            ServiceError: INVALID_ARGUMENT for a bad LoRA config,
                RESOURCE_EXHAUSTED past max_sessions, UNIMPLEMENTED when asked
                to start from a checkpoint (a later release).
        """
        validation.validate_lora(
            lora.rank, lora.alpha, lora.dropout, lora.target_modules, LORA_TARGET_MODULES, self.limits
        )
        if checkpoint_uri:
            raise unimplemented("creating a session from a training checkpoint")
        with self._lock:
            active = sum(1 for s in self._sessions.values() if s.state == ACTIVE)
            if active >= self.max_sessions:
                raise ServiceError(
                    "RESOURCE_EXHAUSTED",
                    f"this resource already has {active} active sessions (max_sessions={self.max_sessions}); "
                    "stop one first",
                    retryable=True,
                )
            session_id = f"s-{uuid.uuid4().hex[:12]}"
            queue = SessionQueue(session_id, self.book, self.worker)
            # Reserve the slot before the slow adapter creation.
            placeholder = Session(session_id, name, lora, queue, 0, owner=owner)
            self._sessions[session_id] = placeholder
        try:
            with self.engine_lock:
                n_params = self.engine.create_adapter(session_id, lora)
        except Exception:
            with self._lock:
                del self._sessions[session_id]
            raise
        placeholder.num_trainable_params = int(n_params)
        return placeholder

    def get_session(self, session_id: str, owner: str = "") -> Session:
        """Raises ServiceError NOT_FOUND for an unknown id (or one owned by another key)."""
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None or (s.owner and s.owner != owner):
            raise ServiceError("NOT_FOUND", f"unknown session {session_id!r}", key="session_id")
        return s

    def active_session(self, session_id: str, owner: str = "") -> Session:
        """The session if ACTIVE, touching its idle timer.

        Raises:
            ServiceError: NOT_FOUND for an unknown id; FAILED_PRECONDITION for
                a stopped or expired session.
        """
        s = self.get_session(session_id, owner)
        if s.state != ACTIVE:
            raise ServiceError(
                "FAILED_PRECONDITION",
                f"session {session_id} is {s.state.lower()}; create a new session"
                + (" (it expired after an idle timeout; call keep_alive to prevent that)" if s.state == EXPIRED else ""),
                key="session_id",
            )
        s.last_active_at = time.time()
        return s

    def list_sessions(self, owner: str = "") -> list[Session]:
        with self._lock:
            return [s for s in self._sessions.values() if not s.owner or s.owner == owner]

    def stop_session(self, session_id: str, owner: str = "", *, state: str = STOPPED) -> Session:
        """Cancel queued operations, drop the adapter everywhere, free the slot."""
        s = self.get_session(session_id, owner)
        if s.state != ACTIVE:
            return s
        s.state = state
        s.queue.cancel_all(f"session {session_id} was {state.lower()}")
        with self.engine_lock:  # waits for a running operation to finish
            self.engine.drop_adapter(session_id)
        self.pool.drop_all(session_id)
        return s

    def keep_alive(self, session_id: str, owner: str = "") -> Session:
        return self.active_session(session_id, owner)

    def expires_at(self, s: Session) -> float:
        return s.last_active_at + self.idle_timeout_s

    def _sweep_loop(self) -> None:
        while not self._closed.wait(min(10.0, self.idle_timeout_s / 4)):
            now = time.time()
            for s in self.list_sessions_all():
                if s.state == ACTIVE and now > self.expires_at(s) and not s.queue.pending():
                    self.stop_session(s.session_id, s.owner, state=EXPIRED)

    def list_sessions_all(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    # ----- operations -----------------------------------------------------------------------
    def _submit(
        self,
        session_id: str,
        owner: str,
        seq_id: int,
        idempotency_key: str,
        kind: str,
        prepare: Callable[[], Callable[[], Any]],
    ) -> OperationRecord:
        """Queue an operation. `prepare` validates and returns the function to run.

        A validation error becomes a FAILED operation occupying its seq_id, so
        the session's order is kept and no state is touched.
        """
        s = self.active_session(session_id, owner)
        try:
            run = prepare()
            error = None
        except ServiceError as err:
            run, error = None, err
        return s.queue.submit(seq_id, idempotency_key, kind, self._locked(run) if run else None, error)

    def _locked(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with self.engine_lock:
                return fn()

        return run

    def _check_batch(
        self, loss_fn: str, loss_params: Mapping[str, Any], samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]]
    ) -> tuple[dict[str, Any], list[TrainSample]]:
        params = validation.validate_loss_params(loss_fn, loss_params, LOSS_SPECS)
        inputs, why = validation.effective_inputs(LOSS_SPECS[loss_fn], params)
        checked = validation.validate_samples(samples, inputs, self.limits, required_because=why)
        return params, [TrainSample(model_input=mi, inputs=inp) for mi, inp in checked]

    def _run_forward(self, session_id: str, batch: list[TrainSample], loss_fn: str, params: Mapping[str, Any],
                     backward: bool, return_logprobs: bool, return_elementwise: bool) -> Any:
        """Run engine.forward; a non-finite loss/gradient becomes INVALID_ARGUMENT (state untouched)."""
        try:
            return self.engine.forward(
                session_id,
                batch,
                loss_fn,
                params,
                backward=backward,
                return_logprobs=return_logprobs,
                return_elementwise=return_elementwise,
            )
        except FloatingPointError as err:
            raise invalid(str(err)) from None

    def submit_forward(
        self,
        session_id: str,
        seq_id: int,
        idempotency_key: str,
        *,
        samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]],
        loss_fn: str,
        loss_params: Mapping[str, Any],
        backward: bool,
        return_logprobs: bool,
        return_elementwise: bool,
        owner: str = "",
    ) -> OperationRecord:
        """Queue `forward` (backward=False) or `forward_backward`; result is a ForwardOutput."""

        def prepare() -> Callable[[], Any]:
            params, batch = self._check_batch(loss_fn, loss_params, samples)
            return lambda: self._run_forward(
                session_id, batch, loss_fn, params, backward, return_logprobs, return_elementwise
            )

        kind = "forward_backward" if backward else "forward"
        return self._submit(session_id, owner, seq_id, idempotency_key, kind, prepare)

    def submit_custom_forward_backward(
        self,
        session_id: str,
        seq_id: int,
        idempotency_key: str,
        *,
        samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]],
        gradients: Sequence[np.ndarray],
        return_logprobs: bool = True,
        return_elementwise: bool = False,
        owner: str = "",
    ) -> OperationRecord:
        """Queue custom_forward_backward: backpropagate client gradients ``g = dL/dp``.

        The engine runs the ``custom`` loss, ``l_t = g_t * p_t``: the gradient
        reaching each target-token logprob ``p_t`` is exactly ``g_t``, and the
        reported loss is ``sum g·p`` (a sum, not the client's own loss value).

        Validation (before queuing, state untouched): each sample's
        ``loss_fn_inputs`` holds ``target_tokens`` only; ``gradients`` has one
        float 1-D array per sample, as long as the sample, finite (errors name
        the sample index and the key ``gradients``).
        """

        def prepare() -> Callable[[], Any]:
            checked = validation.validate_samples(
                samples, LOSS_SPECS["custom"].inputs[:1], self.limits, extra_per_sample=gradients
            )
            batch = [
                TrainSample(model_input=mi, inputs={**inp, "gradients": np.asarray(g, dtype=np.float32)})
                for (mi, inp), g in zip(checked, gradients)
            ]
            return lambda: self._run_forward(
                session_id, batch, "custom", {}, True, return_logprobs, return_elementwise
            )

        return self._submit(session_id, owner, seq_id, idempotency_key, "custom_forward_backward", prepare)

    def submit_optim_step(
        self, session_id: str, seq_id: int, idempotency_key: str, adam: Mapping[str, float | None], owner: str = ""
    ) -> OperationRecord:
        """Queue an AdamW step; result is an OptimOutput (step = new policy version)."""
        s = self.get_session(session_id, owner)

        def prepare() -> Callable[[], Any]:
            cfg = AdamConfig(**validation.validate_adam(adam))

            def run() -> Any:
                out = self.engine.optim_step(session_id, cfg)
                s.step = out.step
                return out

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "optim_step", prepare)

    def submit_weights_sync(
        self, session_id: str, seq_id: int, idempotency_key: str, background: bool, owner: str = ""
    ) -> OperationRecord:
        """Queue a weights_sync: publish the session's current adapter to every replica.

        Synchronous mode completes when all replicas serve the new version;
        background mode completes once the tensors are snapshotted and the
        push is under way (samples report which version served them).
        """
        s = self.get_session(session_id, owner)

        def prepare() -> Callable[[], Any]:
            if len(self.pool) == 0:
                raise ServiceError(
                    "FAILED_PRECONDITION",
                    "this resource has no generator replicas; weights_sync needs at least one (--generators N)",
                )

            def run() -> WeightsSyncOutcome:
                t0 = time.perf_counter()
                version = self.engine.step(session_id)
                tensors = self.engine.adapter_tensors(session_id)

                def push() -> int:
                    n = self.pool.push_all(session_id, version, s.lora, tensors)
                    s.synced_version = max(s.synced_version, version)
                    return n

                if background:
                    threading.Thread(target=push, name=f"push-{session_id}", daemon=True).start()
                    nbytes = sum(int(t.numel()) * 4 for t in tensors.values())
                else:
                    nbytes = push()
                return WeightsSyncOutcome(version, len(self.pool), nbytes, time.perf_counter() - t0)

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "weights_sync", prepare)

    def submit_save_weights(
        self, session_id: str, seq_id: int, idempotency_key: str, name: str, merged: bool, owner: str = ""
    ) -> OperationRecord:
        """Queue save_weights: a PEFT adapter directory in the checkpoint store."""
        from together_train_server.service.checkpoints import validate_name

        def prepare() -> Callable[[], Any]:
            validate_name(name)
            if merged:
                raise unimplemented("save_weights(merged=True)")

            def run() -> Any:
                step = self.engine.step(session_id)
                with self.store.writer(session_id, "weights", name, step=step) as tmp:
                    self.engine.save_adapter(session_id, tmp)
                return self.store.get(self.store.uri(session_id, "weights", name), verify=False)

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "save_weights", prepare)

    def submit_unimplemented(
        self, session_id: str, seq_id: int, idempotency_key: str, kind: str, feature: str, owner: str = ""
    ) -> OperationRecord:
        """Queue an operation of a later release: it FAILS with UNIMPLEMENTED, keeping seq order."""

        def prepare() -> Callable[[], Any]:
            raise unimplemented(feature)

        return self._submit(session_id, owner, seq_id, idempotency_key, kind, prepare)

    def get_operation(self, operation_id: str) -> OperationRecord:
        return self.book.get(operation_id)

    def wait_operation(self, operation_id: str, timeout_s: float) -> OperationRecord:
        return self.book.wait(operation_id, min(max(timeout_s, 0.0) or 30.0, 60.0))

    def cancel_operation(self, operation_id: str) -> OperationRecord:
        rec = self.book.get(operation_id)
        s = self._sessions.get(rec.session_id)
        if s is not None:
            s.queue.cancel(rec)
        return rec

    # ----- sampling --------------------------------------------------------------------------
    def check_sample_session(self, session_id: str, owner: str = "") -> int:
        """Version a sample for this session will be served with (-1 = base model)."""
        if not session_id:
            return -1
        return self.active_session(session_id, owner).synced_version

    def close(self) -> None:
        self._closed.set()
        self.worker.close()
        self.pool.close()
