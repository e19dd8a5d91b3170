"""Operation submission: forward, forward_backward, custom_forward_backward, optim_step, and lookup.

`Submissions` is one of the parts `Resource` is composed of (service/resource.py). Every
submission is validated before it is queued (`submit`): a malformed request becomes a FAILED
operation that keeps its seq_id and touches no state. Operations run on the trainer runtime's thread
(service/core/runtime.py), which makes their engine calls. The other parts' operations (save/load, weights_sync, snapshots, session samples)
hand their ``prepare`` to `submit`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from together_train_server.engines.cross_session import ForwardItem
from together_train_server.engines.loss_specs import LOSS_SPECS
from together_train_server.engines.types import AdamParams, ForwardOutput, OptimOutput, Sample
from together_train_server.service import validation
from together_train_server.service.core.operations import OperationBook, OperationRecord
from together_train_server.service.core.runtime import TrainerRuntime
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.sessions.table import SessionTable
from together_train_server.service.tenancy.quotas import Quotas
from together_train_server.service.usage.meter import UsageMeter
from together_train_server.service.training.cycle import CycleRun
from together_train_server.service.training.memory_admission import MemoryAdmission


def _num_tokens(samples: Sequence[tuple[Any, Any]]) -> int:
    """model_input tokens of a request (0 when it is malformed: validation reports that)."""
    try:
        return sum(len(mi) for mi, _ in samples)
    except (TypeError, ValueError):
        return 0


class Submissions:
    """Operation submission (`submit`), the training operations and operation lookup.

    Args:
        sessions: the sessions operations are queued in (their queues, owner checks).
        runtime: the trainer runtime the operations run on (its engine calls, on its thread).
        book: the operation book (lookup, waits, detached operations).
        limits: requests are checked against them before they are queued.
        admission: the per-operation memory budget (RESOURCE_EXHAUSTED at submission).
        quotas: per-API-key limits on queued operations (RESOURCE_EXHAUSTED at submission).
        usage: the usage meter (a key's tokens used, for its token quota).
    """

    def __init__(self, sessions: SessionTable, runtime: TrainerRuntime, book: OperationBook,
                 limits: validation.Limits, admission: MemoryAdmission, quotas: Quotas, usage: UsageMeter) -> None:
        self.sessions = sessions
        self.runtime = runtime
        self.book = book
        self.limits = limits
        self.admission = admission
        self.quotas = quotas
        self.usage = usage

    def submit(
        self,
        session_id: str,
        owner: str,
        seq_id: int,
        idempotency_key: str,
        kind: str,
        prepare: Callable[[], Callable[[], Any]],
        tokens: int = 0,
    ) -> OperationRecord:
        """Queue an operation of an ACTIVE session. `prepare` validates and returns the function to run.

        A validation error (ServiceError from `prepare`), or a refusal by the key's quotas
        (service/tenancy/quotas.py), becomes a FAILED operation occupying its seq_id, so the session's
        order is kept and no state is touched. The function runs on the trainer runtime's thread; it may
        return a Future (the operation stays RUNNING until it resolves).
        `tokens`: the request's model_input tokens (telemetry counts them when it succeeds).

        Raises:
            ServiceError: NOT_FOUND / FAILED_PRECONDITION for an unknown or inactive session
                (`SessionTable.active_session`).
        """
        s = self.sessions.active_session(session_id, owner)
        try:
            run = prepare()
            error = None
        except ServiceError as err:
            run, error = None, err
        with self.quotas.lock:  # count, then queue: atomic per resource
            if error is None:
                error = self._quota_refusal(owner, tokens)
                run = run if error is None else None
            return s.queue.submit(seq_id, idempotency_key, kind, run, error, tokens=tokens)

    def _quota_refusal(self, owner: str, tokens: int) -> ServiceError | None:
        """Why `owner` may not queue one more operation of `tokens` now (None: it may)."""
        in_flight = [r for s in self.sessions.list_sessions_all() if s.owner == owner for r in s.queue.pending()]
        return self.quotas.operation_refusal(len(in_flight), tokens, sum(r.tokens for r in in_flight),
                                             used=lambda: self.usage.tokens_of_owner(owner))

    def _check_batch(
        self, loss_fn: str, loss_params: Mapping[str, Any], samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]]
    ) -> tuple[dict[str, Any], list[Sample]]:
        params = validation.validate_loss_params(loss_fn, loss_params, LOSS_SPECS)
        inputs, why = validation.effective_inputs(LOSS_SPECS[loss_fn], params)
        checked = validation.validate_samples(samples, inputs, self.limits, required_because=why)
        validation.validate_loss_inputs(LOSS_SPECS[loss_fn], params, checked)
        return params, [Sample(model_input=mi, inputs=inp) for mi, inp in checked]

    def _run_forward(self, session_id: str, batch: list[Sample], loss_fn: str, params: Mapping[str, Any],
                     backward: bool, return_logprobs: bool, return_elementwise: bool) -> ForwardOutput:
        """The runtime's forward; a non-finite loss/gradient becomes INVALID_ARGUMENT (state untouched)."""
        try:
            return self.runtime.forward(
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
            self.admission.check(session_id, [len(s.model_input) for s in batch], backward)
            return CycleRun(lambda: self._run_forward(
                session_id, batch, loss_fn, params, backward, return_logprobs, return_elementwise
            ), ForwardItem(session_id, batch, loss_fn, params, backward, return_logprobs, return_elementwise))

        kind = "forward_backward" if backward else "forward"
        return self.submit(session_id, owner, seq_id, idempotency_key, kind, prepare, _num_tokens(samples))

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
                Sample(model_input=mi, inputs={**inp, "gradients": np.asarray(g, dtype=np.float32)})
                for (mi, inp), g in zip(checked, gradients)
            ]
            self.admission.check(session_id, [len(s.model_input) for s in batch], True)
            return CycleRun(lambda: self._run_forward(
                session_id, batch, "custom", {}, True, return_logprobs, return_elementwise
            ), ForwardItem(session_id, batch, "custom", {}, True, return_logprobs, return_elementwise))

        return self.submit(session_id, owner, seq_id, idempotency_key, "custom_forward_backward", prepare,
                            _num_tokens(samples))

    def submit_optim_step(
        self, session_id: str, seq_id: int, idempotency_key: str, adam: Mapping[str, float | None], owner: str = ""
    ) -> OperationRecord:
        """Queue an AdamW step; result is an OptimOutput (step = new policy version)."""
        s = self.sessions.get_session(session_id, owner)

        def prepare() -> Callable[[], Any]:
            cfg = AdamParams(**validation.validate_adam(adam))

            def run() -> OptimOutput:
                out = self.runtime.optim_step(session_id, cfg)
                s.step = out.step
                return out

            return run

        return self.submit(session_id, owner, seq_id, idempotency_key, "optim_step", prepare)

    def get_operation(self, operation_id: str, owner: str = "") -> OperationRecord:
        """Raises ServiceError NOT_FOUND for an unknown id, or one of another API key's session."""
        rec = self.book.get(operation_id)
        s = self.sessions.find(rec.session_id)
        if s is not None and s.owner and s.owner != owner:
            raise ServiceError("NOT_FOUND", f"unknown operation {operation_id!r}", key="operation_id")
        return rec

    def wait_operation(self, operation_id: str, timeout_s: float, owner: str = "", *,
                       max_wait_s: float = 60.0) -> OperationRecord:
        """The operation once terminal, or as it is after `timeout_s` (0 = 30 s; at most `max_wait_s`, 60 s:
        gRPC's WaitOperation; an in-process caller waiting on an operation it depends on passes more).

        Raises:
            ServiceError: NOT_FOUND for an unknown id or one of another API key's session.
        """
        self.get_operation(operation_id, owner)
        return self.book.wait(operation_id, min(max(timeout_s, 0.0) or 30.0, max_wait_s))

    def run_detached(self, kind: str, fn: Callable[[], Any], *, session_id: str = "") -> OperationRecord:
        """Run `fn` as an operation outside every session queue (e.g. an HTTP API's create-model or sampling).

        Returns its record at once (RUNNING); it ends SUCCEEDED with `fn`'s result, or FAILED with its
        ServiceError (other errors become INTERNAL). `session_id` ("" = none) scopes it for owner checks
        and telemetry; `kind` names it in telemetry.
        """
        return self.book.run_detached(session_id, kind, fn)

    def cancel_operation(self, operation_id: str, owner: str = "") -> OperationRecord:
        """Cancel a queued operation (a running one finishes). Raises as `get_operation`."""
        rec = self.get_operation(operation_id, owner)
        s = self.sessions.find(rec.session_id)
        if s is not None:
            s.queue.cancel(rec)
        return rec
