"""Training submissions of a `Resource`: forward, forward_backward, custom_forward_backward, optim_step.

Every submission is validated before it is queued (`_submit`): a malformed
request becomes a FAILED operation that keeps its seq_id and touches no
state. Operations run on the trainer worker under ``engine_lock``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from together_train_server.engines.cross_session import ForwardItem
from together_train_server.engines.loss_specs import LOSS_SPECS
from together_train_server.engines.types import AdamParams, Sample
from together_train_server.service import validation
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.training.cycle import CycleRun
from together_train_server.service.training.operations import OperationRecord
from together_train_server.service.resource_state import ResourceState


def _num_tokens(samples: Sequence[tuple[Any, Any]]) -> int:
    """model_input tokens of a request (0 when it is malformed: validation reports that)."""
    try:
        return sum(len(mi) for mi, _ in samples)
    except (TypeError, ValueError):
        return 0



class TrainingOpsMixin(ResourceState):
    """Operation submission (`_submit`), the training operations and operation lookup of a `Resource`."""

    def _submit(
        self,
        session_id: str,
        owner: str,
        seq_id: int,
        idempotency_key: str,
        kind: str,
        prepare: Callable[[], Callable[[], Any]],
        tokens: int = 0,
    ) -> OperationRecord:
        """Queue an operation. `prepare` validates and returns the function to run.

        A validation error, or a refusal by the key's quotas (service/tenancy/quotas.py), becomes a FAILED
        operation occupying its seq_id, so the session's order is kept and no state is touched. `tokens`: the
        request's model_input tokens (telemetry counts them when it succeeds).
        """
        s = self.active_session(session_id, owner)
        try:
            run = prepare()
            error = None
        except ServiceError as err:
            run, error = None, err
        with self.quotas.lock:  # count, then queue: atomic per resource
            if error is None:
                error = self._quota_refusal(owner, tokens)
                run = run if error is None else None
            return s.queue.submit(seq_id, idempotency_key, kind, self._locked(run) if run else None, error,
                                  tokens=tokens)

    def _quota_refusal(self, owner: str, tokens: int) -> ServiceError | None:
        """Why `owner` may not queue one more operation of `tokens` now (None: it may)."""
        in_flight = [r for s in self.list_sessions_all() if s.owner == owner for r in s.queue.pending()]
        return self.quotas.operation_refusal(len(in_flight), tokens, sum(r.tokens for r in in_flight),
                                             used=lambda: self.usage_meter.tokens_of_owner(owner))

    def _locked(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with self.engine_lock:
                return fn()

        item = getattr(fn, "item", None)   # a forward that may join a clock cycle (cycle.py)
        return CycleRun(run, item) if item is not None else run

    def _check_batch(
        self, loss_fn: str, loss_params: Mapping[str, Any], samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]]
    ) -> tuple[dict[str, Any], list[Sample]]:
        params = validation.validate_loss_params(loss_fn, loss_params, LOSS_SPECS)
        inputs, why = validation.effective_inputs(LOSS_SPECS[loss_fn], params)
        checked = validation.validate_samples(samples, inputs, self.limits, required_because=why)
        validation.validate_loss_inputs(LOSS_SPECS[loss_fn], params, checked)
        return params, [Sample(model_input=mi, inputs=inp) for mi, inp in checked]

    def _run_forward(self, session_id: str, batch: list[Sample], loss_fn: str, params: Mapping[str, Any],
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
            self.admission.check(session_id, [len(s.model_input) for s in batch], backward)
            return CycleRun(lambda: self._run_forward(
                session_id, batch, loss_fn, params, backward, return_logprobs, return_elementwise
            ), ForwardItem(session_id, batch, loss_fn, params, backward, return_logprobs, return_elementwise))

        kind = "forward_backward" if backward else "forward"
        return self._submit(session_id, owner, seq_id, idempotency_key, kind, prepare, _num_tokens(samples))

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

        return self._submit(session_id, owner, seq_id, idempotency_key, "custom_forward_backward", prepare,
                            _num_tokens(samples))

    def submit_optim_step(
        self, session_id: str, seq_id: int, idempotency_key: str, adam: Mapping[str, float | None], owner: str = ""
    ) -> OperationRecord:
        """Queue an AdamW step; result is an OptimOutput (step = new policy version)."""
        s = self.get_session(session_id, owner)

        def prepare() -> Callable[[], Any]:
            cfg = AdamParams(**validation.validate_adam(adam))

            def run() -> Any:
                out = self.engine.optim_step(session_id, cfg)
                s.step = out.step
                return out

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "optim_step", prepare)

    def get_operation(self, operation_id: str, owner: str = "") -> OperationRecord:
        """Raises ServiceError NOT_FOUND for an unknown id, or one of another API key's session."""
        rec = self.book.get(operation_id)
        with self._lock:
            s = self._sessions.get(rec.session_id)
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
        rec = self.get_operation(operation_id, owner)
        with self._lock:
            s = self._sessions.get(rec.session_id)
        if s is not None:
            s.queue.cancel(rec)
        return rec
