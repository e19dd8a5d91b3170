"""`ResourceClient`: the connection to one model resource (sessions, checkpoints, sampling).

::

    import together_train as tt

    client = tt.ResourceClient("127.0.0.1:50051", api_key=None)
    session = client.create_session(lora=tt.LoraConfig(rank=16))
    fb = session.forward_backward(batch, loss_fn="cross_entropy")   # returns at once
    opt = session.optim_step(tt.AdamParams(learning_rate=1e-4))    # pipelined behind it
    print(fb.result().loss, opt.result().step)

Wire details (what the server can rely on):

- Every RPC carries ``authorization: Bearer <api_key>`` metadata when an API
  key is set (argument or ``TOGETHER_TRAIN_API_KEY``).
- Operation RPCs (sequencing, idempotency keys): see `together_train.session`.
- Errors are read from the ``together_train.v1.ErrorDetail`` packed in the
  ``google.rpc.Status`` details (see `together_train.errors`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
import pathlib
import threading
from typing import Any, Callable, Literal, Sequence, TypeVar


from together_train._async import returns_future, with_async_twins
from together_train._requests import logprobs_request, sample_request
from together_train._channel import auth_metadata, normalize_address, open_channel
from together_train.checkpoint_registry import UNSET, CheckpointRegistry
from together_train._proto import (
    generator_pb2_grpc,
    resource_pb2,
    resource_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)
from together_train.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    TogetherTrainError,
)
from together_train._executor import DaemonExecutor
from together_train._poller import OperationPoller
from together_train.futures import CallCanceller, OperationFuture
from together_train.keepalive import SessionKeepAlive, check_interval as check_keepalive_interval
from together_train.retry import RetryPolicy
from together_train.session import Session
from together_train.types import (
    Capabilities,
    CheckpointInfo,
    ComputeLogprobsResult,
    LoraConfig,
    LossSpec,
    Rollout,
    SampleResult,
    SamplingParams,
    SessionInfo,
    Usage,
    TokenArray,
)

__all__ = ["ResourceClient", "DEFAULT_TIMEOUT_S"]

logger = logging.getLogger("together_train")
T = TypeVar("T")

#: Deadline of control RPCs (session management, operation submission), seconds.
DEFAULT_TIMEOUT_S = 60.0


@with_async_twins
class ResourceClient:
    """Connection to one model resource (``together-train serve``).

    Args:
        address: ``host:port`` of the resource (a ``grpc://`` prefix is accepted).
        api_key: sent as ``authorization: Bearer <key>``; default: the
            ``TOGETHER_TRAIN_API_KEY`` environment variable, else none.
        timeout: deadline in seconds of each control RPC (session management,
            operation submission). Waiting for an operation is not bounded by it.
        max_message_mb: largest message sent or received, MiB.
        generation_timeout: deadline in seconds of one ``Sample`` /
            ``ComputeLogprobs`` RPC (None = no deadline).
        retry: the `RetryPolicy` around every RPC.
        max_workers: threads running client-side calls (``sample``,
            ``compute_logprobs``): how many can be in flight at once.
        tls: use TLS (with `root_certificates` PEM bytes, or the system roots).
            Any of the three certificate arguments below turns TLS on.
        root_certificates: PEM CA bundle the server's certificate must chain to
            (``serve --tls-cert``); None = the system roots.
        certificate_chain, private_key: PEM client certificate and its key, for a
            server with mutual TLS (``serve --tls-client-ca``); give both.
        long_poll_s: how long each ``WaitOperation`` asks the server to wait.
        keepalive_interval_s: keep this client's live `Session` objects from
            expiring on the server (one daemon thread sends ``KeepAlive``,
            see `together_train.keepalive`): ``"auto"`` (default) every quarter
            of the server's idle timeout (``--idle-timeout``, reported in each
            `SessionInfo`), a number of seconds, or None for no keep-alive.
        storage_dir: the resource's storage directory (``serve --storage``) when
            it runs on this machine: checkpoints' ``path`` is resolved in it (the
            resource sends only their URI). `launch_local` sets it.

    `sample` and `compute_logprobs` (base model, checkpoints) have ``*_async`` twins,
    like `Session`'s calls. Thread-safe. Use as a context manager or call `close`.

    Attributes:
        address: the ``host:port`` connected to.
        local_resource: the `LocalResource` that started the server, when the
            client came from `launch_local` (else None).
    """

    local_resource: Any = None
    storage_dir: Path | None = None

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_message_mb: int = 256,
        generation_timeout: float | None = 3600.0,
        retry: RetryPolicy | None = None,
        max_workers: int = 64,
        tls: bool = False,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        long_poll_s: float = 20.0,
        keepalive_interval_s: float | None | Literal["auto"] = "auto",
        storage_dir: str | os.PathLike | None = None,
    ) -> None:
        from together_train import __version__

        check_keepalive_interval(keepalive_interval_s)
        self.storage_dir = Path(storage_dir).resolve() if storage_dir is not None else None
        self.address = normalize_address(address)
        if api_key is None:
            api_key = os.environ.get("TOGETHER_TRAIN_API_KEY") or None
        self._api_key = api_key
        self.timeout = timeout
        self.generation_timeout = generation_timeout
        self.retry = retry or RetryPolicy()
        self._channel = open_channel(
            self.address, max_message_mb=max_message_mb, user_agent=f"together-train-python/{__version__}", tls=tls,
            root_certificates=root_certificates, certificate_chain=certificate_chain, private_key=private_key,
        )
        self._metadata = auth_metadata(api_key)
        self._resource = resource_pb2_grpc.ResourceServiceStub(self._channel)
        self._sessions = session_pb2_grpc.SessionServiceStub(self._channel)
        self._generator = generator_pb2_grpc.GeneratorServiceStub(self._channel)
        self._executor = DaemonExecutor(max_workers, "together-train-call")
        self._poll_executor = DaemonExecutor(32, "together-train-poll")
        self._long_poll_s = long_poll_s
        self._poller = OperationPoller(self._wait_op, self._get_op, self.retry, self._poll_executor, long_poll_s)
        self._caps: Capabilities | None = None
        self._caps_unavailable = False
        self._caps_lock = threading.Lock()
        self._tokenizer: Any = None  # get_tokenizer's, loaded once
        self._tokenizer_lock = threading.Lock()
        self._closed = False
        self._keepalive = SessionKeepAlive(self, keepalive_interval_s) if keepalive_interval_s is not None else None
        self.checkpoints = CheckpointRegistry(self)

    # ------------------------------------------------------------------ plumbing
    def _call(
        self,
        method: Any,
        request: Any,
        *,
        what: str,
        timeout: float | None | Literal["default"] = "default",
        idempotent: bool = True,
        retry: RetryPolicy | None = None,
        canceller: CallCanceller | None = None,
    ) -> Any:
        """One unary RPC with retries; raises the typed TogetherTrainError.

        With `canceller`, each attempt is cancellable by it (OperationCancelledError, not retried).
        """
        self._check_open()
        deadline = self.timeout if timeout == "default" else timeout
        policy = retry or self.retry
        if canceller is None:
            return policy.call(
                lambda: method(request, timeout=deadline, metadata=self._metadata), idempotent=idempotent, what=what
            )
        return policy.call(
            lambda: canceller.run(method.future(request, timeout=deadline, metadata=self._metadata), what),
            idempotent=idempotent, what=what,
        )

    def _wait_op(self, operation_id: str, timeout_s: float) -> session_pb2.Operation:
        return self._sessions.WaitOperation(
            session_pb2.WaitOperationRequest(operation_id=operation_id, timeout_seconds=timeout_s),
            timeout=timeout_s + max(10.0, self.timeout),
            metadata=self._metadata,
        )

    def _get_op(self, operation_id: str) -> session_pb2.Operation:
        return self._sessions.GetOperation(
            session_pb2.GetOperationRequest(operation_id=operation_id), timeout=self.timeout, metadata=self._metadata
        )

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPreconditionError("the ResourceClient is closed", key="client")

    def _submit_call(
        self, kind: str, fn: Callable[[], T], wait_for: OperationFuture | None = None,
        canceller: CallCanceller | None = None,
    ) -> OperationFuture[T]:
        """Run a blocking call on the worker threads, after `wait_for` ends; `canceller` (the one `fn`'s
        RPCs run through) lets the future's ``cancel()`` stop it while it runs."""
        self._check_open()

        def run() -> T:
            if wait_for is not None:
                err = wait_for.exception()
                if err is not None:
                    raise FailedPreconditionError(
                        f"this {kind} waits for weights_sync operation {wait_for.operation_id}, which did not "
                        f"succeed ({err}); submit a new weights_sync (or sample with the base model)",
                        key="weights_sync",
                    ) from err
            return fn()

        return OperationFuture(self._executor.submit(run), kind=kind, canceller=canceller)

    def _known_losses(self) -> dict[str, LossSpec] | None:
        """The resource's loss specs (fetched once), or None when unavailable."""
        caps = self._caps
        if caps is None:
            if self._caps_unavailable:
                return None
            try:
                caps = self.get_capabilities()
            except TogetherTrainError as err:
                if not err.retryable:  # e.g. UNIMPLEMENTED: do not ask again on every call
                    self._caps_unavailable = True
                return None
        return caps.losses or None

    # ------------------------------------------------------------------ resource calls
    def get_capabilities(self, *, refresh: bool = False) -> Capabilities:
        """What the resource offers (model, limits, losses); cached after the first call.

        Raises:
            TogetherTrainError: e.g. UnavailableError when the resource cannot be reached.
        """
        with self._caps_lock:
            if self._caps is None or refresh:
                msg = self._call(self._resource.GetCapabilities, resource_pb2.GetCapabilitiesRequest(), what="GetCapabilities")
                self._caps = Capabilities.from_proto(msg)
            return self._caps

    @property
    def capabilities(self) -> Capabilities:
        """Same as `get_capabilities()` (cached)."""
        return self.get_capabilities()

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer, as a ``transformers`` tokenizer (needs transformers, not torch).

        Built from the resource's own tokenizer files (tokenizer.json, tokenizer_config.json,
        special tokens, chat template, ...): the same token ids and chat template as the
        server's. The files are fetched once (``GetTokenizer``) and cached on disk under
        ``$TOGETHER_TRAIN_CACHE`` (default ``~/.cache/together-train``) by model id and
        content hash; later calls, in this process or another, load the cached copy without
        the RPC. The tokenizer is loaded once per client.

        Raises:
            NotFoundError: the resource's model directory has no tokenizer files.
            FailedPreconditionError: transformers is not installed.
        """
        from together_train.tokenizer import fetch_tokenizer_dir, load_tokenizer

        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(fetch_tokenizer_dir(self))
            return self._tokenizer

    def create_session(
        self,
        lora: LoraConfig | None = None,
        name: str | None = None,
        checkpoint_uri: str | None = None,
        with_optimizer: bool = False,
        *,
        validate: bool = True,
        keep_last: int = 0,
    ) -> "Session":
        """Create a training session: a fresh LoRA adapter with its own AdamW
        optimizer and step counter.

        Args:
            lora: adapter shape; default `LoraConfig()` (rank 16, alpha 32), or
                with `checkpoint_uri` the checkpoint's own config (a given one
                must have the checkpoint's rank, alpha, targets, train_unembed).
            name: free-form label shown in listings.
            checkpoint_uri: start from a training checkpoint (``save_state``),
                also one written before the resource restarted. The session's
                step (= policy version) starts at the checkpoint's step, and
                the replicas serve the loaded weights at once.
            with_optimizer: with `checkpoint_uri`, also restore the AdamW
                moments and the dropout RNG stream (exact resume); without, a
                fresh optimizer.
            validate: check `lora` client-side first (False: leave it to the server).
            keep_last: keep only the newest K checkpoints of each kind this session saves
                (0 = keep all; a save's own ``keep_last`` wins; pinned ones are kept).

        Raises:
            ResourceExhaustedError: the resource holds `max_sessions` already.
            InvalidArgumentError: e.g. a rank over the limit, unknown target modules,
                or `with_optimizer` without `checkpoint_uri`.
            NotFoundError: unknown checkpoint.
            FailedPreconditionError: the checkpoint's base model or LoRA shape
                differs (the message names what).
            InternalError: the checkpoint is corrupted (DATA_LOSS).

        Not retried on DEADLINE_EXCEEDED (no idempotency key), only on UNAVAILABLE.
        """
        if validate and with_optimizer and not checkpoint_uri:
            raise InvalidArgumentError(
                "with_optimizer restores a checkpoint's optimizer: it needs checkpoint_uri", key="with_optimizer"
            )
        if lora is None and not checkpoint_uri:
            lora = LoraConfig()
        if validate and lora is not None:
            lora.validate()
        req = resource_pb2.CreateSessionRequest(
            lora=lora.to_proto() if lora is not None else None,
            checkpoint_uri=checkpoint_uri or "",
            with_optimizer=with_optimizer,
            name=name or "",
            keep_last=int(keep_last),
        )
        info = self._call(self._resource.CreateSession, req, what="CreateSession", idempotent=False)
        return Session(self, SessionInfo.from_proto(info))

    def get_session(self, session_id: str) -> SessionInfo:
        """State of a session. Raises NotFoundError when unknown (or another key's)."""
        msg = self._call(self._resource.GetSession, resource_pb2.GetSessionRequest(session_id=session_id), what="GetSession")
        return SessionInfo.from_proto(msg)

    def usage(self, *, sessions: bool = False) -> list[Usage]:
        """Usage per API key: this key's own (one `Usage`), or every key's for an admin key
        (``serve --admin-key-file``). With `sessions`, one `Usage` per visible session instead."""
        msg = self._call(self._resource.GetUsage, resource_pb2.GetUsageRequest(), what="GetUsage")
        return [Usage.from_proto(u) for u in (msg.sessions if sessions else msg.keys)]

    def session_usage(self, session_id: str) -> Usage:
        """One session's `Usage`. Raises NotFoundError when unknown (or another key's, for a non-admin key)."""
        msg = self._call(self._resource.GetUsage, resource_pb2.GetUsageRequest(session_id=session_id),
                         what="GetUsage")
        return Usage.from_proto(msg.sessions[0])

    def list_sessions(self) -> list[SessionInfo]:
        """Sessions visible to this API key."""
        msg = self._call(self._resource.ListSessions, resource_pb2.ListSessionsRequest(), what="ListSessions")
        return [SessionInfo.from_proto(s) for s in msg.sessions]

    def session(self, session_id: str) -> "Session":
        """Attach to an existing session (e.g. after a reconnect); its seq_id
        counter continues from the server's ``next_seq_id``.

        Raises:
            NotFoundError: unknown session.
        """
        return Session(self, self.get_session(session_id))

    def stop_session(self, session_id: str) -> SessionInfo:
        """Stop a session: frees its slot; its queued operations are cancelled."""
        msg = self._call(self._resource.StopSession, resource_pb2.StopSessionRequest(session_id=session_id), what="StopSession")
        return SessionInfo.from_proto(msg)

    def keep_alive(self, session_id: str) -> SessionInfo:
        """Push back a session's idle expiry (done in the background for live
        `Session` objects unless ``keepalive_interval_s=None``)."""
        return self._keep_alive_rpc(session_id)

    def _keep_alive_rpc(
        self, session_id: str, *, timeout: float | Literal["default"] = "default", retry: RetryPolicy | None = None
    ) -> SessionInfo:
        msg = self._call(
            self._resource.KeepAlive,
            resource_pb2.KeepAliveRequest(session_id=session_id),
            what="KeepAlive",
            timeout=timeout,
            retry=retry,
        )
        return SessionInfo.from_proto(msg)

    def get_rollout(self, rollout_id: str) -> Rollout:
        """The calls recorded under ``/v1/rollouts/{rollout_id}`` of the OpenAI endpoint (see `Rollout`).

        Raises:
            InvalidArgumentError: a bad id (1-128 letters, digits, ``-``, ``_``).
            NotFoundError: no such rollout for this API key (another key's, expired, or deleted).
        """
        msg = self._call(self._resource.GetRollout, resource_pb2.GetRolloutRequest(rollout_id=rollout_id),
                         what="GetRollout")
        return Rollout.from_proto(msg)

    def delete_rollout(self, rollout_id: str) -> None:
        """Free a recorded rollout. Raises InvalidArgumentError (bad id), NotFoundError."""
        self._call(self._resource.DeleteRollout, resource_pb2.DeleteRolloutRequest(rollout_id=rollout_id),
                   what="DeleteRollout")

    # ------------------------------------------------------------------ checkpoints (see `CheckpointRegistry`)
    def list_checkpoints(self, session_id: str | None = None, *, kind: str | None = None,
                         variant: str | None = None, base_model: str | None = None) -> list[CheckpointInfo]:
        """`CheckpointRegistry.list_checkpoints`: complete checkpoints, oldest first."""
        return self.checkpoints.list_checkpoints(session_id, kind=kind, variant=variant, base_model=base_model)

    def list_checkpoints_page(self, limit: int, cursor: str = "", *, session_id: str | None = None,
                              kind: str | None = None, variant: str | None = None,
                              base_model: str | None = None) -> tuple[list[CheckpointInfo], str]:
        """`CheckpointRegistry.list_checkpoints_page`: one page, newest first, and the next cursor."""
        return self.checkpoints.list_checkpoints_page(limit, cursor, session_id=session_id, kind=kind,
                                                      variant=variant, base_model=base_model)

    def search_checkpoints(self, *, user_metadata: dict[str, str] | None = None, type: str | None = None,
                           base_model: str | None = None, session_id: str | None = None, owner: str | None = None,
                           limit: int = 50, cursor: str = "") -> tuple[list[CheckpointInfo], str]:
        """`CheckpointRegistry.search_checkpoints`: matches of every filter, newest first, and the next cursor."""
        return self.checkpoints.search_checkpoints(user_metadata=user_metadata, type=type, base_model=base_model,
                                                   session_id=session_id, owner=owner, limit=limit, cursor=cursor)

    def update_checkpoint(self, uri: str, *, user_metadata: dict[str, str] | None = None,
                          ttl_seconds: int | None | Any = UNSET, pinned: bool | None = None) -> CheckpointInfo:
        """`CheckpointRegistry.update_checkpoint`: change user metadata, TTL or pin."""
        return self.checkpoints.update_checkpoint(uri, user_metadata=user_metadata, ttl_seconds=ttl_seconds,
                                                  pinned=pinned)

    def import_adapter(self, path: str | os.PathLike, name: str, *, type: str = "training",
                       user_metadata: dict[str, str] | None = None, ttl_seconds: int | None = None,
                       pinned: bool = False, chunk_bytes: int = 2 << 20) -> CheckpointInfo:
        """`CheckpointRegistry.import_adapter`: a PEFT adapter directory as a checkpoint (resumable upload)."""
        return self.checkpoints.import_adapter(path, name, type=type, user_metadata=user_metadata,
                                               ttl_seconds=ttl_seconds, pinned=pinned, chunk_bytes=chunk_bytes)

    def download_checkpoint(self, uri: str, dest_dir: str | os.PathLike) -> pathlib.Path:
        """`CheckpointRegistry.download_checkpoint`: a checkpoint directory into `dest_dir`, checked."""
        return self.checkpoints.download_checkpoint(uri, dest_dir)

    def storage_usage(self) -> dict[str, int]:
        """`CheckpointRegistry.storage_usage`: checkpoint bytes per owner tag."""
        return self.checkpoints.storage_usage()

    def delete_checkpoint(self, uri: str) -> None:
        """`CheckpointRegistry.delete_checkpoint`. Raises NotFoundError when unknown."""
        self.checkpoints.delete_checkpoint(uri)

    # ------------------------------------------------------------------ rollouts

    # ------------------------------------------------------------------ generator (base model / checkpoints)
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
        checkpoint_uri: str | None = None,
    ) -> OperationFuture[SampleResult]:
        """Sample from the **base model** (no adapter), or with `checkpoint_uri` from a saved checkpoint's
        adapter: a sampler checkpoint (`Session.save_weights`, an imported ``type="sampler"`` adapter) or a
        training one (`Session.save_state`), fixed whatever its session does later. Arguments as
        `Session.sample`; the result's ``policy_version`` is the checkpoint's step.

        Raises:
            NotFoundError: from ``result()``: no such checkpoint (the message names the URI).
            InvalidArgumentError: from ``result()``: a malformed URI or a merged checkpoint.
        """
        return self._sample(
            "", prompt_tokens, sampling_params, num_samples, prompt_logprobs, top_k_prompt_logprobs, None, validate,
            checkpoint_uri=checkpoint_uri or "",
        )

    @returns_future
    def compute_logprobs(
        self, sequences: Sequence[TokenArray], *, checkpoint_uri: str | None = None
    ) -> OperationFuture[ComputeLogprobsResult]:
        """Score sequences with the base model, or with a saved checkpoint
        (`checkpoint_uri`, as `sample`). See `Session.compute_logprobs`."""
        source = "checkpoint" if checkpoint_uri else "base"
        return self._compute_logprobs("", sequences, source, checkpoint_uri, None)

    def _sample(
        self,
        session_id: str,
        prompt_tokens: TokenArray,
        sampling_params: SamplingParams,
        num_samples: int,
        prompt_logprobs: bool,
        top_k_prompt_logprobs: int,
        wait_for: OperationFuture | None,
        validate: bool = True,
        *,
        checkpoint_uri: str = "",
        snapshot_id: str = "",
    ) -> OperationFuture[SampleResult]:
        req = sample_request(session_id, prompt_tokens, sampling_params, num_samples, prompt_logprobs,
                             top_k_prompt_logprobs, validate, checkpoint_uri=checkpoint_uri, snapshot_id=snapshot_id)
        canceller = CallCanceller()

        def call() -> SampleResult:
            msg = self._call(self._generator.Sample, req, what="Sample", timeout=self.generation_timeout,
                             canceller=canceller)
            return SampleResult.from_proto(
                msg, prompt_logprobs=prompt_logprobs, top_k=top_k_prompt_logprobs > 0
            )

        return self._submit_call("sample", call, wait_for, canceller)

    def _compute_logprobs(
        self,
        session_id: str,
        sequences: Sequence[TokenArray],
        source: str,
        checkpoint_uri: str | None,
        wait_for: OperationFuture | None,
        *,
        snapshot_id: str = "",
    ) -> OperationFuture[ComputeLogprobsResult]:
        req = logprobs_request(session_id, sequences, source, checkpoint_uri, snapshot_id=snapshot_id)
        canceller = CallCanceller()

        def call() -> ComputeLogprobsResult:
            msg = self._call(self._generator.ComputeLogprobs, req, what="ComputeLogprobs",
                             timeout=self.generation_timeout, canceller=canceller)
            return ComputeLogprobsResult.from_proto(msg)

        return self._submit_call("compute_logprobs", call, wait_for, canceller)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the channel. Pending futures fail with `ClientClosedError`
        (their operations may still run on the server). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.close()
        self._poller.close()
        self._executor.shutdown()
        self._poll_executor.shutdown()
        self._channel.close()  # also ends a KeepAlive RPC in flight
        if self._keepalive is not None:
            self._keepalive.join(2.0)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "ResourceClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ResourceClient {self.address}{' closed' if self._closed else ''}>"

