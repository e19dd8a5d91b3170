"""`Session`: one training session (a LoRA adapter, its optimizer, its step counter) on a resource.

Wire details (what the server can rely on):

- Operation RPCs carry an ``OperationHeader``: the session id, a ``seq_id``
  starting at `SessionInfo.next_seq_id` and increasing by one per operation
  (assigned and sent under a per-session lock, so RPCs reach the server in
  seq order), and a fresh uuid4 hex idempotency key. A retried RPC resends the
  same header.
- When an operation RPC is refused, the client reads ``next_seq_id`` back
  with ``GetSession`` (so it works whether or not the server consumed the
  refused seq_id).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

import numpy as np

from together_train._async import returns_future, with_async_twins
from together_train._convert import converter_for
from together_train._requests import custom_forward_backward_request, forward_request
from together_train._proto import resource_pb2, session_pb2
from together_train.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    TogetherTrainError,
)
from together_train._poller import resolve_operation
from together_train.futures import OperationFuture
from together_train.retry import RetryPolicy
from together_train.snapshot import Snapshot
from together_train.types import (
    AdamParams,
    CheckpointInfo,
    ComputeLogprobsResult,
    ForwardResult,
    LoadStateResult,
    OptimStepResult,
    Sample,
    SampleResult,
    SamplingParams,
    OperationStatus,
    SessionInfo,
    TokenArray,
    Usage,
    WeightsSyncResult,
)

if TYPE_CHECKING:
    from together_train._client_handle import ClientHandle

__all__ = ["Session"]

logger = logging.getLogger("together_train")

_SYNC_MODES = {"synchronous": session_pb2.SYNCHRONOUS, "background": session_pb2.BACKGROUND}


@with_async_twins
class Session:
    """One training session: a LoRA adapter, its optimizer, its step counter.

    Obtained from `ResourceClient.create_session` or `ResourceClient.session`.

    Trainer side (`forward`, `forward_backward`, `custom_forward_backward`,
    `optim_step`, `weights_sync`, `save_weights`, `save_state`, `load_state`,
    `load_state_with_optimizer`) returns an `OperationFuture` as soon as the
    server has queued the operation. Operations run strictly in the order
    submitted; gradients accumulate across ``forward_backward`` calls until
    ``optim_step``.

    Where errors surface: client-side validation errors are raised by the
    call itself, before anything is sent. A request the server refuses at
    submission (unknown or stopped session, bad API key) is raised by the
    call too. An invalid batch is reported by the resource as a FAILED
    operation (it keeps its place in the order and changes nothing), so it
    is raised by ``future.result()``, as is any failure while running.

    Generator side (`sample`, `compute_logprobs`) runs on the generator
    replicas and waits (client side) for the last *synchronous* `weights_sync`
    submitted before it on this session, so it reads that version. Background
    syncs are not waited for; every result names the version it came from.

    Every method has an ``*_async`` coroutine variant returning the result.
    The submission itself (a fast unary RPC) runs synchronously inside it, so
    coroutines started in order submit in order.

    As a context manager, the session is cleaned up on exit (`close`):
    operations that have not started are cancelled, the running one is
    waited for until terminal, then the session is stopped. Wait for the
    results you need inside the block.

    While this object and its client live, the client's keep-alive thread
    keeps the session from expiring on the server (see `ResourceClient`'s
    ``keepalive_interval_s``); once it is stopped, garbage-collected or its
    client closed, the session expires after the server's idle timeout.
    """

    def __init__(self, client: "ClientHandle", info: SessionInfo) -> None:
        self.client = client
        self.session_id = info.session_id
        self._info = info
        self._lock = threading.Lock()
        self._next_seq = int(info.next_seq_id)
        self._pending: dict[str, OperationFuture] = {}
        self._pending_lock = threading.Lock()
        self._last_sync: OperationFuture | None = None
        self._stopped = False
        if client._keepalive is not None and info.state == "active":
            client._keepalive.register(self)

    @property
    def id(self) -> str:
        """The session id (same as `session_id`)."""
        return self.session_id

    @property
    def next_seq_id(self) -> int:
        """The seq_id the next operation will carry."""
        return self._next_seq

    def __repr__(self) -> str:
        return f"<Session {self.session_id} next_seq_id={self._next_seq}>"

    # ------------------------------------------------------------------ plumbing
    def _header(self, seq: int) -> session_pb2.OperationHeader:
        return session_pb2.OperationHeader(session_id=self.session_id, seq_id=seq, idempotency_key=uuid.uuid4().hex)

    def _submit(self, kind: str, method: Any, request: Any, converter: Any = None) -> OperationFuture:
        """Send one operation RPC in seq order and return its future (its result made by `converter`, by
        default the kind's `converter_for`)."""
        client = self.client
        client._check_open()
        with self._lock:
            seq = self._next_seq
            request.header.CopyFrom(self._header(seq))
            try:
                op = client._call(method, request, what=kind)
            except TogetherTrainError:
                self._resync_seq(seq)
                raise
            self._next_seq = seq + 1
            inner: cf.Future = cf.Future()
            fut: OperationFuture = OperationFuture(
                inner, kind=op.kind or kind, operation_id=op.operation_id, seq_id=seq, canceller=self._cancel
            )
            with self._pending_lock:
                self._pending[op.operation_id] = fut
            oid = op.operation_id
            inner.add_done_callback(lambda _f: self._forget(oid))
            client._poller.track(self.session_id, op, inner, converter or converter_for(kind, client.storage_dir))
            if kind == "weights_sync" and request.mode != session_pb2.BACKGROUND:
                self._last_sync = fut
        return fut

    def _forget(self, operation_id: str) -> None:
        with self._pending_lock:
            self._pending.pop(operation_id, None)

    def _resync_seq(self, seq: int) -> None:
        """After a refused submission: read next_seq_id back from the server
        (it may or may not have consumed `seq`); keep `seq` if that fails."""
        try:
            info = self.client._call(
                self.client._resource.GetSession,
                resource_pb2.GetSessionRequest(session_id=self.session_id),
                what="GetSession",
                retry=RetryPolicy(max_attempts=2),
            )
            self._next_seq = int(info.next_seq_id)
        except TogetherTrainError:
            self._next_seq = seq

    def _cancel(self, fut: OperationFuture) -> bool:
        try:
            op = self.client._call(
                self.client._sessions.CancelOperation,
                session_pb2.CancelOperationRequest(operation_id=fut.operation_id or ""),
                what="CancelOperation",
            )
        except TogetherTrainError as err:
            logger.debug("cancel of %s refused: %s", fut.operation_id, err)
            return fut.cancelled()
        if op.status == session_pb2.CANCELLED:
            fut._inner.cancel()
            return True
        if op.status in (session_pb2.SUCCEEDED, session_pb2.FAILED):
            resolve_operation(op, fut._inner, converter_for(fut.kind, self.client.storage_dir))
        return fut.cancelled()

    # ------------------------------------------------------------------ trainer side
    @returns_future
    def forward(
        self,
        samples: Sequence[Sample],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, Any] | None = None,
        *,
        return_logprobs: bool = False,
        return_elementwise_loss: bool = False,
        validate: bool = True,
    ) -> OperationFuture[ForwardResult]:
        """Compute the loss (and optionally per-token logprobs) without gradients.

        Args:
            samples: the batch (`Sample`; see docs/design.md §4 for the layout).
            loss_fn: a loss name from `Capabilities.losses`: ``cross_entropy``,
                ``importance_sampling``, ``ppo``, ``cispo``, ``dro``, ``gspo``, ``grpo``.
            loss_fn_config: loss parameters (numbers / strings), e.g.
                ``{"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}``.
            return_logprobs: also return float32 [n_i] target-token logprobs per sample.
            return_elementwise_loss: also return float32 [n_i] per-position losses.
            validate: check samples, loss name and parameters client-side first
                (False: send as is, to exercise the server's validation).

        Returns:
            Future of a `ForwardResult` whose ``loss`` is a SUM over samples and positions.

        Raises:
            InvalidArgumentError: at once, when client-side validation fails
                (names the sample index and key: lengths differ, not 1-D, NaN/inf,
                negative token id, unknown/missing key, unknown loss or parameter);
                from ``result()`` when the server refuses the batch (e.g. a token
                id outside the vocabulary, a sample over the context length).
            TogetherTrainError: from ``result()`` when the operation fails.
        """
        req = forward_request(self.client._known_losses(), samples, loss_fn, loss_fn_config, return_logprobs,
                              return_elementwise_loss, validate)
        return self._submit("forward", self.client._sessions.Forward, req)

    @returns_future
    def forward_backward(
        self,
        samples: Sequence[Sample],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, Any] | None = None,
        *,
        return_logprobs: bool = False,
        return_elementwise_loss: bool = False,
        validate: bool = True,
    ) -> OperationFuture[ForwardResult]:
        """Like `forward`, and add the gradient of the (summed) loss into the
        adapter's accumulated gradient (applied by the next `optim_step`).

        A failed or cancelled forward_backward leaves the accumulated gradient
        as it was. Arguments, result and errors as in `forward`.
        """
        req = forward_request(self.client._known_losses(), samples, loss_fn, loss_fn_config, return_logprobs,
                              return_elementwise_loss, validate)
        return self._submit("forward_backward", self.client._sessions.ForwardBackward, req)

    @returns_future
    def custom_forward_backward(
        self,
        samples: Sequence[Sample],
        gradients: Sequence[Sequence[float] | np.ndarray],
        *,
        return_logprobs: bool = True,
        return_elementwise_loss: bool = False,
        validate: bool = True,
    ) -> OperationFuture[ForwardResult]:
        """Backpropagate client-computed gradients ``g = dL/dp`` (p = target-token
        logprob), i.e. the gradient of ``Σ g·p``.

        Args:
            samples: the batch (needs ``target_tokens``).
            gradients: one float [n_i] array per sample, finite.

        Returns:
            Future of a `ForwardResult`; its ``loss`` is ``Σ g·p`` (a sum over samples
            and positions: the surrogate backpropagated, not your loss's value).

        Raises:
            InvalidArgumentError: count or length mismatch, non-finite values (at once;
                from ``result()`` when the server refuses them, naming the sample and
                the key ``gradients``; a sample's ``loss_fn_inputs`` may hold only
                ``target_tokens``).
            UnimplementedError: when the resource does not offer it yet.
        """
        req = custom_forward_backward_request(samples, gradients, return_logprobs, return_elementwise_loss, validate)
        return self._submit("custom_forward_backward", self.client._sessions.CustomForwardBackward, req)

    @returns_future
    def optim_step(self, adam_params: AdamParams, *, validate: bool = True) -> OperationFuture[OptimStepResult]:
        """Apply one AdamW step with the accumulated gradient, then zero it.

        Every `AdamParams` field is sent (no hidden schedule). The policy
        version becomes the new step number.

        Args:
            adam_params: the hyperparameters of this step.
            validate: check their ranges client-side first (False: leave it to the server).

        Returns:
            Future of `OptimStepResult` (step, pre-clip grad norm, learning rate).
        """
        if not isinstance(adam_params, AdamParams):
            raise InvalidArgumentError("optim_step takes an AdamParams", key="adam_params")
        if validate:
            adam_params.validate()
        req = session_pb2.OptimStepRequest(adam_params=adam_params.to_proto())
        return self._submit("optim_step", self.client._sessions.OptimStep, req)

    @returns_future
    def weights_sync(
        self, mode: Literal["synchronous", "background"] = "synchronous"
    ) -> OperationFuture[WeightsSyncResult]:
        """Publish the adapter as it is after every operation submitted before
        this one to all generator replicas.

        Args:
            mode: ``"synchronous"``: the operation ends when every replica serves
                the new version, and this session's later `sample` /
                `compute_logprobs` calls wait for it. ``"background"``: samples
                do not wait; they read whichever version replicas serve (named
                in each result).

        Returns:
            Future of `WeightsSyncResult`.
        """
        if mode not in _SYNC_MODES:
            raise InvalidArgumentError(f"mode must be 'synchronous' or 'background', got {mode!r}", key="mode")
        req = session_pb2.WeightsSyncRequest(mode=_SYNC_MODES[mode])
        return self._submit("weights_sync", self.client._sessions.WeightsSync, req)

    @returns_future
    def snapshot(self) -> OperationFuture[Snapshot]:
        """Fix the adapter as it is after every operation submitted before this one, to sample while the
        session trains on (Tinker's ``save_weights_and_get_sampling_client``; nothing is written to storage).

        The snapshot is pushed to every generator replica under an id of its own that no later
        `optim_step`, `weights_sync` or `load_state` changes. Release it with `Snapshot.close` (or use it
        as a context manager; a garbage-collected handle is released best effort).

        Returns:
            Future of a `Snapshot` handle: ``sample`` / ``compute_logprobs`` on those weights.

        Raises:
            FailedPreconditionError: from ``result()``: the resource has no generator replicas.
        """
        client = self.client

        def to_snapshot(op: session_pb2.Operation) -> Snapshot:
            return Snapshot(client, op.snapshot.snapshot_id, self.session_id, int(op.snapshot.policy_version))

        return self._submit("snapshot", client._sessions.Snapshot, session_pb2.SnapshotRequest(), to_snapshot)

    @returns_future
    def save_weights(self, name: str, merged: bool = False, *, user_metadata: dict[str, str] | None = None,
                     ttl_seconds: int | None = None, pinned: bool = False,
                     keep_last: int = 0) -> OperationFuture[CheckpointInfo]:
        """Save an inference checkpoint: a PEFT adapter directory, or with
        ``merged=True`` a full Hugging Face model directory.

        Args:
            user_metadata: str -> str pairs stored with it (at most 64 pairs, keys 1-128 characters,
                values up to 1024, 16 KiB in all), searchable with `ResourceClient.search_checkpoints`.
            ttl_seconds: the resource deletes it this many seconds after the save (None: never).
            pinned: never removed by TTL or keep-last.
            keep_last: afterwards keep only the newest K of this session's inference checkpoints
                (0: the session's ``keep_last``); pinned ones are kept and not counted.

        Raises:
            InvalidArgumentError: from ``result()``: a bad name (the server rejects path separators,
                ``..``), metadata key/value, TTL or keep_last (the message names it).
            AlreadyExistsError: from ``result()`` when the name is taken (server-defined).
        """
        req = session_pb2.SaveWeightsRequest(name=name, merged=merged, user_metadata=user_metadata or {},
                                             ttl_seconds=int(ttl_seconds or 0), pinned=pinned, keep_last=keep_last)
        return self._submit("save_weights", self.client._sessions.SaveWeights, req)

    @returns_future
    def save_state(self, name: str, *, user_metadata: dict[str, str] | None = None, ttl_seconds: int | None = None,
                   pinned: bool = False, keep_last: int = 0) -> OperationFuture[CheckpointInfo]:
        """Save a training checkpoint (adapter, optimizer moments, step, RNG, config); the
        keyword arguments as `save_weights` (keep_last counts training checkpoints)."""
        req = session_pb2.SaveStateRequest(name=name, user_metadata=user_metadata or {},
                                           ttl_seconds=int(ttl_seconds or 0), pinned=pinned, keep_last=keep_last)
        return self._submit("save_state", self.client._sessions.SaveState, req)

    @returns_future
    def load_state(self, uri: str) -> OperationFuture[LoadStateResult]:
        """Load a training checkpoint's weights with a fresh optimizer."""
        req = session_pb2.LoadStateRequest(uri=uri, with_optimizer=False)
        return self._submit("load_state", self.client._sessions.LoadState, req)

    @returns_future
    def load_state_with_optimizer(self, uri: str) -> OperationFuture[LoadStateResult]:
        """Load a training checkpoint's weights, optimizer moments and step, so
        training continues as if never interrupted."""
        req = session_pb2.LoadStateRequest(uri=uri, with_optimizer=True)
        return self._submit("load_state", self.client._sessions.LoadState, req)

    def operation(self, operation_id: str) -> OperationFuture:
        """A future for an operation submitted earlier (e.g. by another client
        or before a reconnect). Raises NotFoundError when unknown or expired."""
        op = self.client._call(
            self.client._sessions.GetOperation,
            session_pb2.GetOperationRequest(operation_id=operation_id),
            what="GetOperation",
        )
        inner: cf.Future = cf.Future()
        fut: OperationFuture = OperationFuture(
            inner, kind=op.kind, operation_id=op.operation_id, seq_id=int(op.seq_id), canceller=self._cancel
        )
        self.client._poller.track(self.session_id, op, inner, converter_for(op.kind, self.client.storage_dir))
        return fut

    def operation_status(self, operation_id: str) -> OperationStatus:
        """Where an operation stands now, with its place in the trainer's queue (`OperationStatus`).

        Raises:
            NotFoundError: unknown, expired, or of another API key's session.
        """
        op = self.client._call(
            self.client._sessions.GetOperation,
            session_pb2.GetOperationRequest(operation_id=operation_id),
            what="GetOperation",
        )
        return OperationStatus.from_proto(op)

    def pending_operations(self) -> list[OperationFuture]:
        """Futures of this client's operations on the session that are not done, in seq order."""
        with self._pending_lock:
            futs = list(self._pending.values())
        return sorted((f for f in futs if not f.done()), key=lambda f: f.seq_id or 0)

    # ------------------------------------------------------------------ generator side
    @returns_future
    def sample(
        self,
        prompt_tokens: TokenArray,
        sampling_params: SamplingParams,
        num_samples: int = 1,
        *,
        prompt_logprobs: bool = False,
        top_k_prompt_logprobs: int = 0,
        validate: bool = True,
    ) -> OperationFuture[SampleResult]:
        """Sample completions with the session's synced adapter.

        Waits first (client side, without blocking the caller) for the last
        synchronous `weights_sync` submitted before this call; if that sync
        failed, the sample fails with FailedPreconditionError. A fresh session
        is served by the base model until its first sync (policy_version 0: the
        fresh adapter, B = 0); one created from (or loaded with) a checkpoint is
        served the loaded weights from the start, whatever their step. For
        weights that stay fixed while the session trains on, see `snapshot`.

        Args:
            prompt_tokens: int [m] token ids.
            sampling_params: `SamplingParams` (max_tokens is required).
            num_samples: completions to draw (each its own seed stream).
            prompt_logprobs: also return m-1 prompt logprobs.
            top_k_prompt_logprobs: also return the top-k alternatives per prompt position.
            validate: check the prompt and parameters client-side first.

        Returns:
            Future of `SampleResult` (tokens, sampled logprobs, stop reasons, versions).
        """
        return self.client._sample(
            self.session_id,
            prompt_tokens,
            sampling_params,
            num_samples,
            prompt_logprobs,
            top_k_prompt_logprobs,
            self._last_sync,
            validate,
        )

    @returns_future
    def compute_logprobs(
        self,
        sequences: Sequence[TokenArray],
        source: Literal["session", "base", "checkpoint"] | None = None,
        *,
        checkpoint_uri: str | None = None,
    ) -> OperationFuture[ComputeLogprobsResult]:
        """Score token sequences on a generator replica.

        Args:
            sequences: token id sequences; each gets len - 1 logprobs.
            source: ``"session"`` (the synced adapter; waits for the last
                synchronous weights_sync like `sample`), ``"base"`` (no adapter)
                or ``"checkpoint"`` (`checkpoint_uri`). Default: "checkpoint"
                when `checkpoint_uri` is given, else "session".

        Returns:
            Future of `ComputeLogprobsResult` (float32 arrays, untempered).
        """
        if source is None:
            source = "checkpoint" if checkpoint_uri else "session"
        wait_for = self._last_sync if source == "session" else None
        return self.client._compute_logprobs(self.session_id, sequences, source, checkpoint_uri, wait_for)

    # ------------------------------------------------------------------ lifecycle
    def info(self) -> SessionInfo:
        """Fresh `SessionInfo` from the server (step, synced version, expiry, ...)."""
        self._info = self.client.get_session(self.session_id)
        return self._info

    def usage(self) -> Usage:
        """What this session used so far (`Usage`: tokens prefilled, cached, sampled, trained, forward-only,
        optimizer steps, trainer and sampler seconds, checkpoint bytes)."""
        return self.client.session_usage(self.session_id)

    def keep_alive(self) -> SessionInfo:
        """Push back the idle expiry."""
        self._info = self.client.keep_alive(self.session_id)
        return self._info

    def cancel_pending(self) -> int:
        """Cancel this client's operations on the session that have not started
        (newest first); returns how many were cancelled."""
        n = 0
        for fut in reversed(self.pending_operations()):
            try:
                n += bool(fut.cancel())
            except Exception:
                pass
        return n

    def stop(self) -> SessionInfo:
        """Stop the session and free its slot; operations still queued are
        cancelled by the server. Later calls fail (FailedPreconditionError or
        NotFoundError, as the server decides)."""
        self._info = self.client.stop_session(self.session_id)
        self._stopped = True
        if self.client._keepalive is not None:
            self.client._keepalive.unregister(self)
        return self._info

    def wait_pending(self, timeout: float | None = 60.0) -> bool:
        """Wait until every operation of this client on the session is terminal
        (succeeded, failed or cancelled; errors are not raised here). Returns
        False if some were still running after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for fut in self.pending_operations():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                fut.result(timeout=left)
            except Exception:
                pass
        return not self.pending_operations()

    def close(self, timeout: float | None = 60.0) -> SessionInfo | None:
        """Whitney-style cleanup: cancel the operations that have not started,
        wait (up to `timeout`) until the running one is terminal, then stop the
        session. Returns the final `SessionInfo` (None if it was already gone).
        Idempotent; what the context manager does on exit."""
        if self._stopped:
            return self._info
        self.cancel_pending()
        self.wait_pending(timeout)
        try:
            return self.stop()
        except (NotFoundError, FailedPreconditionError):
            self._stopped = True
            return None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.client.closed or self._stopped:
            return
        try:
            self.close()
        except (NotFoundError, FailedPreconditionError):
            pass  # already stopped or expired
        except TogetherTrainError:
            if exc_type is None:
                raise
            logger.warning("could not stop session %s while handling %s", self.session_id, exc_type.__name__)
